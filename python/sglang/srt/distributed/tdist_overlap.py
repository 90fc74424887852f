"""Triton-distributed sequence-parallel linears (CUDA only): AG-GEMM for column-parallel and GEMM-RS for
row-parallel layers (Zheng et al., "Triton-distributed", 2025, sec. 3.2-3.3), behind
:class:`~sglang.srt.distributed.sequence_parallel.SequenceParallelOps`.

One :class:`~sgl_kernel.tdist.heap.SymmetricHeap` per TP group (CUDA IPC, no multicast). Fused ops are built lazily
on first use; every rank runs the same layers in the same order, so the heap's bookkeeping stays symmetric. Buffers
are sized for ``max_tokens`` rows.

Producer ``"decomp"`` (default): the decomposition of ``sgl_kernel.tdist.decomp`` (cuBLAS per piece, copy-engine
pushes, stream waits on signals; Wang et al., ASPLOS 2023, sec. 3) behind ``sgl_kernel.tdist.auto.AutoAgGemm`` /
``AutoGemmRs``, which fall back to NCCL + cuBLAS below the calibration table's break-even M (``table``, default
:func:`sgl_kernel.tdist.auto.table_for` of the GPU model: H200 / H100 measured tables, the default table
elsewhere). One op object per buffer name (AG: per K, RS: per N), so ops of the same K / N share buffers and
credits. Its stream waits have no device timeout (a dead peer hangs like NCCL does; the
process-level watchdog applies). Producers ``"ce"`` / ``"sm"``: the Triton kernels (AgGemm / GemmRs).

Fail closed (Triton producers): the kernels' device waits are bounded (HeapConfig.wait_timeout_s); after every fused
op the heap's error word is copied asynchronously to pinned host memory, and the next op raises
:class:`~sgl_kernel.tdist.heap.TdistWaitError` (kernel, rank, signal) once it shows a failed wait, so a stuck peer
turns into an error within one forward instead of a hang or silently wrong tokens.
"""

from __future__ import annotations

import logging
from typing import Dict, Tuple

import torch

from sglang.srt.distributed.sequence_parallel import SequenceParallelOps, _check_rows

logger = logging.getLogger(__name__)


def _nccl_or_none(group):
    """``group`` when it is an NCCL process group, else None (AutoAgGemm / AutoGemmRs then never fall back)."""
    if group is None:
        return None
    import torch.distributed as dist

    try:
        return group if dist.get_backend(group) == "nccl" else None
    except (RuntimeError, ValueError):
        return None


class TdistSequenceParallelOps(SequenceParallelOps):
    """AG-GEMM / GEMM-RS on a symmetric heap. Args: group (torch.distributed group for the handle exchange, gloo
    is fine), device (this rank's CUDA device), rank, world_size, max_tokens (largest T per call), heap_bytes
    (data bytes per rank; default sized lazily-safe at 1 GiB), producer ("decomp" default, "ce", "sm"; see the
    module docstring), gather_group (the device group: row gathers, and the NCCL fallback of the decomposition when
    it is an NCCL group), table (a CalibrationTable for the decomposition's fallback; default
    ``auto.table_for(GPU name)``). Raises ValueError on an unknown producer and on heap creation failure (the
    factory falls back to torch). heap: an existing SymmetricHeap of the group (tests: ``simulate_group``); None
    creates one."""

    name = "tdist"

    def __init__(self, group, device: torch.device, rank: int, world_size: int, max_tokens: int,
                 heap_bytes: int = 1 << 30, producer: str = "decomp", gather_group=None, table=None, heap=None):
        super().__init__(rank, world_size)
        if producer not in ("decomp", "ce", "sm"):
            raise ValueError(f"producer={producer!r} must be 'decomp', 'ce' or 'sm'")
        from sglang.srt.distributed.sequence_parallel import TorchSequenceParallelOps

        # the final all-gather of rows (once per forward) goes through torch.distributed on the device group
        self._torch = TorchSequenceParallelOps(gather_group if gather_group is not None else group, rank, world_size)
        from sgl_kernel.tdist.heap import SymmetricHeap
        from sgl_kernel.tdist.layout import HeapConfig

        self.max_tokens, self.producer, self.table = max_tokens, producer, table
        self._nccl = _nccl_or_none(gather_group)  # the fallback's collectives need NCCL (gloo: always decomp)
        self.heap = heap if heap is not None else SymmetricHeap.create(
            group, device, HeapConfig(data_bytes=heap_bytes, signal_slots=16384))
        self._ops: Dict[Tuple, object] = {}
        self._warned = False
        # abort word + first failing site of the error record, polled without a device sync
        self._err_host = torch.zeros(2, dtype=torch.int64, pin_memory=torch.cuda.is_available())

    def _poll_error(self) -> None:
        """Raise TdistWaitError (synchronizing, full message) if an earlier op's device wait gave up."""
        if int(self._err_host[0]) or int(self._err_host[1]):
            self.heap.check()

    def _track_error(self) -> None:
        self._err_host.copy_(self.heap.error[:2], non_blocking=True)

    def _op(self, kind: str, k: int, n: int, dtype: torch.dtype):
        # buffers depend on K (gather) or N (partials) only: ops of the same K / N share them (they run in stream
        # order, and signals / credits are kept per name on the heap), so one op object per name
        dt = str(dtype).split(".")[-1]
        name = f"sp.ag.k{k}.{dt}" if kind == "ag" else f"sp.rs.n{n}.{dt}"
        key = (name,) if self.producer == "decomp" else (name, k, n)
        op = self._ops.get(key)
        if op is None:
            op = self._build(kind, k, n, dtype, name)
            self._ops[key] = op
            logger.info("tdist: built %s op (%s) K=%d N=%d %s", kind, self.producer, k, n, dtype)
        return op

    def _build(self, kind: str, k: int, n: int, dtype: torch.dtype, name: str):
        rs_rows = -(-self.max_tokens // self.world_size)
        if self.producer == "decomp":
            from sgl_kernel.tdist.auto import AutoAgGemm, AutoGemmRs, CalibrationTable, table_for
            from sgl_kernel.tdist.decomp import DecompAgGemm, DecompGemmRs

            table = self.table
            if table is None:  # the built-in table of this GPU model (unknown models: the default table)
                dev = self.heap.device
                table = table_for(torch.cuda.get_device_name(dev)) if dev.type == "cuda" else CalibrationTable()
            if kind == "ag":
                return AutoAgGemm(DecompAgGemm(self.heap, self.max_tokens, k, dtype, name=name), self._nccl, table)
            return AutoGemmRs(DecompGemmRs(self.heap, rs_rows, n, dtype, name=name), self._nccl, table)
        from sgl_kernel.tdist.ag_gemm import AgGemm
        from sgl_kernel.tdist.gemm_rs import GemmRs

        if kind == "ag":
            return AgGemm(self.heap, self.max_tokens, k, dtype, name=name, producer=self.producer)
        return GemmRs(self.heap, rs_rows, n, dtype, name=name)

    def _too_big(self, rows) -> bool:
        if sum(rows) <= self.max_tokens:
            return False
        if not self._warned:
            self._warned = True
            logger.warning("tdist: a batch of %d tokens exceeds max_tokens=%d: torch collectives for such batches",
                           sum(rows), self.max_tokens)
        return True

    def ag_linear(self, x_shard, weight, bias, rows):
        """See :class:`SequenceParallelOps` (fused AllGather-GEMM; the torch sequence above max_tokens)."""
        rows = _check_rows(rows, self.world_size)
        if self._too_big(rows):
            return self._torch.ag_linear(x_shard, weight, bias, rows)
        self._poll_error()
        op = self._op("ag", weight.shape[1], weight.shape[0], x_shard.dtype)
        out = op(x_shard.contiguous(), weight.t(), rows)
        if self.producer != "decomp":
            self._track_error()
        return out + bias if bias is not None else out

    def gather_rows(self, x_shard, rows):
        """See :class:`SequenceParallelOps` (torch.distributed all-gather)."""
        return self._torch.gather_rows(x_shard, rows)

    def linear_rs(self, x, weight, bias, rows):
        """See :class:`SequenceParallelOps` (fused GEMM-ReduceScatter; the torch sequence above max_tokens)."""
        rows = _check_rows(rows, self.world_size)
        if self._too_big(rows):
            return self._torch.linear_rs(x, weight, bias, rows)
        self._poll_error()
        op = self._op("rs", weight.shape[1], weight.shape[0], x.dtype)
        out = op(x.contiguous(), weight.t(), rows)
        if self.producer != "decomp":
            self._track_error()
        return out + bias if bias is not None else out
