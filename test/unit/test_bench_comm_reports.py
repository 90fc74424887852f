"""CPU checks of the communication benchmarks' plumbing: the AllReduce-RMSNorm report carries the NCCL
symmetric-memory baseline column and its ratio (or n/a with the reason in the notes), and the NCCL window
helper fails with a recorded reason, not an exception, where it cannot register (gloo on CPU)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from conftest import load_benchmark  # noqa: E402


def test_report_has_nccl_symm_column_and_ratio():
    b = load_benchmark("comm.bench_allreduce_rmsnorm")
    rows = [dict(world=8, T=128, floor_us=10.0, baseline=40.0, nccl_symm=30.0, oneshot=15.0, twoshot=20.0,
                 twoshot_sharded=22.0, ce=50.0, auto="p2p_oneshot@64", auto_us=16.0),
            dict(world=8, T=4096, floor_us=100.0, baseline=300.0, oneshot=290.0, twoshot=150.0,
                 twoshot_sharded=140.0, ce=400.0, auto="p2p_twoshot@128", auto_us=150.0)]
    text = b.render(rows, ["nccl_symm unavailable: RuntimeError: x"], "cmd", "hw")
    lines = [line for line in text.splitlines() if line.startswith("| 8 |")]
    # auto 16.0: 40/16 vs NCCL, 30/16 vs nccl_symm; best full oneshot 15.0: 40/15, 30/15
    assert "| 16.0 (p2p_oneshot@64) | 15.0 (oneshot) | 22.0 (twoshot_sharded) | 2.50x | 1.88x | n/a | 2.67x | 2.00x |" \
        in lines[0]
    # T=4096: best full is twoshot 150 (2.00x), the sharded 140 (2.14x) is only in its own column
    assert "| 150.0 (twoshot) | 140.0 (twoshot_sharded) | 2.00x | n/a | n/a | 2.00x | n/a | n/a | 2.14x |" in lines[1]
    assert "nccl_symm unavailable" in text and "| nccl_symm |" in text


def test_cta_sweep_table_and_method_names():
    """--ctas rows: one line per (world, T, method) with every CTA count, best / floor and NCCL / @16; unknown
    method names raise ValueError naming the choices."""
    import pytest

    b = load_benchmark("comm.bench_allreduce_rmsnorm")
    row = {"world": 4, "T": 1024, "floor_us": 50.0, "baseline": 140.0, "twoshot_bulk": 90.0, "auto": "p2p_twoshot",
           "cta:twoshot_bulk@8": 120.0, "cta:twoshot_bulk@16": 70.0, "cta:twoshot_bulk@all": 60.0}
    text = b.render([row], [], "cmd", "hw")
    line = [x for x in text.splitlines() if "| twoshot_bulk | 120.0 |" in x]
    assert line and line[0].endswith("| 120.0 | 70.0 | 60.0 | 1.20x | 2.00x |")
    assert b.method_spec("twoshot_bulk_sharded")[1] is True
    with pytest.raises(ValueError, match="twoshot_bulk"):
        b.method_spec("bulk")


def test_nccl_window_records_why_on_gloo(tmp_path):
    import torch.distributed as dist

    ns = load_benchmark("comm.nccl_symm")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        notes: set = set()
        assert ns.make_window_or_note(64, torch.float32, torch.device("cpu"), notes) is None
        assert len(notes) == 1 and next(iter(notes)).startswith("nccl_symm unavailable:")
    finally:
        dist.destroy_process_group()


def test_allreduce_rmsnorm_record_carries_baselines_ratios_headline(tmp_path):
    """--record-dir: the rows become a valid benchmark record with the NCCL baselines, the speed-ups, the floor and a
    headline of auto vs NCCL + norm at the largest world (smallest and largest T)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from benchmark.comm.allreduce_rmsnorm_report import build_record
    from benchmark.common import records

    rows = [dict(world=2, T=1, floor_us=0.1, baseline=20.0, oneshot=10.0, auto="p2p_oneshot@64", auto_us=10.0),
            dict(world=4, T=1, floor_us=0.1, baseline=21.0, nccl_symm=18.0, oneshot=12.0, twoshot_sharded=11.0,
                 auto="p2p_oneshot@64", auto_us=14.0),
            dict(world=4, T=8192, floor_us=100.0, baseline=300.0, twoshot=150.0, **{"twoshot@64": 140.0},
                 auto="p2p_twoshot@128", auto_us=150.0)]
    env = {"git_commit": "abc", "git_dirty": False, "date": "2026-12-07T00:00:00+00:00",
           "gpu": {"model": "NVIDIA H200", "count": 8, "driver": None}, "versions": {"python": "3"}}
    rec = build_record(rows, ["a note"], ("oneshot", "twoshot", "twoshot_sharded"), params={"hidden": 8192},
                       gpu_count=4, env=env, command="python benchmark/comm/bench_allreduce_rmsnorm.py --worlds 4")
    js, md = records.write_record(rec, tmp_path)
    rec = records.load_record(js)
    assert js.name == "2026-12-07_allreduce_rmsnorm_4xh200.json" and md.exists()
    assert rec["subject"] == "comm" and rec["benchmark"] == "benchmark.comm.bench_allreduce_rmsnorm"
    assert rec["baselines"] == ["baseline", "nccl_symm"] and rec["floor"]["column"] == "floor_us"
    r = rec["rows"][1]
    assert r["best_full"] == "oneshot" and r["best_sharded_us"] == 11.0 and r["nccl_over_auto"] == 1.5
    assert rec["rows"][2]["best_full"] == "twoshot@64" and rec["rows"][2]["best_full_over_floor"] == 1.4
    assert [(h["value"], h["baseline"], h["ratio"]) for h in rec["headline"]] == [(14.0, 21.0, 1.5),
                                                                                   (150.0, 300.0, 2.0)]
    assert "world 4, T=8192" in rec["headline"][1]["label"] and rec["units"]["auto_us"] == "us"
