"""Helpers for the prefill/decode disaggregation tests: a prefill server, a decode server and the mini_lb
router as separate processes (stopped without orphans)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import Optional

import requests

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
from server_utils import ENV, ServerProcess, free_port  # noqa: E402

# SGLANG_PD_TEST_DEVICE=cuda SGLANG_PD_TEST_BACKEND=nixl run the same tests on a GPU (scripts/gpu/pd_disaggregation.sh);
# SGLANG_PD_TEST_SPLIT_GPUS=1 in addition puts every prefill server on GPU 0 and every decode server on GPU 1
# (--base-gpu-id), so the KV crosses GPUs (scripts/gpu/pd_2gpu.sh); the aggregated baseline stays on GPU 0
DEVICE = os.environ.get("SGLANG_PD_TEST_DEVICE", "cpu")
BACKEND = os.environ.get("SGLANG_PD_TEST_BACKEND", "fake")
SPLIT_GPUS = DEVICE == "cuda" and os.environ.get("SGLANG_PD_TEST_SPLIT_GPUS", "") == "1"
_GPU = ["--mem-fraction-static", "0.2", "--cuda-graph-max-bs", "8"] if DEVICE == "cuda" else []
FAST = ["--device", DEVICE, "--max-total-tokens", "2048", "--max-running-requests", "8",
        "--disaggregation-transfer-backend", BACKEND, "--disaggregation-verify", *_GPU]
AGG = [*FAST[:6], *_GPU]  # the aggregated baseline's flags (no disaggregation flags)


def pd_args(mode: str, model: str, extra: Optional[list[str]] = None, bootstrap_port: Optional[int] = None,
            timeouts: float = 20.0) -> list[str]:
    """launch_server arguments of one side."""
    args = ["--model-path", model, *FAST, "--disaggregation-mode", mode,
            "--disaggregation-bootstrap-timeout", str(timeouts), "--disaggregation-transfer-timeout", str(timeouts),
            "--disaggregation-heartbeat-timeout", "3", "--disaggregation-heartbeat-interval", "0.5", "--enable-metrics"]
    if mode == "prefill":
        args += ["--disaggregation-bootstrap-port", str(bootstrap_port or free_port())]
    if SPLIT_GPUS:
        args += ["--base-gpu-id", "0" if mode == "prefill" else "1"]
    return args + list(extra or [])


class Router:
    """``python -m sglang.srt.disaggregation.mini_lb`` on a free port."""

    def __init__(self, prefill: list[str], decode: list[str], extra: Optional[list[str]] = None,
                 timeout: float = 60.0):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = f"/tmp/sglang-test-router-{self.port}.log"
        self._log = open(self.log_path, "w")
        cmd = [sys.executable, "-m", "sglang.srt.disaggregation.mini_lb", "--port", str(self.port)]
        if prefill:
            cmd += ["--prefill", *prefill]
        if decode:
            cmd += ["--decode", *decode]
        self.proc = subprocess.Popen(cmd + list(extra or []), stdout=self._log, stderr=subprocess.STDOUT, env=ENV)
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"router exited {self.proc.returncode}:\n{open(self.log_path).read()[-3000:]}")
            try:
                if requests.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.3)
        self.stop()
        raise RuntimeError("router not healthy")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._log.close()


_T0 = time.monotonic()


def progress(msg: str) -> None:
    """One timestamped progress line on stderr, flushed (visible with ``pytest -s`` even if the test is killed):
    wall clock UTC and seconds since the test module was imported."""
    stamp = time.strftime("%H:%M:%S", time.gmtime())
    sys.stderr.write(f"[pd-test {stamp} +{time.monotonic() - _T0:.1f}s] {msg}\n")
    sys.stderr.flush()


def start_servers(arg_lists: list[list[str]], names: list[str], timeout: float = 600.0) -> list[ServerProcess]:
    """Start every server at once and wait until all are healthy (their start-up overlaps: on GPUs each spends
    most of it in CUDA init and graph capture). On any failure every one of them is stopped and the error
    re-raised. Progress lines name each server, its port and log file."""
    servers = []
    try:
        for args, name in zip(arg_lists, names):
            servers.append(ServerProcess(args, timeout=timeout, wait=False))
            progress(f"starting {name} on port {servers[-1].port} (log {servers[-1].log_path})")
        end = time.time() + timeout
        for s, name in zip(servers, names):
            s.wait_healthy(max(end - time.time(), 1.0))
            progress(f"{name} up")
        return servers
    except BaseException:
        for s in servers:
            s.stop()
        raise


def kv_in_use(server: ServerProcess) -> int:
    """KV slots held by requests (not free and not reclaimable from the prefix cache)."""
    st = server.internal_state()
    return st["max_total_tokens"] - st["available_tokens"] - st["evictable_tokens"]


def wait_for(cond, what: str, timeout: float = 20.0) -> None:
    """Poll ``cond()`` every 50 ms; AssertionError naming ``what`` after ``timeout`` seconds."""
    end = time.time() + timeout
    while time.time() < end:
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def generate_in_order(prefill: ServerProcess, decode: ServerProcess, bootstrap_port: int, body: dict, room: int,
                      decode_first: bool, wait_key: Optional[str] = None) -> dict:
    """One /generate through both sides without the router, in a known order; returns the decode side's answer.

    ``decode_first``: the decode side's RoomRequest (push: with its preallocated slots) reaches the prefill side
    before the request does (push mode then writes layer by layer during the forward); else the prefill forward
    ran and its KV is held before the decode side asks (push: written after the forward). ``wait_key``: the
    prefill server's ``/get_server_info`` counter that must reach 1 before the second side gets the request
    (default ``disagg_rooms_awaiting_prefill`` / ``disagg_open_rooms``)."""
    import threading

    body = {**body, "bootstrap_host": "127.0.0.1", "bootstrap_port": bootstrap_port, "bootstrap_room": room}

    def post(server: ServerProcess) -> dict:
        r = requests.post(server.url + "/generate", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()

    out: dict = {}
    first, second = (decode, prefill) if decode_first else (prefill, decode)
    t = threading.Thread(target=lambda: out.setdefault("first", post(first)))
    t.start()
    key = wait_key or ("disagg_rooms_awaiting_prefill" if decode_first else "disagg_open_rooms")
    wait_for(lambda: prefill.internal_state()[key] >= 1, key)
    out["second"] = post(second)
    t.join(120)
    assert "first" in out, "the first request did not finish"
    return out["first"] if decode_first else out["second"]
