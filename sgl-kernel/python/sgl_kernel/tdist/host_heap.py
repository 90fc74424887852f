"""A symmetric heap in host shared memory: one rank per *process* on CPU, for running the Triton-distributed kernels
under the Triton interpreter (``TRITON_INTERPRET=1``) with real process boundaries (gloo groups, as the server's
CPU ranks), where :func:`~sgl_kernel.tdist.heap.simulate_group` keeps every rank in one process.

Each rank creates a zero-filled POSIX shared-memory file (``/dev/shm``), the paths are all-gathered over the group,
every rank maps every peer's file (``mmap(MAP_SHARED)`` through ``torch.from_file``), and the files are unlinked as
soon as everyone mapped them (the memory lives while mapped; nothing is left behind if a rank dies). The kernels
translate addresses exactly as on the GPU (``symm_at``: ``base[peer] - base[me]``), and the interpreter reads and
writes those addresses directly, so peer stores land in the peer's memory.

What the GPU does in one launch (every program announces, then spins on its peers) a process cannot do inside the
interpreter (its waits do not spin: an unsatisfied wait is recorded as an error at once). Callers therefore run a
collective kernel phase by phase with a host barrier between phases (e.g. :meth:`AllToAll.stages
<sgl_kernel.tdist.all_to_all.AllToAll.stages>` and :func:`run_phased`); the barrier (a gloo round trip) also orders
the shared-memory stores between processes.
"""

from __future__ import annotations

import logging
import os
import uuid
from typing import Callable, Sequence

import torch

from sgl_kernel.tdist.heap import SymmetricHeap
from sgl_kernel.tdist.layout import HeapConfig

logger = logging.getLogger(__name__)
SHM_DIR = "/dev/shm"


def create_host_heap(group, config: HeapConfig = HeapConfig()) -> SymmetricHeap:
    """Collective over ``group`` (torch.distributed, gloo): this rank's heap in host shared memory, every peer's
    mapped into this process (module docstring). Returns a :class:`SymmetricHeap` with ``backend="host_shm"`` on the
    CPU device.

    Raises:
        ValueError: ``/dev/shm`` is missing or not writable (the message names it).
        RuntimeError: the ranks' configs differ.
    """
    import torch.distributed as dist

    if not os.path.isdir(SHM_DIR) or not os.access(SHM_DIR, os.W_OK):
        raise ValueError(f"the host tdist heap needs a writable {SHM_DIR} (POSIX shared memory)")
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    nbytes = config.total_bytes
    path = os.path.join(SHM_DIR, f"sglang-tdist-{os.getpid()}-{uuid.uuid4().hex[:12]}-r{rank}")
    with open(path, "wb") as f:
        f.truncate(nbytes)  # zero-filled
    try:
        infos: list = [None] * world
        dist.all_gather_object(infos, (path, nbytes, config), group=group)
        if any(i[2] != config for i in infos):
            raise RuntimeError(f"rank {rank}: heap configs differ across ranks: {[i[2] for i in infos]}")
        maps = [torch.from_file(p, shared=True, size=n, dtype=torch.uint8) for p, n, _ in infos]
        dist.barrier(group=group)  # every rank mapped every file
    finally:
        os.unlink(path)
    bases = [m.data_ptr() for m in maps]

    def closer() -> None:
        maps.clear()  # the mappings go with their tensors

    heap = SymmetricHeap(rank, world, maps[rank], bases, config, barrier=lambda: dist.barrier(group=group),
                         closer=closer, backend="host_shm")
    heap._peer_maps = maps  # keep every mapping alive as long as the heap
    logger.info("tdist host heap: rank %d/%d, %d bytes in %s (interpreter, one process per rank)", rank, world, nbytes,
                SHM_DIR)
    return heap


def run_phased(heap: SymmetricHeap, phases: Sequence[tuple[str, Callable[[], None]]]) -> None:
    """Run a collective kernel's phases (``[(name, launch)]``) with a host barrier between consecutive phases, then
    :meth:`SymmetricHeap.check` (raises :class:`~sgl_kernel.tdist.heap.TdistWaitError` if a wait gave up)."""
    for i, (_, launch) in enumerate(phases):
        if i:
            heap._barrier()
        launch()
    heap.check()
