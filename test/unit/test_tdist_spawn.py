"""The tdist rank harness (sgl_kernel.tdist.spawn.run_ranks) fails closed and keeps partial results, on CPU: ranks
are real spawned processes with a gloo group and a host stand-in heap. Per-case results reach the parent as each
case finishes (so a later hang does not lose them), a rank that stops sending is killed after ``stall_timeout`` with
its last progress note, and a rank that raises is reported with its traceback."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
for p in (str(HERE), str(REPO / "sgl-kernel" / "python"), str(REPO / "python")):
    if p not in sys.path:
        sys.path.insert(0, p)

from sgl_kernel.tdist.layout import HeapConfig  # noqa: E402
from sgl_kernel.tdist.spawn import run_ranks  # noqa: E402

from sglang.srt.utils.nvls_env import NVLS_OFF_ENV  # noqa: E402

import tdist_spawn_case as C  # noqa: E402

CFG = HeapConfig(data_bytes=1 << 12, signal_slots=16)


def _run(hang_in, raise_in, stall, notes=None):
    got = []
    results, problems = run_ranks(2, C.three_cases, (hang_in, raise_in), heap_config=CFG, timeout=120,
                                  env=NVLS_OFF_ENV,
                                  stall_timeout=stall, gloo_timeout=30, cpu_heap=True,
                                  on_result=lambda r, k, v: got.append((r, k, v["rank"])),
                                  on_note=None if notes is None else lambda r, msg: notes.append((r, msg)))
    return results, problems, got


@pytest.mark.timeout(180)
def test_all_cases_reported_and_results_returned(monkeypatch):
    """Also: every progress note reaches on_note live, and the ranks run with CUDA_DEVICE_MAX_CONNECTIONS=32 (set
    by the harness before CUDA when the parent leaves it unset: layout.stream_queue_env)."""
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    notes = []
    results, problems, got = _run(-1, -1, None, notes)
    assert problems == []
    assert results == [{"finished": r, "connections": "32"} for r in range(2)]
    assert sorted(got) == sorted((r, f"c{i}", r) for r in range(2) for i in range(3))
    assert {(r, f"c{i} done") for r in range(2) for i in range(3)} <= set(notes), notes


def test_stream_queue_env_keeps_an_explicit_value():
    from sgl_kernel.tdist.layout import stream_queue_env

    assert stream_queue_env({}) == {"CUDA_DEVICE_MAX_CONNECTIONS": "32"}
    assert stream_queue_env({"CUDA_DEVICE_MAX_CONNECTIONS": "8"}) == {}


@pytest.mark.timeout(180)
def test_stalled_rank_is_killed_and_earlier_cases_are_kept():
    # the stall bound must exceed a rank's start-up (spawn + torch import + gloo rendezvous) on a loaded 2-core CI
    # machine: with 8 s both ranks were killed before their first case in a full-suite run
    t = time.time()
    results, problems, got = _run(2, -1, 25.0)
    assert time.time() - t < 150
    assert {(r, k) for r, k, _ in got} >= {(0, "c0"), (1, "c0"), (0, "c1"), (1, "c1")}
    assert (1, "c2") not in {(r, k) for r, k, _ in got}
    assert results[1] is None
    assert any("rank 1 sent nothing for 25 s; last progress: c2 start" in p for p in problems), problems


@pytest.mark.timeout(180)
def test_raising_rank_is_reported_with_its_traceback():
    results, problems, got = _run(-1, 1, None)
    assert (1, "c0") in {(r, k) for r, k, _ in got} and (1, "c1") not in {(r, k) for r, k, _ in got}
    assert any("rank 1 raised" in p and "boom in c1" in p for p in problems), problems
