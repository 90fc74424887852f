"""SchedulerWatchdog (``--watchdog-timeout``): fires once when no loop iteration finished in time."""

from __future__ import annotations

import time

import pytest

from sglang.srt.managers.watchdog import SchedulerWatchdog


def test_fires_once_only_after_timeout_without_beats():
    now = [100.0]
    fired = []
    wd = SchedulerWatchdog(5.0, on_expire=lambda: fired.append(now[0]), clock=lambda: now[0])
    for _ in range(20):  # a loop that keeps iterating never trips it
        now[0] += 4.9
        wd.beat()
        assert not wd.check()
    now[0] += 5.0
    assert not wd.check()
    now[0] += 0.2
    assert wd.check() and fired == [now[0]]
    now[0] += 100
    assert not wd.check() and len(fired) == 1


def test_thread_fires_when_loop_stalls():
    fired = []
    wd = SchedulerWatchdog(0.3, on_expire=lambda: fired.append(1)).start()
    try:
        for _ in range(8):
            time.sleep(0.05)
            wd.beat()
        assert not fired
        deadline = time.time() + 5
        while not fired and time.time() < deadline:
            time.sleep(0.05)
        assert fired == [1]
    finally:
        wd.stop()


def test_rejects_nonpositive_timeout():
    with pytest.raises(ValueError, match="watchdog-timeout"):
        SchedulerWatchdog(0)
