"""CPU checks of the AllReduce-RMSNorm benchmark's main table (the `auto` column is what a plain call
runs, `best full` never mixes in sharded-residual variants, the sharded best is reported apart) and of
``auto_pick`` (the communicator's backend / SM choice from a calibration table, or the built-in rules)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from conftest import load_benchmark  # noqa: E402

GiB = 1 << 30


def _row():
    """World 4, T 1024: the sharded CTA-sweep entry is the fastest overall, a calibration candidate is the fastest
    full-residual one, an overlapped candidate (not a plain-call configuration) is faster still but ignored."""
    return {"world": 4, "T": 1024, "bytes": 1024 * 8192 * 2, "floor_us": 50.0, "baseline": 140.0,
            "nccl_symm": 120.0, "torch_symm": 130.0, "twoshot": 160.0, "twoshot_sharded": 100.0,
            "twoshot_pipe": 150.0, "cal:p2p_twoshot_pipe@64": 145.0, "ovl:p2p_oneshot@16": 1.0,
            "twoshot_pipe_sharded_c16k@16": 95.0, "cta:twoshot_bulk_sharded@16": 90.0, "twoshot@16": 300.0,
            "auto": "p2p_twoshot_pipe@128", "auto_us": 150.0}


def test_best_full_and_sharded_kept_apart():
    r = load_benchmark("comm.allreduce_rmsnorm_report")
    row = _row()
    methods = ("twoshot", "twoshot_sharded", "twoshot_pipe")
    assert r.best(row, methods, sharded=False) == ("cal:p2p_twoshot_pipe@64", 145.0)
    assert r.best(row, methods, sharded=True) == ("cta:twoshot_bulk_sharded@16", 90.0)
    assert "ovl:p2p_oneshot@16" not in r.tw_timings(row, methods)
    assert r.is_sharded("twoshot_pipe_sharded_c16k@16") and not r.is_sharded("cal:p2p_twoshot_pipe@64")
    assert r.best({"world": 2, "T": 1, "floor_us": 1.0, "baseline": 5.0}, methods, sharded=False) is None


def test_main_table_ratios_for_auto_full_and_sharded():
    r = load_benchmark("comm.allreduce_rmsnorm_report")
    lines = r.main_table([_row()], ("twoshot", "twoshot_sharded", "twoshot_pipe"))
    head = [x for x in lines if x.startswith("| world |")][0].split(" | ")
    line = [x for x in lines if x.startswith("| 4 | 1024 |")][0]
    cells = dict(zip(head, line.split(" | ")))
    assert cells["auto (pick)"] == "150.0 (p2p_twoshot_pipe@128)"
    assert cells["best full (method)"] == "145.0 (cal:p2p_twoshot_pipe@64)"
    assert cells["best sharded (method)"] == "90.0 (cta:twoshot_bulk_sharded@16)"
    # X / side = X's time / side's time: 140/150, 120/150, 130/150; 140/145 ...; 140/90 ...
    assert [cells[f"{b} / auto"] for b in ("NCCL", "nccl_symm", "torch_symm")] == ["0.93x", "0.80x", "0.87x"]
    assert [cells[f"{b} / full"] for b in ("NCCL", "nccl_symm", "torch_symm")] == ["0.97x", "0.83x", "0.90x"]
    assert [cells[f"{b} / sharded"] for b in ("NCCL", "nccl_symm", "torch_symm")] == ["1.56x", "1.33x", "1.44x"]
    assert line.endswith("| 2.90x |")  # best full / floor = 145 / 50
    assert len(head) == len(line.split(" | "))


def test_main_table_without_auto_or_baselines_says_na():
    r = load_benchmark("comm.allreduce_rmsnorm_report")
    row = {"world": 2, "T": 8, "floor_us": 1.0, "baseline": 10.0, "oneshot": 5.0}
    line = [x for x in r.main_table([row], ("oneshot",)) if x.startswith("| 2 | 8 |")][0]
    assert "| n/a (?) | 5.0 (oneshot) | n/a | n/a | n/a | n/a | 2.00x | n/a | n/a | n/a | n/a | n/a | 5.00x |" in line


def test_auto_pick_follows_the_table_then_the_builtin_rules(tmp_path):
    """The pick a plain bf16 call gets: the calibrated table's backend and SMs where the GPU / world has one, the
    built-in rules otherwise, NCCL where the staging buffer is too small."""
    b = load_benchmark("comm.bench_allreduce_rmsnorm")
    from sglang.srt.distributed.tw_comm import TwBackend, TwCommConfig
    from sglang.srt.distributed.tw_comm_tuning import UNBOUNDED, write_table

    table = tmp_path / "t.json"
    write_table(table, "GPU X", 4, [(1 << 20, "p2p_lamport", 32), (UNBOUNDED, "p2p_twoshot_pipe", 96)],
                [(UNBOUNDED, "p2p_twoshot", 16)], "test")
    cfg = TwCommConfig(use_calibrated=False)
    pick = lambda t, gpu="GPU X", cap=GiB: b.auto_pick(cfg, 4, cap, t, 8192, gpu, table)[1:]  # noqa: E731
    assert pick(32) == (TwBackend.LAMPORT, 32)  # 0.5 MiB <= 1 MiB entry
    assert pick(1024) == (TwBackend.PIPE, 96)
    assert pick(1024, cap=1 << 20) == (TwBackend.NCCL, 128)  # no staging room: NCCL fallback
    assert pick(1, gpu="GPU Y") == (TwBackend.LAMPORT, cfg.oneshot_sms)  # no table: built-in rules
    assert pick(8192, gpu="GPU Y") == (TwBackend.TWOSHOT, cfg.twoshot_sms)
    cal = b.auto_pick(cfg, 4, GiB, 1024, 8192, "GPU X", table)[0]
    assert cal.use_calibrated and cal.crossovers.plain[1] == (UNBOUNDED, "p2p_twoshot_pipe", 96)


def test_auto_pick_packaged_h200_world4():
    """The packaged table (H200 x4, 2026-11-27): 8192 tokens (128 MiB) -> bulk two-shot on 128 SMs, 1024 tokens
    (16 MiB) -> pipelined two-shot on 128 SMs."""
    b = load_benchmark("comm.bench_allreduce_rmsnorm")
    from sglang.srt.distributed.tw_comm import TwBackend, TwCommConfig
    from sglang.srt.distributed.tw_comm_tuning import DEFAULT_TABLE_PATH

    cfg = TwCommConfig(use_calibrated=False)
    assert b.auto_pick(cfg, 4, GiB, 8192, 8192, "NVIDIA H200", DEFAULT_TABLE_PATH)[1:] == (TwBackend.BULK, 128)
    assert b.auto_pick(cfg, 4, GiB, 1024, 8192, "NVIDIA H200", DEFAULT_TABLE_PATH)[1:] == (TwBackend.PIPE, 128)
