"""CPU tests of the per-shape path choice (sgl_kernel/tdist/auto.py) and of the decomposition ops' argument checks
(sgl_kernel/tdist/decomp.py; their GPU behaviour is tested in test/gpu/test_tdist_decomp_gpu.py).

Imports no Triton (decomp/auto do not), so the interpreter tests in the same process are unaffected.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "sgl-kernel" / "python"))

from sgl_kernel.tdist.auto import NEVER, CalibrationTable  # noqa: E402


def test_choose_uses_table_entry_and_default():
    t = CalibrationTable((("ag", 8192, 2560, 2, 2048), ("rs", 2048, 8192, 2, 8192)), default_min_m=4096)
    assert t.choose("ag", 8192, 2560, 2, 2048) == "decomp"
    assert t.choose("ag", 8192, 2560, 2, 1024) == "nccl"
    assert t.choose("rs", 2048, 8192, 2, 4096) == "nccl"
    assert t.choose("rs", 2048, 8192, 4, 4096) == "decomp"  # other world: the default applies
    assert t.choose("ag", 1, 1, 2, 4095) == "nccl"


def test_from_timings_takes_smallest_m_that_wins_from_there_on():
    pts = [dict(kind="ag", k=8, n=16, world=2, m=m, decomp_ms=d, nccl_ms=1.0)
           for m, d in ((512, 0.5), (1024, 1.5), (2048, 0.9), (8192, 0.8))]
    pts += [dict(kind="rs", k=8, n=16, world=2, m=m, decomp_ms=2.0, nccl_ms=1.0) for m in (2048, 8192)]
    pts += [dict(kind="rs", k=9, n=16, world=2, m=2048, decomp_ms=None, nccl_ms=1.0)]  # skipped
    t = CalibrationTable.from_timings(pts)
    assert t.min_m("ag", 8, 16, 2) == 2048  # 512 won, but 1024 lost: not trusted below 2048
    assert t.min_m("rs", 8, 16, 2) == NEVER
    assert t.min_m("rs", 9, 16, 2) == t.default_min_m
    assert CalibrationTable.from_json(t.to_json()) == t


@pytest.mark.parametrize("bad", [("xx", 1, 1, 2, 1), ("ag", 0, 1, 2, 1), ("ag", 1, 1, 2)])
def test_bad_entries_and_json_raise(bad):
    with pytest.raises(ValueError):
        CalibrationTable((bad,))
    with pytest.raises(ValueError, match="calibration table JSON"):
        CalibrationTable.from_json('{"entries": 3}')
    with pytest.raises(ValueError, match="kind"):
        CalibrationTable().choose("bogus", 1, 1, 2, 1)


def test_decomp_ops_reject_bad_arguments_before_any_device_work():
    from sgl_kernel.tdist.decomp import DecompAgGemm, DecompGemmRs
    from sgl_kernel.tdist.heap import simulate_group
    from sgl_kernel.tdist.layout import HeapConfig

    heap = simulate_group(2, HeapConfig(data_bytes=1 << 20, signal_slots=64))[0]
    ag = DecompAgGemm(heap, 64, 16, torch.float32)
    with pytest.raises(ValueError, match="rows"):
        ag(torch.zeros(4, 16), torch.zeros(16, 8), [4, 4, 4])
    with pytest.raises(ValueError, match="K=16"):
        ag(torch.zeros(4, 15), torch.zeros(15, 8), [4, 4])
    with pytest.raises(ValueError, match="max_rows"):
        ag(torch.zeros(40, 16), torch.zeros(16, 8), [40, 40])
    with pytest.raises(ValueError, match="dtype"):
        ag(torch.zeros(4, 16, dtype=torch.float16), torch.zeros(16, 8), [4, 4])
    rs = DecompGemmRs(heap, 8, 8, torch.float32)
    with pytest.raises(ValueError, match="rows"):
        rs(torch.zeros(18, 4), torch.zeros(4, 8), [9, 9])
    with pytest.raises(ValueError, match="N=8"):
        rs(torch.zeros(8, 4), torch.zeros(4, 7), [4, 4])
    with pytest.raises(ValueError, match="max_rows"):
        DecompGemmRs(heap, 0, 8)


def test_decomp_and_auto_import_no_triton():
    import subprocess

    code = "import sys; import sgl_kernel.tdist.decomp, sgl_kernel.tdist.auto; print('triton' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={"PYTHONPATH": str(Path(__file__).resolve().parents[2] / "sgl-kernel" / "python"),
                            "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "False"


def test_h100_table_holds_the_two_h100_measurements():
    """2026-11-26 (2 H100s, Llama-3.3-70B TP4 shapes): o_proj and down fall back to NCCL + cuBLAS at M 2048,
    qkv and gate_up use the decomposition there; the piece count is the measured best per M."""
    from sgl_kernel.tdist.auto import H100_TABLE as t

    assert t.choose("rs", 2048, 8192, 2, 2048) == "nccl" and t.choose("rs", 7168, 8192, 2, 2048) == "nccl"
    assert t.choose("rs", 2048, 8192, 2, 8192) == "decomp" and t.choose("rs", 7168, 8192, 2, 8192) == "decomp"
    assert t.choose("ag", 8192, 2560, 2, 2048) == "decomp" and t.choose("ag", 8192, 14336, 2, 2048) == "decomp"
    assert [t.pieces_for("ag", 8192, 2560, 2, m) for m in (1024, 2048, 4096, 8192, 16384)] == [1, 1, 1, 2, 2]
    assert t.pieces_for("ag", 8192, 14336, 2, 8192) == 2 and t.pieces_for("rs", 7168, 8192, 2, 8192) == 2
    assert t.pieces_for("ag", 8192, 2560, 4, 8192) is None  # world 4 not measured: the decomposition plans
    assert t.choose("rs", 2048, 8192, 2, 8192, symm=True) == "symm"  # o_proj: torch's fused op was faster
    assert t.choose("rs", 7168, 8192, 2, 8192, symm=True) == "decomp"
    assert CalibrationTable.from_json(t.to_json()) == t


def test_pieces_entries_are_checked():
    with pytest.raises(ValueError, match="pieces entry"):
        CalibrationTable(pieces=(("ag", 1, 1, 2, 1, 5),))
    with pytest.raises(ValueError, match="pieces entry"):
        CalibrationTable(pieces=(("ag", 1, 1, 2, 1),))


class _FakeDecomp:
    def __init__(self, k=8192, n=8192, chunks=None):
        self.k, self.n, self.chunks = k, n, chunks
        self.heap = type("H", (), {"world": 2, "rank": 0})()
        self.calls = []

    def __call__(self, a, b, rows, out=None, chunks=None):
        self.calls.append(chunks)
        return out


def test_auto_ops_pass_the_measured_piece_count():
    from sgl_kernel.tdist.auto import H100_TABLE, AutoAgGemm, AutoGemmRs

    ag = AutoAgGemm(_FakeDecomp(k=8192), None, H100_TABLE)
    ag(torch.zeros(4096, 1), torch.zeros(1, 2560), [4096, 4096])
    ag(torch.zeros(1024, 1), torch.zeros(1, 2560), [1024, 1024])
    assert ag.decomp.calls == [2, 1] and ag.last_path == "decomp"
    rs = AutoGemmRs(_FakeDecomp(n=8192), None, H100_TABLE)
    rs(torch.zeros(1).expand(8192, 7168), torch.zeros(7168, 1), [4096, 4096])
    assert rs.decomp.calls == [2]
    fixed = AutoAgGemm(_FakeDecomp(k=8192, chunks=4), None, H100_TABLE)  # an op built with explicit chunks keeps them
    fixed(torch.zeros(4096, 1), torch.zeros(1, 2560), [4096, 4096])
    assert fixed.decomp.calls == [None]


def test_best_path_per_measured_m_and_symm_needs_a_group():
    """from_timings keeps the fastest of decomposition / NCCL + cuBLAS / torch fused symm-mem per measured M;
    choose() takes "symm" only when the caller has a symmetric-memory group, else the break-even M decides."""
    pts = [dict(kind="rs", k=8, n=16, world=2, m=2048, decomp_ms=1.2, nccl_ms=1.0, symm_ms=1.5),
           dict(kind="rs", k=8, n=16, world=2, m=8192, decomp_ms=0.58, nccl_ms=0.68, symm_ms=0.55),
           dict(kind="ag", k=8, n=16, world=2, m=8192, decomp_ms=2.6, nccl_ms=3.0, symm_ms=None)]
    t = CalibrationTable.from_timings(pts)
    assert ("rs", 8, 16, 2, 8192, "symm") in t.best and ("ag", 8, 16, 2, 8192, "decomp") in t.best
    assert t.choose("rs", 8, 16, 2, 8192, symm=True) == "symm"
    assert t.choose("rs", 8, 16, 2, 16384, symm=True) == "symm"  # the largest measured M <= m applies
    assert t.choose("rs", 8, 16, 2, 8192) == "decomp"  # no symm group: min_m (decomp won at 8192)
    assert t.choose("rs", 8, 16, 2, 2048, symm=True) == "nccl"
    assert t.choose("ag", 8, 16, 2, 8192, symm=True) == "decomp"
    assert CalibrationTable.from_json(t.to_json()) == t
    with pytest.raises(ValueError, match="best entry"):
        CalibrationTable(best=(("rs", 8, 16, 2, 8192, "nvls"),))


def test_auto_without_symm_group_never_takes_the_symm_path():
    from sgl_kernel.tdist.auto import AutoGemmRs

    t = CalibrationTable(best=(("rs", 7168, 8192, 2, 2048, "symm"),))
    rs = AutoGemmRs(_FakeDecomp(n=8192), None, t)  # no NCCL group, no symm group: the decomposition
    rs(torch.zeros(1).expand(4096, 7168), torch.zeros(7168, 1), [2048, 2048])
    assert rs.last_path == "decomp" and rs.decomp.calls == [None]


def test_best_path_ties_within_two_percent_keep_the_earlier_path():
    """A path within 2% of the fastest is a tie and the decomposition (then NCCL) keeps it; a clear win still
    picks the faster path."""
    row = dict(kind="rs", k=7168, n=8192, world=2, m=8192)
    tie = CalibrationTable.from_timings([dict(row, decomp_ms=1.436, nccl_ms=1.701, symm_ms=1.431)])
    assert tie.choose("rs", 7168, 8192, 2, 8192, symm=True) == "decomp"
    win = CalibrationTable.from_timings([dict(row, decomp_ms=1.436, nccl_ms=1.701, symm_ms=1.30)])
    assert win.choose("rs", 7168, 8192, 2, 8192, symm=True) == "symm"
    nccl_tie = CalibrationTable.from_timings([dict(row, m=2048, decomp_ms=0.405, nccl_ms=0.400)])
    assert nccl_tie.choose("rs", 7168, 8192, 2, 2048) == "decomp"


def test_auto_ops_apply_the_measured_schedule():
    """A ``schedules`` entry sets the decomposition's per-peer stream schedule for calls at and above its M; a shape
    without one keeps the op's; bad entries raise; the table round-trips through JSON."""
    from sgl_kernel.tdist.auto import AutoAgGemm, AutoGemmRs, CalibrationTable

    table = CalibrationTable(default_min_m=1, schedules=(("ag", 8192, 2560, 2, 4096, "ring"),
                                                         ("rs", 7168, 8192, 2, 8192, "all")))
    assert CalibrationTable.from_json(table.to_json()) == table
    ag = AutoAgGemm(_FakeDecomp(k=8192), None, table)
    ag.decomp.hs = type("HS", (), {"schedule": "all"})()
    ag(torch.zeros(1024, 1), torch.zeros(1, 2560), [1024, 1024])
    assert ag.decomp.hs.schedule == "ring"  # below the only measured M: that entry
    rs = AutoGemmRs(_FakeDecomp(n=8192), None, table)
    rs.decomp.hs = type("HS", (), {"schedule": "ring"})()
    rs(torch.zeros(1).expand(8192, 2048), torch.zeros(2048, 1), [4096, 4096])
    assert rs.decomp.hs.schedule == "ring"  # K 2048 has no entry: unchanged
    rs(torch.zeros(1).expand(8192, 7168), torch.zeros(7168, 1), [4096, 4096])
    assert rs.decomp.hs.schedule == "all"
    with pytest.raises(ValueError, match="schedules entry"):
        CalibrationTable(schedules=(("ag", 1, 1, 2, 1, "zigzag"),))


def test_builtin_table_per_gpu_model():
    """table_for: H200 -> the H200 table (world-4 rows measured on 4 x H200, world-2 rows of H100 where H200 has
    none), H100 -> the H100 table, any other GPU -> the default table (no measured rows)."""
    from sgl_kernel.tdist.auto import H100_TABLE, H200_TABLE, NEVER, CalibrationTable, table_for

    assert table_for("NVIDIA H200") is H200_TABLE and table_for("NVIDIA H100 80GB HBM3") is H100_TABLE
    assert table_for("NVIDIA A100-SXM4-80GB") == CalibrationTable()
    t = H200_TABLE
    # world 4 on H200: qkv NCCL at 2048 and torch's fused op at 8192 (given a symm group; else the decomposition from
    # its break-even 8192), gate_up decomposition with 1 piece ("all" at 8192), o_proj never the decomposition
    assert t.choose("ag", 8192, 2560, 4, 2048) == "nccl"
    assert t.choose("ag", 8192, 2560, 4, 8192, symm=True) == "symm"
    assert t.choose("ag", 8192, 2560, 4, 8192) == "decomp" and t.pieces_for("ag", 8192, 2560, 4, 8192) == 2
    assert t.choose("ag", 8192, 14336, 4, 8192) == "decomp" and t.schedule_for("ag", 8192, 14336, 4, 8192) == "all"
    assert t.pieces_for("ag", 8192, 14336, 4, 16384) == 1
    assert t.min_m("rs", 2048, 8192, 4) == NEVER and t.choose("rs", 2048, 8192, 4, 8192) == "nccl"
    assert t.choose("rs", 7168, 8192, 4, 8192, symm=True) == "symm" and t.choose("rs", 7168, 8192, 4, 2048) == "nccl"
    # world 2: H200's measured o_proj row replaces H100's (decomp, 4 pieces), H100's other rows stay
    assert t.choose("rs", 2048, 8192, 2, 8192, symm=True) == "decomp" and t.pieces_for("rs", 2048, 8192, 2, 8192) == 4
    assert H100_TABLE.choose("rs", 2048, 8192, 2, 8192, symm=True) == "symm"
    assert t.choose("ag", 8192, 14336, 2, 2048) == "decomp" and t.pieces_for("ag", 8192, 14336, 2, 8192) == 2
    assert t.min_m("ag", 8192, 2560, 2) == 2048
    # the table round-trips through JSON (what benchmark/tdist/bench_kernels.py prints)
    assert CalibrationTable.from_json(t.to_json()) == t
