"""The decode side's KV hand-off: READs are posted and polled while the launched forward runs
(``DecodeConnector.during_forward``, called by ``Scheduler.step`` between launch and result), so their DONE time is
stamped when they finish rather than at the next step; ``meta_info`` / ``/metrics`` separate the pure transfer time
(first READ posted -> last READ DONE) from the scheduling phases (RoomReady -> post, DONE -> activation)."""

from __future__ import annotations

import time
from types import SimpleNamespace

from sglang.srt.disaggregation import decode as dec
from sglang.srt.disaggregation.decode import DecodeConnector
from sglang.srt.disaggregation.decode_room import DecodeRoom, handoff_timings
from sglang.srt.metrics.collector import MetricsCollector


class _Queue:
    """A TransferQueue stand-in: one READ that becomes DONE on the ``done_after``-th ``progress`` call."""

    def __init__(self, done_after: int):
        self.calls, self.done_after = 0, done_after

    def progress(self):
        self.calls += 1
        return []

    def busy_rooms(self):
        return set() if self.calls >= self.done_after else {"7:0"}


def _connector(queue: _Queue, ready_rooms=(), tp_size: int = 2, recv=lambda: []) -> DecodeConnector:
    c = DecodeConnector.__new__(DecodeConnector)  # no scheduler: only the hand-off path is exercised
    c.rooms, c._decided, c.transfer_mode = {}, [], "pull"
    c.agent = SimpleNamespace(queue=queue, recv=recv, tp_size=tp_size)
    c.started = []
    c._start_transfer = lambda r: (c.started.append(r.room), setattr(r, "state", "transfer"))
    for room in ready_rooms:
        c.rooms[room] = DecodeRoom(room, None, ("h", 1), state="wait_ready", ready=object())
    return c


def test_during_forward_polls_until_the_reads_are_done():
    q = _Queue(done_after=4)
    calls = []
    c = _connector(q, ready_rooms=(3, 1), recv=lambda: calls.append(1) or [])
    c.during_forward(lambda: False)  # TP > 1, forward still running: poll until no READ is in flight
    assert q.calls == 4
    assert c.started == [1, 3]  # ready rooms are posted first, in room order
    assert len(calls) == 1  # TP > 1: the control broadcast happens once, at the same point on every rank


def test_during_forward_tp1_posts_a_room_ready_that_arrives_mid_forward():
    q = _Queue(done_after=0)
    rounds = []

    def recv():
        rounds.append(1)
        if len(rounds) == 3:  # RoomReady of room 9 arrives while the forward runs
            c.rooms[9].ready = object()
        return []

    c = _connector(q, tp_size=1, recv=recv)
    c.rooms[9] = DecodeRoom(9, None, ("h", 1), state="wait_ready")
    c.during_forward(lambda: len(rounds) >= 5)
    # read on every round; posted once, in the round it arrived; then nothing is in flight or awaited: stop
    assert c.started == [9] and len(rounds) == 3


def test_during_forward_tp1_returns_at_once_when_nothing_is_awaited():
    """No room waits for KV and no READ is in flight: one pass, so the host is free for the previous batch's results
    (overlap scheduling) instead of spinning until the forward ends."""
    q = _Queue(done_after=0)
    c = _connector(q, tp_size=1)
    c.rooms[4] = DecodeRoom(4, None, ("h", 1), state="transfer")  # READs done, waiting for activation at poll()
    t0 = time.monotonic()
    c.during_forward(lambda: False)
    assert q.calls == 1 and time.monotonic() - t0 < 0.05


def test_during_forward_stops_when_the_forward_is_done():
    for tp in (1, 2):
        q = _Queue(done_after=100)
        c = _connector(q, tp_size=tp)
        c.during_forward(lambda: True)  # CPU: the forward already ran -> one pass, never spins
        assert q.calls == 1


def test_during_forward_spin_is_bounded():
    for tp in (1, 2):
        q = _Queue(done_after=10**9)
        c = _connector(q, tp_size=tp)
        t0 = time.monotonic()
        c.during_forward(lambda: False)  # a READ that never finishes and a forward that never ends
        assert time.monotonic() - t0 < dec.SPIN_MAX_S + 0.2
        assert q.calls > 1


def test_timings_separate_pure_transfer_from_scheduling_waits():
    r = DecodeRoom(5, None, ("h", 1), t_alloc=99.0, t_ready=100.0, t_post=100.002, t_done=100.003)
    ready = SimpleNamespace(push_time_s=0.5, prefill_queue_s=0.25)
    req = SimpleNamespace(arrival_time=98.0)
    out = handoff_timings(r, ready, req, pull=True, t=100.009)
    assert abs(out["transfer_time_s"] - 0.001) < 1e-9
    assert abs(out["transfer_setup_s"] - 0.002) < 1e-9
    assert abs(out["transfer_wait_s"] - 0.006) < 1e-9
    assert abs(out["handoff_s"] - 0.009) < 1e-9
    assert out["decode_queue_s"] == 1.0 and out["prefill_queue_s"] == 0.25
    push = handoff_timings(r, ready, req, pull=False, t=100.009)  # push: the prefill side's WRITE time, no READ phases
    assert push["transfer_time_s"] == 0.5 and "transfer_setup_s" not in push
    assert "transfer_tail_s" not in out
    ready.push_tail_s = 0.125  # layerwise push: the part of the WRITE time after the prefill forward
    assert handoff_timings(r, ready, req, pull=False, t=100.009)["transfer_tail_s"] == 0.125


def test_metrics_expose_the_handoff_phases():
    m = MetricsCollector("m")
    m.observe_kv_transfer({"transfer_bytes": 10, "transfer_reads": 2, "transfer_time_s": 0.001,
                           "transfer_setup_s": 0.002, "transfer_wait_s": 0.006, "handoff_s": 0.009})
    m.observe_kv_transfer({"transfer_bytes": 10, "transfer_reads": 2, "transfer_time_s": 0.5, "transfer_tail_s": 0.25})
    text = m.render().decode()
    for phase, v in (("setup", 0.002), ("wait", 0.006), ("handoff", 0.009), ("tail", 0.25)):
        line = next(x for x in text.splitlines()
                    if x.startswith("sglang:kv_handoff_seconds_sum") and f'phase="{phase}"' in x)
        assert abs(float(line.split()[-1]) - v) < 1e-12, line
    assert "sglang:kv_transfer_seconds_sum" in text
