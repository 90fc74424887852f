"""Decode GEMMs of a model config, cuBLAS vs the best skinny config per (shape, M), against copy bandwidth.

Runs the same measurement the CUDA-graph runner runs with ``SGLANG_DECODE_GEMM_AUTOTUNE=1``
(:func:`sglang.srt.layers.decode_gemm.autotune`: CUDA events, warm-up, median of reps, cycling several copies of each
weight so none sits in L2) on random bf16 weights of the model's linear shapes (qkv, o_proj, gate_up, down,
lm_head), and prints per (shape, M): cuBLAS and best-skinny microseconds per call, their fraction of the
device-to-device copy bandwidth measured first in this process (bytes = weight + x + y), the table's choice, and the
estimated GEMM time per decode step (projections x num_hidden_layers, LM head once) for cuBLAS only vs the table.
Writes ``<out>/decode_gemm_tune.md``; with ``--record-dir DIR`` also the project's JSON record + markdown under
``DIR/decode/`` (:func:`tune_record`).

With ``--ab-off DIR --ab-on DIR`` (no GPU) it instead appends the served-step A/B of two
``benchmark/decode/step_ab.py --serving`` runs (autotune off / on) to ``<out>/decode_gemm_tune.md`` (``--record-dir``:
the record of :func:`ab_record`).

Usage (repo root, one GPU)::

    python benchmark/decode/gemm_tune.py --out /tmp/out [--model-path CFG_DIR] [--batches 1,8,16,32,64,128]
    python benchmark/decode/gemm_tune.py --out /tmp/out --ab-off /tmp/out/off --ab-on /tmp/out/on
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
for _path in (REPO / "python", REPO / "sgl-kernel" / "python", REPO):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))
del _path

import torch  # noqa: E402

DATA = REPO.parent / "shared" / "data"


def linear_shapes(cfg: dict) -> dict:
    """``name -> (N, K, calls per decode step)`` of a Llama-style config.json dict's linears and LM head (tp 1)."""
    h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    kv, hd = cfg.get("num_key_value_heads", heads), cfg.get("head_dim") or cfg["hidden_size"] // heads
    inter, layers = cfg["intermediate_size"], cfg["num_hidden_layers"]
    return {"qkv": ((heads + 2 * kv) * hd, h, layers), "o_proj": (h, heads * hd, layers),
            "gate_up": (2 * inter, h, layers), "down": (h, inter, layers), "lm_head": (cfg["vocab_size"], h, 1)}


def measure(shapes: dict, batches: list, bw: float, seed: int = 0):
    """Autotune over random weight copies of ``shapes`` (>= 512 MiB per shape, 2..8 copies); returns
    ``(table, name_of_shape)``."""
    from sglang.srt.layers import decode_gemm

    gen = torch.Generator(device="cuda").manual_seed(seed)
    weights, names = {}, {}
    for name, (n, k, _calls) in shapes.items():
        copies = min(8, max(2, math.ceil(512 * 2**20 / (n * k * 2))))
        key = (n, k, "bfloat16")
        weights[key] = [torch.randn(n, k, device="cuda", generator=gen).to(torch.bfloat16) / k ** 0.5
                        for _ in range(copies)]
        names[key] = (name, _calls)
    table = decode_gemm.autotune(weights, batches, "cuda", seed=seed)
    del weights
    return table, names


def render(table, names: dict, bw: float, head: list) -> str:
    """Markdown: per (shape, M) rows, then the per-step GEMM estimate per M."""
    out = head + ["| shape (N x K) | M | cuBLAS us | of copy bw | best skinny us | of copy bw | config | chosen |"
                  " speed-up |", "|---|---:|---:|---:|---:|---:|---|---|---:|"]
    per_m = {}
    for (n, k, _dt), choices in table.entries:
        for c in choices:
            nbytes = 2 * (n * k + c.m_max * (n + k))
            frac = lambda us: nbytes / (us * 1e-6) / bw  # noqa: E731
            chosen_us = c.skinny_us if c.config is not None else c.cublas_us
            sk = (f"{c.skinny_us:.1f} | {frac(c.skinny_us):.2f} | {c.skinny_config}" if c.skinny_us is not None
                  else "- | - | -")
            name, calls = names.get((n, k, _dt), ("?", 1))
            out.append(f"| {name} ({n} x {k}) | {c.m_max} | {c.cublas_us:.1f} | "
                       f"{frac(c.cublas_us):.2f} | {sk} | {'skinny' if c.config is not None else 'cuBLAS'} | "
                       f"{c.cublas_us / chosen_us:.2f} |")
            acc = per_m.setdefault(c.m_max, [0.0, 0.0, 0.0])
            acc[0] += c.cublas_us * calls
            acc[1] += chosen_us * calls
            acc[2] += nbytes / bw * 1e6 * calls
    out += ["", "Per decode step (each shape x its calls per step: the layer projections x num_hidden_layers, the LM "
            "head once):", "",
            "| M | cuBLAS ms | autotuned ms | copy-bw floor ms | cuBLAS / floor | autotuned / floor |",
            "|---:|---:|---:|---:|---:|---:|"]
    for m, (cub, tuned, floor) in sorted(per_m.items()):
        out.append(f"| {m} | {cub / 1e3:.3f} | {tuned / 1e3:.3f} | {floor / 1e3:.3f} | {cub / floor:.3f} | "
                   f"{tuned / floor:.3f} |")
    return "\n".join(out) + "\n"


def tune_record(table, names: dict, bw: float, params: dict, env=None, command=None) -> dict:
    """``--record-dir``: the autotune table as a :mod:`benchmark.common.records` record (subject decode, mode
    ``gemm-tune``, ``what`` = ``decode_gemm_tune``), the same numbers as :func:`render`. One row per (shape, M): cuBLAS
    microseconds per call (the same-run baseline ``cublas_us``), the best skinny config's, the table's choice and its
    time (``chosen_us``), ``speedup`` = cuBLAS / chosen, and the copy-bandwidth floor ``floor_us`` (weight + x + y bytes
    / the device-to-device copy bandwidth ``bw`` measured first) with ``cublas_over_floor`` and ``chosen_over_floor``;
    then one row per M for the whole decode step (each shape x its calls per step). Headline: at the largest M, the
    step's GEMM time autotuned vs cuBLAS only, and autotuned vs the floor."""
    from benchmark.common import records

    rows, per_m = [], {}
    for (n, k, dt), choices in table.entries:
        name, calls = names.get((n, k, dt), ("?", 1))
        for c in choices:
            nbytes = 2 * (n * k + c.m_max * (n + k))
            chosen = c.skinny_us if c.config is not None else c.cublas_us
            rows.append({"shape": name, "n": n, "k": k, "m": c.m_max, "calls_per_step": calls,
                         "cublas_us": c.cublas_us, "skinny_us": c.skinny_us,
                         "skinny_config": None if c.skinny_config is None else str(c.skinny_config),
                         "chosen": "skinny" if c.config is not None else "cuBLAS", "chosen_us": chosen,
                         "floor_us": nbytes / bw * 1e6})
            acc = per_m.setdefault(c.m_max, [0.0, 0.0, 0.0])
            acc[0] += c.cublas_us * calls
            acc[1] += chosen * calls
            acc[2] += nbytes / bw * 1e6 * calls
    rows += [{"shape": "decode step (all GEMMs)", "m": m, "cublas_us": cub, "chosen": "table", "chosen_us": tuned,
              "floor_us": floor} for m, (cub, tuned, floor) in sorted(per_m.items())]
    rows = records.add_ratio(rows, "speedup", "cublas_us", "chosen_us")
    rows = records.add_ratio(records.add_ratio(rows, "cublas_over_floor", "cublas_us", "floor_us"),
                             "chosen_over_floor", "chosen_us", "floor_us")
    steps = [r for r in rows if r["shape"] == "decode step (all GEMMs)"]
    headline = []
    if steps:
        big = steps[-1]
        headline = [{"label": f"decode-step GEMM time, M={big['m']}, autotuned table vs cuBLAS only",
                     "value": round(big["chosen_us"] / 1e3, 4), "unit": "ms",
                     "baseline": round(big["cublas_us"] / 1e3, 4), "ratio": big["speedup"]},
                    {"label": f"decode-step GEMM time, M={big['m']}, autotuned table vs copy-bandwidth floor",
                     "value": round(big["chosen_us"] / 1e3, 4), "unit": "ms",
                     "baseline": round(big["floor_us"] / 1e3, 4), "ratio": big["chosen_over_floor"]}]
    return records.make_record(
        subject="decode", benchmark="benchmark.decode.bench", mode="gemm-tune", what="decode_gemm_tune", rows=rows,
        params=dict(params, copy_bytes_per_s=bw, tune_s=table.tune_s, device_name=table.device_name),
        baselines=["cublas_us"] if rows else [],
        units={k: "us" for k in ("cublas_us", "skinny_us", "chosen_us", "floor_us")},
        floor={"column": "floor_us", "what": "(weight + x + y bytes) / device-to-device copy bandwidth measured first "
                                             "in this process"},
        headline=headline, notes=["speedup = cuBLAS / chosen (> 1: the table beats cuBLAS alone)."],
        gpu_count=1, env=env, command=command)


def ab_rows(off_dir: Path, on_dir: Path) -> list[dict]:
    """The rows of two ``decode_step_ab.json`` (autotune off / on), sorted by (batch, row): graph replay, harness step
    and served step (per serving mode), each with ``off_ms`` / ``on_ms`` and the floor each run measured
    (``off_floor_ms`` / ``on_floor_ms``); None for a side that lacks the row."""
    res = {}
    for tag, d in (("off", off_dir), ("on", on_dir)):
        f = Path(d) / "decode_step_ab.json"
        res[tag] = json.loads(f.read_text()) if f.exists() else {}
    rows = {}
    for tag, r in res.items():
        for d in r.get("decode", []):
            rows.setdefault((d["batch"], "graph replay"), {})[tag] = (d["replay_ms"], d["floor_ms"])
            rows.setdefault((d["batch"], "harness step"), {})[tag] = (d["step_ms"], d["floor_ms"])
        for s in r.get("serving", []):
            rows.setdefault((s["batch"], f"served step ({s['mode']})"), {})[tag] = (s["step_ms"], s["floor_ms"])
    return [{"batch": bs, "row": name, "off_ms": v.get("off", (None,))[0], "on_ms": v.get("on", (None,))[0],
             "off_floor_ms": v.get("off", (None, None))[1], "on_floor_ms": v.get("on", (None, None))[1]}
            for (bs, name), v in sorted(rows.items())]


def render_ab(off_dir: Path, on_dir: Path) -> str:
    """Markdown A/B of two ``decode_step_ab.json`` (autotune off / on): graph replay, harness step, served step."""
    out = ["", "## Decode step, decode-GEMM autotune off vs on (two benchmark/decode/step_ab.py processes, same call)", "",
           "| batch | row | off (ms) | on (ms) | off / floor | on / floor | on / off |", "|---:|---|---:|---:|---:|---:|---:|"]
    for r in ab_rows(off_dir, on_dir):
        bs, name = r["batch"], r["row"]
        if r["off_ms"] is not None and r["on_ms"] is not None:
            (a, fa), (b, fb) = (r["off_ms"], r["off_floor_ms"]), (r["on_ms"], r["on_floor_ms"])
            out.append(f"| {bs} | {name} | {a:.3f} | {b:.3f} | {a / fa:.3f} | {b / fb:.3f} | {b / a:.3f} |")
        else:
            cell = {t: f"{r[t + '_ms']:.3f}" if r[t + "_ms"] is not None else "missing" for t in ("off", "on")}
            out.append(f"| {bs} | {name} | {cell['off']} | {cell['on']} | | | |")
    return "\n".join(out) + "\n"


def ab_record(rows: list, params: dict, env=None, command=None) -> dict:
    """``--record-dir`` with ``--ab-off/--ab-on``: :func:`ab_rows` as a :mod:`benchmark.common.records` record (subject
    decode, mode ``gemm-tune-ab``, ``what`` = ``decode_gemm_tune_ab``): autotune off is the baseline (``off_ms``),
    ``on_vs_off`` = on / off (< 1: the autotuned GEMMs are faster), each side over the memory floor its run measured.
    Headline: at the largest batch, the served step (the first serving mode; else the harness step) on vs off."""
    from benchmark.common import records

    rows = records.add_ratio(rows, "on_vs_off", "on_ms", "off_ms")
    rows = records.add_ratio(records.add_ratio(rows, "off_over_floor", "off_ms", "off_floor_ms"), "on_over_floor",
                             "on_ms", "on_floor_ms")
    done = [r for r in rows if r["on_vs_off"] is not None]
    headline = []
    if done:
        big = max(r["batch"] for r in done)
        at = [r for r in done if r["batch"] == big]
        r = next((r for r in at if r["row"].startswith("served step")), None) or next(
            (r for r in at if r["row"] == "harness step"), at[0])
        headline.append({"label": f"decode {r['row']}, batch {big}, decode-GEMM autotune on vs off",
                         "value": round(r["on_ms"], 4), "unit": "ms", "baseline": round(r["off_ms"], 4),
                         "ratio": r["on_vs_off"]})
    return records.make_record(
        subject="decode", benchmark="benchmark.decode.bench", mode="gemm-tune-ab", what="decode_gemm_tune_ab",
        rows=rows, params=params, baselines=["off_ms"] if rows else [],
        units={k: "ms" for k in ("off_ms", "on_ms", "off_floor_ms", "on_floor_ms")},
        floor={"column": "on_floor_ms", "what": "(weight bytes + KV bytes read per step) / device-to-device copy "
                                                "bandwidth, measured by each step_ab.py run (off_floor_ms, on_floor_ms)"},
        headline=headline, notes=["Two benchmark/decode/step_ab.py processes (autotune off / on) of the same call."],
        gpu_count=1, env=env, command=command)


def main(argv=None) -> int:
    """CLI entry (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="/tmp/out")
    p.add_argument("--model-path", default=str(DATA / "configs" / "meta-llama--Meta-Llama-3.1-8B"))
    p.add_argument("--batches", default="1,8,16,32,64,128")
    p.add_argument("--ab-off", default=None)
    p.add_argument("--ab-on", default=None)
    from benchmark.common.records import add_record_dir_argument
    add_record_dir_argument(p, "decode")
    ns = p.parse_args(argv)
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    md = out / "decode_gemm_tune.md"
    if ns.ab_off or ns.ab_on:
        if not (ns.ab_off and ns.ab_on):
            raise SystemExit("--ab-off and --ab-on go together")
        with md.open("a") as f:
            f.write(render_ab(Path(ns.ab_off), Path(ns.ab_on)))
        sys.stdout.write(md.read_text())
        if ns.record_dir:
            from benchmark.common.records import write_record

            rec = ab_record(ab_rows(Path(ns.ab_off), Path(ns.ab_on)), {"ab_off": ns.ab_off, "ab_on": ns.ab_on})
            sys.stdout.write(f"record: {write_record(rec, Path(ns.record_dir))[0]}\n")
        return 0
    batches = [int(b) for b in ns.batches.split(",") if b.strip()]
    if not batches or any(not 1 <= b <= 128 for b in batches) or batches != sorted(set(batches)):
        raise SystemExit(f"--batches {ns.batches}: need ascending distinct values in 1..128")
    cfg = json.loads((Path(ns.model_path) / "config.json").read_text())
    from benchmark.attention.bench_triton_attention import hbm_bandwidth

    bw = hbm_bandwidth(2.0)
    table, names = measure(linear_shapes(cfg), batches, bw)
    head = [f"# Decode GEMMs: cuBLAS vs the autotuned skinny GEMM "
            f"({datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}, {table.device_name})",
            "", f"Command: `python benchmark/decode/gemm_tune.py {' '.join(sys.argv[1:] if argv is None else argv)}`",
            f"Model config {Path(ns.model_path).name}, bf16; copy bandwidth {bw / 1e12:.3f} TB/s (same process); "
            f"autotune (all shapes x buckets, compile included) {table.tune_s:.1f} s; times are medians of CUDA-event "
            "passes over distinct weight copies (us per call).", ""]
    md.write_text(render(table, names, bw, head))
    sys.stdout.write(md.read_text())
    if ns.record_dir:
        from benchmark.common.records import write_record

        rec = tune_record(table, names, bw, {"model_path": ns.model_path, "batches": batches})
        sys.stdout.write(f"record: {write_record(rec, Path(ns.record_dir))[0]}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
