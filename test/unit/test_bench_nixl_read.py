"""benchmark/disaggregation/bench_nixl_read.py on CPU: its argument checks, the UCX protocol-table parser, the table and the best-setting
choice (pure functions), and, when nixl imports, one tiny host-memory run whose READs are checked byte for byte."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmark.disaggregation import bench_nixl_read as bn  # noqa: E402
from sglang.srt.disaggregation.transfer.base import nixl_available  # noqa: E402
from sglang.srt.disaggregation.transfer.nixl_backend import UCX_ENV_DEFAULTS  # noqa: E402

pytestmark = pytest.mark.timeout(300)

UCX_LOG = """[17.0] [h:1 :0]   | bench-initiator self cfg#0 |
[17.0] [h:1 :0]   | remote memory write by ucp_put* from host memory to host |
[17.0] [h:1 :0]   | 0..inf | zero-copy | self/memory |
[17.1] [h:1 :0]   +--------+
[17.1] [h:1 :0]   | bench-initiator intra-node cfg#1                          |
[17.1] [h:1 :0]   | remote memory read by ucp_get*(multi) into cuda/GPU1 from cuda/GPU0 |
[17.1] [h:1 :0]   +--------+
[17.1] [h:1 :0]   | Range  | Description |   Config   |
[17.1] [h:1 :0]   | 0..inf | zero-copy   | cuda_ipc/cuda |
[17.2] [h:1 :0]   | bench-initiator intra-node cfg#2                          |
[17.2] [h:1 :0]   | tagged message by ucp_tag_send* from host memory |
[17.2] [h:1 :0]   | 0..inf | zero-copy   | tcp/lo |
{"row": 1}
"""


def test_proto_lines_keeps_rma_tables_once():
    lines = bn.proto_lines(UCX_LOG + UCX_LOG)  # printed twice (two endpoints): kept once
    assert lines == ["| bench-initiator intra-node cfg#1                          |",
                     "| remote memory read by ucp_get*(multi) into cuda/GPU1 from cuda/GPU0 |",
                     "| 0..inf | zero-copy   | cuda_ipc/cuda |"]


def _row(setting, path, descs, gbps, correct=True):
    return {"row": 1, "setting": setting, "path": path, "descs": descs, "correct": correct, "gbps": gbps,
            "median_ms": 128 / 1024 / gbps * 1e3 if gbps else 0.0}


def test_table_and_best_env(tmp_path):
    rows = [_row("default", "ours", 64, 58.0), _row("tls", "ours", 64, 300.0), _row("sgl", "ours", 64, 900.0, False),
            _row("ours", "ours", 64, 250.0), _row("tls", "repost", 64, 999.0)]
    text = bn.table(rows, [1, 64])
    assert "| tls | ours | - | 300.0 (" in text and "| sgl | ours | - | X |" in text
    f = tmp_path / "r.json"
    f.write_text(json.dumps({"rows": rows}))
    assert bn.best_env(str(f), 64) == {"UCX_TLS": "cuda_ipc,cuda_copy,tcp,self"}  # wrong bytes never win
    f.write_text(json.dumps({"rows": [_row("default", "ours", 64, 58.0), _row("ours", "ours", 64, 50.0)]}))
    assert bn.best_env(str(f), 64) == bn.UCX_OWN_DEFAULTS  # UCX's own values keep the transport's defaults off
    assert set(bn.UCX_OWN_DEFAULTS) == set(UCX_ENV_DEFAULTS)
    f.write_text(json.dumps({"rows": []}))
    assert bn.best_env(str(f), 64) == {}


@pytest.mark.parametrize("argv", [["--descs", "3", "--mib", "1"], ["--mib", "0"], ["--settings", "nope"],
                                  ["--descs", "0"]])
def test_bad_arguments_exit(argv):
    with pytest.raises(SystemExit):
        bn.parse_args(argv)


@pytest.mark.skipif(not nixl_available()[0], reason=f"nixl: {nixl_available()[1]}")
def test_host_memory_run_reads_and_writes_the_pattern(tmp_path):
    bn.main(["--device", "cpu", "--mib", "1", "--descs", "1", "8", "--iters", "2", "--warmup", "1", "--settings",
             "ours", "--write", "--out-dir", str(tmp_path)])
    rows = json.loads((tmp_path / "nixl_read.json").read_text())["rows"]
    assert {(r["path"], r["descs"]) for r in rows} == {(p, k) for p in ("ours", "repost", "write") for k in (1, 8)}
    # write rows are correct only when the WRITTEN bytes read back (bench_nixl_read._write_lands)
    assert all(r["correct"] and r["gbps"] > 0 for r in rows)


FAKE_ENV = {"git_commit": "0" * 40, "git_dirty": False, "date": "2026-12-07T12:00:00+00:00",
            "gpu": {"model": "NVIDIA H100 80GB HBM3", "count": 2, "driver": "x"}, "platform": "test",
            "versions": {"python": "3", "torch": None, "cuda": None, "nccl": None, "triton": None}}


def test_nixl_record_puts_the_floor_beside_every_row(tmp_path):
    from benchmark.common import records

    def row(setting, path, k, gbps, ok=True):
        return {"row": 1, "setting": setting, "path": path, "descs": k, "correct": ok, "median_ms": 1.0,
                "gbps": gbps, "min_ms": 0.9, "env": {}}

    rows = [row("torch_copy", "floor", 1, 200.0), row("torch_copy", "floor", 64, 160.0),
            row("default", "ours", 64, 40.0), row("ours", "ours", 64, 120.0), row("ours", "repost", 64, 130.0),
            row("tls", "ours", 64, 150.0, ok=False), row("ours", "ours", 1, 180.0)]
    args = bn.parse_args(["--descs", "1", "64", "--settings", "default", "ours", "tls"])
    js, _ = records.write_record(bn.make_nixl_record(rows, args, env=FAKE_ENV), tmp_path)
    rec = records.load_record(js)
    assert rec["what"] == "nixl_read" and rec["baselines"] == ["floor_gbps"] and rec["floor"]["column"] == "floor_gbps"
    assert all("row" not in r for r in rec["rows"])
    ours64 = next(r for r in rec["rows"] if (r["setting"], r["path"], r["descs"]) == ("ours", "ours", 64))
    assert ours64["floor_gbps"] == 160.0 and ours64["of_floor"] == 0.75
    h = rec["headline"]
    assert "64 descriptors" in h[0]["label"] and "(ours)" in h[0]["label"]  # the wrong-bytes tls row is not a winner
    assert (h[0]["value"], h[0]["baseline"], h[0]["ratio"]) == (120.0, 160.0, 0.75)
    assert (h[1]["baseline"], h[1]["ratio"]) == (40.0, 3.0)
    assert js.name.endswith("_nixl_read_2xh100.json")
