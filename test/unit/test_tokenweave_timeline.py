"""``benchmark/tokenweave/overlap_timeline.py`` (the TokenWeave overlap diagnosis) on a tiny synthetic kernel timeline whose
busy times, overlap and gap causes are known by construction."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmark.tokenweave import overlap_timeline as tl  # noqa: E402

# compute stream 7: GEMM [0, 100], attention [150, 250] (resumes 5 us after the comm kernel's end: wait-comm),
# GEMM [400, 450] (nothing ran in [250, 400]: idle), GEMM [480, 600] ([450, 480] has comm running but no end
# near 480: comm-running); comm stream 22: [50, 145] and [440, 520]; one NCCL kernel on stream 7 at [600, 610]
ROWS = [(7, 0, 100, 0, "nvjet_sm90_gemm"), (22, 50, 95, 1, "void twcomm::twoshot_bulk_kernel<bf16>"),
        (7, 150, 100, 0, "_extend_kernel"), (7, 400, 50, 0, "nvjet_sm90_gemm_b"),
        (22, 440, 80, 1, "void twcomm::twoshot_bulk_kernel<bf16>"), (7, 480, 120, 0, "nvjet_sm90_gemm_c"),
        (7, 600, 10, 1, "ncclDevKernel_AllGather_RING_LL")]


def _csv(tmp_path, rows=ROWS, header="stream,start_us,dur_us,comm,name"):
    p = tmp_path / "t.csv"
    p.write_text(header + "\n" + "".join(f"{s},{a},{d},{c},{n}\n" for s, a, d, c, n in rows))
    return str(p)


def test_busy_overlap_and_gap_causes(tmp_path):
    ks = tl.load(_csv(tmp_path))
    st = tl.analyze(ks, gap_us=20, tol_us=10)
    assert st["compute_stream"] == 7 and st["span"] == pytest.approx(610)
    # comm union [50,145] + [440,520] + [600,610] = 95 + 80 + 10; compute union [0,100] [150,250] [400,450] [480,600]
    assert st["comm_busy"] == pytest.approx(185) and st["compute_busy"] == pytest.approx(370)
    # overlap: [50,100] = 50, [440,450] = 10, [480,520] = 40 -> 100
    assert st["overlap"] == pytest.approx(100) and st["overlap_frac"] == pytest.approx(100 / 185)
    assert st["streams"][7] == (5, pytest.approx(380), 1) and st["streams"][22] == (2, pytest.approx(175), 2)
    assert [ov for _, ov in st["per_comm"]] == [pytest.approx(50), pytest.approx(50), pytest.approx(0)]
    causes = [(g.start, g.end, g.cause) for g in st["gaps"]]
    assert causes == [(100, 150, "wait-comm"), (250, 400, "idle"), (450, 480, "comm-running")]
    assert st["gaps"][0].comm.start == 50 and st["gaps"][1].comm is None
    assert st["gap_by_cause"] == {"wait-comm": 50, "idle": 150, "comm-running": 30}
    assert st["gaps"][0].before == "nvjet_sm90_gemm" and st["gaps"][0].after == "_extend_kernel"


def test_tolerance_and_min_gap(tmp_path):
    ks = tl.load(_csv(tmp_path))
    st = tl.analyze(ks, gap_us=40, tol_us=2)  # the 5 us resume is now too late for wait-comm; 30 us gap dropped
    assert [(g.start, g.cause) for g in st["gaps"]] == [(100, "comm-running"), (250, "idle")]


def test_schedule_and_report_lines(tmp_path):
    ks = tl.load(_csv(tmp_path))
    sched = tl.schedule(ks, 0, 200)
    assert len(sched) == 4  # header + 3 kernels starting before 200
    assert sched[2].split(" | ")[:6] == ["50.0", "145.0", "22", "comm", "95.0", "50.0"]
    assert sched[3].split(" | ")[3] == "attention"
    text = "\n".join(tl.report(tl.analyze(ks)))
    assert "overlapped by compute 100.0 us (0.54)" in text and "wait-comm 50.0 us" in text
    assert tl.main([_csv(tmp_path), "--schedule", "0", "200"]) == 0


def test_bad_input(tmp_path):
    with pytest.raises(ValueError, match="lack"):
        tl.load(_csv(tmp_path, header="stream,start,dur_us,comm,name"))
    with pytest.raises(ValueError, match="does not parse"):
        tl.load(_csv(tmp_path, rows=[(7, "x", 1, 0, "k")]))
    with pytest.raises(ValueError, match="no compute kernel"):
        tl.analyze(tl.load(_csv(tmp_path, rows=[(22, 0, 5, 1, "nccl")])))
    with pytest.raises(ValueError, match="empty"):
        tl.analyze([])
    assert tl.main([str(tmp_path / "missing.csv")]) == 2


def test_union_and_intersect():
    assert tl.union([(5, 7), (0, 2), (1, 3), (7, 8)]) == [(0, 3), (5, 8)]
    assert tl.intersect([(0, 3), (5, 8)], [(2, 6)]) == pytest.approx(2)
    assert tl.length([(0, 3), (5, 8)]) == 6
