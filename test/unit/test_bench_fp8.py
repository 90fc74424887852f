"""``benchmark/quantization/bench_fp8.py --smoke`` runs its whole pipeline on CPU (stories260K, tiny shapes) and writes
the JSON record and markdown the GPU run will write: every section, the bf16 and FP8 rows side by side, ratios."""

from __future__ import annotations

import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
from conftest import REPO_ROOT, shared_path  # noqa: E402


def test_bench_fp8_smoke_writes_the_record(tmp_path):
    shared_path("models", "stories260K")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    p = subprocess.run([sys.executable, os.path.join(REPO_ROOT, "benchmark", "quantization", "bench_fp8.py"),
                        "--smoke", "--out", str(tmp_path)], capture_output=True, text=True, timeout=600, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads((tmp_path / "fp8_weights.json").read_text())
    for key in ("benchmark", "mode", "commit", "date", "gpu", "gpu_count", "torch", "triton", "command"):
        assert key in res, key
    assert res["benchmark"] == "fp8_weights" and res["mode"].startswith("smoke")
    assert {r["method"] for r in res["gemm"]} == {"bf16 cuBLAS", "fp8 W8A8 (quant + _scaled_mm)"}
    assert {(r["batch"], r["weights"]) for r in res["decode"]} == {(b, w) for b in (1, 4) for w in ("bf16", "fp8")}
    assert all(r["ratio"] > 0 and r["floor_ms"] > 0 for r in res["decode"])
    fp8_bytes = {r["weights"]: r["weight_bytes"] for r in res["decode"]}
    assert fp8_bytes["fp8"] < fp8_bytes["bf16"]  # the floor counts the smaller weights
    assert [r["weights"] for r in res["prefill"]] == ["bf16", "fp8"]
    md = (tmp_path / "fp8_weights.md").read_text()
    assert "## Decode step vs memory floor" in md and "## Prefill" in md and "fp8 vs bf16 step" in md


FAKE_ENV = {"git_commit": "0" * 40, "git_dirty": False, "date": "2026-12-07T12:00:00+00:00",
            "gpu": {"model": "NVIDIA H100 80GB HBM3", "count": 8, "driver": "x"}, "platform": "test",
            "versions": {"python": "3", "torch": None, "cuda": None, "nccl": None, "triton": None}}


def test_fp8_record_pairs_every_row_with_its_bf16_baseline(tmp_path):
    from benchmark.common import records
    from conftest import load_benchmark

    bf = load_benchmark("quantization.bench_fp8")
    cfg = bf.parse_args(["--out", str(tmp_path), "--batches", "1,32"])
    res = {"peaks": {"hbm_bytes_per_s": 3e12, "matmul_bf16_flops_per_s": 7e14, "matmul_fp8_flops_per_s": {}},
           "gemm": [{"shape": "qkv", "n": 6144, "k": 4096, "m": 1, "method": "bf16 cuBLAS", "us": 20.0},
                    {"shape": "qkv", "n": 6144, "k": 4096, "m": 1, "method": "auto", "us": 10.0}],
           "decode": [{"batch": b, "setting": "new", "weights": w, "step_ms": s, "floor_ms": 1.0, "ratio": s,
                       "weight_bytes": 1} for b in (1, 32) for w, s in (("bf16", 8.0), ("fp8", 5.0))],
           "prefill": [{"weights": "bf16", "tokens": 8192, "tflops": 500.0, "median_s": 0.2},
                       {"weights": "fp8", "tokens": 8192, "tflops": 750.0, "median_s": 0.13}]}
    js, _ = records.write_record(bf.make_fp8_record(res, cfg, env=FAKE_ENV), tmp_path)
    rec = records.load_record(js)
    assert rec["subject"] == "quantization" and rec["what"] == "fp8_weights" and rec["gpu"]["count"] == 1
    assert rec["baselines"] == ["base_us", "base_step_ms", "base_tflops"]
    gemm_auto = next(r for r in rec["rows"] if r["part"] == "gemm" and r["method"] == "auto")
    assert gemm_auto["fp8_vs_bf16"] == 2.0
    h = rec["headline"]
    assert "batch 32" in h[0]["label"] and (h[0]["value"], h[0]["baseline"], h[0]["ratio"]) == (5.0, 8.0, 1.6)
    assert (h[1]["value"], h[1]["baseline"], h[1]["ratio"]) == (750.0, 500.0, 1.5)
