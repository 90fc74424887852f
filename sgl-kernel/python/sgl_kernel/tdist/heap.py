"""The symmetric heap of a process group (Zheng et al., "Triton-distributed", 2025, sec. 2.2), without NVSHMEM.

Each rank allocates one heap (:class:`~sgl_kernel.tdist.layout.HeapConfig`: int64 signal slots, then data regions)
and maps every peer's heap into its address space through CUDA IPC (:mod:`sgl_kernel.tdist.cuda_ipc`). Kernels get
one small int64 tensor, ``heap.meta = [rank, world, base_0, ..., base_{world-1}, wait_budget_ns]`` (bases as mapped
in *this* process; the budget bounds every device wait, see primitives.signal_wait_until), and translate a local
heap address to a peer's with ``ptr + (base[peer] - base[rank])`` (the ``symm_at``
primitive). Multicast objects are never created. The handle exchange follows tw-comm's workspace
(``sglang.srt.distributed.tw_comm``): allocate, export, all-gather the 64-byte handles over the group, open the peers;
it works with a gloo group, so several ranks can share one GPU (CUDA IPC maps within a device across processes).

Choice of building block (documented in docs/tdist.md): the driver-API IPC path rather than
``torch.distributed._symmetric_memory`` because the latter keys rendezvous on one device per rank (ranks sharing a GPU
are our one-GPU test setup) and owns its signal pads, while Triton-distributed kernels need the raw base addresses and
a signal layout of their own. tw-comm's C workspace has a fixed layout for the fused all-reduce, so it is not reused
as the allocation itself. An NVSHMEM backend is not provided (``nvshmem`` is not installed in our images); the heap
interface (``meta``/regions/signals) is what such a backend would fill in.

:func:`simulate_group` builds the heaps of N ranks inside one process (CPU or one CUDA device, plain tensors; no IPC),
which runs the same kernels under ``TRITON_INTERPRET=1`` or on one GPU for unit tests.
"""

from __future__ import annotations

import logging
from typing import Callable, List, Optional, Sequence

import torch

from sgl_kernel.tdist.layout import (ERR_ABORT, ERR_CMP, ERR_EXPECT, ERR_NS, ERR_REASON, ERR_SEEN, ERR_SIG, ERR_SITE,
                                     ERROR_SLOTS, HeapConfig, HeapLayout, SIGNAL_BYTES, SignalEpochs, WAIT_CMPS,
                                     WAIT_REASONS, WAIT_SITES)

logger = logging.getLogger(__name__)
BASE_ALIGN = 256  # bytes; cuMemAlloc guarantees it, simulate_group aligns to 512


class TdistWaitError(RuntimeError):
    """A device-side wait of a tdist kernel gave up (timed out, or its group was aborted by a peer that timed out).
    The message names the kernel, the rank, the signal (heap name and index), the awaited and the last seen value."""


class _DevicePointer:
    """Exposes a raw CUDA address range as ``__cuda_array_interface__`` so torch can view it without copying."""

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3,
                                         "strides": None}


class SymmetricHeap:
    """One rank's view of the group's symmetric heap.

    Attributes: rank, world (ints); device (torch.device); config (HeapConfig); layout (HeapLayout, same calls on
    every rank); epochs (SignalEpochs, same calls on every rank); local (uint8 [total_bytes] tensor on device: this
    rank's heap); meta (int64 [3 + world] on device: rank, world, peer base addresses, wait budget in ns); signal
    (int64 [signal_slots] view of the signal region; slots 0..7 are the device error record, see :meth:`check`).
    Build it with :meth:`create` (collective) or :func:`simulate_group`.
    """

    def __init__(self, rank: int, world: int, local: torch.Tensor, bases: Sequence[int], config: HeapConfig,
                 barrier: Callable[[], None], closer: Optional[Callable[[], None]] = None, backend: str = "sim"):
        if not 0 <= rank < world:
            raise ValueError(f"rank={rank} must be in [0, world={world})")
        if len(bases) != world:
            raise ValueError(f"got {len(bases)} base addresses for world={world}")
        if local.dtype != torch.uint8 or local.numel() < config.total_bytes:
            raise ValueError(f"local heap must be uint8 with >= {config.total_bytes} bytes")
        if any(int(b) % BASE_ALIGN for b in bases):
            raise ValueError(f"heap bases {[hex(int(b)) for b in bases]} must be {BASE_ALIGN}-byte aligned "
                             "(symm_at's alignment hint relies on it); allocate with cuMemAlloc or simulate_group")
        self.rank, self.world, self.config, self.backend = rank, world, config, backend
        self.local = local
        self.device = local.device
        self.bases = tuple(int(b) for b in bases)
        self.meta = torch.tensor([rank, world, *self.bases, config.wait_timeout_ns], dtype=torch.int64,
                                 device=self.device)
        self.signal = local[: config.signal_slots * SIGNAL_BYTES].view(torch.int64)
        self.layout = HeapLayout(config)
        self.error = self.signals("tdist.error", ERROR_SLOTS)  # first allocation: slots 0..7 on every rank
        if self.layout._signals["tdist.error"][0] != 0:
            raise RuntimeError("the error record must be the heap's first signal allocation")
        self.epochs = SignalEpochs()
        self._counters: dict = {}
        self._streams: dict = {}
        self._barrier = barrier
        self._closer = closer

    # ---- regions -------------------------------------------------------------------------------------------------
    def tensor(self, name: str, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """This rank's view of data region ``name`` as a contiguous ``shape``/``dtype`` tensor (allocated on first use,
        at the same offset on every rank; all ranks must request the same names and sizes in the same order)."""
        numel = 1
        for s in shape:
            numel *= int(s)
        esize = torch.empty((), dtype=dtype).element_size()
        off = self.layout.region(name, numel * esize)
        return self.local[off: off + numel * esize].view(dtype).view(*shape)

    def signals(self, name: str, n: int) -> torch.Tensor:
        """int64 view of ``n`` signal slots named ``name`` (zero at heap creation; never reset, see layout.py)."""
        i = self.layout.signals(name, n)
        return self.signal[i: i + n]

    def counters(self, name: str) -> torch.Tensor:
        """int64 [2] tensor (this rank's device, zero at first use) of op ``name``'s device-side epochs: [0] calls
        completed, [1] cumulative arrival target; advanced only by common.release_kernel at the end of each call, so
        kernels read their epoch from memory instead of a launch argument (CUDA-graph capturable). Not in the
        heap (peers never read it); one per name, shared by every op object of that name."""
        t = self._counters.get(name)
        if t is None:
            t = torch.zeros(2, dtype=torch.int64, device=self.device)
            self._counters[name] = t
        return t

    def side_stream(self, key) -> "torch.cuda.Stream":
        """The high-priority side stream ``key`` of this heap (on :attr:`device`), created on first use and shared by
        every op that asks for the same key (e.g. the decomposition's ring-step streams, ``HeapConfig.shared_streams``):
        the stream count stays bounded however many ops exist. torch takes streams round-robin from a pool of 32 per
        priority, so per-op streams beyond 32 silently alias other ops' streams; the CUDA driver then maps all
        streams onto ``CUDA_DEVICE_MAX_CONNECTIONS`` hardware queues (default 8)."""
        s = self._streams.get(key)
        if s is None:
            s = self._streams[key] = torch.cuda.Stream(self.device, priority=-1)
        return s

    def barrier(self) -> None:
        """Host barrier: this rank's device work is finished and every rank reached this point. Raises
        :class:`TdistWaitError` (before the host barrier) if a device wait of this rank gave up."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.check()
        self._barrier()

    def signal_name(self, byte_offset: int) -> str:
        """Human name of the signal at ``byte_offset`` from the heap base: ``"name[i]"`` of its signals() block, or
        a description when the address is not a named heap signal."""
        if byte_offset % SIGNAL_BYTES == 0 and 0 <= byte_offset < self.config.signal_slots * SIGNAL_BYTES:
            slot = byte_offset // SIGNAL_BYTES
            for name, (i, n) in self.layout._signals.items():
                if i <= slot < i + n:
                    return f"{name}[{slot - i}] (slot {slot})"
            return f"unallocated signal slot {slot}"
        return f"address heap_base{byte_offset:+d} (not a heap signal)"

    def wait_error(self) -> Optional[str]:
        """The decoded device error record of this rank (None when no wait gave up). Synchronizing (reads 8 int64
        from the device)."""
        rec = [int(v) for v in self.error.tolist()]
        if rec[ERR_ABORT] == 0 and rec[ERR_SITE] == 0:
            return None
        first = rec[ERR_ABORT] - 1
        head = f"tdist device wait failed on rank {self.rank} of {self.world}"
        if rec[ERR_SITE] == 0:
            return (f"{head}: the group was aborted by rank {first} (one of its waits gave up); no wait of this "
                    "rank failed yet")
        site = WAIT_SITES.get(rec[ERR_SITE], f"site {rec[ERR_SITE]}")
        reason = WAIT_REASONS.get(rec[ERR_REASON], f"reason {rec[ERR_REASON]}")
        cmp = WAIT_CMPS.get(rec[ERR_CMP], "?")
        return (f"{head}: kernel {site} waited for signal {self.signal_name(rec[ERR_SIG])} {cmp} {rec[ERR_EXPECT]}, "
                f"last value {rec[ERR_SEEN]}, after {rec[ERR_NS] / 1e9:.3f} s: {reason}"
                + (f"; group aborted by rank {first}" if first >= 0 else "")
                + f" (budget {self.config.wait_timeout_s} s: HeapConfig.wait_timeout_s)")

    def check(self) -> None:
        """Raise :class:`TdistWaitError` naming kernel, rank and signal if a device wait of this rank gave up (its
        results since then are garbage; the heap stays poisoned: rebuild the group). Synchronizing."""
        msg = self.wait_error()
        if msg is not None:
            raise TdistWaitError(msg)

    def close(self) -> None:
        """Collective: barrier, then unmap peers and free this rank's heap. Idempotent. Does not raise for a
        recorded wait error (call :meth:`check` first to see it)."""
        if self._closer is not None:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self._barrier()
            closer, self._closer = self._closer, None
            closer()

    def __enter__(self) -> "SymmetricHeap":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @classmethod
    def create(cls, group, device: torch.device, config: HeapConfig = HeapConfig()) -> "SymmetricHeap":
        """Collective over ``group`` (torch.distributed; gloo or nccl): allocate this rank's heap on ``device``
        (CUDA), zero it, exchange CUDA IPC handles and map every peer. Several ranks may share one device.

        Raises ValueError for a non-CUDA device, CudaDriverError when the driver refuses (the message names the
        call), RuntimeError when the ranks' configs differ.
        """
        import torch.distributed as dist

        from sgl_kernel.tdist import cuda_ipc

        device = torch.device(device)
        if device.type != "cuda":
            raise ValueError(f"device={device}: the CUDA IPC heap needs a CUDA device (use simulate_group on CPU)")
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        torch.cuda.set_device(device)
        torch.zeros(1, device=device)  # make the primary context current on this thread
        nbytes = config.total_bytes
        ptr = cuda_ipc.mem_alloc(nbytes)
        cuda_ipc.memset_d8(ptr, 0, nbytes)
        infos: List = [None] * world
        dist.all_gather_object(infos, (cuda_ipc.ipc_get_handle(ptr), nbytes, config), group=group)
        if any(i[2] != config for i in infos):
            cuda_ipc.mem_free(ptr)
            raise RuntimeError(f"rank {rank}: heap configs differ across ranks: {[i[2] for i in infos]}")
        bases, opened = [], []
        for p, (handle, _, _) in enumerate(infos):
            if p == rank:
                bases.append(ptr)
            else:
                b = cuda_ipc.ipc_open(handle)
                bases.append(b)
                opened.append(b)
        dev = device.index if device.index is not None else torch.cuda.current_device()
        local = torch.as_tensor(_DevicePointer(ptr, nbytes), device=torch.device("cuda", dev))

        def closer() -> None:
            for b in opened:
                cuda_ipc.ipc_close(b)
            cuda_ipc.mem_free(ptr)

        heap = cls(rank, world, local, bases, config, barrier=lambda: dist.barrier(group=group), closer=closer,
                   backend="cuda_ipc")
        heap.barrier()  # nobody signals into a peer before that peer's heap is zeroed and mapped
        logger.info("tdist heap: rank %d/%d on %s, %d bytes, CUDA IPC (no multicast)", rank, world, device, nbytes)
        return heap


def simulate_group(world: int, config: HeapConfig = HeapConfig(), device: str = "cpu") -> List[SymmetricHeap]:
    """Heaps of ``world`` simulated ranks in this process (plain zeroed tensors on ``device``, no IPC).

    Kernels run rank by rank (e.g. all producers, then all consumers) since one process cannot spin on another
    launch; used by the CPU interpreter tests and one-process GPU tests. Barrier is a no-op (single thread).
    """
    if world < 1:
        raise ValueError(f"world={world} must be >= 1")
    bufs = [torch.zeros(config.total_bytes + 512, dtype=torch.uint8, device=device) for _ in range(world)]
    # align every base to 512 bytes so byte deltas between heaps divide every element size
    views = []
    for b in bufs:
        skip = (-b.data_ptr()) % 512
        views.append(b[skip: skip + config.total_bytes])
    bases = [v.data_ptr() for v in views]
    return [SymmetricHeap(r, world, views[r], bases, config, barrier=lambda: None, backend="sim")
            for r in range(world)]
