"""The prefill target (8K prefill at >= 0.70 of the matmul rate; 0.67 when this was written): the extend/prefill attention kernel's tile configs at one
causal prefill of ``--tokens`` tokens (Llama-3.1-8B heads: 32 query heads, 8 KV heads, head_dim 128, bf16), against
PyTorch's scaled_dot_product_attention (causal, K/V heads repeated) as the same-run reference.

Per config (BLOCK_M, BLOCK_N, num_warps, num_stages) it reports the median of ``--reps`` CUDA-event timings after a
warm-up (compile included in the warm-up), the attention TFLOP/s (causal: ``2 * 2 * T^2 / 2 * heads * head_dim``),
and the max abs error vs SDPA (a config that is wrong is marked, never picked). The default config of
``sgl_kernel.triton.extend_attention.extend_config`` for this GPU's arch is the first row (passed explicitly
through ``extend_attention_fwd(config=...)``, as every other row).

Usage (repo root, one GPU): ``python benchmark/attention/extend_configs.py [--tokens 8192] [--out DIR]``
``--record-dir DIR`` also writes a :mod:`benchmark.common.records` record (``what`` = ``extend_configs``) under
``DIR/attention/`` (:func:`extend_configs_record`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[2]
for _p in (REPO / "python", REPO / "sgl-kernel" / "python", REPO):  # REPO: the benchmark package as a file
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

import torch  # noqa: E402

CONFIGS = [None, (128, 64, 8, 2), (128, 128, 8, 2), (128, 128, 8, 4), (128, 64, 8, 3), (64, 64, 4, 2)]


def timed_ms(fn, reps: int) -> float:
    """Median CUDA-event time of ``fn()`` in ms over ``reps`` runs after two warm-ups."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def main(argv=None) -> int:
    """Time every config of :data:`CONFIGS` and SDPA; print a table, write ``extend_configs.{md,json}``."""
    import sgl_kernel.triton.extend_attention as ea

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out", default=None)
    from benchmark.common.records import add_record_dir_argument
    add_record_dir_argument(p, "attention")
    cfg = p.parse_args(argv)
    t, nh, nkv, hd, dev = cfg.tokens, 32, 8, 128, torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(t, nh, hd, device=dev, dtype=torch.bfloat16, generator=gen)
    kb = torch.randn(t + 8, nkv, hd, device=dev, dtype=torch.bfloat16, generator=gen)
    vb = torch.randn(t + 8, nkv, hd, device=dev, dtype=torch.bfloat16, generator=gen)
    r2t = torch.arange(8, t + 8, device=dev, dtype=torch.int32).view(1, t)  # slots 8.. (0..7 unused)
    i64 = dict(device=dev, dtype=torch.int64)
    rows, prefix, ext, start = (torch.zeros(1, **i64), torch.zeros(1, **i64), torch.full((1,), t, **i64),
                                torch.zeros(1, **i64))
    out = torch.empty_like(q)
    scale = hd ** -0.5
    qs, ks, vs = (x.transpose(0, 1).unsqueeze(0) for x in (q, kb[8:].repeat_interleave(nh // nkv, 1),
                                                            vb[8:].repeat_interleave(nh // nkv, 1)))
    sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale)  # noqa
    ref = sdpa()[0].transpose(0, 1)
    flops = 2 * 2 * t * t / 2 * nh * hd
    results = [{"config": "torch SDPA (causal, repeated KV heads)", "ms": timed_ms(sdpa, cfg.reps), "err": 0.0}]
    default = ea.extend_config(hd, torch.cuda.get_device_capability(0))
    for c in CONFIGS:
        name = f"{default} (default, this arch)" if c is None else str(c)
        run = lambda c=c: ea.extend_attention_fwd(q, out, kb, vb, r2t, rows, prefix, ext, start, t, scale,  # noqa
                                                  config=c)
        try:
            out.fill_(float("nan"))
            ms = timed_ms(run, cfg.reps)
            err = float((out.float() - ref.float()).abs().max())
            results.append({"config": name, "ms": ms, "err": err})
        except Exception as e:  # e.g. out of shared memory for a large tile
            results.append({"config": name, "ms": None, "err": None, "error": f"{type(e).__name__}: {e}"[:160]})
    # radix-cache hit: the first half of the same keys is a cached prefix, the second half is new (unmasked prefix
    # tiles); its output must equal the last half of SDPA's rows; it does 3/4 of the full prefill's work
    half = t // 2
    q2, out2 = q[half:].contiguous(), torch.empty_like(q[half:])
    pre2, ext2 = torch.full((1,), half, **i64), torch.full((1,), t - half, **i64)
    run2 = lambda: ea.extend_attention_fwd(q2, out2, kb, vb, r2t, rows, pre2, ext2, start, t - half, scale)  # noqa
    try:
        out2.fill_(float("nan"))
        ms = timed_ms(run2, cfg.reps)
        results.append({"config": f"{default} (default), {half} cached prefix + {t - half} new", "ms": ms,
                        "err": float((out2.float() - ref[half:].float()).abs().max()), "flop_scale": 0.75})
    except Exception as e:
        results.append({"config": "default with a cached prefix", "ms": None, "err": None,
                        "error": f"{type(e).__name__}: {e}"[:160]})
    lines = [f"Extend attention, one causal prefill of {t} tokens, 32/8 heads, head_dim 128, bf16, "
             f"{torch.cuda.get_device_name(0)}", "",
             "| config (BLOCK_M, BLOCK_N, warps, stages) | ms | TFLOP/s | max abs err vs SDPA |",
             "|---|---:|---:|---:|"]
    for r in results:
        if r["ms"] is None:
            lines.append(f"| {r['config']} | n/a | n/a | {r['error']} |")
        else:
            bad = "" if r["err"] <= 0.05 else " (WRONG)"  # NaN (rows left unwritten) is wrong too
            tflops = flops * r.get("flop_scale", 1.0) / r["ms"] / 1e9
            lines.append(f"| {r['config']} | {r['ms']:.2f} | {tflops:.0f} | {r['err']:.4f}{bad} |")
    text = "\n".join(lines) + "\n"
    sys.stdout.write(text)
    if cfg.out:
        Path(cfg.out).mkdir(parents=True, exist_ok=True)
        (Path(cfg.out) / "extend_configs.md").write_text(text)
        (Path(cfg.out) / "extend_configs.json").write_text(json.dumps(results, indent=1))
    if cfg.record_dir:
        from benchmark.common import records

        js, _ = records.write_record(extend_configs_record(results, cfg, torch.cuda.get_device_name(0)),
                                     Path(cfg.record_dir))
        sys.stdout.write(f"record: {js}\n")
    return 0


def extend_configs_record(results: list[dict], cfg, device_name: str = "", env: Optional[dict] = None) -> dict:
    """The ``results`` :func:`main` collected (SDPA first, then each config, then the cached-prefix case) as a
    :mod:`benchmark.common.records` record. A row per case: ms, causal TFLOP/s (the cached-prefix case counts its
    3/4 of the work), the same-run SDPA baseline ``sdpa_tflops`` and ``of_sdpa`` (TFLOP/s / SDPA's: above 1 = faster
    than SDPA), the error and whether it is within 0.05; a failed config keeps its error text. No physical floor:
    this benchmark measures none. Headline: the default config against SDPA, and the fastest correct config."""
    from benchmark.common import records

    t = cfg.tokens
    flops = 2 * 2 * t * t / 2 * 32 * 128
    sdpa = next((r for r in results if r["config"].startswith("torch SDPA") and r["ms"] is not None), None)
    sdpa_tflops = round(flops / sdpa["ms"] / 1e9, 2) if sdpa else None
    rows = []
    for r in results:
        row = {"config": r["config"], "ms": None if r["ms"] is None else round(r["ms"], 4), "tflops": None,
               "sdpa_tflops": sdpa_tflops, "max_abs_err": r["err"]}
        if r["ms"] is not None:
            row["tflops"] = round(flops * r.get("flop_scale", 1.0) / r["ms"] / 1e9, 2)
            row["correct"] = r["err"] <= 0.05
        if r.get("error"):
            row["error"] = r["error"]
        rows.append(row)
    rows = records.add_ratio(rows, "of_sdpa", "tflops", "sdpa_tflops")
    headline = []
    dflt = next((r for r in rows if "(default, this arch)" in r["config"] and r["tflops"] is not None), None)
    if dflt is not None:
        headline.append({"label": f"Triton extend attention default config, {t}-token causal prefill, vs torch SDPA",
                         "value": dflt["tflops"], "unit": "TFLOP/s", "baseline": sdpa_tflops,
                         "ratio": dflt["of_sdpa"]})
    ok = [r for r in rows
          if r.get("correct") and not r["config"].startswith("torch SDPA") and "cached" not in r["config"]]
    if ok:
        best = max(ok, key=lambda r: r["tflops"])
        headline.append({"label": f"fastest correct extend attention config {best['config']}, {t}-token prefill, "
                                  "vs torch SDPA", "value": best["tflops"], "unit": "TFLOP/s",
                         "baseline": sdpa_tflops, "ratio": best["of_sdpa"]})
    return records.make_record(
        subject="attention", benchmark="benchmark.attention.extend_configs", mode="prefill", what="extend_configs",
        rows=rows, env=env,
        params={"tokens": t, "reps": cfg.reps, "q_heads": 32, "kv_heads": 8, "head_dim": 128, "dtype": "bfloat16",
                "device": device_name},
        baselines=["sdpa_tflops"] if sdpa_tflops is not None else [],
        units={"ms": "ms", "tflops": "TFLOP/s", "sdpa_tflops": "TFLOP/s", "max_abs_err": "abs"},
        notes=["TFLOP/s counts causal attention FLOPs, 2 * 2 * T^2 / 2 * heads * head_dim; the cached-prefix case "
               "does 3/4 of that work.", "correct: max abs error vs SDPA <= 0.05."],
        headline=headline, gpu_count=1)


if __name__ == "__main__":
    sys.exit(main())
