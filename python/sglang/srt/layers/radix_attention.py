"""The attention layer models call; it delegates to the batch's attention backend."""

from __future__ import annotations

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

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, forward_batch) -> torch.Tensor:
        """q: [N, num_heads*head_dim]; k, v: [N, num_kv_heads*head_dim] -> [N, num_heads*head_dim]."""
        return forward_batch.attn_backend.forward(q, k, v, self, forward_batch)
