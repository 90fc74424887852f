"""The default decode (every linear on cuBLAS) against ``SGLANG_DECODE_GEMM_AUTOTUNE=1`` (per shape and
batch bucket, cuBLAS or the fastest skinny split-K GEMM, :mod:`sglang.srt.layers.decode_gemm`) in ONE process, on
one runner: two CUDA-graph sets are captured (``cublas`` first, then ``autotune``, which tunes before its capture),
and per batch size the served step (the Scheduler's overlap loop with device futures, as the server runs on CUDA),
the graph replay alone and the per-class kernel breakdown (:mod:`benchmark.decode.breakdown`) are measured for both, the order
alternating between repetitions; then one more profiled served run on the cuBLAS set gives the GPU busy / idle
time per served step (the part of the served step that is not graph work). Called by ``benchmark/decode/step_ab.py
--gemm-ab``.
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from typing import Callable, Dict, List, Optional

import torch

from benchmark.decode.breakdown import (
    kernel_events, kernel_trace, min_bytes, model_dims, render_role_table, role_breakdown, served_timeline,
)
from benchmark.common.floors import kv_bytes, memory_floor_s

logger = logging.getLogger("benchmark.decode.gemm_ab")
SETS = ("cublas", "autotune")


def capture_sets(runner, sizes: List[int], capture: Callable) -> Dict[str, object]:
    """``{"cublas": graphs, "autotune": graphs}``, captured by ``capture(runner, sizes)`` with
    ``SGLANG_DECODE_GEMM_AUTOTUNE`` 0 then 1 (restored afterwards); the model is left with no table installed."""
    from sglang.srt.layers import decode_gemm

    saved = os.environ.get(decode_gemm.AUTOTUNE_ENV)
    sets = {}
    try:
        for name in SETS:
            os.environ[decode_gemm.AUTOTUNE_ENV] = "1" if name == "autotune" else "0"
            t0 = time.monotonic()
            sets[name] = capture(runner, sizes)
            logger.info("graph set %s captured in %.1f s (table %s)", name, time.monotonic() - t0,
                        "yes" if getattr(sets[name], "decode_gemm_table", None) else "none")
    finally:
        if saved is None:
            os.environ.pop(decode_gemm.AUTOTUNE_ENV, None)
        else:
            os.environ[decode_gemm.AUTOTUNE_ENV] = saved
        decode_gemm.install(runner.model, None)
    return sets


def use_set(runner, graphs) -> None:
    """Make ``graphs`` the runner's decode graphs and install its GEMM table (None for cuBLAS) on the model, so
    eager calls agree with what the graphs captured."""
    from sglang.srt.layers import decode_gemm

    runner.cuda_graph_runner = graphs
    decode_gemm.install(runner.model, getattr(graphs, "decode_gemm_table", None))


def staged_kv_tokens(graphs, bs: int) -> int:
    """Cached tokens the padded-``bs`` graph reads as last staged (sum of its static ``seq_lens``)."""
    return int(graphs.seq_lens[: graphs.padded_size(bs)].sum().item())


def gemm_ab(runner, cfg, bw: float, weight_bytes: int, capture: Callable, replay_ms: Callable,
            progress: Optional[Callable[[dict], None]] = None) -> dict:
    """The A/B of the module docstring. ``capture(runner, sizes)`` -> CudaGraphRunner; ``replay_ms(graphs, bs)`` ->
    median GPU ms of back-to-back replays; ``progress(res)`` (optional) gets the partial result after each batch
    size. Returns ``{"rows": [...], "breakdown": [...], "table": [lines], "tune_s"}``; rows: batch, set, served
    step / floor, replay / floor."""
    from benchmark.decode.served_step import run_mode

    mc = runner.model_config
    sets = capture_sets(runner, sorted(set(cfg.batches)), capture)
    table = getattr(sets["autotune"], "decode_gemm_table", None)
    res = {"table": table.describe() if table else ["(autotune produced no table: every linear on cuBLAS)"],
           "tune_s": table.tune_s if table else None, "rows": [], "breakdown": []}
    dims = model_dims(mc, runner.num_kv_heads, runner.local_num_heads)
    try:
        for bs in cfg.batches:
            gen = torch.Generator().manual_seed(cfg.seed + 1000 + bs)
            prompts = torch.randint(3, mc.vocab_size, (bs, cfg.context), generator=gen).tolist()
            acc = {s: {"step_s": [], "floor_s": [], "replay": [], "rfloor": []} for s in SETS}
            for rep in range(cfg.serving_reps):
                for name in (SETS if rep % 2 == 0 else SETS[::-1]):
                    use_set(runner, sets[name])
                    got = run_mode(runner, "overlap", prompts, cfg.serving_warmup, cfg.serving_steps, bw,
                                   weight_bytes, f"ab-{name}-{bs}-{rep}", cfg.model_path)
                    acc[name]["step_s"] += got["step_s"]
                    acc[name]["floor_s"] += got["floor_s"]
            for rep in range(2 * cfg.serving_reps):  # replay alone on the inputs the serving runs staged last
                for name in (SETS if rep % 2 == 0 else SETS[::-1]):
                    g = sets[name]
                    kv = kv_bytes(staged_kv_tokens(g, bs), mc.num_hidden_layers, runner.num_kv_heads, mc.head_dim,
                                  mc.dtype.itemsize)
                    acc[name]["replay"].append(replay_ms(g, bs))
                    acc[name]["rfloor"].append(memory_floor_s(weight_bytes, kv, bw) * 1e3)
            for name in SETS:
                a = acc[name]
                step, floor = statistics.median(a["step_s"]), statistics.median(a["floor_s"])
                rep_ms, rfloor = statistics.median(a["replay"]), statistics.median(a["rfloor"])
                res["rows"].append({"batch": bs, "set": name, "step_ms": step * 1e3, "floor_ms": floor * 1e3,
                                    "ratio": step / floor, "replay_ms": rep_ms, "replay_floor_ms": rfloor,
                                    "replay_ratio": rep_ms / rfloor, "steps": len(a["step_s"])})
                logger.info("gemm A/B bs %d %s: served %.3f ms (x%.3f), replay %.3f ms (x%.3f)", bs, name,
                            step * 1e3, step / floor, rep_ms, rep_ms / rfloor)
            for name in SETS:
                res["breakdown"].append(_breakdown(sets[name], bs, name, dims, bw))
            res.setdefault("timeline", []).append(_timeline(runner, sets["cublas"], bs, prompts, cfg, bw,
                                                            weight_bytes, res["breakdown"][-2]))
            runner.kv_cache.prefix_cache.reset()  # the next batch size starts from an empty cache
            if progress is not None:
                progress(res)
    finally:
        use_set(runner, sets["cublas"])
    return res


def _breakdown(graphs, bs: int, name: str, dims: dict, bw: float) -> dict:
    """Role breakdown of one replay of the padded-``bs`` graph of ``graphs`` (warm replay first)."""
    label = f"bs {bs}, {name}"
    try:
        graph = graphs.graphs[graphs.padded_size(bs)]
        graph.replay()
        events = kernel_events(graph.replay)
        nbytes = min_bytes(dims, graphs.padded_size(bs), staged_kv_tokens(graphs, bs))
        return {"label": label, "result": role_breakdown(events, nbytes, bw)}
    except Exception as e:  # no CUPTI etc.: report it, keep the timings
        logger.warning("breakdown %s failed: %s: %s", label, type(e).__name__, e)
        return {"label": label, "error": f"{type(e).__name__}: {e}"[:300]}


def _timeline(runner, graphs, bs: int, prompts, cfg, bw: float, weight_bytes: int, breakdown: dict) -> dict:
    """GPU busy / idle per served step (:func:`benchmark.decode.breakdown.served_timeline`) of one profiled overlap run of
    ``prompts`` on ``graphs`` (2 warm-up + 8 steps; the profiler's own host cost makes this a lower bound on
    busy)."""
    from benchmark.decode.served_step import run_mode

    try:
        use_set(runner, graphs)
        n_graph = sum(r["kernels"] for r in breakdown["result"]["rows"]) if "result" in breakdown else 0
        trace = kernel_trace(lambda: run_mode(runner, "overlap", prompts, 2, 8, bw, weight_bytes, f"tl-{bs}",
                                              cfg.model_path))  # the prompts hit the radix cache of the A/B runs
        return {"batch": bs, "graph_kernels": n_graph, **served_timeline(trace, n_graph)}
    except Exception as e:  # no CUPTI etc.
        logger.warning("served timeline bs %d failed: %s: %s", bs, type(e).__name__, e)
        return {"batch": bs, "error": f"{type(e).__name__}: {e}"[:300]}


def render_ab(res: dict, bw: float) -> List[str]:
    """Markdown lines: the A/B table, the per-class breakdowns, the autotune table."""
    out = ["## Default (cuBLAS) vs SGLANG_DECODE_GEMM_AUTOTUNE=1, one process, order alternated", "",
           "| batch | GEMMs | served step (ms) | floor (ms) | served / floor | replay (ms) | replay floor (ms) | "
           "replay / floor | steps |", "|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    out += [f"| {r['batch']} | {r['set']} | {r['step_ms']:.3f} | {r['floor_ms']:.3f} | {r['ratio']:.3f} | "
            f"{r['replay_ms']:.3f} | {r['replay_floor_ms']:.3f} | {r['replay_ratio']:.3f} | {r['steps']} |"
            for r in res.get("rows", [])]
    out += ["", "## Per-class breakdown of one graph replay (torch.profiler; min bytes per class; bandwidth vs "
            "the copy bandwidth of this process)", ""]
    for b in res.get("breakdown", []):
        out += ([f"### {b['label']}: n/a ({b['error']})", ""] if "error" in b
                else render_role_table(b["label"], b["result"], bw))
    out += ["## GPU timeline of the served step (cuBLAS set, overlap, one profiled run after the last prefill)", "",
            "| batch | steps | period (us) | GPU busy (us) | GPU idle (us) | kernels / step | graph kernels | "
            "largest idle gaps (us, before -> after) |", "|---:|---:|---:|---:|---:|---:|---:|---|"]
    for t in res.get("timeline", []):
        if "error" in t:
            out.append(f"| {t['batch']} | n/a ({t['error']}) | | | | | | |")
            continue
        gaps = "; ".join(f"{g} `{a}` -> `{b}`" for g, a, b in t["gaps"][:2])
        out.append(f"| {t['batch']} | {t['steps']} | {t['period_us']:.0f} | {t['busy_us']:.0f} | {t['idle_us']:.0f} |"
                   f" {t['kernels_per_step']:.0f} | {t['graph_kernels']} | {gaps} |")
    out.append("")
    tune = f" (tuned in {res['tune_s']:.1f} s)" if res.get("tune_s") is not None else ""
    out += [f"## Autotune table{tune}", ""] + [f"- {line}" for line in res.get("table", [])]
    return out
