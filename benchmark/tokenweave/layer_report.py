"""Report helpers of ``benchmark/tokenweave/bench_layer.py`` layer mode: the host-vs-GPU table, the auto-off decision, and the
per-forward fixed cost fitted over layer counts.

Fixed per-forward cost (target: "under 0.2 ms"): the same variants timed at several ``--layers`` counts
(e.g. 1 and 4, one results JSON per count, written next to each layer-mode results file) give per variant and T a
least-squares line ``ms = intercept + slope * layers``: ``slope`` is the cost of one decoder layer, ``intercept``
what a forward costs besides its layers (embedding, final norm, logits, and for TokenWeave the split set-up and
stream/event work). TokenWeave's fixed cost *over NCCL* is ``intercept(tokenweave) - intercept(nccl)``.
CLI: ``python benchmark/tokenweave/layer_report.py --layer-fit L1.json L4.json [--out fit.md]``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Optional, Sequence


def host_table(cases: list[tuple[str, int, dict]], tokens: list[int], variants: list[str]) -> list[str]:
    """Markdown rows: per case and token count, each variant's GPU ms (CUDA events), host enqueue ms (until
    ``run`` returned) and host / GPU; kernel launches and tensor allocations per forward where profiled
    (``--profile-tokens``, variants nccl and tokenweave)."""
    lines = ["| model | TP | tokens | variant | GPU ms | host ms | host / GPU | launches | allocations |",
             "|---|---:|---:|---|---:|---:|---:|---:|---:|"]
    for model, tp, res in cases:
        for t in tokens:
            for v in variants:
                g, h = res.get(f"{v}|{t}"), res.get(f"host|{v}|{t}")
                n, a = res.get(f"launches|{v}|{t}"), res.get(f"allocs|{v}|{t}")
                if g and h:
                    lines.append(f"| {model} | {tp} | {t} | {v} | {g:.3f} | {h:.3f} | {h / g:.2f} | "
                                 f"{int(n) if n else '-'} | {int(a) if a else '-'} |")
    return lines


def auto_off_decision(results: dict, tokens: list[int]) -> tuple[list[str], Optional[int]]:
    """Per token count: TokenWeave on when its ms is below ``nccl`` (and ``nccl_symm`` where measured), and the
    smallest measured T from which it stays on at every larger measured T (the ``--tokenweave-min-tokens``
    these numbers support; None: off at every T measured). Returns (markdown lines, that T or None)."""
    on = {}
    for t in tokens:
        tw, base = results.get(f"tokenweave|{t}"), [results.get(f"{b}|{t}") for b in ("nccl", "nccl_symm")]
        base = [b for b in base if b]
        on[t] = bool(tw and base and tw < min(base))
    ok = [t for t in sorted(tokens) if all(on[u] for u in tokens if u >= t)]
    best = ok[0] if ok else None
    lines = [f"- auto-off at T={t}: TokenWeave {'ON' if on[t] else 'OFF'}" for t in sorted(tokens)]
    lines.append(f"- supported --tokenweave-min-tokens: {best}" if best else
                 "- supported --tokenweave-min-tokens: none (TokenWeave loses at every T measured: keep it off)")
    return lines, best


def target_of(tokens: int) -> float:
    """The TokenWeave / NCCL target at ``tokens`` (4 layers): <= 0.95 at 1024-2048, <= 0.8 from 4096, and
    never above 1.0 elsewhere."""
    return 0.8 if tokens >= 4096 else 0.95 if tokens >= 1024 else 1.0


def targets_table(cases: list[tuple[str, int, dict]], tokens: list[int]) -> list[str]:
    """Markdown rows: per case and T, TokenWeave / NCCL (and without the GEMM carveout where measured) against
    the issue's target, and ``nocomm / nccl``: the no-communication bound (perfect overlap, free split). A target
    below that bound cannot be met by overlap at this TP size; the row says so."""
    lines = ["| model | TP | tokens | tokenweave / nccl | nocarve / nccl | nocomm / nccl (bound) | target | met | "
             "target reachable by overlap |", "|---|---:|---:|---:|---:|---:|---:|---|---|"]
    f = lambda v: f"{v:.3f}" if v else "n/a"  # noqa: E731
    for model, tp, res in cases:
        for t in tokens:
            nccl = res.get(f"nccl|{t}")
            r = {v: (res.get(f"{v}|{t}") / nccl if res.get(f"{v}|{t}") and nccl else None)
                 for v in ("tokenweave", "tokenweave_nocarve", "nocomm")}
            goal = target_of(t)
            met = "n/a" if r["tokenweave"] is None else ("yes" if r["tokenweave"] <= goal else "no")
            reach = "n/a" if r["nocomm"] is None else ("yes" if r["nocomm"] <= goal else
                                                       f"no (bound {r['nocomm']:.3f} > {goal})")
            lines.append(f"| {model} | {tp} | {t} | {f(r['tokenweave'])} | {f(r['tokenweave_nocarve'])} | "
                         f"{f(r['nocomm'])} | <= {goal} | {met} | {reach} |")
    return lines


FIT_MODES = (("eager", "{v}|{t}"), ("graph", "graph|{v}|{t}"), ("host", "host|{v}|{t}"))
FIXED_COST_TARGET_MS = 0.2  # TokenWeave's fixed per-forward cost


def write_cases_json(path: Path, layers: int, tokens: list[int], variants: list[str],
                     cases: list[tuple[str, int, dict]]) -> Path:
    """Write one layer-mode run (``cases``: (model, TP, {"<key>": ms})) with its layer count as JSON for
    :func:`layer_fit_table`; only float timings are kept. Returns ``path``."""
    data = {"layers": layers, "tokens": list(tokens), "variants": list(variants),
            "cases": [{"model": m, "tp": tp, "results": {k: v for k, v in res.items() if isinstance(v, float)}}
                      for m, tp, res in cases]}
    Path(path).write_text(json.dumps(data, indent=1) + "\n")
    return Path(path)


def layer_record(cases: list[tuple[str, int, dict]], tokens: list[int], variants: list[str], *, params: dict,
                 gpu_count: Optional[int] = None, env: Optional[dict] = None, command: Optional[str] = None) -> dict:
    """The layer table as a :mod:`benchmark.common.records` record (``what`` = ``tokenweave_layer``): one row per
    (model, TP, T) with every variant's ms (``<variant>_ms``; ``nocomm`` / ``nccl`` / ``nccl_symm`` / ``custom`` are
    the same-run baselines) and the table's ratios ``<a>_over_<b>`` (< 1: ``a`` faster); ``nocomm_ms`` is the floor.
    Headline: TokenWeave vs NCCL at the largest T of up to three (model, TP) cases."""
    from benchmark.common import records
    from benchmark.tokenweave.layer_variants import ratio_pairs

    rows = [{"model": model, "tp": tp, "tokens": t, **{f"{v}_ms": res.get(f"{v}|{t}") for v in variants}}
            for model, tp, res in cases for t in tokens]
    for a, b in ratio_pairs(variants):
        rows = records.add_ratio(rows, f"{a}_over_{b}", f"{a}_ms", f"{b}_ms")
    big = max(tokens)
    headline = [{"label": f"TokenWeave layer forward, {r['model']} TP{r['tp']}, T={big}",
                 "value": r["tokenweave_ms"], "unit": "ms", "baseline": r["nccl_ms"],
                 "ratio": r["tokenweave_over_nccl"]}
                for r in rows if r["tokens"] == big and r.get("tokenweave_ms") and r.get("nccl_ms")][:3]
    return records.make_record(
        subject="tokenweave", benchmark="benchmark.tokenweave.bench_layer", mode="layer", what="tokenweave_layer",
        rows=rows, params=params, baselines=[f"{b}_ms" for b in ("nocomm", "nccl", "nccl_symm", "custom")
                                             if b in variants],
        units={f"{v}_ms": "ms" for v in variants},
        floor={"column": "nocomm_ms", "model": "every collective skipped: no overlap can beat it"}
        if "nocomm" in variants else None, headline=headline, gpu_count=gpu_count, env=env, command=command)


def write_layer_record(cases: list[tuple[str, int, dict]], a, variants: list[str], device: str) -> Path:
    """``--record-dir``: :func:`layer_record` of the run written under ``a.record_dir``; returns the JSON path."""
    from benchmark.common import records

    params = {k: getattr(a, k) for k in ("layers", "min_tokens", "comm_sms", "iters", "warmup", "cuda_graph")}
    rec = layer_record(cases, a.tokens, variants, params=dict(params, device=device),
                       gpu_count=max(a.tps) if device == "cuda" else 0)
    return records.write_record(rec, Path(a.record_dir))[0]


def fit_line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float, float]:
    """Least-squares ``y = intercept + slope * x``: (intercept, slope, rms residual). Raises ValueError with
    fewer than two distinct x or unequal lengths."""
    if len(xs) != len(ys) or len(set(xs)) < 2:
        raise ValueError(f"fit_line needs >= 2 distinct layer counts with one time each, got x={list(xs)}, "
                         f"y={list(ys)}: run benchmark/tokenweave/bench_layer.py with at least two --layers values")
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    icpt = my - slope * mx
    rms = (sum((y - icpt - slope * x) ** 2 for x, y in zip(xs, ys)) / n) ** 0.5
    return icpt, slope, rms


def layer_fits(runs: Sequence[dict]) -> dict:
    """{(model, TP, mode, T, variant): (layer counts, intercept ms, slope ms/layer, rms ms)} over ``runs`` (the
    :func:`write_cases_json` dicts), for every key measured at >= 2 distinct layer counts (a count measured twice
    keeps its last run)."""
    pts: dict = {}
    for run in runs:
        for case in run["cases"]:
            for mode, fmt in FIT_MODES:
                for t in run["tokens"]:
                    for v in run["variants"]:
                        ms = case["results"].get(fmt.format(v=v, t=t))
                        if ms:
                            key = (case["model"], case["tp"], mode, t, v)
                            pts.setdefault(key, {})[run["layers"]] = ms
    return {k: (sorted(p), *fit_line(sorted(p), [p[x] for x in sorted(p)])) for k, p in pts.items() if len(p) >= 2}


def layer_fit_table(runs: Sequence[dict]) -> list[str]:
    """Markdown lines: per (model, TP, mode, T, variant) the fitted fixed per-forward cost (intercept) and
    per-layer cost (slope), both minus / over NCCL's of the same mode and T, and for TokenWeave variants whether
    the fixed cost over NCCL is under the 0.2 ms target."""
    fits = layer_fits(runs)
    lines = ["| model | TP | mode | tokens | variant | layers | fixed ms (intercept) | ms / layer (slope) | "
             "fit rms ms | fixed - nccl ms | slope / nccl | fixed - nccl < 0.2 ms |",
             "|---|---:|---|---:|---|---|---:|---:|---:|---:|---:|---|"]
    for (model, tp, mode, t, v), (layers, icpt, slope, rms) in sorted(fits.items()):
        ref = fits.get((model, tp, mode, t, "nccl"))
        d = f"{icpt - ref[1]:+.3f}" if ref else "n/a"
        r = f"{slope / ref[2]:.3f}" if ref and ref[2] else "n/a"
        met = ("yes" if icpt - ref[1] < FIXED_COST_TARGET_MS else "no") if ref and v.startswith("tokenweave") else "-"
        lines.append(f"| {model} | {tp} | {mode} | {t} | {v} | {','.join(map(str, layers))} | {icpt:.3f} | "
                     f"{slope:.3f} | {rms:.3f} | {d} | {r} | {met} |")
    return lines


def main(argv=None) -> str:
    """CLI: ``--layer-fit`` JSON files (one per --layers count) -> the fit table (printed, and written to --out)."""
    p = argparse.ArgumentParser(description="TokenWeave fixed per-forward cost: fit over layer counts")
    p.add_argument("--layer-fit", nargs="+", required=True, help="benchmark/tokenweave/bench_layer.py layer-mode JSON files")
    p.add_argument("--out", default="", help="also write the section here (markdown)")
    a = p.parse_args(argv)
    runs = [json.loads(Path(f).read_text()) for f in a.layer_fit]
    counts = sorted({r["layers"] for r in runs})
    if len(counts) < 2:
        p.error(f"--layer-fit needs runs at >= 2 layer counts, got {counts} from {a.layer_fit}")
    text = "\n".join(["## fixed per-forward cost (least squares over layer counts "
                      f"{', '.join(map(str, counts))}; ms = fixed + layers x slope)", "",
                      *layer_fit_table(runs)]) + "\n"
    print(text)
    if a.out:
        Path(a.out).write_text(text)
    return text


if __name__ == "__main__":
    main()
