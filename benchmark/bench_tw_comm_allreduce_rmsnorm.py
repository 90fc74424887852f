"""Benchmark: fused AllReduce + residual add + RMSNorm, tw-comm variants vs NCCL (TokenWeave section 3.3).

One process per GPU, for each world size in --worlds and each token count T (hidden 8192 bf16 by default), every
method is captured in a CUDA graph (--calls-per-graph calls per graph) and timed by replaying it; the per-call
time is the median over replays, max over ranks. Methods:
  baseline      NCCL AllReduce (in place) + tw-comm's local fused add+RMSNorm kernel
  nccl_symm     NCCL >= 2.27 symmetric kernels on a window-registered buffer (benchmark/nccl_symm.py) + the same
                fused add+RMSNorm: the strongest non-multicast NCCL baseline (if this torch/NCCL can register it)
  torch_symm    torch symmetric-memory two_shot_all_reduce_ + the same fused add+RMSNorm (if available)
  flashinfer    trtllm_allreduce_fusion (only if flashinfer imports; not installed on our hosts)
  oneshot / twoshot / twoshot_sharded / ce  tw-comm variants at their default SM bounds
  lamport       (--lamport) the flag-in-data one-shot, where world*T*H*2 fits its buffer (world x 2 MiB)
  SM sweep      twoshot and ce at 2, 4, 8, 16, 32 SMs (T >= --sweep-min-tokens)
Ratios: baseline / method (speed-up) and method / line-rate floor, floor = 2(n-1)/n * S / 450 GB/s.

NVLink multicast stays off (the script sets NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1,
NVSHMEM_DISABLE_NVLS=1 for itself and its children). Usage:
  python benchmark/bench_tw_comm_allreduce_rmsnorm.py --worlds 2,4,8 [--tokens 1,8,...] [--out benchmark/results]
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import socket
import sys
import tempfile
from pathlib import Path

from sglang.srt.utils.nvls_env import NVLS_OFF_ENV  # noqa: E402  (pure Python: no torch/CUDA import)

os.environ.update(NVLS_OFF_ENV)

import torch  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
PATHS = [str(REPO / "sgl-kernel" / "python"), str(REPO / "python"), str(REPO / "benchmark")]
sys.path[:0] = PATHS
logger = logging.getLogger(__name__)

LINK_BYTES_PER_S = 450e9
EPS = 1e-5


def floor_us(world: int, nbytes: int) -> float:
    """Line-rate floor of an AllReduce of nbytes over world ranks: 2(n-1)/n * S / 450 GB/s, in microseconds."""
    return 2 * (world - 1) / world * nbytes / LINK_BYTES_PER_S * 1e6


def _time_graph(fn, calls: int, replays: int) -> float:
    """Median microseconds per call of fn captured `calls` times in one CUDA graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    g.replay()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / calls)
    del g
    times.sort()
    return times[len(times) // 2]


def _worker(rank, world, init_file, args, result_file):
    sys.path[:0] = PATHS
    import torch.distributed as dist
    from sglang.srt.distributed.tw_comm import TwBackend, TwCommConfig, TwCommWorkspace, allreduce_rmsnorm

    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world, device_id=dev)
    H = args.hidden
    dtype = torch.bfloat16
    tokens = [int(t) for t in args.tokens.split(",")]
    ws = TwCommWorkspace(None, dev, TwCommConfig(max_bytes=max(tokens) * H * 2))
    group_name = dist.group.WORLD.group_name
    symm = None
    try:
        import torch.distributed._symmetric_memory as symm  # noqa: F811
    except Exception as e:  # pragma: no cover - depends on the torch build
        logger.warning("torch symmetric memory unavailable: %s", e)
    rows = []
    notes = set()
    ops = torch.ops.sgl_kernel
    from nccl_symm import make_window_or_note

    window = make_window_or_note(max(tokens) * H, dtype, dev, notes)
    for T in tokens:
        g = torch.Generator(device="cpu").manual_seed(1000 + T)
        residual = torch.randn(T, H, generator=g).to(dtype).to(dev)
        weight = (torch.rand(H, generator=g) + 0.5).to(dtype).to(dev)
        g.manual_seed(2000 + T * 8 + rank)
        x = torch.randn(T, H, generator=g).to(dtype).to(dev)
        out = torch.empty_like(x)
        scratch = x.clone()

        def measure(fn):
            """Per-call microseconds of ``fn`` (graph-timed), max over ranks."""
            t = torch.tensor([_time_graph(fn, args.calls_per_graph, args.replays)], device=dev)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            return float(t.item())

        row = {"world": world, "T": T, "bytes": T * H * 2, "floor_us": floor_us(world, T * H * 2)}

        def baseline():
            """NCCL all-reduce in place, then the local fused add + RMSNorm."""
            dist.all_reduce(scratch)
            ops.tw_fused_add_rmsnorm(scratch, residual, weight, out, EPS, 132)

        row["baseline"] = measure(baseline)
        if window is not None:
            wbuf = window.buffer((T, H))
            wbuf.copy_(x)

            def nccl_symm():
                """NCCL all-reduce on the symmetric window (symmetric kernels), then the local fused add + RMSNorm."""
                dist.all_reduce(wbuf)
                ops.tw_fused_add_rmsnorm(wbuf, residual, weight, out, EPS, 132)

            try:
                row["nccl_symm"] = measure(nccl_symm)
            except Exception as e:  # pragma: no cover - host dependent
                notes.add(f"nccl_symm failed: {type(e).__name__}: {str(e)[:120]}")
        if symm is not None:
            try:
                buf = symm.empty((T, H), dtype=dtype, device=dev)
                symm.rendezvous(buf, group_name)
                buf.copy_(x)

                def torch_symm():
                    """Torch symmetric-memory two-shot all-reduce, then the local fused add + RMSNorm."""
                    torch.ops.symm_mem.two_shot_all_reduce_(buf, "sum", group_name)
                    ops.tw_fused_add_rmsnorm(buf, residual, weight, out, EPS, 132)

                row["torch_symm"] = measure(torch_symm)
            except Exception as e:  # pragma: no cover
                notes.add(f"torch_symm unavailable: {type(e).__name__}: {str(e)[:120]}")
        try:
            import flashinfer.comm  # noqa: F401

            notes.add("flashinfer importable but its trtllm_allreduce_fusion workspace set-up is not wired here")
        except Exception:
            notes.add("flashinfer not importable: trtllm_allreduce_fusion not measured")

        def tw(backend, sms, sharded=False):
            """A closure running tw-comm ``allreduce_rmsnorm`` with ``backend`` on at most ``sms`` SMs."""
            return lambda: allreduce_rmsnorm(ws, x, residual, weight, EPS, out=out, backend=backend, max_sms=sms,
                                             residual_sharded=sharded)

        if world * T * H * 2 <= ws.capacity_bytes:
            row["oneshot"] = measure(tw(TwBackend.ONESHOT, ws.config.oneshot_sms))
        if args.lamport and T * H * 2 <= 2 << 20:
            row["lamport"] = measure(tw(TwBackend.LAMPORT, ws.config.oneshot_sms))
        row["twoshot"] = measure(tw(TwBackend.TWOSHOT, ws.config.twoshot_sms))
        row["twoshot_sharded"] = measure(tw(TwBackend.TWOSHOT, ws.config.twoshot_sms, True))
        row["ce"] = measure(tw(TwBackend.CE, ws.config.ce_sms))
        row["auto"] = ws.select(T, H).value
        if T >= args.sweep_min_tokens:
            for sms in (2, 4, 8, 16, 32, 64, 128):
                row[f"twoshot@{sms}"] = measure(tw(TwBackend.TWOSHOT, sms))
                row[f"ce@{sms}"] = measure(tw(TwBackend.CE, sms))
        rows.append(row)
        if rank == 0:
            logger.warning("world=%d T=%d done: %s", world, T,
                           {k: round(v, 1) for k, v in row.items() if isinstance(v, float)})
    ws.close()
    if rank == 0:
        Path(result_file).write_text(json.dumps({"rows": rows, "notes": sorted(notes)}))
    dist.destroy_process_group()


TW_METHODS = ("oneshot", "lamport", "twoshot", "twoshot_sharded", "ce")


def render(rows, notes, command, hardware) -> str:
    """Markdown report: main table, SM sweep table, notes."""
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [f"# tw-comm fused AllReduce + residual + RMSNorm, hidden 8192 bf16 ({now})", "",
             f"hardware: {hardware}", f"command: `{command}`",
             "times: us per call, CUDA graph replay median, max over ranks. speed-up = baseline / best tw-comm; "
             "floor = 2(n-1)/n*S/450GB/s.", "",
             "| world | T | floor | baseline | nccl_symm | torch_symm | oneshot | lamport | twoshot | twoshot_sharded | "
             "ce(8 SMs) | best tw | speed-up | vs nccl_symm | vs torch_symm | best/floor | auto |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    fmt = lambda v: f"{v:.1f}" if isinstance(v, float) else "n/a"  # noqa: E731
    for r in rows:
        tw = {m: r[m] for m in TW_METHODS if m in r}
        best_m = min(tw, key=tw.get)
        best = tw[best_m]
        lines.append(
            f"| {r['world']} | {r['T']} | {r['floor_us']:.1f} | {fmt(r['baseline'])} | {fmt(r.get('nccl_symm'))} | "
            f"{fmt(r.get('torch_symm'))} | " + " | ".join(fmt(r.get(m)) for m in TW_METHODS)
            + f" | {best:.1f} ({best_m}) | {r['baseline'] / best:.2f}x | "
            + (f"{r['nccl_symm'] / best:.2f}x" if r.get("nccl_symm") else "n/a") + " | "
            + (f"{r['torch_symm'] / best:.2f}x" if r.get("torch_symm") else "n/a")
            + f" | {best / r['floor_us']:.2f}x | {r['auto']} |"
        )
    sweep = [r for r in rows if "ce@8" in r]
    sms = (2, 4, 8, 16, 32, 64, 128)
    if sweep:
        lines += ["", "SM sweep (us per call; twoshot = full residual):", "",
                  "| world | T | " + " | ".join(f"twoshot@{s}" for s in sms) + " | "
                  + " | ".join(f"ce@{s}" for s in sms) + " | ce@<=8 / best ce |",
                  "|---|---|" + "---|" * (2 * len(sms) + 1)]
        for r in sweep:
            ce = [r[f"ce@{s}"] for s in sms]
            ce_small = min(r[f"ce@{s}"] for s in sms if s <= 8)
            lines.append(f"| {r['world']} | {r['T']} | " + " | ".join(fmt(r[f"twoshot@{s}"]) for s in sms)
                         + " | " + " | ".join(fmt(v) for v in ce) + f" | {ce_small / min(ce):.2f}x |")
    if notes:
        lines += ["", "notes:"] + [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"


def main() -> None:
    """CLI entry: build the tw-comm library, run one worker per GPU for each world size, write and log the results
    table."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worlds", default="2,4,8")
    p.add_argument("--tokens", default="1,8,32,128,512,1024,2048,4096,8192,16384")
    p.add_argument("--hidden", type=int, default=8192)
    p.add_argument("--calls-per-graph", type=int, default=10)
    p.add_argument("--replays", type=int, default=7)
    p.add_argument("--sweep-min-tokens", type=int, default=2048)
    p.add_argument("--out", default=str(REPO / "benchmark" / "results"))
    p.add_argument("--tag", default="")
    p.add_argument("--lamport", action="store_true", help="also time the Lamport one-shot (p2p_lamport)")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(message)s")
    import torch.multiprocessing as mp
    from sgl_kernel.tw_comm.build import build_library

    build_library()
    rows, notes = [], set()
    n_gpu = torch.cuda.device_count()
    hardware = f"{n_gpu}x {torch.cuda.get_device_name(0)}, torch {torch.__version__}, host {socket.gethostname()}"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d_%H%M")
    for world in [int(w) for w in args.worlds.split(",")]:
        if world > n_gpu:
            notes.add(f"world {world} skipped: {n_gpu} GPUs")
            continue
        with tempfile.TemporaryDirectory() as tmp:
            res = Path(tmp) / "res.json"
            mp.spawn(_worker, args=(world, str(Path(tmp) / "store"), args, str(res)), nprocs=world, join=True)
            data = json.loads(res.read_text())
            rows += data["rows"]
            notes.update(data["notes"])
        # rewrite after every world size, so a run cut short keeps what it measured
        report = render(rows, sorted(notes), " ".join(sys.argv), hardware)
        (out / f"tw_comm_allreduce_rmsnorm_{stamp}{args.tag}.md").write_text(report)
        (out / f"tw_comm_allreduce_rmsnorm_{stamp}{args.tag}.json").write_text(json.dumps({"rows": rows}, indent=1))
    print(render(rows, sorted(notes), " ".join(sys.argv), hardware))

if __name__ == "__main__":
    main()
