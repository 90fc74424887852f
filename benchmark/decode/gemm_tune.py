"""Decode GEMMs of a model config, cuBLAS vs the best skinny config per (shape, M), against copy bandwidth.

Runs the same measurement the CUDA-graph runner runs with ``SGLANG_DECODE_GEMM_AUTOTUNE=1``
(:func:`sglang.srt.layers.decode_gemm.autotune`: CUDA events, warm-up, median of reps, cycling several copies of each
weight so none sits in L2) on random bf16 weights of the model's linear shapes (qkv, o_proj, gate_up, down,
lm_head), and prints per (shape, M): cuBLAS and best-skinny microseconds per call, their fraction of the
device-to-device copy bandwidth measured first in this process (bytes = weight + x + y), the table's choice, and the
estimated GEMM time per decode step (projections x num_hidden_layers, LM head once) for cuBLAS only vs the table.
Writes ``<out>/decode_gemm_tune.md``.

With ``--ab-off DIR --ab-on DIR`` (no GPU) it instead appends the served-step A/B of two
``benchmark/decode/step_ab.py --serving`` runs (autotune off / on) to ``<out>/decode_gemm_tune.md``.

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


def render_ab(off_dir: Path, on_dir: Path) -> str:
    """Markdown A/B of two ``decode_step_ab.json`` (autotune off / on): graph replay, harness step, served step."""
    res = {}
    for tag, d in (("off", off_dir), ("on", on_dir)):
        f = Path(d) / "decode_step_ab.json"
        res[tag] = json.loads(f.read_text()) if f.exists() else {}
    out = ["", "## Decode step, decode-GEMM autotune off vs on (two benchmark/decode/step_ab.py processes, same call)", "",
           "| batch | row | off (ms) | on (ms) | off / floor | on / floor | on / off |", "|---:|---|---:|---:|---:|---:|---:|"]
    rows = {}
    for tag, r in res.items():
        for d in r.get("decode", []):
            rows.setdefault((d["batch"], "graph replay"), {})[tag] = (d["replay_ms"], d["floor_ms"])
            rows.setdefault((d["batch"], "harness step"), {})[tag] = (d["step_ms"], d["floor_ms"])
        for s in r.get("serving", []):
            rows.setdefault((s["batch"], f"served step ({s['mode']})"), {})[tag] = (s["step_ms"], s["floor_ms"])
    for (bs, name), v in sorted(rows.items()):
        if "off" in v and "on" in v:
            (a, fa), (b, fb) = v["off"], v["on"]
            out.append(f"| {bs} | {name} | {a:.3f} | {b:.3f} | {a / fa:.3f} | {b / fb:.3f} | {b / a:.3f} |")
        else:
            cell = {t: f"{v[t][0]:.3f}" if t in v else "missing" for t in ("off", "on")}
            out.append(f"| {bs} | {name} | {cell['off']} | {cell['on']} | | | |")
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    """CLI entry (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="/tmp/out")
    p.add_argument("--model-path", default=str(DATA / "configs" / "meta-llama--Meta-Llama-3.1-8B"))
    p.add_argument("--batches", default="1,8,16,32,64,128")
    p.add_argument("--ab-off", default=None)
    p.add_argument("--ab-on", default=None)
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
