"""tw-comm stress, one process per GPU (the one-GPU 2-rank case is ``tw_comm_stress_case.py``):
``--calls`` back-to-back fused AllReduce + residual add + RMSNorm calls, cycling through ``--variants`` on one
pair of buffers, with a checked call of every variant against NCCL AllReduce in fp32 + fp32 RMSNorm (fresh
random inputs, NaN-poisoned outputs, bit-identical on every rank) every ``--check-every`` calls and at the end.
A hang is bounded: the parent kills the ranks after ``--timeout`` seconds and exits 2 naming the last checkpoint
reached. Small enough for ``compute-sanitizer --tool racecheck --target-processes all`` with a few calls.

Exit codes: 0 every call and check passed; 1 a check failed or a rank raised; 2 timeout (hang); 3 too few GPUs.

Usage (repo root)::

    python test/gpu/tw_comm_stress_gpus.py --world 4 --calls 100000 --tokens 16
    compute-sanitizer --tool racecheck --target-processes all python test/gpu/tw_comm_stress_gpus.py \\
        --world 2 --calls 8 --check-every 4
    python test/gpu/tw_comm_stress_gpus.py --world 2 --calls 20000 --variants p2p_twoshot_bulk \\
        p2p_twoshot_sharded p2p_twoshot_pipe_sharded p2p_twoshot_bulk_sharded   # bulk + sharded-residual calls
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE)]

# A variant is a tw-comm backend, or ``<backend>_sharded``: the same backend with the residual sharded (TokenWeave's
# split calls: each rank updates only its ``owned_range`` rows of the residual, the normed rows are gathered whole).
# Only the two-shot family and CE have a sharded form (one-shot and Lamport read every residual row).
SHARDED = "_sharded"
VARIANTS = ("p2p_lamport", "p2p_oneshot", "p2p_twoshot", "p2p_twoshot_pipe", "ce", "p2p_twoshot_bulk",
            "p2p_twoshot" + SHARDED, "p2p_twoshot_pipe" + SHARDED, "p2p_twoshot_bulk" + SHARDED, "ce" + SHARDED)
DEFAULT_VARIANTS = VARIANTS[:4]  # the 100,000-call default (CE is 3-5x slower; bulk needs sm_90+)


def variant_call(name: str) -> tuple[str, bool]:
    """``(backend value, residual_sharded)`` of a :data:`VARIANTS` name, e.g. ``"p2p_twoshot_bulk_sharded"`` ->
    ``("p2p_twoshot_bulk", True)``. Raises ValueError for a name outside :data:`VARIANTS`."""
    if name not in VARIANTS:
        raise ValueError(f"tw-comm stress variant {name!r} is unknown; use one of {', '.join(VARIANTS)}")
    sharded = name.endswith(SHARDED)
    return (name[:-len(SHARDED)] if sharded else name), sharded


def _rank(rank: int, a: argparse.Namespace, init_file: str, progress: str) -> None:
    """One rank: NCCL group, a tw-comm workspace, the call loop with periodic checks; raises AssertionError on a
    wrong result (the helpers of ``test_tw_comm_gpu.py``)."""
    import test_tw_comm_gpu as h  # sets the NVLS-off environment and sys.path
    import torch
    import torch.distributed as dist
    from sglang.srt.distributed.tw_comm import TwBackend, TwCommConfig, TwCommWorkspace, allreduce_rmsnorm

    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=a.world, device_id=dev)
    ws = TwCommWorkspace(None, dev, TwCommConfig(max_bytes=max(1 << 22, a.tokens * a.hidden * 2)))
    calls = [(TwBackend(b), sh) for b, sh in map(variant_call, a.variants)]
    try:
        x, r, w = h._inputs(7, rank, a.tokens, a.hidden, torch.bfloat16, dev)
        out = torch.empty_like(x)
        r.mul_(0.0)  # the residual accumulates over the calls; keep it bounded
        t0, seed = time.time(), 10
        for it in range(a.calls):
            backend, sharded = calls[it % len(calls)]
            allreduce_rmsnorm(ws, x, r, w, h.EPS, out=out, backend=backend, max_sms=a.sms, residual_sharded=sharded)
            last = it + 1 == a.calls
            if (it + 1) % a.check_every == 0 or last:
                torch.cuda.synchronize()
                for b, sh in calls:  # sharded: owned residual rows vs the reference, foreign rows untouched
                    seed += 1
                    h._check_consistent(h._check_variant(ws, b, a.tokens, a.hidden, torch.bfloat16, seed, a.sms, sh))
                r.zero_()
                if rank == 0:
                    line = f"{it + 1} calls ok after {time.time() - t0:.1f}s"
                    Path(progress).write_text(line)
                    print(f"[tw-comm stress] world={a.world}: {line}", flush=True)
        if rank == 0:
            dt = time.time() - t0
            print(f"[tw-comm stress] world={a.world} T={a.tokens} H={a.hidden} variants={','.join(a.variants)}: "
                  f"{a.calls} back-to-back calls + checks in {dt:.1f}s ({a.calls / dt:.0f} calls/s), no hang, "
                  "all checks passed", flush=True)
    finally:
        ws.close()
        dist.destroy_process_group()


def parse_args(argv=None) -> argparse.Namespace:
    """Flags (see the module docstring); argparse errors name the bad value."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--calls", type=int, default=100000)
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--hidden", type=int, default=8192)
    p.add_argument("--variants", nargs="+", default=list(DEFAULT_VARIANTS), choices=VARIANTS,
                   help="backends cycled call by call; <backend>_sharded: with the residual sharded")
    p.add_argument("--sms", type=int, default=16, help="thread blocks per call (1..256)")
    p.add_argument("--check-every", type=int, default=20000)
    p.add_argument("--timeout", type=float, default=60.0, help="seconds before the ranks are killed (exit 2)")
    a = p.parse_args(argv)
    for name in ("world", "calls", "tokens", "check_every"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')}={getattr(a, name)} must be >= 1")
    if a.hidden % 8 or not 8 <= a.hidden <= 16384:
        p.error(f"--hidden={a.hidden} must be a multiple of 8 in [8, 16384]")
    if not 1 <= a.sms <= 256:
        p.error(f"--sms={a.sms} must be in [1, 256]")
    return a


def main(argv=None) -> int:
    """Spawn ``--world`` ranks, wait at most ``--timeout`` seconds; the exit code of the module docstring."""
    a = parse_args(argv)
    import torch
    import torch.multiprocessing as mp

    if torch.cuda.device_count() < a.world:
        print(f"[tw-comm stress] needs {a.world} GPUs, found {torch.cuda.device_count()}", flush=True)
        return 3
    from sgl_kernel.tw_comm.build import build_library

    build_library()
    d = tempfile.mkdtemp(prefix="tw-stress-")
    progress = str(Path(d) / "progress")
    Path(progress).write_text("0 calls checked")
    ctx = mp.spawn(_rank, args=(a, str(Path(d) / "store"), progress), nprocs=a.world, join=False)
    deadline = time.time() + a.timeout
    try:
        while not ctx.join(timeout=2):
            if time.time() > deadline:
                for p in ctx.processes:
                    if p.is_alive():
                        p.kill()
                print(f"[tw-comm stress] HANG: world={a.world} not done after {a.timeout:.0f}s; last checkpoint: "
                      f"{Path(progress).read_text()}", flush=True)
                return 2
    except Exception as e:  # a rank raised (mp.ProcessRaisedException carries its traceback)
        print(f"[tw-comm stress] FAILED: {e}", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
