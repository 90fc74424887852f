"""RMSNorm, with the fused "add residual then normalize" form the decoder layers use.

Reference: Zhang & Sennrich, "Root Mean Square Layer Normalization" (NeurIPS 2019), eq. 4.
The fused add + RMSNorm semantics below are the contract that faster kernels
(e.g. the TokenWeave fused AllReduce + residual + RMSNorm) must reproduce.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch
from torch import nn

from sglang.srt.layers import ops
from sglang.srt.ops_ref import rmsnorm_ref

logger = logging.getLogger(__name__)




class RMSNorm(nn.Module):
    """RMSNorm over the last dim with a learned weight ``[hidden_size]``.

    Args:
        hidden_size: normalized size H.
        eps: numerical epsilon (HF ``rms_norm_eps``).
        params_dtype: weight dtype (default: torch's default dtype).
        comm: tensor parallelism's fused path. When set, ``forward(x, residual)`` treats ``x`` as this
            rank's *partial sum* (the output of a ``RowParallelLinear``/``FusedMoE`` built with
            ``reduce_results=False``) and returns ``comm.all_reduce_add_rmsnorm(x, residual, weight, eps)``:
            AllReduce + residual add + RMSNorm in one call (TokenWeave, Gond et al. 2025, sec. 3.3), so a
            fused kernel can replace the three steps without touching model code. ``forward(x)``
            without a residual never communicates (its input is already complete), nor does any form while
            the ``sequence_parallel`` layout a sequence-parallel executor installed is active (the inputs are
            complete token rows then).
    ``forward(x [.., H])`` -> normed x; ``forward(x, residual)`` -> ``(normed(x + residual), x + residual)``;
    see :func:`rmsnorm_ref` for the exact numerics.
    Kernels: on CUDA tensors both forms run the fused Triton kernels of :mod:`sglang.srt.layers.ops`, and
    ``forward(x, residual)`` then works *in place*: the results are written into ``x`` and ``residual``
    and returned (callers use the returned tensors and do not reuse the inputs). Elsewhere (CPU) the torch
    reference :func:`rmsnorm_ref` returns new tensors.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, params_dtype: Optional[torch.dtype] = None,
                 comm=None):
        super().__init__()
        self.hidden_size = hidden_size
        self.eps = eps
        self.comm = comm
        self.sequence_parallel = None  # a SequenceParallelLayout, installed once by a sequence-parallel executor
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=params_dtype), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        """x ``[..., H]`` -> normed x, or with ``residual`` -> ``(normed(x + residual), x + residual)`` (fused
        all-reduce first when ``comm`` is set); see the class docstring for in-place behaviour. ``x`` may also be a
        :class:`~sglang.srt.layers.decode_fuse.SplitKPartials` (a projection's deferred split-K reduce):
        with a residual and no comm it is summed inside the norm kernel (a new normed tensor, the residual updated
        in place), else materialized first."""
        if not isinstance(x, torch.Tensor):  # a projection's deferred split-K partials (decode_fuse)
            if residual is not None and self.comm is None and self.sequence_parallel is None:
                return ops.splitk_add_rmsnorm(x, residual, self.weight, self.eps)
            x = x.materialize()
        if residual is not None and self.comm is not None and (self.sequence_parallel is None
                                                                or self.sequence_parallel.rows is None):
            if self.comm.fuses_add_rmsnorm or not x.is_cuda or residual.dtype != x.dtype:
                return self.comm.all_reduce_add_rmsnorm(x, residual, self.weight, self.eps)
            x = self.comm.all_reduce(x)  # no fused communicator kernel: the fused add + RMSNorm kernel below
        if residual is None:
            return ops.rmsnorm(x, self.weight, self.eps)
        if x.is_cuda:
            return ops.fused_add_rmsnorm(x, residual, self.weight, self.eps)
        return rmsnorm_ref(x, self.weight, self.eps, residual)

    def extra_repr(self) -> str:
        """Hidden size, eps and whether the all-reduce is fused, for ``repr``."""
        return f"{self.hidden_size}, eps={self.eps}{', fused all-reduce' if self.comm is not None else ''}"


