"""benchmark/afd/bench_step_graph.py's table on CPU: each graphed row carries Ta / Tf / Tc (graphed) and the
m >= 2(1 + Tc/Tf) check from the stamped capture and the FFN workers' Tf files, or says why a piece is missing."""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "benchmark"))


def _cells(line):
    return [c.strip() for c in line.split("|")[1:-1]]


def test_rows_carry_ta_tf_tc_and_the_check(tmp_path):
    from benchmark.afd import bench_step_graph as bag

    for j, tf in enumerate(({"32": [0.30, 0.31], "16,16": [0.2]}, {"32": [0.40, 0.42, 0.41]})):
        (tmp_path / f"tf{j}.json").write_text(json.dumps(tf))
    tf = bag._ffn_tf([str(tmp_path / "tf0.json"), str(tmp_path / "tf1.json"), str(tmp_path / "missing.json")])
    assert tf == {"32": [0.40, 0.42, 0.41], "16,16": [0.2]}  # the slowest worker's samples per step
    rows = [{"m": 1, "b": 32, "eager": 0.1, "ta_eager": 1.2, "sizes": "32", "graphed": 0.02,
             "stages": {"ta": 0.1, "rtt": 0.61}},
            {"m": 2, "b": 32, "eager": 0.2, "ta_eager": 1.3, "sizes": "16,16", "graphed": 0.025,
             "stages": {"error": "RuntimeError: no"}},
            {"m": 2, "b": 128, "eager": 0.15, "ta_eager": None, "error": "RuntimeError: capture"}]
    lines = bag.format_rows(rows, 2, tf)
    body = [_cells(x) for x in lines if x.startswith("| ") and x[2].isdigit()]
    assert len(body) == 3 and all(len(c) == 10 for c in body)
    assert body[0][6] == "800"  # tok/s per GPU graphed: 32 / 0.02 / 2 (the GPU script's summary reads this cell)
    assert body[0][8] == "0.100 / 0.410 / 0.100" and body[0][9] == "m >= 2(1+Tc/Tf) = 2.49: NO"
    assert body[1][8].startswith("n/a (timed capture: RuntimeError: no)")
    assert body[2][3].startswith("capture failed")
    no_tf = _cells([x for x in bag.format_rows(rows[:1], 2, {}) if x.startswith("| 1")][0])
    assert no_tf[8].startswith("n/a (no stamps")


def test_step_graph_record_carries_baseline_ratio_headline(tmp_path):
    """--record-dir: eager device-driven step as the baseline, eager / graphed as the ratio, a failed capture kept as
    a row with its error, the largest m and batch that captured as the headline."""
    from types import SimpleNamespace

    from benchmark.afd import bench_step_graph as bag
    from benchmark.common import records

    rows = [{"m": 1, "b": 32, "eager": 0.010, "ta_eager": 1.2, "graphed": 0.004},
            {"m": 2, "b": 32, "eager": 0.012, "ta_eager": 1.1, "graphed": 0.005},
            {"m": 2, "b": 64, "eager": 0.020, "ta_eager": None, "error": "RuntimeError: x"}]
    a = SimpleNamespace(model_path="m", load_format="dummy", batch=[32, 64], micro_batches=[1, 2], ffn_workers=1,
                        input_len=8, steps=8, warmup=3, transport="cuda_push")
    env = {"git_commit": "abc", "git_dirty": False, "date": "2026-12-07T00:00:00+00:00",
           "gpu": {"model": "NVIDIA H100 80GB HBM3", "count": 8, "driver": None}, "versions": {"python": "3"}}
    js, _ = records.write_record(bag.step_graph_record(a, rows, 2, env=env, command="python x.py"), tmp_path)
    rec = records.load_record(js)
    assert js.name == "2026-12-07_afd_step_graph_2xh100.json" and rec["baselines"] == ["eager_step_ms"]
    assert rec["rows"][0]["eager_over_graphed"] == 2.5 and rec["rows"][0]["tok_s_per_gpu_graphed"] == 4000.0
    assert rec["rows"][2]["graphed_step_ms"] is None and rec["rows"][2]["error"] == "RuntimeError: x"
    (h,) = rec["headline"]
    assert (h["value"], h["baseline"], h["ratio"]) == (5.0, 12.0, 2.4) and "m=2, batch 32" in h["label"]
