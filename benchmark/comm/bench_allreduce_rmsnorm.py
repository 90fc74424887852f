"""Benchmark: fused AllReduce + residual add + RMSNorm, tw-comm variants vs NCCL (TokenWeave section 3.3).

One process per GPU, for each world size in --worlds and each token count T (hidden 8192 bf16 by default), every
method is captured in a CUDA graph (--calls-per-graph calls per graph) and timed by replaying it; the per-call
time is the median over replays, max over ranks. Methods:
  baseline      NCCL AllReduce (in place) + tw-comm's local fused add+RMSNorm kernel
  nccl_symm     NCCL >= 2.27 symmetric kernels on a window-registered buffer (benchmark/comm/nccl_symm.py) + the same
                fused add+RMSNorm: the strongest non-multicast NCCL baseline (if this torch/NCCL can register it)
  torch_symm    torch symmetric-memory two_shot_all_reduce_ + the same fused add+RMSNorm (if available)
  flashinfer    trtllm_allreduce_fusion (only if flashinfer imports; not installed on our hosts)
  oneshot / twoshot / twoshot_sharded / twoshot_pipe / twoshot_pipe_sharded / ce  tw-comm variants at their
                default SM bounds (twoshot_pipe: the pipelined two-shot with per-chunk flags)
  twoshot_bulk / twoshot_bulk_sharded  the two-shot whose NVLink phases are cp.async.bulk copies (few CTAs)
  lamport       (--lamport) the flag-in-data one-shot, where world*T*H*2 fits its buffer (world x 2 MiB)
  --variants    time only these of the methods above (comma list; default all)
  --ctas        CTA sweep: each --cta-variants method at each CTA count ("all" = the GPU's SM count), every T,
                reported as one row per (world, T, method) with the floor, NCCL + norm and the best / floor
  SM sweep      twoshot, twoshot_pipe, twoshot_pipe_sharded (and ce unless --no-ce) at --sweep-sms SMs, and
                twoshot_pipe_sharded with each --chunk-sweep chunk size (T >= --sweep-min-tokens)
  --calibrate   also times every candidate (variant, SMs) the communicator may pick, for plain calls and for
                overlapped ones on --overlap-sms, and writes the fastest per size into --table (JSON, per GPU
                model and world; see sglang.srt.distributed.tw_comm_tuning), then reports what auto picks
  auto          a plain full-residual call as the communicator makes it (no backend / max_sms given: the packaged
                calibration table's pick for this GPU and world via tw_comm.select_backend, $TW_COMM_CROSSOVERS if
                set, the built-in rules without a table)
Main table (benchmark/comm/allreduce_rmsnorm_report.py): auto, the best full-residual and, apart, the best sharded-residual
configuration (only TokenWeave's split calls may shard the residual), each with baseline / it (speed-up) over NCCL
+ norm, nccl_symm and torch_symm; best full / line-rate floor, floor = 2(n-1)/n * S / 450 GB/s.

NVLink multicast stays off (the script sets NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1,
NVSHMEM_DISABLE_NVLS=1 for itself and its children). Usage:
  python benchmark/comm/bench_allreduce_rmsnorm.py --worlds 2,4,8 [--tokens 1,8,...] [--out benchmark/results]
  --record-dir DIR  also write the project's JSON record + markdown (benchmark.common.records) under DIR/comm/
                    (allreduce_rmsnorm_report.build_record; headline: auto vs NCCL + norm, largest world)
"""

from __future__ import annotations

import argparse
import dataclasses
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

REPO = Path(__file__).resolve().parents[2]
PATHS = [str(REPO / "sgl-kernel" / "python"), str(REPO / "python"), str(REPO)]
sys.path[:0] = PATHS
from benchmark.comm.allreduce_rmsnorm_report import main_table  # noqa: E402

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
    from sglang.srt.distributed.tw_comm import TwCommConfig, TwCommWorkspace, allreduce_rmsnorm

    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world, device_id=dev)
    H = args.hidden
    dtype = torch.bfloat16
    tokens = [int(t) for t in args.tokens.split(",")]
    # at least the communicator's 64 MiB default, so the `auto` call fits as it does in the server
    ws = TwCommWorkspace(None, dev, TwCommConfig(max_bytes=max(TwCommConfig().max_bytes, max(tokens) * H * 2),
                                                 use_calibrated=False))
    group_name = dist.group.WORLD.group_name
    symm = None
    try:
        import torch.distributed._symmetric_memory as symm  # noqa: F811
    except Exception as e:  # pragma: no cover - depends on the torch build
        logger.warning("torch symmetric memory unavailable: %s", e)
    rows = []
    notes = set()
    ops = torch.ops.sgl_kernel
    from benchmark.comm.nccl_symm import make_window_or_note

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

        _measure_tw(ws, args, row, measure, tw)
        _measure_auto(ws, row, measure, lambda: allreduce_rmsnorm(ws, x, residual, weight, EPS, out=out,
                                                                   residual_sharded=False))
        rows.append(row)
        if rank == 0:
            logger.warning("world=%d T=%d done: %s", world, T,
                           {k: round(v, 1) for k, v in row.items() if isinstance(v, float)})
    ws.close()
    if rank == 0:
        Path(result_file).write_text(json.dumps({"rows": rows, "notes": sorted(notes)}))
    dist.destroy_process_group()


def _measure_tw(ws, args, row, measure, tw) -> None:
    """Time the tw-comm variants of one (world, T) row into ``row``: defaults, the SM / chunk sweeps, calibration
    candidates. ``measure(fn)`` -> us per call (max over ranks); ``tw(backend, sms, sharded)`` -> a closure."""
    from sglang.srt.distributed.tw_comm import TwBackend

    world, T, H = row["world"], row["T"], args.hidden
    oneshot_fits = world * T * H * 2 <= ws.capacity_bytes
    lamport_fits = T * H * 2 <= 2 << 20
    wanted = set(args.variants.split(",")) if args.variants else set(TW_METHODS)
    fits = {"oneshot": oneshot_fits, "lamport": args.lamport and lamport_fits, "ce": not args.no_ce}
    c = ws.config
    default_sms = {"oneshot": c.oneshot_sms, "lamport": c.oneshot_sms, "ce": c.ce_sms}
    for m in TW_METHODS:
        if m in wanted and fits.get(m, True):
            backend, sharded = method_spec(m)
            row[m] = measure(tw(backend, default_sms.get(m, c.twoshot_sms), sharded))
    for m in (args.cta_variants.split(",") if args.ctas else []):
        backend, sharded = method_spec(m)
        if m == "oneshot" and not oneshot_fits:
            continue
        for n in args.ctas.split(","):
            sms = torch.cuda.get_device_properties(ws.device).multi_processor_count if n == "all" else int(n)
            row[f"cta:{m}@{n}"] = measure(tw(backend, sms, sharded))
    if T >= args.sweep_min_tokens:
        for sms in [int(v) for v in args.sweep_sms.split(",")]:
            row[f"twoshot@{sms}"] = measure(tw(TwBackend.TWOSHOT, sms))
            row[f"twoshot_pipe@{sms}"] = measure(tw(TwBackend.PIPE, sms))
            row[f"twoshot_pipe_sharded@{sms}"] = measure(tw(TwBackend.PIPE, sms, True))
            if not args.no_ce:
                row[f"ce@{sms}"] = measure(tw(TwBackend.CE, sms))
        base_cfg = ws.config
        for cb in [int(v) for v in args.chunk_sweep.split(",") if v]:
            ws.config = dataclasses.replace(base_cfg, pipe_chunk_bytes=cb)
            for sms in sorted({args.overlap_sms, base_cfg.twoshot_sms}):
                row[f"twoshot_pipe_sharded_c{cb >> 10}k@{sms}"] = measure(tw(TwBackend.PIPE, sms, True))
        ws.config = base_cfg
    if args.calibrate:  # the same (variant, SMs) timed above is reused, not timed twice
        c = ws.config
        same = {("p2p_twoshot", c.twoshot_sms): "twoshot", ("p2p_twoshot_pipe", c.twoshot_sms): "twoshot_pipe",
                ("p2p_twoshot_bulk", c.twoshot_sms): "twoshot_bulk",
                ("p2p_oneshot", c.oneshot_sms): "oneshot", ("p2p_lamport", c.oneshot_sms): "lamport"}
        for kind, backend, sms in _candidates(args, oneshot_fits, lamport_fits):
            name = same.get((backend.value, sms)) or f"{backend.value[4:]}@{sms}"
            row[f"{kind}:{backend.value}@{sms}"] = row[name] if name in row else measure(tw(backend, sms))


def auto_pick(config, world: int, capacity_bytes: int, tokens: int, hidden: int, gpu_name: str,
              table_path=None):
    """(TwCommConfig with the calibrated table of ``gpu_name`` x ``world`` loaded, backend, SMs) of a plain
    (non-overlapped, fused, bf16) call of [tokens, hidden] as the communicator makes it: the table from
    ``table_path`` (default: ``$TW_COMM_CROSSOVERS`` or the packaged ``tw_comm_crossovers.json``; the built-in
    rules where it has no entry for this GPU / world), backend by ``tw_comm.select_backend``, SMs as
    ``tw_comm.allreduce_rmsnorm`` resolves them without ``max_sms``. Pure (no CUDA)."""
    from types import SimpleNamespace

    from sglang.srt.distributed.tw_comm import _sms, select_backend
    from sglang.srt.distributed.tw_comm_tuning import load_crossovers

    cfg = dataclasses.replace(config, crossovers=load_crossovers(gpu_name, world, table_path), use_calibrated=True)
    b = select_backend(tokens, hidden, world, config=cfg, capacity_bytes=capacity_bytes)
    pick = cfg.crossovers.pick(tokens * hidden * 2, False)
    return cfg, b, _sms(SimpleNamespace(config=cfg), b, None, False, pick)


def _measure_auto(ws, row, measure, call) -> None:
    """Time ``call`` (allreduce_rmsnorm with no backend / max_sms, full residual) with ``ws`` on the calibrated
    config, as the communicator runs a plain call; row["auto"] = "<backend>@<sms>", row["auto_us"] = us."""
    cfg, b, sms = auto_pick(ws.config, ws.world, ws.capacity_bytes, row["T"], row["bytes"] // (2 * row["T"]),
                            torch.cuda.get_device_name(ws.device))
    base, ws.config = ws.config, cfg
    try:
        row["auto"], row["auto_us"] = f"{b.value}@{sms}", measure(call)
    finally:
        ws.config = base


TW_METHODS = ("oneshot", "lamport", "twoshot", "twoshot_sharded", "twoshot_pipe", "twoshot_pipe_sharded",
              "twoshot_bulk", "twoshot_bulk_sharded", "ce")


def method_spec(method: str):
    """(TwBackend, residual_sharded) of a method name of TW_METHODS; ValueError naming the choices otherwise."""
    from sglang.srt.distributed.tw_comm import TwBackend as B

    spec = {"oneshot": (B.ONESHOT, False), "lamport": (B.LAMPORT, False), "twoshot": (B.TWOSHOT, False),
            "twoshot_sharded": (B.TWOSHOT, True), "twoshot_pipe": (B.PIPE, False),
            "twoshot_pipe_sharded": (B.PIPE, True), "twoshot_bulk": (B.BULK, False),
            "twoshot_bulk_sharded": (B.BULK, True), "ce": (B.CE, False)}
    if method not in spec:
        raise ValueError(f"method {method!r} is not one of {', '.join(TW_METHODS)}")
    return spec[method]


def render_ctas(rows) -> list:
    """Markdown lines of the --ctas sweep: one row per (world, T, method), one column per CTA count."""
    keys = [k for r in rows for k in r if k.startswith("cta:")]
    if not keys:
        return []
    ctas = list(dict.fromkeys(k.split("@")[1] for k in keys))
    methods = list(dict.fromkeys(k[4:].split("@")[0] for k in keys))
    lines = ["", "CTA sweep (us per call; floor = line rate; best/floor and @16 vs NCCL: NCCL + fused norm / @16):",
             "", "| world | T | floor | NCCL + norm | nccl_symm | method | " + " | ".join(f"@{n}" for n in ctas)
             + " | best/floor | NCCL / @16 |", "|---|---|---|---|---|---|" + "---|" * len(ctas) + "---|---|"]
    fmt = lambda v: f"{v:.1f}" if isinstance(v, float) else "n/a"  # noqa: E731
    for r in rows:
        for m in methods:
            vals = [r.get(f"cta:{m}@{n}") for n in ctas]
            if not any(isinstance(v, float) for v in vals):
                continue
            best = min(v for v in vals if isinstance(v, float))
            at16 = r.get(f"cta:{m}@16")
            lines.append(f"| {r['world']} | {r['T']} | {r['floor_us']:.1f} | {fmt(r['baseline'])} | "
                         f"{fmt(r.get('nccl_symm'))} | {m} | " + " | ".join(fmt(v) for v in vals)
                         + f" | {best / r['floor_us']:.2f}x | "
                         + (f"{r['baseline'] / at16:.2f}x" if at16 else "n/a") + " |")
    return lines


def _candidates(args, oneshot_fits: bool, lamport_fits: bool):
    """(kind, backend, sms) the communicator may pick: kind "cal" = plain calls, "ovl" = overlapped calls on
    --overlap-sms SMs (full residual for all, so every candidate computes the same thing)."""
    from sglang.srt.distributed.tw_comm import TwBackend as B

    plain = [(B.TWOSHOT, 128), (B.PIPE, 64), (B.PIPE, 128), (B.BULK, 32), (B.BULK, 128)]
    if oneshot_fits:
        plain += [(B.ONESHOT, 64), (B.ONESHOT, 128)]
    if lamport_fits:
        plain += [(B.LAMPORT, 64), (B.LAMPORT, 128)]
    ovl = [(B.TWOSHOT, args.overlap_sms), (B.PIPE, args.overlap_sms), (B.BULK, args.overlap_sms)]
    if oneshot_fits:
        ovl.append((B.ONESHOT, args.overlap_sms))
    return [("cal", b, n) for b, n in plain] + [("ovl", b, n) for b, n in ovl]


def calibrate(rows, world: int, gpu: str, table_path: Path, command: str):
    """Fastest candidate per size of one world's rows -> (plain, overlap) entries, merged into table_path."""
    from sglang.srt.distributed.tw_comm_tuning import entries_from_timings, write_table

    def timings(kind):
        out = {}
        for r in rows:
            if r["world"] != world:
                continue
            out[r["bytes"]] = {(k.split(":")[1].split("@")[0], int(k.split("@")[1])): v
                               for k, v in r.items() if k.startswith(kind + ":")}
        return out

    plain, overlap = entries_from_timings(timings("cal")), entries_from_timings(timings("ovl"))
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    write_table(table_path, gpu, world, plain, overlap, f"{stamp}: {command}")
    return plain, overlap


def render_calibration(rows, tables) -> list:
    """Markdown lines: per size the fastest plain / overlapped candidate and what the written table picks."""
    from sglang.srt.distributed.tw_comm_tuning import Crossovers, describe

    lines = ["", "Calibration (us; cal = plain calls, ovl = overlapped on --overlap-sms; table = what auto picks "
             "from the written table):", "", "| world | T | fastest plain | table plain | fastest overlap | "
             "table overlap | candidates |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["world"] not in tables:
            continue
        plain, overlap = tables[r["world"]]
        cx = Crossovers(plain=plain, overlap=overlap)
        cand = {k: v for k, v in r.items() if k.startswith(("cal:", "ovl:"))}
        best = {kind: min((k for k in cand if k.startswith(kind)), key=cand.get, default=None)
                for kind in ("cal", "ovl")}
        fmt = lambda k: f"{k.split(':')[1]} {cand[k]:.1f}" if k else "n/a"  # noqa: E731
        pp, po = cx.pick(r["bytes"]), cx.pick(r["bytes"], True)
        lines.append(f"| {r['world']} | {r['T']} | {fmt(best['cal'])} | {pp[1]}@{pp[2]} | {fmt(best['ovl'])} | "
                     f"{po[1]} | " + ", ".join(f"{k} {v:.1f}" for k, v in sorted(cand.items())) + " |")
    for w, (plain, overlap) in sorted(tables.items()):
        lines.append(f"- world {w}: plain {describe(plain)}; overlap {describe(overlap)}")
    return lines


def render(rows, notes, command, hardware, tables=None) -> str:
    """Markdown report: main table, SM sweep table, calibration table (``tables``: {world: (plain, overlap)}),
    notes."""
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [f"# tw-comm fused AllReduce + residual + RMSNorm, hidden 8192 bf16 ({now})", "",
             f"hardware: {hardware}", f"command: `{command}`",
             "times: us per call, CUDA graph replay median, max over ranks; floor = 2(n-1)/n*S/450GB/s.", "",
             *main_table(rows, TW_METHODS)]
    fmt = lambda v: f"{v:.1f}" if isinstance(v, float) else "n/a"  # noqa: E731
    lines += render_ctas(rows)
    sweep_cols = sorted({k for r in rows for k in r if "@" in k and ":" not in k},
                        key=lambda k: (k.split("@")[0], int(k.split("@")[1])))
    if sweep_cols:
        lines += ["", "SM sweep (us per call; twoshot / twoshot_pipe = full residual, *_sharded = own rows only; "
                  "floor as above):", "", "| world | T | floor | " + " | ".join(sweep_cols) + " |",
                  "|---|---|---|" + "---|" * len(sweep_cols)]
        for r in rows:
            if any(k in r for k in sweep_cols):
                lines.append(f"| {r['world']} | {r['T']} | {r['floor_us']:.1f} | "
                             + " | ".join(fmt(r.get(k)) for k in sweep_cols) + " |")
    if tables:
        lines += render_calibration(rows, tables)
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
    p.add_argument("--out", default=str(REPO / "benchmark" / "results" / "comm"))
    p.add_argument("--tag", default="")
    p.add_argument("--lamport", action="store_true", help="also time the Lamport one-shot (p2p_lamport)")
    p.add_argument("--sweep-sms", default="2,4,8,16,32,64,128", help="SM counts of the sweep (comma list)")
    p.add_argument("--chunk-sweep", default="16384,65536",
                   help="pipe chunk bytes to also time (sharded, at --overlap-sms and the two-shot SMs; '' = none)")
    p.add_argument("--no-ce", action="store_true", help="skip the copy-engine variant (slow to time)")
    p.add_argument("--variants", default="", help="time only these methods (comma list of " + ",".join(TW_METHODS)
                   + "; default all)")
    p.add_argument("--ctas", default="", help="CTA sweep counts, e.g. 8,16,24,32,all ('' = none)")
    p.add_argument("--cta-variants", default="twoshot_sharded,twoshot_pipe_sharded,twoshot_bulk,twoshot_bulk_sharded",
                   help="methods of the --ctas sweep (comma list)")
    p.add_argument("--calibrate", action="store_true", help="time the auto candidates and write --table")
    p.add_argument("--overlap-sms", type=int, default=16, help="SM budget of the overlapped candidates")
    from benchmark.common.records import add_record_dir_argument
    add_record_dir_argument(p, "comm")
    p.add_argument("--table", default=None,
                   help="crossover table to merge into (default: <out>/tw_comm_crossovers.json)")
    args = p.parse_args()
    for m in [v for v in (args.variants + "," + args.cta_variants).split(",") if v]:
        method_spec(m)  # ValueError naming the choices
    for n in [v for v in args.ctas.split(",") if v]:
        if n != "all" and not (n.isdigit() and 1 <= int(n) <= 256):
            p.error(f"--ctas entry {n!r} must be an integer in [1, 256] or 'all'")
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
    tables = {}
    table_path = Path(args.table) if args.table else out / "tw_comm_crossovers.json"
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
        if args.calibrate:
            tables[world] = calibrate(rows, world, torch.cuda.get_device_name(0), table_path, " ".join(sys.argv))
        # rewrite after every world size, so a run cut short keeps what it measured
        report = render(rows, sorted(notes), " ".join(sys.argv), hardware, tables)
        (out / f"tw_comm_allreduce_rmsnorm_{stamp}{args.tag}.md").write_text(report)
        (out / f"tw_comm_allreduce_rmsnorm_{stamp}{args.tag}.json").write_text(json.dumps({"rows": rows}, indent=1))
    print(render(rows, sorted(notes), " ".join(sys.argv), hardware, tables))
    if args.record_dir:  # the parent process gathers rank 0's rows: one writer
        from benchmark.common.records import write_record
        from benchmark.comm.allreduce_rmsnorm_report import build_record

        params = {k: v for k, v in vars(args).items() if k != "record_dir"}
        rec = build_record(rows, sorted(notes), TW_METHODS, params=params,
                           gpu_count=max([r["world"] for r in rows], default=n_gpu))
        print(f"record: {write_record(rec, Path(args.record_dir))[0]}")

if __name__ == "__main__":
    main()
