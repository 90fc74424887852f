"""The attention layer models call; it delegates to the batch's attention backend."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn


class RadixAttention(nn.Module):
    """Paged attention over the KV pool for one layer.

    Args:
        num_heads: query heads on this rank; num_kv_heads: KV heads on this rank.
        head_dim: per-head size; scaling: softmax scale (usually head_dim**-0.5).
        layer_id: index of this layer's KV buffers in the pool.
    """

    def __init__(self, num_heads: int, head_dim: int, scaling: float, num_kv_heads: int, layer_id: int):
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scaling = scaling
        self.num_kv_heads = num_kv_heads
        self.layer_id = layer_id

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, forward_batch,
                positions: Optional[torch.Tensor] = None, rotary_emb=None) -> torch.Tensor:
        """q: [N, num_heads*head_dim]; k, v: [N, num_kv_heads*head_dim] (row-strided views allowed) ->
        [N, num_heads*head_dim].

        With ``rotary_emb`` (a :class:`~sglang.srt.layers.rotary_embedding.RotaryEmbedding`) and ``positions``
        ``[N]`` int64, q and k are still unrotated: a backend with ``fuses_rope_kv_store`` applies RoPE inside its
        KV-cache store (one kernel per layer, see :mod:`sgl_kernel.triton.rope_kv_store`); for any other backend
        RoPE runs here first. Raises ValueError for ``rotary_emb`` without ``positions``.
        """
        backend = forward_batch.attn_backend
        if rotary_emb is not None:
            if positions is None:
                raise ValueError("RadixAttention.forward: rotary_emb needs positions")
            if getattr(backend, "fuses_rope_kv_store", False):
                return backend.forward(q, k, v, self, forward_batch, rope=(positions, rotary_emb))
            q, k = rotary_emb(positions, q, k)
        return backend.forward(q, k, v if v.is_contiguous() else v.contiguous(), self, forward_batch)
