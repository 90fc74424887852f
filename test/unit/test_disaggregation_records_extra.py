"""The benchmark record that ``--record-dir`` makes ``benchmark/disaggregation/bench_push_layerwise.py`` write: the
builder on synthetic medians (the after-the-forward push as the same-run baseline, the overlap floor, the ratios
computed from the inputs) and the CPU run (fake backend, toy shapes) writing and reloading its JSON."""

from __future__ import annotations

import os
import sys
from types import SimpleNamespace

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from benchmark.common import records  # noqa: E402

FAKE_ENV = {"git_commit": "0" * 40, "git_dirty": False, "date": "2026-12-07T12:00:00+00:00",
            "gpu": {"model": "NVIDIA H200", "count": 2, "driver": "x"}, "platform": "test",
            "versions": {"python": "3", "torch": None, "cuda": None, "nccl": None, "triton": None}}


def test_push_layerwise_record(tmp_path):
    """One row per path; speedup = after / path on the after and layerwise rows; the layerwise row's floor is
    max(forward, transfer); headline: layerwise vs after and the ideal ratio (F + X) / max(F, X)."""
    from benchmark.disaggregation.bench_push_layerwise import push_record

    res = {"forward": 0.040, "transfer": 0.025, "after": 0.066, "layerwise": 0.047}
    args = SimpleNamespace(device="cuda:0", backend="nixl", layers=16, tokens=2048, kv_heads=8, head_dim=128,
                           hidden=1024, mlp_iters=2, repeats=7, threads=1)
    rec = push_record(res, args, nbytes=2 ** 27, nrows=32, kv_equal=True, env=FAKE_ENV,
                      command="python benchmark/disaggregation/bench_push_layerwise.py --device cuda --backend nixl")
    js, md = records.write_record(rec, tmp_path)
    rec = records.load_record(js)
    assert js.name == "2026-12-07_push_layerwise_h200.json" and rec["mode"] == "nixl-cuda"
    assert rec["baselines"] == ["after_ms"] and rec["floor"]["column"] == "overlap_floor_ms"
    fwd, xfer, after, lw = rec["rows"]
    assert [r["path"] for r in rec["rows"]] == ["forward only", "transfer only", "after the forward", "layerwise"]
    assert fwd["speedup"] is None and xfer["time_ms"] == 25.0 and after["speedup"] == 1.0
    assert lw["speedup"] == round(66.0 / 47.0, 3) and lw["overlap_floor_ms"] == 40.0
    assert lw["over_floor"] == round(47.0 / 40.0, 3) and rec["params"]["kv_equal_after_runs"] is True
    vs_after, ideal = rec["headline"]
    assert (vs_after["value"], vs_after["baseline"], vs_after["ratio"]) == (47.0, 66.0, round(66.0 / 47.0, 3))
    assert ideal["value"] == round((40.0 + 25.0) / 40.0, 3)
    assert "| path | time_ms (ms) |" in md.read_text() and "Headline:" in records.render_markdown(rec)


def test_push_layerwise_cpu_run_writes_record(tmp_path):
    """The benchmark on CPU (fake backend, 2 layers x 32 tokens) with --record-dir writes a record that loads."""
    from benchmark.disaggregation import bench_push_layerwise

    bench_push_layerwise.main(["--device", "cpu", "--backend", "fake", "--layers", "2", "--tokens", "32",
                               "--kv-heads", "2", "--head-dim", "16", "--hidden", "32", "--repeats", "1",
                               "--out-dir", str(tmp_path / "md"), "--record-dir", str(tmp_path)])
    (js,) = (tmp_path / "disaggregation").glob("*_push_layerwise_cpu.json")
    rec = records.load_record(js)
    assert rec["mode"] == "fake-cpu" and rec["gpu"]["count"] == 0 and len(rec["rows"]) == 4
    lw = rec["rows"][3]
    assert lw["speedup"] == round(lw["after_ms"] / lw["time_ms"], 3) and rec["params"]["kv_equal_after_runs"] is True
    assert list((tmp_path / "md").glob("*_push_layerwise_cpu.md"))
