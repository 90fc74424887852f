"""Where a serving run's time goes, from the scheduler's step trace (``SGLANG_STEP_TRACE``, see
``python/sglang/srt/metrics/step_trace.py``).

For one trace: the wall span, device busy time by mode (extend / mixed / decode) and the prefill share of the wall
time, device idle time, decode batch-size histogram with each bin's step time against its memory floor
(``(weight bytes + KV tokens read x KV bytes per token) / bandwidth``, Williams et al., "Roofline", CACM 2009),
eager decode steps (no CUDA graph) and those above the largest captured graph, host time per step (build, wait,
result processing) and host-bound steps, retractions, the drain phase (nothing waiting any more), and an ideal
time (every decode step at its floor, every prefill token at ``--prefill-tflops``). Several traces (``--trace
LABEL=PATH``, the first is the baseline) are also compared over a common horizon: decode tokens generated in the
first T seconds of each (a variant cut by its time limit is still comparable with the baseline over its prefix).

Usage::

    python benchmark/serving/step_trace_report.py --trace base=/tmp/out/base.jsonl --trace cg256=/tmp/out/cg.jsonl \\
        [--graph-max-bs 160] [--bw-tbs 3.0] [--json out.json] [--md out.md]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass
from typing import Optional, Sequence

# Llama-3.1-8B bf16: 8.03e9 parameters x 2 bytes; KV per token = 32 layers x 8 KV heads x 128 x 2 (K, V) x 2 bytes
DEFAULT_WEIGHT_BYTES = 16.06e9
DEFAULT_KV_BYTES_PER_TOKEN = 131072
DEFAULT_FLOP_PER_TOKEN = 16.06e9  # prefill: 2 x parameters per token (attention's own FLOPs not counted)
BS_BINS = (1, 33, 65, 97, 129, 161, 193, 257, 385, 513)  # lower edges of the decode batch-size bins


@dataclass(frozen=True)
class Model:
    """The physical model of a step.

    Attributes: weight_bytes (read once per forward), kv_bytes_per_token (read per decode row per context token),
    bw (bytes/s, the device's copy bandwidth), flop_per_token and prefill_flops (FLOP/s) for prefill tokens.
    """

    weight_bytes: float = DEFAULT_WEIGHT_BYTES
    kv_bytes_per_token: float = DEFAULT_KV_BYTES_PER_TOKEN
    bw: float = 3.0e12
    flop_per_token: float = DEFAULT_FLOP_PER_TOKEN
    prefill_flops: float = 700e12

    def decode_floor_ms(self, kv_tok: float) -> float:
        """Least time of one decode step reading the weights once and ``kv_tok`` tokens of KV."""
        return (self.weight_bytes + kv_tok * self.kv_bytes_per_token) / self.bw * 1e3

    def prefill_ms(self, tokens: float) -> float:
        """Least time of ``tokens`` prefill tokens at ``prefill_flops``."""
        return tokens * self.flop_per_token / self.prefill_flops * 1e3


def load_trace(path: str) -> list[dict]:
    """The records of a trace file in forward order (a torn last line, from a killed server, is skipped).

    Raises:
        ValueError: the file holds no record.
    """
    recs = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                recs.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    if not recs:
        raise ValueError(f"{path}: no step-trace records (was SGLANG_STEP_TRACE set in the server's environment?)")
    return sorted(recs, key=lambda r: r["i"])


def _dur_ms(r: dict) -> float:
    """A step's duration: its device time, else (CPU) its host wait + processing."""
    return r["gpu"] if r.get("gpu") is not None else r.get("wait", 0.0) + r.get("proc", 0.0)


def _pct(xs: Sequence[float], q: float) -> float:
    if not xs:
        return 0.0
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * (len(s) - 1) + 0.5))]


def wall_s(recs: list[dict]) -> float:
    """Seconds from the first launch to the end of the last step (device clock when traced on CUDA)."""
    last = recs[-1]
    if all(r.get("gpu_t") is not None for r in (recs[0], last)):
        return (last["gpu_t"] + last["gpu"] - recs[0]["gpu_t"]) / 1e3
    return last["t_s"] - recs[0]["t_s"] + _dur_ms(last) / 1e3


def bin_label(bs: int) -> str:
    """The batch-size bin of ``bs`` as ``lo-hi`` (``lo+`` for the last)."""
    for lo, hi in zip(BS_BINS, BS_BINS[1:]):
        if lo <= bs < hi:
            return f"{lo}-{hi - 1}"
    return f"{BS_BINS[-1]}+"


def ideal_ms(r: dict, model: Model) -> float:
    """A step at its floor: a decode step reads the weights and its KV; a step with prefill tokens computes them at
    the prefill rate and its decode rows (mixed) add their KV reads (the weights ride the prefill's compute)."""
    if r["mode"] == "decode":
        return model.decode_floor_ms(r["kv_tok"])
    kv = r["kv_tok"] * model.kv_bytes_per_token / model.bw * 1e3
    return model.prefill_ms(r["pre_tok"]) + kv


def analyze(recs: list[dict], model: Model, graph_max_bs: int) -> dict:
    """The breakdown of one trace (see the module docstring); all times in seconds unless named ``_ms``."""
    wall = wall_s(recs)
    by_mode: dict = {}
    for r in recs:
        m = by_mode.setdefault(r["mode"], {"steps": 0, "busy_s": 0.0, "pre_tok": 0, "dec_tok": 0})
        m["steps"] += 1
        m["busy_s"] += _dur_ms(r) / 1e3
        m["pre_tok"] += r["pre_tok"]
        m["dec_tok"] += r["dec"]
    busy = sum(m["busy_s"] for m in by_mode.values())
    for m in by_mode.values():
        m["share_of_wall"] = m["busy_s"] / wall if wall > 0 else 0.0
    dec = [r for r in recs if r["mode"] == "decode"]
    hist: dict = {}
    for r in dec:
        h = hist.setdefault(bin_label(r["bs"]), {"steps": 0, "bs": [], "ms": [], "floor_ms": [], "eager": 0,
                                                 "tokens": 0})
        h["steps"] += 1
        h["bs"].append(r["bs"])
        h["ms"].append(_dur_ms(r))
        h["floor_ms"].append(model.decode_floor_ms(r["kv_tok"]))
        h["eager"] += not r["graph"]
        h["tokens"] += r["dec"]
    bins = []
    for label in sorted(hist, key=lambda s: int(s.split("-")[0].rstrip("+"))):
        h = hist[label]
        ms, fl = statistics.mean(h["ms"]), statistics.mean(h["floor_ms"])
        bins.append({"bin": label, "steps": h["steps"], "mean_bs": statistics.mean(h["bs"]), "mean_ms": ms,
                     "floor_ms": fl, "ratio": ms / fl if fl else 0.0, "eager": h["eager"], "tokens": h["tokens"],
                     "time_s": sum(h["ms"]) / 1e3})
    eager = [r for r in dec if not r["graph"]]
    above = [r for r in dec if r["bs"] > graph_max_bs]
    host = {}
    for mode in sorted(by_mode):
        rs = [r for r in recs if r["mode"] == mode]
        host[mode] = {k: {"median_ms": statistics.median([r.get(k, 0.0) for r in rs]),
                          "p90_ms": _pct([r.get(k, 0.0) for r in rs], 0.9)} for k in ("build", "wait", "proc")}
    host_bound = [r for r in recs if r.get("gpu") is not None and r["build"] + r.get("proc", 0.0) > r["gpu"]]
    last_waiting = max((k for k, r in enumerate(recs) if r["waiting"] > 0), default=-1)
    drain = None
    if last_waiting + 1 < len(recs):
        rest = recs[last_waiting + 1:]
        drain = {"start_s": rest[0]["t_s"] - recs[0]["t_s"], "span_s": wall_s(rest), "steps": len(rest),
                 "dec_tok": sum(r["dec"] for r in rest), "mean_bs": statistics.mean(r["bs"] for r in rest)}
    ideal = sum(ideal_ms(r, model) for r in recs) / 1e3
    return {
        "steps": len(recs), "wall_s": wall, "busy_s": busy, "idle_s": max(wall - busy, 0.0),
        "by_mode": by_mode, "prefill_share_of_wall": sum(by_mode.get(m, {}).get("busy_s", 0.0)
                                                         for m in ("extend", "mixed")) / wall if wall else 0.0,
        "decode_tokens": sum(r["dec"] for r in recs), "prefill_tokens": sum(r["pre_tok"] for r in recs),
        "decode_bins": bins, "eager_decode_steps": len(eager), "eager_decode_s": sum(_dur_ms(r) for r in eager) / 1e3,
        "above_graph_steps": len(above), "above_graph_s": sum(_dur_ms(r) for r in above) / 1e3,
        "max_decode_bs": max((r["bs"] for r in dec), default=0), "graph_max_bs": graph_max_bs,
        "host": host, "host_bound_steps": len(host_bound), "retractions": recs[-1]["retract"],
        "drain": drain, "ideal_s": ideal,
    }


def tokens_by(recs: list[dict], horizon_s: float) -> int:
    """Decode tokens of the steps launched in the first ``horizon_s`` seconds of the trace."""
    return sum(r["dec"] for r in recs if r["t_s"] - recs[0]["t_s"] <= horizon_s)


def compare(traces: dict[str, list[dict]]) -> dict:
    """Decode tokens by a common horizon (the shortest trace's span) per trace, and the ratio to the first."""
    horizon = min(r[-1]["t_s"] - r[0]["t_s"] for r in traces.values())
    toks = {k: tokens_by(v, horizon) for k, v in traces.items()}
    base = next(iter(toks.values()))
    return {"horizon_s": horizon, "rows": [{"label": k, "tokens": t, "tok_per_s": t / horizon if horizon else 0.0,
                                            "vs_first": t / base if base else 0.0} for k, t in toks.items()]}


def render(label: str, a: dict) -> str:
    """Markdown of one :func:`analyze` result."""
    out = [f"### {label}: {a['steps']} steps, wall {a['wall_s']:.1f} s, device busy {a['busy_s']:.1f} s, "
           f"idle {a['idle_s']:.1f} s; ideal {a['ideal_s']:.1f} s (floor per decode step, prefill at the set rate)",
           "", "| mode | steps | busy s | share of wall | prefill tokens | decode tokens |", "|---|---:|---:|---:|---:|---:|"]
    for mode, m in sorted(a["by_mode"].items()):
        out.append(f"| {mode} | {m['steps']} | {m['busy_s']:.1f} | {m['share_of_wall']:.1%} | {m['pre_tok']} | "
                   f"{m['dec_tok']} |")
    out += ["", f"Prefill share of wall (extend + mixed steps): {a['prefill_share_of_wall']:.1%}. Decode tokens "
            f"{a['decode_tokens']}, prefill tokens {a['prefill_tokens']}, retractions {a['retractions']}.",
            f"Eager decode steps: {a['eager_decode_steps']} ({a['eager_decode_s']:.1f} s); above the largest graph "
            f"({a['graph_max_bs']}): {a['above_graph_steps']} ({a['above_graph_s']:.1f} s); largest decode batch "
            f"{a['max_decode_bs']}. Host-bound steps (build + proc > device time): {a['host_bound_steps']}.", "",
            "| decode bs | steps | mean bs | mean ms | floor ms | ms / floor | eager | tokens | time s |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for b in a["decode_bins"]:
        out.append(f"| {b['bin']} | {b['steps']} | {b['mean_bs']:.1f} | {b['mean_ms']:.2f} | {b['floor_ms']:.2f} | "
                   f"{b['ratio']:.2f} | {b['eager']} | {b['tokens']} | {b['time_s']:.1f} |")
    out += ["", "| mode | build median / p90 ms | wait median / p90 ms | proc median / p90 ms |", "|---|---|---|---|"]
    for mode, h in a["host"].items():
        out.append(f"| {mode} | " + " | ".join(f"{h[k]['median_ms']:.2f} / {h[k]['p90_ms']:.2f}"
                                               for k in ("build", "wait", "proc")) + " |")
    d = a["drain"]
    if d:
        out += ["", f"Drain (nothing waiting from {d['start_s']:.1f} s): {d['span_s']:.1f} s, {d['steps']} steps, "
                f"mean batch {d['mean_bs']:.1f}, {d['dec_tok']} decode tokens."]
    return "\n".join(out)


def load_bench(path: str) -> Optional[dict]:
    """The last result line of a ``bench_serving --output-file`` file, None when absent or empty."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = [ln for ln in f if ln.strip()]
        return json.loads(lines[-1]) if lines else None
    except (OSError, json.JSONDecodeError):
        return None


def bench_text(b: Optional[dict]) -> str:
    """The client's numbers of one run: completed, output tok/s, duration, median E2E / TTFT / ITL."""
    if not b:
        return "bench: no result"
    return (f"completed {b.get('completed')} | out {b.get('output_throughput', 0.0):.0f} tok/s | dur "
            f"{b.get('duration', 0.0):.1f}s | med e2e {b.get('median_e2e_latency_ms', 0.0):.0f} ttft "
            f"{b.get('median_ttft_ms', 0.0):.1f} itl {b.get('median_itl_ms', 0.0):.2f} ms")


def summary_line(label: str, a: dict) -> str:
    """One line: the numbers the GPU script prints last."""
    dec = a["by_mode"].get("decode", {})
    return (f"{label}: wall {a['wall_s']:.1f}s | prefill {a['prefill_share_of_wall']:.0%} | decode "
            f"{dec.get('busy_s', 0.0):.1f}s/{dec.get('steps', 0)} steps | idle {a['idle_s']:.1f}s | eager "
            f"{a['eager_decode_steps']} (>{a['graph_max_bs']}: {a['above_graph_steps']}) | max bs {a['max_decode_bs']} | "
            f"retract {a['retractions']} | ideal {a['ideal_s']:.1f}s")


def main(argv: Optional[list[str]] = None) -> int:
    """CLI entry (see the module docstring); prints the markdown; returns 0."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trace", action="append", default=[], help="LABEL=PATH (repeat; the first is the baseline)")
    p.add_argument("--graph-max-bs", type=int, default=160, help="largest captured decode graph of the baseline")
    p.add_argument("--bw-tbs", type=float, default=3.0, help="copy bandwidth in TB/s for the decode floor")
    p.add_argument("--prefill-tflops", type=float, default=700.0)
    p.add_argument("--weight-gb", type=float, default=DEFAULT_WEIGHT_BYTES / 1e9)
    p.add_argument("--kv-bytes-per-token", type=float, default=DEFAULT_KV_BYTES_PER_TOKEN)
    p.add_argument("--bench", action="append", default=[], help="LABEL=PATH of a bench_serving --output-file")
    p.add_argument("--json", default=None, help="write the analysis here")
    p.add_argument("--md", default=None, help="write the markdown here")
    a = p.parse_args(argv)
    model = Model(weight_bytes=a.weight_gb * 1e9, kv_bytes_per_token=a.kv_bytes_per_token, bw=a.bw_tbs * 1e12,
                  prefill_flops=a.prefill_tflops * 1e12)
    traces: dict[str, list[dict]] = {}
    for spec in a.trace:
        label, sep, path = spec.partition("=")
        if not sep:
            p.error(f"--trace {spec!r}: use LABEL=PATH")
        try:
            traces[label] = load_trace(path)
        except (OSError, ValueError) as e:
            print(f"{label}: {e}", file=sys.stderr)
    if not traces and not a.bench:
        return 1
    results = {k: analyze(v, model, a.graph_max_bs) for k, v in traces.items()}
    md = [render(k, v) for k, v in results.items()]
    cmp = compare(traces) if len(traces) > 1 else None
    if cmp:
        md += ["", f"### Decode tokens over the common horizon ({cmp['horizon_s']:.1f} s)", "",
               "| trace | tokens | tok/s | vs first |", "|---|---:|---:|---:|"]
        md += [f"| {r['label']} | {r['tokens']} | {r['tok_per_s']:.0f} | {r['vs_first']:.3f} |" for r in cmp["rows"]]
    benches = {}
    for spec in a.bench:
        label, _, path = spec.partition("=")
        benches[label] = load_bench(path)
    md += ["", *[summary_line(k, v) for k, v in results.items()]]
    md += [f"{k}: {bench_text(v)}" for k, v in benches.items()]
    text = "\n".join(md)
    print(text)
    if a.md:
        with open(a.md, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump({"model": vars(model), "traces": results, "compare": cmp, "bench": benches}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
