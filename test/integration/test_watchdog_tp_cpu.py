"""A stalled TP rank under ``--watchdog-timeout`` (CPU, ``--tp 2``, stories260K), and the rendezvous store's
listening address.

SIGSTOP on rank 1 (no crash, no closed socket: only a watchdog can notice): the in-flight stream gets a 503
error event and ``[DONE]``, ``/health`` turns 503, and the server exits non-zero naming the watchdog.
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time

import psutil
import pytest
import requests

from conftest import shared_path
from server_utils import ServerProcess


def _listening(pid: int) -> list[tuple[str, int]]:
    try:
        conns = psutil.Process(pid).net_connections(kind="tcp")
    except psutil.NoSuchProcess:
        return []
    return [(c.laddr.ip, c.laddr.port) for c in conns if c.status == psutil.CONN_LISTEN]


# SGLANG_TEST_DEVICE=cuda (scripts/gpu/one_gpu.sh watchdog): both ranks on one GPU (--tp-ranks-share-gpu)
DEVICE_ARGS = (["--device", "cuda", "--tp-ranks-share-gpu"] if os.environ.get("SGLANG_TEST_DEVICE") == "cuda"
               else ["--device", "cpu"])


def test_stalled_rank_stops_server_and_store_listens_on_loopback_only():
    s = ServerProcess(["--model-path", shared_path("models", "stories260K"), *DEVICE_ARGS, "--tp", "2",
                       "--watchdog-timeout", "4"])
    rank1 = None
    try:
        log = open(s.log_path).read()
        pids = {int(r): int(p) for r, p in re.findall(r"scheduler TP rank (\d+) started \(pid (\d+)\)", log)}
        rank1 = pids[1]
        for rank, pid in pids.items():  # nothing listens on every interface
            socks = _listening(pid)
            assert all(ip in ("127.0.0.1", "::1") for ip, _ in socks), (rank, socks)
        assert _listening(pids[0]), "rank 0 serves the rendezvous store"

        warm = requests.post(s.url + "/generate", timeout=120, json={  # compile/warm every kernel first
            "text": "Once upon a time", "sampling_params": {"max_new_tokens": 8, "ignore_eos": True}})
        assert warm.status_code == 200, warm.text
        health: list[int] = []
        stop_probe = threading.Event()

        def probe() -> None:
            while not stop_probe.is_set():
                try:
                    health.append(requests.get(s.url + "/health", timeout=2).status_code)
                except requests.RequestException:
                    health.append(-1)
                time.sleep(0.1)

        threading.Thread(target=probe, daemon=True).start()
        with requests.post(s.url + "/generate", stream=True, timeout=120, json={
                "text": "Once upon a time", "stream": True,
                "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}}) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            first = next(x for x in lines if x)  # streaming is under way
            assert first.startswith(b"data: {")
            os.kill(rank1, signal.SIGSTOP)
            t0 = time.monotonic()
            rest = [x.decode() for x in lines if x]
        waited = time.monotonic() - t0
        assert rest[-1] == "data: [DONE]", rest[-3:]
        err = json.loads(rest[-2][len("data: "):])["error"]
        assert err["code"] == 503 and "watchdog" in err["message"], err
        assert waited < 60, waited
        s.proc.wait(timeout=60)
        stop_probe.set()
        assert s.proc.returncode not in (0, None)
        assert 503 in health, health[-20:]
        assert "stopped by its watchdog" in s.log_tail(400)
    finally:
        if rank1 is not None and psutil.pid_exists(rank1):
            os.kill(rank1, signal.SIGKILL)
        assert s.stop() == []
