"""Spawn N torch.distributed ranks on this host, run a function in each, collect the results (tests and
benchmarks of the tensor-parallel code).

``spawn_ranks(fn, world, *args)`` starts ``world`` spawned processes that join one group on a free local port
(through :func:`sglang.srt.distributed.parallel_state.init_parallel_state`; gloo on CPU, NCCL on CUDA) and call
``fn(parallel_state, *args)``; it returns the per-rank results (picklable) in rank order, and raises
RuntimeError with the failing rank's traceback, or on timeout (all ranks are killed: no hang).
"""

from __future__ import annotations

import multiprocessing as mp
import pickle
import sys
import time
import traceback

import torch

from sglang.srt.utils.common import free_tcp_ports


def free_port() -> int:
    """A free local TCP port (the ranks' rendezvous)."""
    return free_tcp_ports(1)[0]


def _entry(rank: int, world: int, init: str, fn, args, pipe, ep_size: int, device: str = "cpu",
           share_gpu: bool = False, sys_path: tuple = ()) -> None:
    sys.path[:0] = [p for p in sys_path if p not in sys.path]
    torch.set_num_threads(1)
    from sglang.srt.distributed.parallel_state import DistConfig, destroy_parallel_state, init_parallel_state

    try:
        ps = init_parallel_state(DistConfig(tp_rank=rank, tp_size=world, init_method=init, device=device,
                                            ep_size=ep_size, timeout_s=120,
                                            device_index=0 if share_gpu else None,
                                            device_backend="gloo" if share_gpu else None))
        result = ("ok", fn(ps, *args))
    except BaseException:
        result = ("error", traceback.format_exc())
    finally:
        destroy_parallel_state()
    # plain pickle: tensors travel as bytes (multiprocessing's pickler would share them through a
    # file descriptor server that dies with this process)
    pipe.send_bytes(pickle.dumps(result))


def spawn_ranks(fn, world: int, *args, timeout: float = 180.0, ep_size: int = 1, device: str = "cpu",
                share_gpu: bool = False, sys_path: tuple = ()) -> list:
    """Run ``fn(parallel_state, *args)`` on ``world`` ranks (gloo on CPU, NCCL with ``device="cuda"``;
    ``share_gpu=True``: every rank on cuda:0 with a gloo device group, the ``--tp-ranks-share-gpu`` test mode);
    results in rank order (see module doc). ``sys_path``: folders each rank puts first on ``sys.path`` (where
    ``fn`` imports its helpers from).

    Raises:
        RuntimeError: a rank raised (its traceback), died, or the ranks did not finish within ``timeout`` s.
    """
    ctx = mp.get_context("spawn")
    init = f"tcp://127.0.0.1:{free_port()}"
    procs, pipes = [], []
    for rank in range(world):
        reader, writer = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_entry, daemon=True,
                        args=(rank, world, init, fn, args, writer, ep_size, device, share_gpu, tuple(sys_path)))
        p.start()
        procs.append(p)
        pipes.append(reader)
    results: dict[int, object] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world:
            if time.monotonic() > deadline:
                raise RuntimeError(f"ranks did not finish within {timeout} s")
            for rank, (p, r) in enumerate(zip(procs, pipes)):
                if rank in results:
                    continue
                if r.poll(0.05):
                    status, value = pickle.loads(r.recv_bytes())
                    if status != "ok":
                        raise RuntimeError(f"rank {rank} failed:\n{value}")
                    results[rank] = value
                elif not p.is_alive():
                    raise RuntimeError(f"rank {rank} died with exit code {p.exitcode}")
    finally:
        for p in procs:
            p.join(5 if len(results) == world else 0)
            if p.is_alive():
                p.kill()
                p.join(2)
    return [results[r] for r in range(world)]
