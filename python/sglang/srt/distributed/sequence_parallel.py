"""Sequence-parallel (token-sharded) linear collectives: the seams AG-GEMM and GEMM-RS plug into.

With a sequence-parallel layout the residual stream is sharded by tokens: rank r holds rows ``rows[r]`` of the
``[T, H]`` activations (``rows`` = :func:`sgl_kernel`-free :func:`split_rows`, identical on every rank). A
column-parallel linear then needs the *all-gathered* input, and a row-parallel linear produces a *reduce-scattered*
output (Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models", 2022, sec. 4.2.2):

* ``ag_linear(x_shard [rows[rank], K], weight [N_local, K], bias) -> [T, N_local]`` = ``F.linear(all_gather(x))``;
* ``linear_rs(x [T, K_local], weight [N, K_local], bias) -> [rows[rank], N]`` = this rank's rows of
  ``sum_ranks F.linear(x)`` (+ bias once).

:class:`TorchSequenceParallelOps` runs the collective and the GEMM in sequence (torch.distributed + cuBLAS/CPU);
``sglang.srt.distributed.tdist_overlap.TdistSequenceParallelOps`` (CUDA only) fuses them with tile-level overlap
(Triton-distributed AG-GEMM / GEMM-RS). :func:`create_sequence_parallel_ops` picks one (``--enable-tdist-overlap``)
and logs the choice. Layers call these through ``ColumnParallelLinear.forward_gathered`` and
``RowParallelLinear.forward_scattered`` (sglang.srt.layers.linear). CPU-safe module: imports no CUDA-only code.
"""

from __future__ import annotations

import contextlib
import logging
from abc import ABC, abstractmethod
from typing import Any, Iterator, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

logger = logging.getLogger(__name__)


def split_rows(total: int, world: int) -> Tuple[int, ...]:
    """Token-sharded row counts: ``total`` rows over ``world`` ranks, the first ``total % world`` one more.
    Raises ValueError on total < 0 or world < 1. (Same rule as sgl_kernel.tdist.layout.split_rows.)"""
    if world < 1 or total < 0:
        raise ValueError(f"split_rows: total={total} must be >= 0 and world={world} >= 1")
    q, r = divmod(total, world)
    return tuple(q + (1 if i < r else 0) for i in range(world))


def _check_rows(rows: Sequence[int], world: int) -> Tuple[int, ...]:
    rows = tuple(int(r) for r in rows)
    if len(rows) != world or any(r < 0 for r in rows):
        raise ValueError(f"rows={rows} must be {world} non-negative per-rank token counts")
    return rows


class SequenceParallelOps(ABC):
    """Contract of the token-sharded linear collectives (module docstring). Every rank calls the same op with the
    same ``rows`` in the same order. Attributes: rank, world_size, name (for logs)."""

    name = "abstract"

    def __init__(self, rank: int, world_size: int):
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"sequence parallel: rank={rank} must be in [0, world_size={world_size})")
        self.rank, self.world_size = rank, world_size

    @abstractmethod
    def ag_linear(self, x_shard: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                  rows: Sequence[int]) -> torch.Tensor:
        """``F.linear(all_gather(x_shard), weight, bias)``: [rows[rank], K] -> [sum(rows), N_local]."""

    @abstractmethod
    def linear_rs(self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                  rows: Sequence[int]) -> torch.Tensor:
        """This rank's rows of ``sum_ranks F.linear(x, weight)`` (+ bias): [sum(rows), K_local] -> [rows[rank], N]."""

    @abstractmethod
    def gather_rows(self, x_shard: torch.Tensor, rows: Sequence[int]) -> torch.Tensor:
        """All-gather token shards: [rows[rank], H] -> [sum(rows), H] in rank order."""


class SequenceParallelLayout:
    """The token-sharded layout shared by a model's column/row-parallel linears and residual norms.

    A sequence-parallel executor gives every such module of its model a reference to one layout, once
    (``module.sequence_parallel = layout``); per forward it only sets the layout's rows (:meth:`active`). While
    ``rows`` is set, column-parallel linears all-gather their token-sharded input, row-parallel linears
    reduce-scatter their output (through ``ops``) and residual norms run without their all-reduce; with ``rows``
    None (every other forward, e.g. CUDA graph capture) the modules run their plain path.

    Attributes: ops (:class:`SequenceParallelOps`), rows (per-rank token counts of the forward in progress, or None).
    """

    def __init__(self, ops: "SequenceParallelOps"):
        self.ops = ops
        self.rows: Optional[Tuple[int, ...]] = None

    @property
    def is_active(self) -> bool:
        """True while a sequence-parallel forward runs."""
        return self.rows is not None

    @contextlib.contextmanager
    def active(self, rows: Sequence[int]) -> Iterator["SequenceParallelLayout"]:
        """Within the block the layout's modules run sequence-parallel with ``rows`` (``world_size`` token counts);
        rows are cleared on exit, also on error. Raises RuntimeError when already active (no nesting)."""
        if self.rows is not None:
            raise RuntimeError("a sequence-parallel forward is already running on this layout")
        self.rows = _check_rows(rows, self.ops.world_size)
        try:
            yield self
        finally:
            self.rows = None


class TorchSequenceParallelOps(SequenceParallelOps):
    """Collective then GEMM (or GEMM then collective) with torch.distributed over ``group`` (NCCL or gloo).

    Uneven rows: the gather pads every shard to ``max(rows)``; the scatter all-reduces and keeps this rank's rows
    (the reference semantics; the fused path avoids both costs).
    """

    name = "torch"

    def __init__(self, group: Any, rank: int, world_size: int):
        super().__init__(rank, world_size)
        self.group = group

    def gather_rows(self, x_shard, rows):
        """See :class:`SequenceParallelOps` (shards padded to max(rows), one all_gather)."""
        rows = _check_rows(rows, self.world_size)
        if x_shard.shape[0] != rows[self.rank]:
            raise ValueError(f"gather_rows: x_shard has {x_shard.shape[0]} rows, rows[{self.rank}]={rows[self.rank]}")
        if self.world_size == 1:
            return x_shard
        mx = max(rows)
        padded = torch.zeros(mx, *x_shard.shape[1:], dtype=x_shard.dtype, device=x_shard.device)
        padded[: x_shard.shape[0]] = x_shard
        parts = [torch.empty_like(padded) for _ in range(self.world_size)]
        dist.all_gather(parts, padded, group=self.group)  # the list form: NCCL, and gloo with CPU or CUDA tensors
        return torch.cat([p[: rows[r]] for r, p in enumerate(parts)])

    def ag_linear(self, x_shard, weight, bias, rows):
        """See :class:`SequenceParallelOps`."""
        return F.linear(self.gather_rows(x_shard, rows), weight, bias)

    def linear_rs(self, x, weight, bias, rows):
        """See :class:`SequenceParallelOps`."""
        rows = _check_rows(rows, self.world_size)
        if x.shape[0] != sum(rows):
            raise ValueError(f"linear_rs: x has {x.shape[0]} rows, sum(rows)={sum(rows)}")
        y = F.linear(x, weight)
        if self.world_size > 1:
            dist.all_reduce(y, group=self.group)
        start = sum(rows[: self.rank])
        y = y[start: start + rows[self.rank]]
        return y + bias if bias is not None else y.contiguous()


def create_sequence_parallel_ops(ps: Optional[Any], enable_tdist_overlap: bool = False,
                                 max_tokens: int = 8192) -> SequenceParallelOps:
    """The sequence-parallel ops for a rank (logged at INFO).

    ``enable_tdist_overlap`` (``--enable-tdist-overlap``) selects the Triton-distributed fused AG-GEMM / GEMM-RS when
    the rank runs on CUDA with tp_size > 1; otherwise (or if building the symmetric heap fails, logged as a warning)
    the torch sequence. ``max_tokens`` bounds T per call (it sizes the symmetric heap's buffers).
    """
    if ps is None:
        return TorchSequenceParallelOps(None, 0, 1)
    group = ps.device_group
    if enable_tdist_overlap:
        if ps.device != "cuda" or ps.tp_size == 1:
            logger.info("tdist overlap requested but not used (device=%s, tp_size=%d): torch sequence-parallel ops",
                        ps.device, ps.tp_size)
        else:
            try:
                from sglang.srt.distributed.tdist_overlap import TdistSequenceParallelOps

                ops = TdistSequenceParallelOps(ps.cpu_group, ps.torch_device(), ps.tp_rank, ps.tp_size, max_tokens,
                                               gather_group=group)
                logger.info("sequence-parallel linears: Triton-distributed AG-GEMM / GEMM-RS (tp=%d, max_tokens=%d)",
                            ps.tp_size, max_tokens)
                return ops
            except Exception as e:  # fall back, loudly
                logger.warning("tdist overlap unavailable (%s: %s): using the torch sequence", type(e).__name__, e)
    logger.info("sequence-parallel linears: torch collectives + GEMM in sequence (tp=%d)", ps.tp_size)
    return TorchSequenceParallelOps(group, ps.tp_rank, ps.tp_size)
