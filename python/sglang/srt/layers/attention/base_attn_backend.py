"""Attention backend contract.

A backend computes causal attention for the new tokens of a
:class:`~sglang.srt.forward_batch_info.ForwardBatch` over the
paged KV pool. Contract for :meth:`AttentionBackend.forward`:

1. write ``k``/``v`` of the new tokens into the pool at ``forward_batch.out_cache_loc``
   (``token_to_kv_pool.set_kv_buffer``);
2. for request i, its query tokens sit at positions
   ``prefix_lens[i] .. seq_lens[i]-1`` and attend to the keys at positions
   ``0 .. own position`` whose slots are ``req_to_token[req_pool_indices[i], :seq_lens[i]]``;
3. return ``[N, num_heads * head_dim]`` in the query dtype.
GQA: query head h reads KV head ``h // (num_heads // num_kv_heads)``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.forward_batch_info import ForwardBatch


class AttentionBackend(ABC):
    """Base class of attention backends (see the module docstring for the contract)."""

    def init_forward_metadata(self, forward_batch: "ForwardBatch") -> Any:
        """Precompute this batch's metadata once, before the layers run; store it as
        ``forward_batch.attn_metadata`` (never on the backend, so several batches can be live) and
        return it. The default needs none and stores None."""
        forward_batch.attn_metadata = None
        return None

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: "RadixAttention",
                forward_batch: "ForwardBatch") -> torch.Tensor:
        """Attention of the batch's new tokens.

        Args:
            q: [N, num_heads * head_dim]; k, v: [N, num_kv_heads * head_dim].
            layer: the calling layer (head counts, scaling, layer_id).
        Returns:
            [N, num_heads * head_dim], dtype of ``q``.
        """
