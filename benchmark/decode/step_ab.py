"""One GPU: the decode step against the memory floor with the host path around the graph replay A/B'd
in ONE process (``old`` = before the host-path rework, ``new`` = now), the 8K-token prefill against the matmul rate with its GPU
time split by kernel category, and floors for ``bench_one_batch`` results of the same call.

One runner (dummy weights, ``--max-total-tokens`` sized for the largest batch) captures one
:class:`~sglang.srt.model_executor.cuda_graph_runner.CudaGraphRunner` for the measured batch sizes. The two settings
share its graphs and differ on the host only (the first H100 run settled the graph-node switches: the fused split
reduce was removed, the in-graph argmax is the default):

* ``old``: the host path before the rework: a fresh ``SamplingBatchInfo`` every step, the replay inputs staged by
  :func:`~sglang.srt.model_executor.graph_inputs.stage_decode_inputs_legacy` (two copies, a pinned block per
  step), greedy ids from the sampler after the replay;
* ``new``: the sampling info reused for the same requests, one packed copy from a persistent pinned buffer
  (:class:`~sglang.srt.model_executor.graph_inputs.DecodeInputStager`), greedy ids from the graph's argmax.

Per batch size one static batch (1K-token prompts, prefilled in 8192-token chunks) then decodes in blocks of
``--steps`` timed steps per setting, the order alternating between repetitions, so both settings see the same
contexts and machine state. Per setting and batch it reports:

* step: wall time of one synchronized decode step through ``ModelRunner.forward`` (graph replay + sampling, as
  ``bench_one_batch`` times it), median; ratio = step / memory floor at the step's context;
* host: CPU time before ``ModelRunner.forward`` (``bench_one_batch``'s batch building: KV slots, sampling
  tensors) and inside it (static-input copies, replay launch, sampler launches; not synchronized), medians;
* replay: GPU time of ``graph.replay()`` alone, back to back (CUDA events), median;
* nodes: the captured graph's node count by type (``cuGraphGetNodes`` through the driver; needs
  ``torch.cuda.CUDAGraph(keep_graph=True)``).

With ``--breakdown`` one replay per batch size and one prefill are profiled (:mod:`kernel_breakdown`): GPU time
per kernel category and the GEMM-only rate of the prefill against the matmul rate.

Memory floor = (weight bytes read per step + KV bytes read) / device-to-device copy bandwidth measured first in this
process. Usage (repo root, one GPU)::

    python benchmark/decode/step_ab.py --out /tmp/out [--batches 1,32,128] [--cli-results result.jsonl] [--breakdown]
        [--serving]  # + the serving path's decode step (benchmark/decode/served_step.py), same process
    python benchmark/decode/step_ab.py --out /tmp/out --gemm-ab  # cuBLAS vs decode-GEMM autotune, per-class split

``--record-dir DIR`` also writes a :mod:`benchmark.common.records` record under ``DIR/decode/`` of the A/B rows
(``decode_step_ab``: ``old`` is the baseline; ``--gemm-ab``: ``decode_gemm_ab``, ``cublas`` is; ``--switch-ab``:
``decode_switch_ab``, the first set is), each row with its baseline's step (``base_step_ms``), ``vs_base`` = step /
that, and the memory floor.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[2]
for _path in (REPO / "python", REPO):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))
del _path

import torch  # noqa: E402

from benchmark.decode.graphs import capture_graphs, graph_node_counts, replay_only_ms  # noqa: E402
from benchmark.common.floors import (  # noqa: E402
    kv_bytes, mean_decode_context, memory_floor_s, model_param_stats, prefill_flops,
)

logger = logging.getLogger("benchmark.decode.step_ab")
DATA = REPO.parent / "shared" / "data"
SETTINGS = ("old", "new")



def set_host_path(runner, graphs, name: str) -> None:
    """Switch ``runner`` (and its graphs) to the ``old`` or ``new`` host path (see the module docstring) by
    instance attributes; ``new`` removes them (the class methods are the new path)."""
    from sglang.srt.model_executor.graph_inputs import stage_decode_inputs_legacy
    from sglang.srt.model_executor.model_runner import build_sampling_info

    for obj, attr in ((runner, "make_sampling_info"), (graphs, "greedy_ids"), (graphs.inputs, "stage")):
        obj.__dict__.pop(attr, None)
    runner._sampling_cache = None
    if name == "old":
        pad = torch.from_numpy(graphs.inputs._pad[:4].copy())
        runner.make_sampling_info = lambda reqs: build_sampling_info(reqs, runner.device,
                                                                     runner.model_config.vocab_size)
        graphs.greedy_ids = lambda batch: None
        graphs.inputs.stage = lambda batch, padded: stage_decode_inputs_legacy(graphs.inputs.static, pad, batch,
                                                                               padded)


class ForwardTimer:
    """Wraps ``runner.forward`` to record when it is entered (``perf_counter``) and the host time spent inside it
    (seconds, not synchronized)."""

    def __init__(self, runner):
        self.runner, self.inner, self.host_s, self.enter_s = runner, type(runner).forward, [], []

    def __call__(self, batch):
        t0 = time.perf_counter()
        self.enter_s.append(t0)
        out = self.inner(self.runner, batch)
        self.host_s.append(time.perf_counter() - t0)
        return out


def profile_host(batch, ids: list, steps: int, path: Path) -> list:
    """cProfile of ``steps`` decode steps of ``batch`` (whatever host path is set): the 25 functions with the most
    own time and the 25 with the most cumulative time, as text in ``path`` (``list.tolist`` / ``Tensor.tolist`` own
    time there is the wait for the GPU). Returns the last sampled ids."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        ids = batch.step([[t] for t in ids])
    prof.disable()
    buf = io.StringIO()
    stats = pstats.Stats(prof, stream=buf).strip_dirs()
    stats.sort_stats("tottime").print_stats(25)
    stats.sort_stats("cumulative").print_stats(25)
    path.write_text(f"{steps} decode steps, batch {len(ids)}\n" + buf.getvalue())
    return ids


def decode_ab(runner, graphs, bs: int, cfg, bw: float, weight_bytes: int) -> list[dict]:
    """Alternating-order decode blocks of every setting on one static batch of ``bs`` x ``cfg.context``."""
    from sglang.bench_one_batch import StaticBatch

    mc = runner.model_config
    names = list(cfg.settings)
    total_steps = cfg.reps * len(names) * (cfg.steps + cfg.warmup) + 1 + (2 * cfg.steps if cfg.host_profile else 0)
    gen = torch.Generator().manual_seed(cfg.seed + bs)
    prompts = torch.randint(0, mc.vocab_size, (bs, cfg.context), generator=gen).tolist()
    batch = StaticBatch(runner, prompts, total_steps + 1)
    acc = {n: {"step": [], "host": [], "pre": [], "floor": [], "replay": []} for n in names}
    timer = ForwardTimer(runner)
    runner.forward = timer
    try:
        ids = batch.prefill(prompts, 8192)
        for rep in range(cfg.reps):
            for name in (names if rep % 2 == 0 else names[::-1]):
                set_host_path(runner, graphs, name)
                for _ in range(cfg.warmup):
                    ids = batch.step([[t] for t in ids])
                for _ in range(cfg.steps):
                    torch.cuda.synchronize()
                    ctx = batch.seq_lens[0] + 1
                    t0 = time.perf_counter()
                    ids = batch.step([[t] for t in ids])  # .tolist() inside synchronizes
                    acc[name]["step"].append(time.perf_counter() - t0)
                    acc[name]["host"].append(timer.host_s[-1])
                    acc[name]["pre"].append(timer.enter_s[-1] - t0)  # batch building before forward()
                    kvr = kv_bytes(bs * ctx, mc.num_hidden_layers, runner.num_kv_heads, mc.head_dim,
                                   mc.dtype.itemsize)
                    acc[name]["floor"].append(memory_floor_s(weight_bytes, kvr, bw))
                acc[name]["replay"].append(replay_only_ms(graphs, bs))
        if cfg.host_profile:
            set_host_path(runner, graphs, "new")
            profile_host(batch, ids, 2 * cfg.steps, Path(cfg.out) / f"decode_host_profile_bs{bs}.txt")
    finally:
        del runner.forward
        set_host_path(runner, graphs, "new")
        batch.free()
    rows = []
    for name in names:
        a = acc[name]
        step, floor = statistics.median(a["step"]), statistics.median(a["floor"])
        rows.append({"batch": bs, "setting": name, "step_ms": step * 1e3, "floor_ms": floor * 1e3,
                     "ratio": step / floor, "host_ms": statistics.median(a["host"]) * 1e3,
                     "pre_ms": statistics.median(a["pre"]) * 1e3,
                     "replay_ms": statistics.median(a["replay"]), "steps": len(a["step"]),
                     "nodes": graph_node_counts(graphs.graphs[graphs.padded_size(bs)])})
        logger.info("bs %d %s: step %.3f ms (floor %.3f, x%.3f), host %.3f ms, replay %.3f ms, nodes %s", bs, name,
                    step * 1e3, floor * 1e3, step / floor, rows[-1]["host_ms"], rows[-1]["replay_ms"],
                    rows[-1]["nodes"])
    return rows


def prefill_rate(runner, tokens: int, reps: int, mm: float, seed: int) -> dict:
    """Median latency of a one-request ``tokens``-token prefill (after a warm-up) vs the matmul rate ``mm``."""
    from sglang.bench_one_batch import run_latency

    mc = runner.model_config
    lat = [run_latency(runner, 1, tokens, 1, seed + i)["prefill_latency"] for i in range(reps + 1)][1:]
    med = statistics.median(lat)
    flops = prefill_flops(tokens, model_param_stats(runner.model), mc.num_hidden_layers, mc.num_attention_heads,
                          mc.head_dim)
    return {"tokens": tokens, "median_s": med, "flops_per_s": flops / med, "matmul_flops_per_s": mm,
            "ratio": flops / med / mm}


def breakdowns(runner, graphs, cfg, mm: float) -> list[dict]:
    """Kernel-category split of one replay per batch size (inputs as last staged) and of one prefill of
    ``cfg.prefill_tokens`` tokens (with the GEMM-only rate vs the matmul rate ``mm``)."""
    from benchmark.common.kernel_breakdown import kernel_breakdown

    from sglang.bench_one_batch import run_latency

    rows = []
    for bs in cfg.batches:
        graph = graphs.graphs[graphs.padded_size(bs)]
        graph.replay()
        rows.append({"label": f"decode replay bs {bs}", "breakdown": kernel_breakdown(graph.replay)})
    if cfg.prefill_tokens:
        mc, stats = runner.model_config, model_param_stats(runner.model)
        label = f"prefill {cfg.prefill_tokens} tokens"
        b = kernel_breakdown(lambda: run_latency(runner, 1, cfg.prefill_tokens, 1, cfg.seed + 99))
        gemm_ms = b.get("by_category", {}).get("gemm", 0.0)
        if gemm_ms:
            flops = 2.0 * cfg.prefill_tokens * stats.layer_matmul_params + 2.0 * stats.lm_head_params
            b["gemm_rate_ratio"] = flops / (gemm_ms / 1e3) / mm
            label += f" (GEMMs at {b['gemm_rate_ratio']:.2f} of the matmul rate)"
        rows.append({"label": label, "breakdown": b})
    for r in rows:
        logger.info("breakdown %s: %s", r["label"], {k: v for k, v in r["breakdown"].items() if k != "top"})
    return rows


def cli_floors(path: str, bw: float, weight_bytes: int, mc, kv_heads: int) -> list[dict]:
    """Memory floors for ``bench_one_batch`` JSON lines (median decode latency vs the floor at the mean context)."""
    rows = []
    for line in Path(path).read_text().splitlines():
        r = json.loads(line)
        if "median_decode_latency" not in r or not r["median_decode_latency"]:
            continue
        ctx = mean_decode_context(r["input_len"], r["output_len"] - 1)
        floor = memory_floor_s(weight_bytes, kv_bytes(r["batch_size"] * ctx, mc.num_hidden_layers, kv_heads,
                                                      mc.head_dim, mc.dtype.itemsize), bw)
        rows.append({"batch": r["batch_size"], "input_len": r["input_len"], "output_len": r["output_len"],
                     "median_decode_ms": r["median_decode_latency"] * 1e3, "floor_ms": floor * 1e3,
                     "ratio": r["median_decode_latency"] / floor, "prefill_s": r["prefill_latency"]})
    return rows


def build_runner(cfg):
    """Dummy-weight runner, CUDA graphs off (each setting captures its own), pool sized for the largest batch."""
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.server_args import ServerArgs

    need = max(cfg.batches) * (cfg.context + cfg.reps * len(cfg.settings) * (cfg.steps + cfg.warmup) + 8)
    if cfg.serving or cfg.gemm_ab or cfg.switch_ab:  # prompts cached once, every run's outputs kept by the cache
        runs = 3 if not cfg.switch_ab else cfg.switch_ab.count(";") + 2
        need = max(need, max(cfg.batches) * (cfg.context + runs * cfg.serving_reps * (cfg.serving_warmup
                                                                                   + cfg.serving_steps + 8)) + 4096)
    sa = ServerArgs(model_path=cfg.model_path, load_format="dummy", dtype="bfloat16", device="cuda",
                    max_total_tokens=max(need, cfg.prefill_tokens + 64) + 1024, disable_cuda_graph=True,
                    random_seed=cfg.seed, context_length=max(cfg.context + 1024, cfg.prefill_tokens + 64))
    return ModelRunner(ModelConfig.from_path(sa.model_path, sa.context_length, sa.dtype, "cuda"), sa, "cuda:0")


def render(res: dict) -> str:
    """Markdown tables of ``res``."""
    out = [f"# Decode A/B ({res['date']}, {res['gpu']})", "", f"Command: `{res['command']}`",
           f"Copy bandwidth {res['hbm_bytes_per_s'] / 1e12:.3f} TB/s, bf16 matmul "
           f"{res['matmul_flops_per_s'] / 1e12:.0f} TFLOP/s (same process).", ""]
    if res.get("cli"):
        out += ["## bench_one_batch (same device call) vs the floor", "",
                "| batch | in | out | median decode (ms) | floor (ms) | ratio | prefill (s) |",
                "|---:|---:|---:|---:|---:|---:|---:|"]
        out += [f"| {r['batch']} | {r['input_len']} | {r['output_len']} | {r['median_decode_ms']:.3f} | "
                f"{r['floor_ms']:.3f} | {r['ratio']:.3f} | {r['prefill_s']:.3f} |" for r in res["cli"]]
        out.append("")
    out += ["## Decode, host path old vs new (same graphs), one process, order alternated", "",
            "| batch | setting | step (ms) | floor (ms) | step/floor | host before forward (ms) | host in forward (ms) "
            "| graph replay (ms) | nodes |",
            "|---:|---|---:|---:|---:|---:|---:|---:|---|"] if res.get("decode") else []
    for r in res.get("decode", []):
        nodes = r["nodes"] or {}
        nd = f"{nodes.get('total', 'n/a')} ({nodes.get('kernel', '?')} kernels)" if nodes else "n/a"
        out.append(f"| {r['batch']} | {r['setting']} | {r['step_ms']:.3f} | {r['floor_ms']:.3f} | {r['ratio']:.3f} |"
                   f" {r['pre_ms']:.3f} | {r['host_ms']:.3f} | {r['replay_ms']:.3f} | {nd} |")
    if res.get("serving"):
        from benchmark.decode.served_step import render_rows

        out += [""] + render_rows(res["serving"])
    if res.get("prefill"):
        p = res["prefill"]
        out += ["", f"Prefill {p['tokens']} tokens: {p['median_s'] * 1e3:.1f} ms, "
                f"{p['flops_per_s'] / 1e12:.0f} TFLOP/s = {p['ratio']:.2f} of the matmul rate (target >= 0.70)."]
    if res.get("gemm_ab"):
        from benchmark.decode.gemm_ab import render_ab

        out += [""] + render_ab(res["gemm_ab"], res["hbm_bytes_per_s"])
    if res.get("switch_ab"):
        from benchmark.decode.switch_ab import render_switch

        out += [""] + render_switch(res["switch_ab"], res["hbm_bytes_per_s"])
    if res.get("breakdown"):
        from benchmark.common.kernel_breakdown import render_breakdowns

        out += ["", "## GPU time by kernel category (torch.profiler)", ""] + render_breakdowns(res["breakdown"])
    return "\n".join(out) + "\n"


def parse_args(argv):
    """Command line -> argparse namespace (``batches``/``settings`` as lists)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default=str(DATA / "configs" / "meta-llama--Meta-Llama-3.1-8B"))
    p.add_argument("--batches", default="1,32,128")
    p.add_argument("--settings", default="old,new", help="host paths to A/B (old,new), or none")
    p.add_argument("--breakdown", action="store_true", help="profile one replay per batch and one prefill")
    p.add_argument("--host-profile", action="store_true",
                   help="cProfile 2 x --steps decode steps per batch (new path) -> <out>/decode_host_profile_bs*.txt")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--reps", type=int, default=4)
    p.add_argument("--prefill-tokens", type=int, default=8192)
    p.add_argument("--prefill-reps", type=int, default=3)
    p.add_argument("--serving", action="store_true",
                   help="also time the serving path's decode step (Scheduler loop, overlap off / host / device futures)")
    p.add_argument("--serving-modes", default="plain,overlap-host,overlap",
                   help="serving modes to time (comma list of plain, overlap-host, overlap)")
    p.add_argument("--serving-steps", type=int, default=24)
    p.add_argument("--serving-warmup", type=int, default=4)
    p.add_argument("--serving-reps", type=int, default=2)
    p.add_argument("--gemm-ab", action="store_true",
                   help="instead of the host-path A/B: two graph sets (cuBLAS, SGLANG_DECODE_GEMM_AUTOTUNE=1), their "
                        "served step (overlap) and replay alternated, per-class replay breakdown (benchmark/decode/gemm_ab.py)")
    p.add_argument("--switch-ab", default=None, metavar="SPEC",
                   help="instead: one graph set per 'name:VAR=v,...' (';'-separated) of the launch-time kernel "
                        "switches, served step + replay alternated, breakdown per set (benchmark/decode/switch_ab.py)")
    p.add_argument("--switch-breakdown", default="32", help="batches (comma list) profiled per set by --switch-ab")
    p.add_argument("--cli-results", default=None, help="bench_one_batch result.jsonl to put beside the floor")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="/tmp/out")
    from benchmark.common.records import add_record_dir_argument
    add_record_dir_argument(p, "decode")
    ns = p.parse_args(argv)
    ns.batches = [int(b) for b in ns.batches.split(",") if b.strip()]
    ns.switch_breakdown = [int(b) for b in ns.switch_breakdown.split(",") if b.strip()]
    if (ns.gemm_ab or ns.switch_ab) and min(ns.serving_reps, ns.serving_steps) < 1:
        raise SystemExit("--gemm-ab / --switch-ab need --serving-reps and --serving-steps >= 1")
    ns.settings = [s.strip() for s in ns.settings.split(",") if s.strip()]
    ns.settings = [] if ns.settings == ["none"] else ns.settings
    ns.serving_modes = [s.strip() for s in ns.serving_modes.split(",") if s.strip()]
    if not ns.serving_modes or any(m not in ("plain", "overlap-host", "overlap") for m in ns.serving_modes):
        raise SystemExit(f"bad --serving-modes {ns.serving_modes}: choose from plain, overlap-host, overlap")
    bad = [s for s in ns.settings if s not in SETTINGS]
    if bad or not ns.batches or min(ns.batches) < 1 or min(ns.steps, ns.reps) < 1:
        raise SystemExit(f"bad --settings {bad} (choose from {list(SETTINGS)}) or --batches/--steps/--reps < 1")
    return ns


def main(argv=None) -> int:
    """Floors, runner, graphs, decode old vs new, prefill, breakdown; writes ``<out>/decode_step_ab.{md,json}``."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    cfg = parse_args(sys.argv[1:] if argv is None else argv)
    from benchmark.attention import bench_triton_attention as bta
    res = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
           "command": "python benchmark/decode/step_ab.py " + " ".join(sys.argv[1:] if argv is None else argv),
           "hbm_bytes_per_s": bta.hbm_bandwidth(4.0), "matmul_flops_per_s": bta.matmul_rate(8192)}
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)

    def write():
        (out / "decode_step_ab.json").write_text(json.dumps(res, indent=1, default=str))
        (out / "decode_step_ab.md").write_text(render(res))

    runner = build_runner(cfg)
    weight_bytes = model_param_stats(runner.model).decode_weight_bytes
    if cfg.cli_results and Path(cfg.cli_results).exists():
        res["cli"] = cli_floors(cfg.cli_results, res["hbm_bytes_per_s"], weight_bytes, runner.model_config,
                                runner.num_kv_heads)
    write()
    if cfg.switch_ab:
        from benchmark.decode.switch_ab import switch_ab

        def progress_sw(partial):
            res["switch_ab"] = partial
            write()

        res["switch_ab"] = switch_ab(runner, cfg, res["hbm_bytes_per_s"], weight_bytes, capture_graphs,
                                     replay_only_ms, cfg.switch_ab, progress_sw)
        write()
        sys.stdout.write(render(res))
        write_step_record(res, cfg)
        return 0
    if cfg.gemm_ab:
        from benchmark.decode.gemm_ab import gemm_ab

        def progress(partial):
            res["gemm_ab"] = partial
            write()

        res["gemm_ab"] = gemm_ab(runner, cfg, res["hbm_bytes_per_s"], weight_bytes, capture_graphs, replay_only_ms,
                                 progress)
        write()
        sys.stdout.write(render(res))
        write_step_record(res, cfg)
        return 0
    t0 = time.monotonic()
    graphs = capture_graphs(runner, sorted(set(cfg.batches)))
    runner.cuda_graph_runner = graphs
    logger.info("captured graphs in %.1f s", time.monotonic() - t0)
    res["decode"] = []
    for bs in cfg.batches if cfg.settings else []:
        res["decode"] += decode_ab(runner, graphs, bs, cfg, res["hbm_bytes_per_s"], weight_bytes)
        write()
    if cfg.serving:
        from benchmark.decode.served_step import serving_rows

        res["serving"] = serving_rows(runner, cfg.batches, cfg, res["hbm_bytes_per_s"], weight_bytes)
        for r in res["serving"]:
            logger.info("serving bs %d %s: step %.3f ms (floor %.3f, x%.3f)", r["batch"], r["mode"], r["step_ms"],
                        r["floor_ms"], r["ratio"])
        write()
    if cfg.prefill_tokens:
        res["prefill"] = prefill_rate(runner, cfg.prefill_tokens, cfg.prefill_reps, res["matmul_flops_per_s"],
                                      cfg.seed)
        write()
    if cfg.breakdown:
        res["breakdown"] = breakdowns(runner, graphs, cfg, res["matmul_flops_per_s"])
    write()
    sys.stdout.write(render(res))
    write_step_record(res, cfg)
    return 0


def write_step_record(res: dict, cfg) -> None:
    """With ``--record-dir``: write :func:`make_step_record` of ``res`` and print its path."""
    if not getattr(cfg, "record_dir", None):
        return
    from benchmark.common import records

    rec = make_step_record(res, cfg)
    if rec is not None:
        js, _ = records.write_record(rec, Path(cfg.record_dir))
        sys.stdout.write(f"record: {js}\n")


def make_step_record(res: dict, cfg, env: Optional[dict] = None) -> Optional[dict]:
    """The A/B rows of ``res`` (the host-path A/B, or ``gemm_ab`` / ``switch_ab``) as a
    :mod:`benchmark.common.records` record; None when no row was measured. Each row gets the same-run baseline
    setting's step at its batch (``base_step_ms``) and ``vs_base`` = step / that; the headline is the largest batch:
    each other setting's step against the baseline (up to two) and the best step against the memory floor. The
    ``benchmark`` is the decode entry point (``benchmark.decode.bench``, as the ``host`` mode's record), ``mode``
    ``step``, ``step-gemm-ab`` or ``step-switch-ab``."""
    from benchmark.common import records

    if res.get("switch_ab"):
        rows, key, what, mode = res["switch_ab"].get("rows", []), "set", "decode_switch_ab", "step-switch-ab"
        base = (res["switch_ab"].get("sets") or [[None]])[0][0]
    elif res.get("gemm_ab"):
        rows, key, base, what, mode = res["gemm_ab"].get("rows", []), "set", "cublas", "decode_gemm_ab", "step-gemm-ab"
    else:
        rows, key, base, what, mode = res.get("decode", []), "setting", "old", "decode_step_ab", "step"
    if not rows:
        return None
    base_step = {r["batch"]: r["step_ms"] for r in rows if r[key] == base}
    rows = records.add_ratio([{**r, "base_step_ms": base_step.get(r["batch"])} for r in rows], "vs_base",
                             "step_ms", "base_step_ms")
    big = max(r["batch"] for r in rows)
    at_big = [r for r in rows if r["batch"] == big]
    headline = [{"label": f"decode step, batch {big}, {r[key]} vs {base}", "value": round(r["step_ms"], 4),
                 "unit": "ms", "baseline": round(r["base_step_ms"], 4), "ratio": r["vs_base"]}
                for r in at_big if r[key] != base and r["base_step_ms"] is not None][:2]
    best = min(at_big, key=lambda r: r["step_ms"])
    headline.append({"label": f"decode step vs memory floor, batch {big}, {best[key]}",
                     "value": round(best["step_ms"], 4), "unit": "ms", "baseline": round(best["floor_ms"], 4),
                     "ratio": round(best["ratio"], 3)})
    units = {k: "ms" for r in rows for k in r if k.endswith("_ms")}
    return records.make_record(
        subject="decode", benchmark="benchmark.decode.bench", mode=mode, what=what, rows=rows, env=env,
        params={"model_path": cfg.model_path, "batches": list(cfg.batches), "context": cfg.context,
                "steps": cfg.steps, "reps": cfg.reps, "baseline_setting": base,
                "hbm_bytes_per_s": res.get("hbm_bytes_per_s"), "matmul_flops_per_s": res.get("matmul_flops_per_s")},
        baselines=("base_step_ms",), units=units,
        floor={"column": "floor_ms", "what": "(weight bytes + KV bytes read per step) / device-to-device copy "
                                             "bandwidth measured first in this process; ratio = step / floor"},
        headline=headline, gpu_count=1)


if __name__ == "__main__":
    sys.exit(main())
