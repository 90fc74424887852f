"""Startup races seen in CI under ``--use-ray``: a probed port taken before it was bound, and remote ranks' log lines
swallowed by Ray's log deduplication.

- :func:`free_tcp_ports` picks ports below the kernel's ephemeral range, so no ``connect()`` / ``bind(0)`` of another
  process takes them; :func:`bind_zmq_tcp` binds at once and returns a reachable endpoint.
- Importing :mod:`sglang.srt.ray` sets ``RAY_DEDUP_LOGS=0`` unless the user set it; with Ray's default the second
  rank's ``[... Scheduler TP1]`` line is held back (shown here against Ray's own deduplicator) until some later log
  line arrives after the aggregation window, which an idle server never sends.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import zmq

from sglang.srt.utils.common import _ephemeral_range, bind_zmq_tcp, free_tcp_ports


def test_free_tcp_ports_are_distinct_bindable_and_below_the_ephemeral_range():
    import socket

    lo_eph, _ = _ephemeral_range()
    for _ in range(20):
        ports = free_tcp_ports(4)
        assert len(set(ports)) == 4
        assert all(20000 <= p < lo_eph for p in ports), (ports, lo_eph)
        socks = [socket.socket() for _ in ports]
        try:
            for s, p in zip(socks, ports):
                s.bind(("127.0.0.1", p))  # each one is free right after the call
        finally:
            for s in socks:
                s.close()


def test_free_tcp_ports_falls_back_to_kernel_ports_when_no_room_below_the_ephemeral_range():
    lo_eph, _ = _ephemeral_range()
    ports = free_tcp_ports(2, low=lo_eph)  # no room: the kernel assigns them
    assert len(set(ports)) == 2 and all(p > 0 for p in ports)


def test_bind_zmq_tcp_is_bound_before_returning_and_reachable():
    ctx = zmq.Context()
    pull, endpoint = bind_zmq_tcp(ctx, zmq.PULL, "127.0.0.1")
    push = ctx.socket(zmq.PUSH)
    try:
        port = int(endpoint.rsplit(":", 1)[1])
        assert endpoint == f"tcp://127.0.0.1:{port}"
        other = ctx.socket(zmq.PULL)
        with pytest.raises(zmq.ZMQError, match="in use"):  # the port is held: nobody else can bind it
            other.bind(endpoint)
        other.close(linger=0)
        push.connect(endpoint)
        push.send(b"hello")
        assert pull.poll(5000) and pull.recv() == b"hello"
    finally:
        push.close(linger=0)
        pull.close(linger=0)
        ctx.term()


def _run(code: str, **env) -> str:
    full = {k: v for k, v in os.environ.items() if k != "RAY_DEDUP_LOGS"}
    full.update(env)
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=full, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_importing_the_ray_package_turns_ray_log_dedup_off_unless_the_user_chose():
    code = "import os, sglang.srt.ray; import sys; sys.stdout.write(os.environ['RAY_DEDUP_LOGS'])"
    assert _run(code) == "0"
    assert _run(code, RAY_DEDUP_LOGS="1") == "1"


DEDUP = """
    {first}
    from ray._private.ray_logging import LogDeduplicator

    t = [0.0]
    d = LogDeduplicator(agg_window_s=5, allow_re=None, skip_re=None, _timesource=lambda: t[0])
    lines = []
    for pid, rank in ((101, 0), (202, 1)):
        batch = {{"ip": "10.0.0.1", "pid": pid, "job": "01", "is_err": True, "actor_name": None, "task_name": None,
                  "lines": [f"[2026-11-27 10:08:13 Scheduler TP{{rank}}] INFO x: TP rank {{rank}}/2 ready"]}}
        for b in d.deduplicate(batch):
            lines += b["lines"]
    # the driver prints what deduplicate() returns; a held-back line only comes out with a later batch that arrives
    # after the aggregation window, which an idle server never sends
    import sys
    sys.stdout.write(str(any("Scheduler TP1]" in line for line in lines)))
"""


def test_ray_dedup_would_drop_the_second_rank_and_does_not_after_our_import():
    pytest.importorskip("ray", reason="ray is not installed (pip install '.[ray]')")
    assert _run(DEDUP.format(first="import sglang.srt.ray")) == "True"
    # the counterfactual: Ray's default setting swallows TP1's line (held back: why the package turns it off)
    assert _run(DEDUP.format(first="import sglang.srt.ray"), RAY_DEDUP_LOGS="1") == "False"
