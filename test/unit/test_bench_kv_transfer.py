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


FAKE_ENV = {"git_commit": "0" * 40, "git_dirty": False, "date": "2026-12-07T12:00:00+00:00",
            "gpu": {"model": "cpu", "count": 0, "driver": None}, "platform": "test",
            "versions": {"python": "3", "torch": None, "cuda": None, "nccl": None, "triton": None}}


def test_kv_record_has_the_baselines_ratios_and_headline(tmp_path):
    from benchmark.common import records
    from benchmark.disaggregation import bench_kv_transfer as bkt

    rows = [{"block_kb": kb, "page_size": 2, "blocks": n, "bytes": n * kb * 1024, "reads_per_block": n,
             "reads_coalesced": 4, "msg_ms": 2.0, "msg_gbps": 1.0, "per_block_ms": 4.0, "per_block_gbps": 0.5,
             "coalesced_ms": 1.0, "coalesced_gbps": 2.0, "coalesced_vs_per_block": 4.0, "coalesced_vs_msg": 2.0}
            for kb, n in ((4, 64), (16, 64))]
    result = {"command": "python benchmark/disaggregation/bench_kv_transfer.py", "backend": "fake", "device": "cpu",
              "run_pages": 0, "reps": 2, "shape": {"num_hidden_layers": 2}, "skipped": []}
    js, md = records.write_record(bkt.make_kv_record(rows, result, env=FAKE_ENV), tmp_path)
    rec = records.load_record(js)
    assert rec["subject"] == "disaggregation" and rec["benchmark"] == "benchmark.disaggregation.bench_kv_transfer"
    assert rec["what"] == "kv_transfer" and rec["baselines"] == ["msg_gbps", "per_block_gbps"]
    assert rec["units"]["coalesced_gbps"] == "GB/s" and rec["gpu"]["count"] == 0
    h = rec["headline"]
    assert "16 KB" in h[0]["label"] and (h[0]["value"], h[0]["baseline"], h[0]["ratio"]) == (2.0, 0.5, 4.0)
    assert (h[1]["baseline"], h[1]["ratio"]) == (1.0, 2.0)
    assert js.name.endswith("_kv_transfer_cpu.json") and "[baseline]" in md.read_text()


def test_smoke_run_writes_a_record(tmp_path):
    from benchmark.common import records
    from benchmark.disaggregation import bench_kv_transfer as bkt

    bkt.main(["--smoke", "--backend", "fake", "--out-dir", str(tmp_path / "out"), "--record-dir", str(tmp_path)])
    (js,) = (tmp_path / "disaggregation").glob("*_kv_transfer_cpu.json")
    rec = records.load_record(js)
    assert len(rec["rows"]) == 2 and rec["headline"][0]["unit"] == "GB/s" and rec["mode"] == "fake-cpu"
