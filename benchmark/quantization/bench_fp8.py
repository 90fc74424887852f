"""FP8 weights on one GPU, in one run: GEMM rates, the decode step vs the FP8 memory floor, the 8K prefill vs the FP8
matmul rate, each beside the same run's bf16 rows.

Sections (``--sections``, default all):

* ``peaks``: device-to-device copy bandwidth, bf16 cuBLAS 8192^3, FP8 ``torch._scaled_mm`` 8192^3 (row-wise, which
  the layers run, and tensor-wise; the best is the "FP8 matmul peak");
* ``gemm``: Llama-3.1-8B's four linear shapes at M = 1 / 32 / 128 (decode) and 8192 (prefill): bf16 cuBLAS vs the
  FP8 paths and the automatic choice (:mod:`fp8_gemm_rates`);
* ``decode``: two runners (bf16, and ``--quantization fp8``) on the model config (dummy weights, CUDA graphs with the
  decode-GEMM table, as served), a static batch of 1 / 32 / 128 requests of ``--context`` tokens: the step through
  ``ModelRunner.forward`` (graph replay + sampling) and, with ``--serving``, the steady decode step of the overlap
  scheduler (``benchmark/decode/served_step.py``), each against its memory floor = (decode weight bytes of that runner + KV
  bytes read) / copy bandwidth; the runners alternate which goes first per batch size;
* ``prefill``: one ``--prefill-tokens`` prefill per runner (median of reps after a warm-up) against the matmul peak
  of its weight dtype (FLOPs: 2 x tokens x matmul params + the causal attention; attention runs in bf16 either way).

Writes ``<out>/fp8_weights.json`` (benchmark, mode, commit, date, GPU, versions, command, every row with its
same-run baseline and ratio) and ``<out>/fp8_weights.md``. ``--smoke`` runs the plumbing on CPU (stories260K,
tiny shapes, torch reference paths, wall-clock timing; numbers meaningless) so CI covers it. ``--record-dir DIR``
also writes a :mod:`benchmark.common.records` record (``what`` = ``fp8_weights``) under ``DIR/quantization/``: the
GEMM, decode and prefill rows (``part``), each with its same-run bf16 counterpart and ``fp8_vs_bf16`` (speed-up).

Usage (repo root, one GPU)::

    python benchmark/quantization/bench_fp8.py --out /tmp/fp8 [--serving] [--sections peaks,gemm,decode,prefill]
    python benchmark/quantization/bench_fp8.py --out /tmp/fp8_smoke --smoke   # CPU
    python benchmark/quantization/bench_fp8.py --out /tmp/fp8 --record-dir benchmark/results  # + a record
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
for _p in (REPO / "python", REPO / "sgl-kernel" / "python", REPO, HERE):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))
del _p

import torch  # noqa: E402

from benchmark.common.floors import kv_bytes, memory_floor_s, model_param_stats, prefill_flops  # noqa: E402

logger = logging.getLogger("bench_fp8")
DATA = REPO.parent / "shared" / "data"
SECTIONS = ("peaks", "gemm", "decode", "prefill")
QUANTS = (None, "fp8")  # bf16 baseline, FP8 weights


def _label(q) -> str:
    return "fp8" if q else "bf16"


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="/tmp/fp8_weights")
    p.add_argument("--model-path", default=str(DATA / "configs" / "meta-llama--Meta-Llama-3.1-8B"))
    p.add_argument("--sections", default=",".join(SECTIONS))
    p.add_argument("--batches", default="1,32,128")
    p.add_argument("--gemm-m", default="1,32,128,8192")
    p.add_argument("--no-block", action="store_true", help="skip the block-wise GEMM rows")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--prefill-tokens", type=int, default=8192)
    p.add_argument("--prefill-reps", type=int, default=3)
    p.add_argument("--serving", action="store_true", help="+ the overlap scheduler's steady decode step")
    p.add_argument("--serving-steps", type=int, default=24)
    p.add_argument("--serving-warmup", type=int, default=4)
    p.add_argument("--serving-reps", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true", help="CPU plumbing check (stories260K, tiny shapes)")
    from benchmark.common.records import add_record_dir_argument
    add_record_dir_argument(p, "quantization")
    ns = p.parse_args(argv)
    ns.sections = [s for s in ns.sections.split(",") if s]
    if any(s not in SECTIONS for s in ns.sections):
        raise SystemExit(f"--sections {ns.sections}: choose from {list(SECTIONS)}")
    ns.batches = [int(b) for b in ns.batches.split(",")]
    ns.gemm_m = [int(m) for m in ns.gemm_m.split(",")]
    if ns.smoke:
        ns.model_path = str(DATA / "models" / "stories260K")
        ns.batches, ns.gemm_m, ns.context, ns.prefill_tokens = [1, 4], [1, 64], 32, 64
        ns.steps, ns.reps, ns.prefill_reps, ns.serving = 3, 1, 1, False
    ns.settings = ("new",)
    ns.host_profile = False
    ns.serving_modes = ("overlap",)
    return ns


# ---- peaks -------------------------------------------------------------------------------------------------
def peaks(cfg) -> dict:
    """Copy bandwidth (B/s), bf16 and FP8 matmul rates (FLOP/s) measured in this process."""
    if cfg.smoke:
        n = 1 << 24
        a, b = torch.empty(n, dtype=torch.uint8).random_(), torch.empty(n, dtype=torch.uint8)
        t0 = time.perf_counter()
        b.copy_(a)
        bw = 2 * n / (time.perf_counter() - t0)
        x = torch.randn(256, 256)
        t0 = time.perf_counter()
        x @ x
        mm = 2 * 256 ** 3 / (time.perf_counter() - t0)
        return {"hbm_bytes_per_s": bw, "matmul_bf16_flops_per_s": mm, "matmul_fp8_flops_per_s": {"peak": mm}}
    from benchmark.attention import bench_triton_attention as bta
    from fp8_gemm_rates import fp8_matmul_peaks

    return {"hbm_bytes_per_s": bta.hbm_bandwidth(4.0), "matmul_bf16_flops_per_s": bta.matmul_rate(8192),
            "matmul_fp8_flops_per_s": fp8_matmul_peaks(8192)}


# ---- runners, decode, prefill --------------------------------------------------------------------------------
def build_runner(cfg, quantization):
    """A dummy-weight runner (CUDA: bf16, graphs captured by :func:`capture`; smoke: CPU fp32, eager)."""
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.server_args import ServerArgs

    dev = "cpu" if cfg.smoke else "cuda"
    steps = cfg.reps * (cfg.steps + cfg.warmup) + 8
    need = max(cfg.batches) * (cfg.context + steps)  # the static batch is freed before the served one starts
    if cfg.serving:
        need = max(need, max(cfg.batches) * (cfg.context + cfg.serving_reps * (cfg.serving_warmup
                                                                             + cfg.serving_steps + 72)))
    sa = ServerArgs(model_path=cfg.model_path, load_format="dummy", dtype="float32" if cfg.smoke else "bfloat16",
                    device=dev, quantization=quantization, disable_cuda_graph=True, random_seed=cfg.seed,
                    max_total_tokens=max(need, cfg.prefill_tokens + 64) + 1024,
                    context_length=max(cfg.context + (256 if cfg.smoke else 1024), cfg.prefill_tokens + 64))
    mc = ModelConfig.from_path(sa.model_path, sa.context_length, sa.dtype, dev)
    return ModelRunner(mc, sa, "cpu" if cfg.smoke else "cuda:0")


def capture(runner, cfg):
    """The runner's CUDA graphs for the measured batch sizes (decode-GEMM table tuned on its weights, as served)."""
    from benchmark.decode.graphs import capture_graphs

    graphs = capture_graphs(runner, sorted(set(cfg.batches)))
    runner.cuda_graph_runner = graphs
    return graphs


def eager_decode(runner, bs: int, cfg, bw: float, weight_bytes: int) -> dict:
    """Smoke: wall time of eager decode steps of a static batch (no graphs) against the floor formula."""
    from sglang.bench_one_batch import StaticBatch

    mc = runner.model_config
    gen = torch.Generator().manual_seed(cfg.seed + bs)
    prompts = torch.randint(3, mc.vocab_size, (bs, cfg.context), generator=gen).tolist()
    batch = StaticBatch(runner, prompts, cfg.steps + cfg.warmup + 2)
    try:
        ids = batch.prefill(prompts, 8192)
        steps, floors = [], []
        for i in range(cfg.warmup + cfg.steps):
            t0 = time.perf_counter()
            ids = batch.step([[t] for t in ids])
            if i >= cfg.warmup:
                steps.append(time.perf_counter() - t0)
                kvr = kv_bytes(bs * (batch.seq_lens[0]), mc.num_hidden_layers, runner.num_kv_heads, mc.head_dim,
                               mc.dtype.itemsize)
                floors.append(memory_floor_s(weight_bytes, kvr, bw))
    finally:
        batch.free()
    step, floor = statistics.median(steps), statistics.median(floors)
    return {"batch": bs, "setting": "eager", "step_ms": step * 1e3, "floor_ms": floor * 1e3, "ratio": step / floor}


def decode_rows(runners: dict, cfg, bw: float) -> list[dict]:
    """Per batch size, both runners (the first alternating): step vs floor (and the served step with --serving)."""
    rows = []
    for i, bs in enumerate(cfg.batches):
        order = list(QUANTS) if i % 2 == 0 else list(QUANTS)[::-1]
        for q in order:
            runner, graphs = runners[q]
            wbytes = model_param_stats(runner.model).decode_weight_bytes
            if cfg.smoke:
                got = [eager_decode(runner, bs, cfg, bw, wbytes)]
            else:
                from benchmark.decode.step_ab import decode_ab

                got = decode_ab(runner, graphs, bs, cfg, bw, wbytes)
                if cfg.serving:
                    from benchmark.decode.served_step import serving_rows

                    for r in serving_rows(runner, [bs], cfg, bw, wbytes):
                        got.append({**r, "setting": f"served ({r['mode']} scheduler)"})
            for r in got:
                rows.append({**r, "weights": _label(q), "weight_bytes": wbytes})
    return rows


def prefill_row(runner, q, cfg, mm: float) -> dict:
    """Median latency of a one-request ``cfg.prefill_tokens`` prefill (after a warm-up) vs the matmul peak ``mm``."""
    from sglang.bench_one_batch import run_latency

    mc = runner.model_config
    lat = [run_latency(runner, 1, cfg.prefill_tokens, 1, cfg.seed + i)["prefill_latency"]
           for i in range(cfg.prefill_reps + 1)][1:]
    med = statistics.median(lat)
    flops = prefill_flops(cfg.prefill_tokens, model_param_stats(runner.model), mc.num_hidden_layers,
                          mc.num_attention_heads, mc.head_dim)
    return {"weights": _label(q), "tokens": cfg.prefill_tokens, "median_s": med, "tflops": flops / med / 1e12,
            "peak_tflops": mm / 1e12, "ratio": flops / med / mm}


# ---- report ----------------------------------------------------------------------------------------------------
def render(res: dict) -> str:
    """Markdown tables of ``res``."""
    from fp8_gemm_rates import render_gemm

    p = res.get("peaks", {})
    fp8 = p.get("matmul_fp8_flops_per_s", {})
    out = [f"# FP8 weights ({res['mode']}, {res['date']}, {res['gpu']}, commit {res['commit']})", "",
           f"Command: `{res['command']}`", ""]
    if p:
        out += [f"Copy bandwidth {p['hbm_bytes_per_s'] / 1e12:.3f} TB/s; bf16 matmul "
                f"{p['matmul_bf16_flops_per_s'] / 1e12:.0f} TFLOP/s; FP8 matmul peak {fp8.get('peak', 0) / 1e12:.0f} "
                "TFLOP/s (" + ", ".join(f"{k} {v / 1e12:.0f}" for k, v in fp8.items() if v and k != "peak") + ")", ""]
    if res.get("gemm"):
        out += ["## GEMMs (Llama-3.1-8B shapes)", ""] + render_gemm(res["gemm"])
    if res.get("decode"):
        out += ["## Decode step vs memory floor", "", "floor = (decode weight bytes + KV bytes read) / copy bandwidth",
                "", "| batch | weights | setting | step ms | floor ms | step / floor | fp8 vs bf16 step |",
                "|---:|---|---|---:|---:|---:|---:|"]
        base = {(r["batch"], r["setting"]): r["step_ms"] for r in res["decode"] if r["weights"] == "bf16"}
        for r in sorted(res["decode"], key=lambda r: (r["batch"], r["setting"], r["weights"])):
            speed = base.get((r["batch"], r["setting"]), float("nan")) / r["step_ms"]
            out.append(f"| {r['batch']} | {r['weights']} | {r['setting']} | {r['step_ms']:.3f} | {r['floor_ms']:.3f} "
                       f"| {r['ratio']:.3f} | {speed:.2f}x |")
        out.append("")
    if res.get("prefill"):
        out += ["## Prefill vs matmul peak of the weight dtype", "",
                "| weights | tokens | median s | TFLOP/s | peak TFLOP/s | rate / peak |",
                "|---|---:|---:|---:|---:|---:|"]
        out += [f"| {r['weights']} | {r['tokens']} | {r['median_s']:.4f} | {r['tflops']:.1f} | {r['peak_tflops']:.0f} "
                f"| {r['ratio']:.3f} |" for r in res["prefill"]]
        out.append("")
    return "\n".join(out)


def main(argv=None) -> int:
    """Run the sections (module docstring); write ``fp8_weights.{json,md}`` after each."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    args = sys.argv[1:] if argv is None else argv
    cfg = parse_args(args)
    if not cfg.smoke and not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU (or --smoke for the CPU plumbing check)")
    import triton

    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip() or "unknown"
    res = {"benchmark": "fp8_weights", "mode": "smoke (CPU)" if cfg.smoke else "full",
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "commit": commit,
           "gpu": "cpu" if cfg.smoke else torch.cuda.get_device_name(0),
           "gpu_count": 0 if cfg.smoke else torch.cuda.device_count(), "torch": torch.__version__,
           "triton": triton.__version__, "cuda": torch.version.cuda,
           "command": "python benchmark/quantization/bench_fp8.py " + " ".join(args), "model": cfg.model_path}
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)

    def write():
        (out / "fp8_weights.json").write_text(json.dumps(res, indent=1, default=str))
        (out / "fp8_weights.md").write_text(render(res))

    res["peaks"] = peaks(cfg)
    bw = res["peaks"]["hbm_bytes_per_s"]
    mm = {None: res["peaks"]["matmul_bf16_flops_per_s"], "fp8": res["peaks"]["matmul_fp8_flops_per_s"]["peak"]}
    write()
    if "gemm" in cfg.sections:
        if cfg.smoke:
            res["gemm"] = smoke_gemm(cfg, bw)
        else:
            from fp8_gemm_rates import gemm_rows

            res["gemm"] = gemm_rows(cfg.gemm_m, bw, mm[None], mm["fp8"], block=not cfg.no_block, seed=cfg.seed)
        write()
    if "decode" in cfg.sections or "prefill" in cfg.sections:
        runners = {}
        for q in QUANTS:
            t0 = time.monotonic()
            runner = build_runner(cfg, q)
            runners[q] = (runner, None if cfg.smoke else capture(runner, cfg))
            logger.info("%s runner ready in %.1f s (%.2f GiB of parameters)", _label(q), time.monotonic() - t0,
                        runner.param_bytes / 2**30)
        if "decode" in cfg.sections:
            res["decode"] = decode_rows(runners, cfg, bw)
            write()
        if "prefill" in cfg.sections:
            res["prefill"] = [prefill_row(runners[q][0], q, cfg, mm[q]) for q in QUANTS]
            write()
    write()
    sys.stdout.write(render(res) + "\n")
    if cfg.record_dir:
        from benchmark.common import records

        js, _ = records.write_record(make_fp8_record(res, cfg), Path(cfg.record_dir))
        sys.stdout.write(f"record: {js}\n")
    return 0


def make_fp8_record(res: dict, cfg, env: dict | None = None) -> dict:
    """``res`` of :func:`main` as a :mod:`benchmark.common.records` record. Rows by ``part``: ``gemm`` (with the same
    shape and M's bf16 cuBLAS time, ``base_us``), ``decode`` (the bf16 runner's step at the same batch and setting,
    ``base_step_ms``), ``prefill`` (the bf16 runner's rate, ``base_tflops``); ``fp8_vs_bf16`` is the speed-up over
    that baseline (> 1: FP8 faster). ``ratio`` keeps the benchmark's own meaning (time / floor, or rate / peak).
    Headline: the decode step at the largest batch and the prefill, FP8 vs bf16."""
    from benchmark.common import records

    gemm = [dict(r) for r in res.get("gemm", [])]
    gbase = {(r["shape"], r["m"]): r["us"] for r in gemm if r["method"] == "bf16 cuBLAS"}
    gemm = records.add_ratio([{"part": "gemm", **r, "base_us": gbase.get((r["shape"], r["m"]))} for r in gemm],
                             "fp8_vs_bf16", "base_us", "us")
    dec = res.get("decode", [])
    dbase = {(r["batch"], r["setting"]): r["step_ms"] for r in dec if r["weights"] == "bf16"}
    dec = records.add_ratio([{"part": "decode", **r, "base_step_ms": dbase.get((r["batch"], r["setting"]))}
                             for r in dec], "fp8_vs_bf16", "base_step_ms", "step_ms")
    pre = res.get("prefill", [])
    pbase = next((r["tflops"] for r in pre if r["weights"] == "bf16"), None)
    pre = records.add_ratio([{"part": "prefill", **r, "base_tflops": pbase} for r in pre], "fp8_vs_bf16", "tflops",
                            "base_tflops")
    rows = gemm + dec + pre
    headline = []
    fdec = [r for r in dec if r["weights"] == "fp8" and r["base_step_ms"] is not None
            and not str(r["setting"]).startswith("served")]
    if fdec:
        big = max(r["batch"] for r in fdec)
        r = next(x for x in fdec if x["batch"] == big)
        headline.append({"label": f"decode step, batch {big} ({r['setting']}), FP8 vs bf16 weights",
                         "value": r["step_ms"], "unit": "ms", "baseline": r["base_step_ms"],
                         "ratio": r["fp8_vs_bf16"]})
    fpre = next((r for r in pre if r["weights"] == "fp8" and r["base_tflops"] is not None), None)
    if fpre is not None:
        headline.append({"label": f"prefill of {fpre['tokens']} tokens, FP8 vs bf16 weights",
                         "value": fpre["tflops"], "unit": "TFLOP/s", "baseline": fpre["base_tflops"],
                         "ratio": fpre["fp8_vs_bf16"]})
    units = {"us": "us", "base_us": "us", "floor_us": "us", "tflops": "TFLOP/s", "peak_tflops": "TFLOP/s",
             "base_tflops": "TFLOP/s", "step_ms": "ms", "floor_ms": "ms", "base_step_ms": "ms", "median_s": "s",
             "weight_bytes": "B"}
    p = res.get("peaks", {})
    return records.make_record(
        subject="quantization", benchmark="benchmark.quantization.bench_fp8",
        mode=("smoke-" if cfg.smoke else "") + "+".join(s for s in SECTIONS if s in cfg.sections), what="fp8_weights",
        rows=rows, env=env, gpu_count=0 if cfg.smoke else 1,
        params={"model": cfg.model_path, "batches": list(cfg.batches), "context": cfg.context,
                "prefill_tokens": cfg.prefill_tokens, "serving": bool(cfg.serving),
                "hbm_bytes_per_s": p.get("hbm_bytes_per_s"),
                "matmul_bf16_flops_per_s": p.get("matmul_bf16_flops_per_s"),
                "matmul_fp8_flops_per_s": p.get("matmul_fp8_flops_per_s")},
        baselines=[c for c in ("base_us", "base_step_ms", "base_tflops") if any(r.get(c) is not None for r in rows)],
        units={k: v for k, v in units.items() if any(k in r for r in rows)},
        floor={"columns": ["floor_us", "floor_ms", "peak_tflops"],
               "what": "decode-sized GEMMs and the decode step: bytes read / copy bandwidth; M = 8192 GEMMs and the "
                       "prefill: the weight dtype's matmul peak; all measured in this run"},
        headline=headline)


def smoke_gemm(cfg, bw: float) -> list[dict]:
    """CPU: the reference FP8 linear vs F.linear at one tiny shape (plumbing only)."""
    from sglang.srt.layers.quantization import fp8_ops, fp8_ref

    rows = []
    w = torch.randn(96, 64)
    wq, ws = fp8_ref.quant_weight_per_channel(w)
    for m in cfg.gemm_m:
        x = torch.randn(m, 64)
        for name, fn in (("bf16 cuBLAS", lambda: torch.nn.functional.linear(x, w)),
                         ("fp8 W8A8 (quant + _scaled_mm)", lambda: fp8_ops.linear_per_channel(x, wq, ws))):
            t0 = time.perf_counter()
            fn()
            us = (time.perf_counter() - t0) * 1e6
            rows.append({"shape": "tiny", "n": 96, "k": 64, "m": m, "method": name, "us": us,
                         "tflops": 2 * m * 96 * 64 / us / 1e6, "floor_us": 96 * 64 / bw * 1e6, "ratio": 1.0})
    return rows


if __name__ == "__main__":
    sys.exit(main())
