"""Run a function on N ranks as N processes (one GPU shared, or one GPU per rank), with hang diagnostics.

Used by the GPU tests and ``benchmark/bench_tdist.py``. Each rank: sets the multicast-off environment, joins a gloo
process group (host control only; several ranks may share one GPU, which NCCL refuses), builds the
:class:`~sgl_kernel.tdist.heap.SymmetricHeap` on ``cuda:(rank % device_count)`` and calls
``fn(heap, *args) -> dict``. The parent collects the dicts; a rank that does not finish within ``timeout`` seconds is
reported with the last progress note it sent (``note(msg)`` in the child) and all ranks are killed, so a device-side
hang becomes an error, never a stuck run.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import socket
import time
import traceback
from typing import Any, Callable, Dict, List, Tuple



def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(rank: int, world: int, port: int, fn: Callable, args: Tuple, cfg, q, with_nccl: bool) -> None:
    from sglang.srt.utils.nvls_env import NVLS_OFF_ENV

    os.environ.update(NVLS_OFF_ENV)
    note = lambda msg: q.put(("note", rank, str(msg)))  # noqa: E731
    try:
        import torch
        import torch.distributed as dist

        from sgl_kernel.tdist.heap import SymmetricHeap

        dev = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(dev)
        import datetime

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=600))
        nccl = None
        if with_nccl:
            nccl = dist.new_group(backend="nccl")
        note("heap create")
        heap = SymmetricHeap.create(dist.group.WORLD, dev, cfg)
        out = fn(heap, note, nccl, *args)
        heap.close()
        q.put(("done", rank, out))
        dist.destroy_process_group()
    except BaseException:
        q.put(("error", rank, traceback.format_exc()[-4000:]))


def run_ranks(world: int, fn: Callable, args: Tuple = (), *, heap_config=None, timeout: float = 600.0,
              with_nccl: bool = False) -> Tuple[List[Any], List[str]]:
    """Run ``fn(heap, note, nccl_group_or_None, *args)`` on ``world`` ranks; returns (per-rank results or None,
    problems). ``fn`` must be importable (module level). with_nccl: also create an NCCL group (needs one GPU per
    rank). Problems name the rank and its last note (where it hung) or its traceback."""
    from sgl_kernel.tdist.layout import HeapConfig

    cfg = heap_config or HeapConfig()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_child, args=(r, world, port, fn, args, cfg, q, with_nccl), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    results: List[Any] = [None] * world
    last: Dict[int, str] = {r: "started" for r in range(world)}
    problems: List[str] = []
    finished = set()
    deadline = time.time() + timeout
    while len(finished) < world and time.time() < deadline:
        try:
            kind, rank, payload = q.get(timeout=1.0)
        except queue.Empty:
            dead = [r for r, p in enumerate(procs) if r not in finished and not p.is_alive() and p.exitcode != 0]
            if dead:
                time.sleep(2.0)
                while not q.empty():
                    kind, rank, payload = q.get()
                    if kind == "note":
                        last[rank] = payload
                    else:
                        finished.add(rank)
                        if kind == "done":
                            results[rank] = payload
                        else:
                            problems.append(f"rank {rank} raised:\n{payload}")
                for r in dead:
                    if r not in finished:
                        problems.append(f"rank {r} died (exit code {procs[r].exitcode}) after: {last[r]}")
                        finished.add(r)
            continue
        if kind == "note":
            last[rank] = payload
        elif kind == "done":
            results[rank] = payload
            finished.add(rank)
        else:
            problems.append(f"rank {rank} raised:\n{payload}")
            finished.add(rank)
            deadline = min(deadline, time.time() + 30.0)  # its peers may now wait forever on the device
    for r in range(world):
        if r not in finished:
            problems.append(f"rank {r} timed out after {timeout:.0f} s; last progress: {last[r]}")
    for p in procs:
        p.join(timeout=5 if not problems else 0.5)
        if p.is_alive():
            p.kill()
            p.join(timeout=5)
    return results, problems
