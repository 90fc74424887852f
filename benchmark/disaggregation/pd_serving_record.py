"""The :mod:`benchmark.common.records` record of ``benchmark/disaggregation/bench_pd_serving.py --record-dir``: one row
per (dataset, setup), the same-run aggregated setup as the baseline (kept apart so the benchmark stays short)."""

from __future__ import annotations


def write_pd_record(a, results: dict, xfer: dict, errors: dict, metrics, setups) -> None:
    """Write :func:`make_pd_record` under ``a.record_dir`` and print its path."""
    from benchmark.common import records

    js, _ = records.write_record(make_pd_record(a, results, xfer, errors, metrics, setups), a.record_dir)
    print(f"[bench_pd_serving] record: {js}", flush=True)


def make_pd_record(a, results: dict, xfer: dict, errors: dict, metrics, setups, env: dict | None = None) -> dict:
    """The measured setups as a :mod:`benchmark.common.records` record: one row per (dataset, setup) with the
    ``bench_serving`` metrics, the same-run aggregated baseline's throughput and mean TTFT (``agg2`` when measured,
    else ``agg``; its name in ``base``) and the ratios to them, and the pd rows' KV transfer share of TTFT. Headline:
    the first dataset's pd output throughput and mean TTFT against that baseline, and the transfer share. ``metrics``
    and ``setups``: the benchmark's ``METRICS`` and ``SETUPS`` (passed in: this module does not import it)."""
    from benchmark.common import records

    rows = []
    for ds in a.dataset:
        res = results.get(ds, {})
        base = "agg2" if "agg2" in res else ("agg" if "agg" in res else None)
        for s in (x for x in setups if x in res):
            r = {"dataset": ds, "setup": s, **{m: res[s].get(m) for m in metrics}, "base": base,
                 "base_output_throughput": res[base].get("output_throughput") if base else None,
                 "base_mean_ttft_ms": res[base].get("mean_ttft_ms") if base else None}
            if s == "pd" and xfer.get(ds):
                r["kv_share_of_ttft"] = xfer[ds].get("share_of_ttft")
                r["kv_reads_per_request"] = xfer[ds].get("reads_per_request")
            rows.append(r)
    rows = records.add_ratio(rows, "throughput_vs_base", "output_throughput", "base_output_throughput")
    rows = records.add_ratio(rows, "ttft_vs_base", "mean_ttft_ms", "base_mean_ttft_ms")
    headline = []
    pd = next((r for r in rows if r["setup"] == "pd"), None)
    if pd is not None and pd["base"]:
        tag = f"{pd['dataset']}, {a.transfer_backend} {a.transfer_mode}, vs {pd['base']}"
        headline += [{"label": f"PD output throughput ({tag})", "value": pd["output_throughput"], "unit": "tok/s",
                      "baseline": pd["base_output_throughput"], "ratio": pd["throughput_vs_base"]},
                     {"label": f"PD mean TTFT ({tag})", "value": pd["mean_ttft_ms"], "unit": "ms",
                      "baseline": pd["base_mean_ttft_ms"], "ratio": pd["ttft_vs_base"]}]
    if pd is not None and pd.get("kv_share_of_ttft") is not None:
        headline.append({"label": f"KV transfer share of PD mean TTFT ({pd['dataset']})",
                         "value": round(pd["kv_share_of_ttft"], 4), "unit": None, "baseline": None, "ratio": None})
    units = {m: "ms" for m in metrics if m.endswith("_ms")}
    units.update(output_throughput="tok/s", request_throughput="req/s", base_output_throughput="tok/s",
                 base_mean_ttft_ms="ms")
    return records.make_record(
        subject="disaggregation", benchmark="benchmark.disaggregation.bench_pd_serving",
        mode=f"{'+'.join(dict.fromkeys(a.setups))}-{a.transfer_backend}-{a.transfer_mode}", what="pd_serving",
        rows=rows, env=env, baselines=("base_output_throughput", "base_mean_ttft_ms") if rows else (), units=units,
        params={"model_path": a.model_path, "device": a.device, "datasets": list(a.dataset),
                "num_prompts": a.num_prompts, "input_len": a.input_len, "output_len": a.output_len,
                "request_rate": a.request_rate, "max_concurrency": a.max_concurrency,
                "warmup_seconds": a.warmup_seconds},
        headline=headline, gpu_count=0 if a.device == "cpu" else None,
        notes=[f"{s} failed: {e[-300:]}" for s, e in errors.items()])

