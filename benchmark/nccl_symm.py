"""NCCL symmetric-memory baseline for the communication benchmarks (NCCL >= 2.27 window registration).

NCCL 2.27 added ``ncclCommWindowRegister`` and symmetric kernels: when every rank passes a buffer at the same
offset of a window registered with ``NCCL_WIN_COLL_SYMMETRIC``, AllReduce / AllGather / ReduceScatter run
low-latency kernels that read peers' memory directly (over P2P when NVLS is off, as on our hosts). PyTorch
exposes this through the NCCL process group: ``ProcessGroupNCCL.mem_allocator`` (``ncclMemAlloc``-backed),
a ``torch.cuda.MemPool`` on it, and ``register_mem_pool(pool, symm=True)``. This is the strongest
non-multicast NCCL baseline, which the issue asks to compare tw-comm and TokenWeave against besides plain
NCCL. Benchmark-only: the serving path never imports this module.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any, Optional

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


class NcclWindow:
    """One symmetric NCCL window of ``numel`` elements of ``dtype`` on ``device`` for ``group`` (collective:
    every rank constructs it, in the same order).

    ``buffer(shape)`` is a view at offset 0 (the same offset on every rank, as the symmetric kernels require).
    Raises RuntimeError (with the reason) when this torch/NCCL cannot register a symmetric window; callers
    record the reason in their notes and leave the column out.
    """

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device, group: Optional[Any] = None):
        group = group or dist.group.WORLD
        try:
            pg = group._get_backend(torch.device(device))
            allocator = pg.mem_allocator
        except Exception as e:
            raise RuntimeError(f"NCCL process group has no mem_allocator ({type(e).__name__}: {e})") from e
        self.pool = torch.cuda.MemPool(allocator)
        with torch.cuda.use_mem_pool(self.pool):
            self.flat = torch.empty(numel, dtype=dtype, device=device)
        params = inspect.signature(pg.register_mem_pool).parameters if hasattr(pg, "register_mem_pool") else {}
        if "symm" not in params:
            raise RuntimeError("ProcessGroupNCCL.register_mem_pool(symm=...) is missing: torch too old for NCCL "
                               "symmetric windows")
        pg.register_mem_pool(self.pool, symm=True)
        self.pg = pg
        dist.barrier(group=group)
        logger.info("NCCL symmetric window: %d x %s on %s", numel, dtype, device)

    def buffer(self, shape) -> torch.Tensor:
        """A ``shape`` view at the window's start (ValueError when it does not fit)."""
        n = 1
        for s in shape:
            n *= int(s)
        if n > self.flat.numel():
            raise ValueError(f"NcclWindow: shape {tuple(shape)} needs {n} elements, window has {self.flat.numel()}")
        return self.flat[:n].view(*shape)


def make_window_or_note(numel: int, dtype: torch.dtype, device: torch.device, notes: set,
                        group: Optional[Any] = None) -> Optional[NcclWindow]:
    """:class:`NcclWindow` or None, adding why to ``notes`` (so a report says why the column is missing)."""
    try:
        return NcclWindow(numel, dtype, device, group)
    except Exception as e:  # depends on the torch/NCCL build of the host
        notes.add(f"nccl_symm unavailable: {type(e).__name__}: {str(e)[:160]}")
        return None


def nccl_symm_communicator(ps: Any, max_numel: int, dtype: torch.dtype, notes: set):
    """A TP communicator whose all-reduce runs NCCL's symmetric kernels: the input is copied into a symmetric
    window, reduced there in place, and copied out (the copy-in/copy-out form serving engines use, since model
    activations are not allocated in the window). Falls back to None (reason in ``notes``) where no window can
    be registered; larger inputs than ``max_numel`` use plain NCCL."""
    from sglang.srt.distributed.communicator import TorchCommunicator

    window = make_window_or_note(max_numel, dtype, ps.torch_device(), notes, ps.device_group)
    if window is None:
        return None

    class NcclSymmCommunicator(TorchCommunicator):
        """torch.distributed collectives; ``all_reduce`` through the symmetric window when the input fits."""

        name = "nccl_symm"

        def all_reduce(self, x):
            if x.numel() > window.flat.numel() or x.dtype != window.flat.dtype:
                return super().all_reduce(x)
            w = window.buffer(x.shape)
            w.copy_(x)
            dist.all_reduce(w, group=self.group)
            return w.clone()

    return NcclSymmCommunicator(ps.device_group, ps.tp_rank, ps.tp_size)
