"""The benchmark records (``benchmark.common.records``) that ``--record-dir`` makes five CUDA-only benchmarks write,
built on CPU from fake results shaped like what each benchmark collects: each record validates, carries a ratio equal
to the one computed here from the inputs, and renders as markdown."""

from __future__ import annotations

import os
import sys
import types

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from conftest import load_benchmark  # noqa: E402

from benchmark.common import records  # noqa: E402

FAKE_ENV = {"git_commit": "0" * 40, "git_dirty": False, "date": "2026-12-07T12:00:00+00:00",
            "gpu": {"model": "NVIDIA H100 80GB HBM3", "count": 1, "driver": "x"}, "platform": "test",
            "versions": {"python": "3", "torch": None, "cuda": None, "nccl": None, "triton": None}}


def _check(rec, tmp_path):
    """Validate, write and reload ``rec``; the markdown renders with its headline."""
    records.validate_record(rec)
    md = records.render_markdown(rec)
    assert "Headline:" in md and rec["what"] in md
    js, _ = records.write_record(rec, tmp_path)
    return records.load_record(js)


def test_gemm_kernels_record(tmp_path):
    gk = load_benchmark("decode.gemm_kernels")
    bw = 3.0e12
    found = []
    for m in (1, 16):
        for name, (n, k) in (("lm_head", (128256, 4096)), ("down_proj", (4096, 14336))):
            res = {"cublas": 400.0 + m, "cublas_t": 390.0 + m}
            err = {"cublas_t": 0.001}
            if m == 1:
                res["mv"] = 380.0
                err["mv"] = 0.002
            res["skinny"] = 360.0 + m
            err["skinny"] = 0.003
            found.append({"rows": m, "projection": name, "n": n, "k": k, "weight_bytes": n * k * 2, "res": res,
                          "skinny_tile": [16, 512, 4, 4], "rel_err": {kk: v / 2.0 for kk, v in err.items()}})
    ns = types.SimpleNamespace(rows=[1, 16], inner=20, rotate_mib=256)
    rec = _check(gk.gemm_kernels_record(found, bw, ns, env=FAKE_ENV), tmp_path)
    assert rec["subject"] == "decode" and rec["what"] == "decode_gemms" and rec["baselines"] == ["cublas_us"]
    lm1 = next(r for r in rec["rows"] if r["rows"] == 1 and r["projection"] == "lm_head")
    assert lm1["best"] == "skinny" and lm1["cublas_vs_best"] == round(401.0 / 361.0, 3)
    assert lm1["floor_us"] == round(128256 * 4096 * 2 / bw * 1e6, 2)
    assert lm1["best_of_floor"] == round(lm1["floor_us"] / 361.0, 3)
    assert next(r for r in rec["rows"] if r["rows"] == 16)["mv_us"] is None
    h = rec["headline"]
    assert len(h) == 2 and "lm_head" in h[0]["label"] and (h[0]["value"], h[0]["baseline"]) == (361.0, 401.0)


def test_attention_configs_record(tmp_path):
    ac = load_benchmark("decode.attention_configs")
    bw, ctx = 3.0e12, 1024
    found = []
    for bs in (1, 128):
        kv = 2 * bs * ctx * 8 * 128 * 2
        for sp, tile, us, dflt in ((4, [64, 4, 2], 20.0 * bs ** 0.5, True), (4, [128, 4, 3], 18.0 * bs ** 0.5, False),
                                   (1, [64, 4, 2], 30.0 * bs ** 0.5, False)):
            found.append({"batch": bs, "splits": sp, "tile": tile, "us": us, "err": 0.0039,
                          "bw_frac": kv / (us * 1e-6) / bw, "default": dflt})
    cfg = types.SimpleNamespace(batches=[1, 128], context=ctx)
    rec = _check(ac.attention_configs_record(found, bw, cfg, env=FAKE_ENV), tmp_path)
    assert rec["subject"] == "decode" and rec["baselines"] == ["default_us"] and rec["floor"]["column"] == "floor_us"
    alt = next(r for r in rec["rows"] if r["batch"] == 128 and r["block_n"] == 128)
    assert alt["vs_default"] == round(round(20.0 * 128 ** 0.5, 2) / round(18.0 * 128 ** 0.5, 2), 3)
    floor = round(2 * 128 * ctx * 8 * 128 * 2 / bw * 1e6, 2)
    assert alt["floor_us"] == floor and alt["of_floor"] == round(floor / alt["us"], 3)
    h = rec["headline"]
    assert len(h) == 2 and h[1]["ratio"] == alt["vs_default"] and "batch 128" in h[0]["label"]


def test_extend_configs_record(tmp_path):
    ec = load_benchmark("attention.extend_configs")
    t = 8192
    results = [{"config": "torch SDPA (causal, repeated KV heads)", "ms": 2.5, "err": 0.0},
               {"config": "(128, 64, 8, 2) (default, this arch)", "ms": 2.0, "err": 0.0039},
               {"config": "(128, 128, 8, 2)", "ms": 1.8, "err": 0.0039},
               {"config": "(128, 128, 8, 4)", "ms": None, "err": None, "error": "OutOfResources: shared memory"},
               {"config": "(64, 64, 4, 2)", "ms": 1.5, "err": 0.5},
               {"config": "(128, 64, 8, 2) (default), 4096 cached prefix + 4096 new", "ms": 1.6, "err": 0.0039,
                "flop_scale": 0.75}]
    cfg = types.SimpleNamespace(tokens=t, reps=5)
    rec = _check(ec.extend_configs_record(results, cfg, "NVIDIA H100 80GB HBM3", env=FAKE_ENV), tmp_path)
    assert rec["subject"] == "attention" and rec["baselines"] == ["sdpa_tflops"]
    flops = 2 * 2 * t * t / 2 * 32 * 128
    sdpa, dflt = round(flops / 2.5 / 1e9, 2), round(flops / 2.0 / 1e9, 2)
    row = next(r for r in rec["rows"] if "(default, this arch)" in r["config"])
    assert row["tflops"] == dflt and row["of_sdpa"] == round(dflt / sdpa, 3)
    cached = next(r for r in rec["rows"] if "cached" in r["config"])
    assert cached["tflops"] == round(flops * 0.75 / 1.6 / 1e9, 2)
    failed = next(r for r in rec["rows"] if r["config"] == "(128, 128, 8, 4)")
    assert failed["of_sdpa"] is None and "OutOfResources" in failed["error"]
    h = rec["headline"]
    assert h[0]["ratio"] == row["of_sdpa"] and "(128, 128, 8, 2)" in h[1]["label"]  # the wrong fast tile is skipped


def _step_row(case, bs, ctx, var, pol, step_ms, floor_ms):
    """A row shaped like ``decode_step_profile.main`` builds it."""
    return {"case": case, "bs": bs, "ctx": ctx, "contexts": "uniform 1..2ctx" if var else "all ctx", "policy": pol,
            "graph": True, "step_ms": step_ms, "wall_ms": step_ms + 0.1, "floor_ms": floor_ms,
            "ratio": step_ms / floor_ms, "kernel_ms": step_ms - 0.2, "attention_ms": 3.0, "gemm_ms": 5.0,
            "attention_share": 3.0 / (step_ms - 0.2), "top": [("attn_kernel", 3.0, 32)], "error": None}


def test_decode_step_profile_record(tmp_path):
    dsp = load_benchmark("serving.decode_step_profile")
    rows = [_step_row(0, 160, 2560, False, "balanced", 12.0, 8.0), _step_row(0, 160, 2560, False, "wave", 13.0, 8.0),
            _step_row(1, 200, 2048, True, "wave", 14.0, 9.0), _step_row(1, 200, 2048, True, "balanced", 12.5, 9.0)]
    a = types.SimpleNamespace(model_path="m", cases=["160x2560", "200x2048:var"], steps=10, warmup=3,
                              device="cuda", dtype="bfloat16")
    rec = _check(dsp.decode_step_profile_record(rows, ["balanced", "wave"], a, "NVIDIA H100", 3.0e12, 16 * 10**9,
                                                131072.0, env=FAKE_ENV), tmp_path)
    assert rec["subject"] == "serving" and rec["baselines"] == ["base_step_ms"] and rec["mode"] == "policies"
    wave1 = next(r for r in rec["rows"] if r["case"] == 1 and r["policy"] == "wave")
    assert wave1["base_step_ms"] == 12.5 and wave1["of_base"] == round(14.0 / 12.5, 3)
    assert wave1["step_over_floor"] == round(14.0 / 9.0, 3) and "top" not in wave1
    h = rec["headline"]
    assert h[0]["ratio"] == round(12.0 / 8.0, 3) and h[1]["ratio"] == round(13.0 / 12.0, 3)
    single = dsp.decode_step_profile_record(rows[:1], ["balanced"], a, "NVIDIA H100", 3.0e12, 1, 1.0, env=FAKE_ENV)
    assert single["baselines"] == [] and len(single["headline"]) == 1 and "of_base" not in single["rows"][0]


def test_kv_cache_dtype_serving_record(tmp_path):
    kv = load_benchmark("quantization.bench_kv_cache_dtype_serving")
    runs = []
    for d, tok, cap in (("auto", 9000.0, 450000), ("fp8_e4m3", 10500.0, 900000), ("auto", 9200.0, 450000),
                        ("fp8_e4m3", 10300.0, 900000)):
        runs.append({"kv_cache_dtype": d, "server_startup_s": 30.0, "max_total_tokens": cap, "server_command": "s",
                     "bench_command": "b", "completed": 500, "failed": 0, "duration": 200.0,
                     "output_throughput": tok, "total_throughput": 3 * tok, "request_throughput": 2.5,
                     "mean_ttft_ms": 900.0, "median_ttft_ms": 800.0, "p99_ttft_ms": 3000.0, "mean_tpot_ms": 40.0,
                     "median_tpot_ms": 39.0, "p99_tpot_ms": 60.0, "mean_itl_ms": 39.0, "median_itl_ms": 38.0,
                     "p99_itl_ms": 70.0})
    dtypes = ["auto", "fp8_e4m3"]
    res = {"command": "python benchmark/quantization/bench_kv_cache_dtype_serving.py --out /tmp/x --repeats 2",
           "workload": "4096/2048, range ratio 0.0, 500 prompts, request rate inf",
           "order": ["auto", "fp8_e4m3", "fp8_e4m3", "auto"], "runs": runs, "errors": [],
           "rows": kv.summarize(runs, dtypes)}
    ns = types.SimpleNamespace(dtypes=dtypes, repeats=2, model_path="m", input_len=4096, output_len=2048,
                               range_ratio=0.0, num_prompts=500, server_args="", smoke=False)
    rec = _check(kv.kv_cache_dtype_serving_record(res, ns, env=FAKE_ENV), tmp_path)
    assert rec["subject"] == "quantization" and rec["baselines"] == ["base_output_tok_s", "base_max_total_tokens"]
    fp8 = rec["rows"][1]
    assert fp8["output_vs_first"] == round(10400.0 / 9100.0, 3) and fp8["capacity_vs_first"] == 2.0
    assert rec["headline"][0]["ratio"] == fp8["output_vs_first"] and rec["command"] == res["command"]
    res["rows"] = kv.summarize(runs[:1], dtypes)  # fp8 runs all failed: the record still validates
    res["errors"] = ["fp8_e4m3: the server did not start"]
    rec = kv.kv_cache_dtype_serving_record(res, ns, env=FAKE_ENV)
    assert rec["headline"] == [] and rec["notes"] and records.render_markdown(rec)
