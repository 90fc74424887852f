"""NCCL symmetric-memory baseline for the communication benchmarks (NCCL >= 2.27 window registration).

NCCL 2.27 added ``ncclCommWindowRegister`` and symmetric kernels: when every rank passes a buffer at the same
offset of a window registered with ``NCCL_WIN_COLL_SYMMETRIC``, AllReduce / AllGather / ReduceScatter run
low-latency kernels that read peers' memory directly (over P2P when NVLS is off, as on our hosts). PyTorch
exposes this through the NCCL backend of a process group created with ``device_id``:
``backend = pg._get_backend(torch.device('cuda'))``, a ``torch.cuda.MemPool(backend.mem_allocator)`` and
``backend.register_mem_pool(pool, True)`` (positional: on torch 2.11 it is a pybind builtin without an inspectable
signature; verified on 2 H100s, NCCL 2.28.9, which then logs ``AllReduce [Symmetric] ... AllReduce_AGxLL_R``).
This is the strongest
non-multicast NCCL baseline, which the issue asks to compare tw-comm and TokenWeave against besides plain
NCCL. Benchmark-only: the serving path never imports this module.
"""

from __future__ import annotations

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
        device = torch.device(device)
        if device.type != "cuda":
            raise RuntimeError(f"NCCL symmetric windows need a CUDA device, got {device}")
        try:
            pg = group._get_backend(torch.device("cuda"))
            allocator = pg.mem_allocator
        except Exception as e:
            raise RuntimeError(f"NCCL process group has no mem_allocator ({type(e).__name__}: {e})") from e
        if not hasattr(pg, "register_mem_pool"):
            raise RuntimeError("ProcessGroupNCCL.register_mem_pool is missing: torch too old for NCCL windows")
        self.pool = torch.cuda.MemPool(allocator)
        with torch.cuda.use_mem_pool(self.pool):
            self.flat = torch.empty(numel, dtype=dtype, device=device)
        _register_symmetric(pg, self.pool)
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


def _register_symmetric(pg: Any, pool: "torch.cuda.MemPool") -> None:
    """``pg.register_mem_pool(pool, True)``: the second positional argument asks for a symmetric
    (``NCCL_WIN_COLL_SYMMETRIC``) window. Raises RuntimeError when this torch only registers plain windows (a
    one-argument binding), so the benchmark never labels a plain registration ``nccl_symm``."""
    try:
        pg.register_mem_pool(pool, True)
    except TypeError as e:
        raise RuntimeError(f"register_mem_pool(pool, True) refused ({e}): this torch cannot register NCCL "
                           "symmetric windows") from e


def make_window_or_note(numel: int, dtype: torch.dtype, device: torch.device, notes: set,
                        group: Optional[Any] = None) -> Optional[NcclWindow]:
    """:class:`NcclWindow` or None, adding why to ``notes`` (so a report says why the column is missing)."""
    try:
        return NcclWindow(numel, dtype, device, group)
    except Exception as e:  # depends on the torch/NCCL build of the host
        notes.add(f"nccl_symm unavailable: {type(e).__name__}: {str(e)[:160]}")
        return None


def fused_norm(comm: Any) -> Any:
    """``comm`` with ``all_reduce_add_rmsnorm`` = its own ``all_reduce`` + tw-comm's fused add-RMSNorm kernel
    (``torch.ops.sgl_kernel.tw_fused_add_rmsnorm``, the norm TokenWeave's tw-comm path runs) on CUDA bf16/fp16,
    so the layer benchmark's ``nccl`` / ``nccl_symm`` / ``nocomm`` baselines and ``tokenweave`` use the same norm
    kernel (the plain communicators use an unfused fp32 torch norm). Elsewhere (CPU, fp32) the communicator's own
    path. The other collectives delegate to ``comm``. Returns a new object; ``comm`` is unchanged."""
    base = type(comm)

    class FusedNorm(base):
        """``{base}`` with the fused add-RMSNorm kernel after its all-reduce (benchmark baseline)."""

        fuses_add_rmsnorm = True

        def all_reduce_add_rmsnorm(self, x, residual, weight, eps):
            if not (x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and residual.dtype == x.dtype):
                return super().all_reduce_add_rmsnorm(x, residual, weight, eps)
            from sgl_kernel.tw_comm import ops as _tw_ops  # noqa: F401  (registers torch.ops.sgl_kernel.tw_*)

            total = self.all_reduce(x.contiguous())
            residual = residual.contiguous()
            out = torch.empty_like(total)
            sms = torch.cuda.get_device_properties(x.device).multi_processor_count
            torch.ops.sgl_kernel.tw_fused_add_rmsnorm(total, residual, weight.to(x.dtype), out, float(eps), sms)
            return out, residual

    FusedNorm.__name__ = FusedNorm.__qualname__ = f"FusedNorm{base.__name__}"
    wrapped = object.__new__(FusedNorm)
    wrapped.__dict__.update(comm.__dict__)
    return wrapped


def nccl_symm_communicator(ps: Any, max_numel: int, dtype: torch.dtype, notes: set):
    """A TP communicator whose all-reduce runs NCCL's symmetric kernels: the input is copied into a symmetric
    window, reduced there in place, and copied out (the copy-in/copy-out form serving engines use, since model
    activations are not allocated in the window). Falls back to None (reason in ``notes``) where no window can
    be registered; larger inputs than ``max_numel`` use plain NCCL. Wrap it in :func:`fused_norm` for the layer
    benchmark."""
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

    comm = NcclSymmCommunicator(ps.device_group, ps.tp_rank, ps.tp_size)
    comm.window = window
    return comm


def _self_check(rank: int, world: int, init_file: str) -> None:
    """One rank of ``python benchmark/comm/nccl_symm.py``: registers a window, all-reduces T x 8192 bf16 through it
    for T in (1, 128, 1024) and compares with plain NCCL on a copy (exact: same sum order is not guaranteed, so
    within bf16 rounding). Raises AssertionError on a mismatch, RuntimeError when no window registers."""
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world, device_id=dev)
    try:
        win = NcclWindow(1024 * 8192, torch.bfloat16, dev)
        for t in (1, 128, 1024):
            g = torch.Generator(device="cpu").manual_seed(10 * t + rank)
            x = torch.randn(t, 8192, generator=g).to(torch.bfloat16).to(dev)
            ref = x.clone()
            dist.all_reduce(ref)
            w = win.buffer((t, 8192))
            w.copy_(x)
            dist.all_reduce(w)
            torch.cuda.synchronize()
            torch.testing.assert_close(w.float(), ref.float(), atol=0.1, rtol=0.02)
        if rank == 0:
            print(f"nccl_symm self-check OK: world {world}, T 1/128/1024 x 8192 bf16 match plain NCCL")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":  # GPU self-check (NCCL_DEBUG=INFO shows whether the symmetric kernels ran)
    import sys
    import tempfile

    import torch.multiprocessing as mp

    if len(sys.argv) > 1 and sys.argv[1] in ("-h", "--help"):
        print("usage: python benchmark/comm/nccl_symm.py [WORLD]  (GPU self-check of the NCCL symmetric window; "
              "WORLD defaults to every visible GPU)")
        sys.exit(0)
    n = int(sys.argv[1]) if len(sys.argv) > 1 else torch.cuda.device_count()
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_self_check, args=(n, f"{d}/store"), nprocs=n, join=True)
