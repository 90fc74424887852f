"""Token embedding and LM head split by vocabulary rows over tensor-parallel ranks.

Reference: Shoeybi et al., "Megatron-LM" (2019), sec. 3 (parallel input/output embeddings).
The vocabulary is padded to a multiple of ``tp_size``; rank r holds rows
``[r*V_pad/tp, (r+1)*V_pad/tp)``; padding rows are zero and never produce
logits the caller keeps (LogitsProcessor trims to ``vocab_size``).
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from sglang.srt.layers.linear import check_tp, copy_checked, narrow_full

logger = logging.getLogger(__name__)


class VocabParallelEmbedding(nn.Module):
    """Embedding table ``[V_pad/tp, embedding_dim]`` for this rank.

    Args:
        num_embeddings: vocabulary size V; embedding_dim: hidden size H.
        params_dtype: weight dtype; tp_rank/tp_size: shard of the vocabulary.
        comm: ``all_reduce(t) -> t`` over the TP group; needed for forward when tp_size > 1.
    ``forward(input_ids [N] int64) -> [N, H]`` in params dtype.
    ``weight.weight_loader(param, full [V, H])`` copies this rank's rows (zeros for padding).
    Raises ValueError on bad tp args, a wrong loaded shape, or a missing comm at forward.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, params_dtype: Optional[torch.dtype] = None,
                 tp_rank: int = 0, tp_size: int = 1, comm: Any = None):
        super().__init__()
        check_tp(tp_rank, tp_size)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.tp_rank, self.tp_size, self.comm = tp_rank, tp_size, comm
        padded = -(-num_embeddings // tp_size) * tp_size
        self.num_embeddings_padded = padded
        self.shard_size = padded // tp_size
        self.vocab_start = tp_rank * self.shard_size
        self.vocab_end = min(self.vocab_start + self.shard_size, num_embeddings)
        self.weight = nn.Parameter(torch.empty(self.shard_size, embedding_dim, dtype=params_dtype), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.weight.expected_shards = (None,)

    def weight_loader(self, param: nn.Parameter, loaded_full_weight: torch.Tensor, shard_id: Any = None) -> None:
        """Copy this rank's rows of the full ``[V, H]`` table and zero the padding rows; ValueError on a wrong shape."""
        if tuple(loaded_full_weight.shape) != (self.num_embeddings, self.embedding_dim):
            raise ValueError(f"{type(self).__name__}: loaded shape {tuple(loaded_full_weight.shape)} != "
                             f"({self.num_embeddings}, {self.embedding_dim})")
        n = max(self.vocab_end - self.vocab_start, 0)
        with torch.no_grad():
            param[n:].zero_()
        if n:  # narrow: a lazy checkpoint tensor reads only this rank's rows
            what = type(self).__name__
            copy_checked(param[:n], narrow_full(loaded_full_weight, 0, self.vocab_start, n, self.num_embeddings, what),
                         what)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``input_ids`` ``[N]`` int64 -> ``[N, H]`` in the weight dtype; with tp_size > 1 rows outside this shard are
        zero and the result is all-reduced (ValueError without ``comm``)."""
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        if self.comm is None:
            raise ValueError("VocabParallelEmbedding with tp_size > 1 needs a comm object to all-reduce its output")
        mask = (input_ids < self.vocab_start) | (input_ids >= self.vocab_end)
        local = (input_ids - self.vocab_start).masked_fill(mask, 0)
        out = F.embedding(local, self.weight).masked_fill(mask.unsqueeze(-1), 0)
        return self.comm.all_reduce(out)

    def extra_repr(self) -> str:
        """Vocabulary size, this rank's row range and the embedding dim for ``repr``."""
        return f"vocab={self.num_embeddings} (rows {self.vocab_start}..{self.vocab_end}), dim={self.embedding_dim}"


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection weight ``[V_pad/tp, H]`` (same sharding as :class:`VocabParallelEmbedding`).

    It is not called directly: models pass ``lm_head.weight`` to
    :class:`~sglang.srt.layers.logits_processor.LogitsProcessor`, which with
    tp_size > 1 all-gathers the per-rank logits ``[bs, V_pad/tp]`` into ``[bs, V_pad]``.
    """

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Not used: always raises RuntimeError (pass ``.weight`` to LogitsProcessor)."""
        raise RuntimeError("ParallelLMHead is not called; pass its .weight to LogitsProcessor")
