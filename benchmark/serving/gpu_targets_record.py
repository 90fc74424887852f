"""The :mod:`benchmark.common.records` record of ``benchmark/serving/bench_gpu_targets.py --record-dir``: one row per
measured target with its same-run floor, ratio and verdict (kept apart so the benchmark stays short)."""

from __future__ import annotations

from typing import Optional


def make_targets_record(res: dict, cfg, goals: dict, env: Optional[dict] = None) -> dict:
    """``res`` of :func:`bench_gpu_targets.run` as a :mod:`benchmark.common.records` record: one row per measured
    target (decode step per batch, prefill, attention per layout, serving) with its same-run floor, ``ratio`` (as the
    table's), target and whether it is met. Headline: the largest-batch decode step vs its floor, the prefill rate vs
    the matmul rate, the serving output throughput. ``goals``: ``{"decode": ..., "prefill": ..., "attention": ...}``,
    the benchmark's targets (passed in: this module does not import it)."""
    from benchmark.common import records

    parts = res["parts"]
    fl = parts.get("floors", {})
    bw, mm = fl.get("hbm_bytes_per_s"), fl.get("matmul_flops_per_s")
    rows = []
    for d in parts.get("decode", {}).get("batches", []):
        rows.append({"target": "decode step", "case": f"batch {d['batch']} x {d['context']} ctx",
                     "measured": d["median_step_s"] * 1e3,
                     "floor": None if d["floor_s"] is None else d["floor_s"] * 1e3,
                     "unit": "ms", "ratio": d["ratio"], "goal": f"<= {goals['decode']}"})
    p = parts.get("prefill", {})
    if "flops_per_s" in p:
        rows.append({"target": "prefill", "case": f"{p['tokens']} tokens", "measured": p["flops_per_s"] / 1e12,
                     "floor": None if not mm else mm / 1e12, "unit": "TFLOP/s", "ratio": p["ratio"],
                     "goal": f">= {goals['prefill']}"})
    for a in parts.get("attention", {}).get("layouts", []):
        rows.append({"target": "Triton decode attention", "case": f"{cfg.attn_batch}x{cfg.attn_context}, {a['name']}",
                     "measured": a["kv_bytes_per_s"] / 1e9, "floor": None if not bw else bw / 1e9, "unit": "GB/s",
                     "ratio": a["kv_bytes_per_s"] / bw if bw else None, "goal": f">= {goals['attention']}"})
    s = parts.get("serving", {})
    if "output_throughput" in s:
        rows.append({"target": "bench_serving output", "case": f"random {cfg.serving_input_len}/"
                     f"{cfg.serving_output_len} @ {cfg.serving_concurrency}", "measured": s["output_throughput"],
                     "floor": None, "unit": "tok/s", "ratio": None, "goal": "report",
                     **{k: s.get(k) for k in ("mean_ttft_ms", "p99_ttft_ms", "mean_itl_ms", "p99_itl_ms")}})
    for r in rows:
        op, _, tgt = r["goal"].partition(" ")
        r["met"] = None if r["ratio"] is None or not tgt else (r["ratio"] <= float(tgt) if op == "<="
                                                                else r["ratio"] >= float(tgt))
    headline = []
    dec = [r for r in rows if r["target"] == "decode step"]
    if dec:
        d = dec[-1]
        headline.append({"label": f"decode step vs memory floor, {d['case']}", "value": d["measured"],
                         "unit": "ms", "baseline": None if d["floor"] is None else d["floor"],
                         "ratio": None if d["ratio"] is None else round(d["ratio"], 3)})
    pre = next((r for r in rows if r["target"] == "prefill"), None)
    if pre is not None:
        headline.append({"label": f"prefill {pre['case']} vs the matmul rate", "value": pre["measured"],
                         "unit": "TFLOP/s", "baseline": None if pre["floor"] is None else pre["floor"],
                         "ratio": None if pre["ratio"] is None else round(pre["ratio"], 3)})
    srv = next((r for r in rows if r["target"] == "bench_serving output"), None)
    if srv is not None:
        headline.append({"label": f"serving output throughput, {srv['case']}", "value": srv["measured"],
                         "unit": "tok/s", "baseline": None, "ratio": None})
    return records.make_record(
        subject="serving", benchmark="benchmark.serving.bench_gpu_targets", mode="+".join(cfg.parts) or "none",
        what="gpu_targets", rows=rows, env=env, command=res.get("command"),
        gpu_count=0 if cfg.device == "cpu" else 1,
        params={"model_path": cfg.model_path, "device": cfg.device, "dtype": cfg.dtype,
                "decode_batches": list(cfg.decode_batches), "decode_context": cfg.decode_context,
                "prefill_tokens": cfg.prefill_tokens, "hbm_bytes_per_s": bw, "matmul_flops_per_s": mm},
        units={"mean_ttft_ms": "ms", "p99_ttft_ms": "ms", "mean_itl_ms": "ms", "p99_itl_ms": "ms"},
        floor={"column": "floor", "what": "decode: (weight + KV bytes read) / HBM copy bandwidth; prefill: the "
                                          f"{cfg.dtype} {cfg.matmul_n}^3 matmul rate; attention: the HBM copy "
                                          "bandwidth; all measured in this run (units per row in 'unit')"},
        headline=headline,
        notes=[f"{n} failed: {v.get('error')}" for n, v in parts.items() if v.get("status") == "error"])

