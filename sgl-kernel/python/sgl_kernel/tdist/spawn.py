"""Run a function on N ranks as N processes (one GPU shared, or one GPU per rank), with hang diagnostics.

Used by the GPU tests and ``benchmark/tdist/bench_kernels.py``. Each rank: sets the caller's ``env`` (the multicast-off
environment, ``sglang.srt.utils.nvls_env.NVLS_OFF_ENV``: passed in, since sgl_kernel never imports sglang), joins a gloo
process group (host control only; several ranks may share one GPU, which NCCL refuses), builds the
:class:`~sgl_kernel.tdist.heap.SymmetricHeap` on ``cuda:(rank % device_count)`` and calls
``fn(heap, note, nccl, *args) -> dict`` (``CUDA_DEVICE_MAX_CONNECTIONS`` is 32 in every rank unless set:
layout.stream_queue_env). The parent collects the dicts; a rank that does not finish within ``timeout`` seconds
(or, with ``stall_timeout``, sends nothing for that long) is reported with the last progress note it sent
(``note(msg)`` in the child) and all ranks are killed, so a hang becomes an error, never a stuck run. Partial results
are not lost: ``note.result(key, value)`` in the child reaches the parent's ``on_result(rank, key, value)`` at once
(the GPU tests report each case as it finishes). Device-side waits are bounded as well (HeapConfig.wait_timeout_s),
so a device hang surfaces as a TdistWaitError in the rank long before the host timeouts.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import socket
import time
import traceback
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple



def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Note:
    """The child's reporting handle: ``note(msg)`` (progress), ``note.result(key, value)`` (a partial result,
    picklable)."""

    def __init__(self, q, rank: int):
        self._q, self._rank = q, rank

    def __call__(self, msg) -> None:
        self._q.put(("note", self._rank, str(msg)))

    def result(self, key: str, value: Any) -> None:
        self._q.put(("result", self._rank, (key, value)))


def _cpu_heap(rank: int, world: int, cfg, group):
    """A host-memory stand-in heap (no peer mapping: kernels cannot use it) for tests of this harness on CPU."""
    import torch
    import torch.distributed as dist

    from sgl_kernel.tdist.heap import SymmetricHeap

    buf = torch.zeros(cfg.total_bytes + 512, dtype=torch.uint8)
    skip = (-buf.data_ptr()) % 512  # heap bases must be 256-byte aligned (heap.BASE_ALIGN)
    local = buf[skip: skip + cfg.total_bytes]
    return SymmetricHeap(rank, world, local, [local.data_ptr()] * world, cfg,
                         barrier=lambda: dist.barrier(group=group), backend="cpu-test")


def _child(rank: int, world: int, port: int, fn: Callable, args: Tuple, cfg, q, with_nccl: bool,
           gloo_timeout: float, cpu_heap: bool, env: Dict[str, str]) -> None:
    from sgl_kernel.tdist.layout import stream_queue_env

    os.environ.update(env)
    os.environ.update(stream_queue_env(os.environ))  # before CUDA: 32 hardware queues unless set explicitly
    note = _Note(q, rank)
    try:
        import torch
        import torch.distributed as dist

        from sgl_kernel.tdist.heap import SymmetricHeap

        if not cpu_heap:
            dev = torch.device("cuda", rank % torch.cuda.device_count())
            torch.cuda.set_device(dev)
        import datetime

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=gloo_timeout))
        nccl = None
        if with_nccl:
            nccl = dist.new_group(backend="nccl")
        note("heap create")
        if cpu_heap:
            heap = _cpu_heap(rank, world, cfg, dist.group.WORLD)
        else:
            heap = SymmetricHeap.create(dist.group.WORLD, dev, cfg)
        out = fn(heap, note, nccl, *args)
        heap.close()
        q.put(("done", rank, out))
        dist.destroy_process_group()
    except BaseException:
        q.put(("error", rank, traceback.format_exc()[-4000:]))


def run_ranks(world: int, fn: Callable, args: Tuple = (), *, env: Mapping[str, str], heap_config=None,
              timeout: float = 600.0, with_nccl: bool = False,
              on_result: Optional[Callable[[int, str, Any], None]] = None, stall_timeout: Optional[float] = None,
              gloo_timeout: float = 600.0, cpu_heap: bool = False,
              on_note: Optional[Callable[[int, str], None]] = None) -> Tuple[List[Any], List[str]]:
    """Run ``fn(heap, note, nccl_group_or_None, *args)`` on ``world`` ranks; returns (per-rank results or None,
    problems). ``fn`` must be importable (module level). env: variables every rank sets before touching CUDA (pass
    ``sglang.srt.utils.nvls_env.NVLS_OFF_ENV``; required so that no caller forgets it). with_nccl: also create an NCCL group (needs one GPU per
    rank). on_result(rank, key, value): called in this process for every ``note.result`` of a child, as it arrives.
    stall_timeout: end the group when no rank sent anything for that many seconds. gloo_timeout: seconds of the
    ranks' host collectives. cpu_heap: give ``fn`` a host-memory stand-in heap (tests of this harness without a
    GPU; no kernel can use it). on_note(rank, msg): called for every progress note as it arrives (live progress,
    e.g. printed by a GPU test: a run cut from outside still shows where each rank was). Problems name the rank and
    its last note (where it hung) or its traceback."""
    from sgl_kernel.tdist.layout import HeapConfig

    cfg = heap_config or HeapConfig()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_child, args=(r, world, port, fn, args, cfg, q, with_nccl, gloo_timeout, cpu_heap,
                                                    dict(env)),
                         daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    results: List[Any] = [None] * world
    last: Dict[int, str] = {r: "started" for r in range(world)}
    problems: List[str] = []
    finished = set()
    deadline = time.time() + timeout
    last_msg = time.time()
    stalled = False

    def handle(kind, rank, payload) -> None:
        nonlocal deadline
        if kind == "note":
            last[rank] = payload
            if on_note is not None:
                on_note(rank, payload)
        elif kind == "result":
            if on_result is not None:
                on_result(rank, *payload)
        elif kind == "done":
            results[rank] = payload
            finished.add(rank)
        else:
            problems.append(f"rank {rank} raised:\n{payload}")
            finished.add(rank)
            deadline = min(deadline, time.time() + 30.0)  # its peers may now wait on the device (bounded) or host

    while len(finished) < world and time.time() < deadline:
        if stall_timeout is not None and time.time() - last_msg > stall_timeout:
            stalled = True
            break
        try:
            kind, rank, payload = q.get(timeout=1.0)
        except queue.Empty:
            dead = [r for r, p in enumerate(procs) if r not in finished and not p.is_alive() and p.exitcode != 0]
            if dead:
                time.sleep(2.0)
                _drain(q, handle)
                for r in dead:
                    if r not in finished:
                        problems.append(f"rank {r} died (exit code {procs[r].exitcode}) after: {last[r]}")
                        finished.add(r)
            continue
        last_msg = time.time()
        handle(kind, rank, payload)
    _drain(q, handle)  # results that arrived with the deadline
    for r in range(world):
        if r not in finished:
            why = (f"sent nothing for {stall_timeout:.0f} s" if stalled else f"timed out after {timeout:.0f} s")
            problems.append(f"rank {r} {why}; last progress: {last[r]}")
    _reap(procs, quick=bool(problems))
    return results, problems


def _drain(q, handle: Callable) -> None:
    """Pass every message already in the rank queue ``q`` to ``handle(kind, rank, payload)``; never blocks."""
    while not q.empty():
        try:
            handle(*q.get(timeout=0.1))
        except queue.Empty:
            break


def _reap(procs: List, quick: bool) -> None:
    """Join the rank processes (0.5 s each when ``quick``: something failed, else 5 s), killing any still alive."""
    for p in procs:
        p.join(timeout=0.5 if quick else 5)
        if p.is_alive():
            p.kill()
            p.join(timeout=5)
