"""The benchmark records (``benchmark.common.records``) that ``--record-dir`` makes ``benchmark/decode/step_ab.py``
(and its ``--gemm-ab`` / ``--switch-ab`` modes) and the attention benchmarks write, built on CPU from synthetic rows:
each validates and carries its same-run baseline, ratios and headline."""

from __future__ import annotations

import os
import sys
import types

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from conftest import load_benchmark  # noqa: E402

from benchmark.common import records  # noqa: E402

FAKE_ENV = {"git_commit": "0" * 40, "git_dirty": False, "date": "2026-12-07T12:00:00+00:00",
            "gpu": {"model": "NVIDIA H200", "count": 1, "driver": "x"}, "platform": "test",
            "versions": {"python": "3", "torch": None, "cuda": None, "nccl": None, "triton": None}}


def _written(rec, tmp_path):
    js, md = records.write_record(rec, tmp_path)
    assert "Headline:" in md.read_text()
    return records.load_record(js)


def _step_rows(key, names, steps):
    return [{"batch": b, key: n, "step_ms": s * b, "floor_ms": 1.0 * b, "ratio": s, "replay_ms": 1.0, "steps": 8}
            for b in (1, 32) for n, s in zip(names, steps)]


@pytest.mark.parametrize("kind", ["host", "gemm", "switch"])
def test_step_ab_record_uses_the_first_setting_as_baseline(tmp_path, kind):
    sab = load_benchmark("decode.step_ab")
    cfg = sab.parse_args(["--batches", "1,32", "--record-dir", str(tmp_path)])
    assert cfg.record_dir == str(tmp_path) and sab.parse_args([]).record_dir is None
    res = {"hbm_bytes_per_s": 4e12, "matmul_flops_per_s": 8e14}
    if kind == "host":
        res["decode"], base, other, what = _step_rows("setting", ["old", "new"], [2.0, 1.5]), "old", "new", \
            "decode_step_ab"
    elif kind == "gemm":
        res["gemm_ab"] = {"rows": _step_rows("set", ["cublas", "autotune"], [2.0, 1.5])}
        base, other, what = "cublas", "autotune", "decode_gemm_ab"
    else:
        res["switch_ab"] = {"sets": [["a", {}], ["b", {"X": "1"}]], "rows": _step_rows("set", ["a", "b"], [2.0, 1.5])}
        base, other, what = "a", "b", "decode_switch_ab"
    rec = _written(sab.make_step_record(res, cfg, env=FAKE_ENV), tmp_path)
    assert rec["subject"] == "decode" and rec["what"] == what and rec["baselines"] == ["base_step_ms"]
    assert rec["floor"]["column"] == "floor_ms" and rec["params"]["baseline_setting"] == base
    assert {r["vs_base"] for r in rec["rows"] if r.get("setting", r.get("set")) == other} == {0.75}
    h = rec["headline"]
    assert f"batch 32, {other} vs {base}" in h[0]["label"]
    assert (h[0]["value"], h[0]["baseline"], h[0]["ratio"]) == (48.0, 64.0, 0.75)
    assert (h[1]["value"], h[1]["baseline"], h[1]["ratio"]) == (48.0, 32.0, 1.5)
    assert sab.make_step_record({"decode": []}, cfg, env=FAKE_ENV) is None


def test_triton_attention_record(tmp_path):
    bta = load_benchmark("attention.bench_triton_attention")
    args = types.SimpleNamespace(batch=64, context=4096, heads=32, kv_heads=8, head_dim=128, sweep=True)
    cases = [{"part": "decode", "case": "contiguous, splits=8 (default)", "time_us": 100.0, "kv_gbps": 3000.0,
              "hbm_copy_gbps": 4000.0},
             {"part": "decode", "case": "pages16, splits=8 (default)", "time_us": 110.0, "kv_gbps": 3200.0,
              "hbm_copy_gbps": 4000.0},
             {"part": "decode", "case": "pages16, splits=8 BLOCK_N=64 warps=4 stages=2", "time_us": 90.0,
              "kv_gbps": 3600.0, "hbm_copy_gbps": 4000.0},
             {"part": "extend", "case": "prefix 0 + new 8192", "time_ms": 1.5, "tflops": 400.0,
              "matmul_tflops": 800.0}]
    rec = _written(bta.make_attention_record(cases, args, env=FAKE_ENV), tmp_path)
    assert rec["what"] == "triton_attention" and rec["baselines"] == ["hbm_copy_gbps", "matmul_tflops"]
    assert rec["rows"][0]["kv_of_copy"] == 0.75 and "of_matmul" not in rec["rows"][0]
    h = rec["headline"]
    assert (h[0]["value"], h[0]["baseline"], h[0]["ratio"]) == (3200.0, 4000.0, 0.8)
    assert (h[1]["value"], h[1]["baseline"], h[1]["ratio"]) == (400.0, 800.0, 0.5)


@pytest.mark.parametrize("with_fi", [True, False])
def test_flashinfer_vs_triton_record(tmp_path, with_fi):
    fvt = load_benchmark("attention.bench_flashinfer_vs_triton")
    args = types.SimpleNamespace(page_size=1, decode_context=1024, iters=15, inner=8, reps=2)
    rows = [{"workload": "prefill 8K", "triton_ms": 2.0, "sdpa_ms": 1.0, "floor_ms": 0.5, "triton_over_floor": 4.0},
            {"workload": "decode bs 128 x 1024", "triton_ms": 0.2, "floor_ms": 0.1, "triton_over_floor": 2.0}]
    if with_fi:
        for r, fi in zip(rows, (1.5, 0.1)):
            r.update(flashinfer_ms=fi, flashinfer_over_triton=fi / r["triton_ms"])
    rec = _written(fvt.make_fi_record(rows, args, "0.2" if with_fi else None, 4e12, 8e14, env=FAKE_ENV), tmp_path)
    assert rec["what"] == "flashinfer_vs_triton" and rec["baselines"] == ["triton_ms", "sdpa_ms"]
    assert rec["rows"][0]["triton_over_sdpa"] == 2.0 and "triton_over_sdpa" not in rec["rows"][1]
    h = rec["headline"]
    assert "decode bs 128" in h[0]["label"] and "prefill 8K" in h[1]["label"]
    if with_fi:
        assert (h[0]["value"], h[0]["baseline"], h[0]["ratio"]) == (0.1, 0.2, 0.5)
    else:
        assert (h[0]["value"], h[0]["baseline"], h[0]["ratio"]) == (0.2, 0.1, 2.0)


def test_fp8_kv_decode_record(tmp_path):
    fkv = load_benchmark("attention.bench_fp8_kv_decode")
    ns = fkv.parse_args(["--out", str(tmp_path), "--record-dir", str(tmp_path)])
    res = {"kv_dtype": "fp8_e4m3", "policy": "balanced", "shape": "Llama-3.1-8B", "reps": 20, "inner": 20,
           "copy_bandwidth_gbs": 4000.0,
           "rows": [{"batch": b, "context": c, "splits": 4, "bf16_us": 20.0 * b, "bf16_floor_us": 10.0 * b,
                     "bf16_vs_floor": 2.0, "fp8_us": 12.5 * b, "fp8_floor_us": 5.0 * b, "fp8_vs_floor": 2.5,
                     "fp8_speedup": 1.6} for b in (1, 128) for c in (1024, 4096)],
           "extend_rows": [{"extend_tokens": 4096, "bf16_us": 100.0, "fp8_us": 110.0, "fp8_vs_bf16": 1.1,
                            "bf16_tflops": 300.0, "fp8_tflops": 272.7}]}
    rec = _written(fkv.make_fp8_kv_record(res, ns, env=FAKE_ENV), tmp_path)
    assert rec["what"] == "fp8_kv_decode" and rec["baselines"] == ["bf16_us"] and rec["mode"] == "fp8_e4m3-balanced"
    assert [r["part"] for r in rec["rows"]] == ["decode"] * 4 + ["extend"]
    h = rec["headline"]
    assert "batch 128 x context 4096" in h[0]["label"]
    assert (h[0]["value"], h[0]["baseline"], h[0]["ratio"]) == (1600.0, 2560.0, 1.6)
    assert (h[1]["baseline"], h[1]["ratio"]) == (640.0, 2.5) and (h[2]["value"], h[2]["ratio"]) == (110.0, 1.1)
