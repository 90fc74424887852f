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
