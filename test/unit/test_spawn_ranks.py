"""``sglang.test.spawn_ranks`` on CPU: ranks are forked from a torch-preloaded forkserver, yet each sees what a
``spawn``-ed process would: the caller's environment and ``sys.path`` at the time of the call (not the forkserver's
from its start), its own pid, one gloo group; a failing rank's traceback and a dead rank are reported."""

from __future__ import annotations

import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from spawn_ranks_cases import all_reduce_rank, env_and_path, raise_on_rank_one  # noqa: E402

from sglang.test.spawn_ranks import spawn_ranks  # noqa: E402


def test_ranks_see_the_callers_environment_and_path_at_call_time(monkeypatch, tmp_path):
    spawn_ranks(all_reduce_rank, 2, sys_path=(HERE,))  # the forkserver is up from here on
    for value in ("first", "second"):
        monkeypatch.setenv("SPAWN_RANKS_PROBE", value)
        extra = str(tmp_path / value)
        monkeypatch.syspath_prepend(extra)
        out = spawn_ranks(env_and_path, 2, extra, sys_path=(HERE,))
        assert [o["probe"] for o in out] == [value, value]
        assert all(o["has_path"] for o in out)
        assert len({o["pid"] for o in out} | {os.getpid()}) == 3  # one process per rank, not the caller
    monkeypatch.delenv("SPAWN_RANKS_PROBE")
    assert [o["probe"] for o in spawn_ranks(env_and_path, 2, "", sys_path=(HERE,))] == [None, None]


def test_all_reduce_over_the_ranks_group():
    assert spawn_ranks(all_reduce_rank, 3, sys_path=(HERE,)) == [3.0, 3.0, 3.0]


def test_a_failing_rank_is_reported_with_its_traceback():
    with pytest.raises(RuntimeError, match=r"rank 1 failed:(.|\n)*ValueError: rank one refuses"):
        spawn_ranks(raise_on_rank_one, 2, sys_path=(HERE,), timeout=60)
