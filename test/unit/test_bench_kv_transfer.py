"""benchmark/disaggregation/bench_kv_transfer.py --smoke runs on CPU (fake backend, and nixl when it imports), verifies every method
byte for byte (it raises otherwise) and reports one row per (block size, count) with consistent counts."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from sglang.srt.disaggregation.transfer.base import nixl_available  # noqa: E402

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize("backend", ["fake", pytest.param("nixl", marks=pytest.mark.skipif(
    not nixl_available()[0], reason=f"nixl: {nixl_available()[1]}"))])
def test_bench_kv_transfer_smoke(tmp_path, backend):
    from benchmark.disaggregation import bench_kv_transfer as bench_kv_transfer

    res = bench_kv_transfer.main(["--smoke", "--backend", backend, "--out-dir", str(tmp_path), "--tag", "_t"])
    rows = res["rows"]
    assert [(r["block_kb"], r["blocks"]) for r in rows] == [(4, 16), (4, 64)]
    for r in rows:
        assert r["reads_per_block"] == r["blocks"]  # one read per block before coalescing
        assert r["reads_coalesced"] == 2 * 2  # contiguous pages: one read per (layer, K/V)
        assert r["bytes"] == r["blocks"] * r["block_kb"] * 1024
        for m in ("msg", "per_block", "coalesced"):
            assert r[f"{m}_gbps"] > 0
    written = json.loads(next(tmp_path.glob("*_kv_transfer_cpu_t.json")).read_text())
    assert written["rows"] == rows and written["command"].startswith("python benchmark/disaggregation/bench_kv_transfer.py")
    assert "hardware" in written and "date" in written
