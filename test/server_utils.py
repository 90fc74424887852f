"""Start a real ``python -m sglang.launch_server`` for tests, and stop it without orphans."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Optional

import psutil
import requests

from sglang.srt.utils.nvls_env import NVLS_OFF_ENV  # noqa: E402  (pure Python: the multicast-off env, defined once)

ENV = {**os.environ, **NVLS_OFF_ENV, "PYTHONUNBUFFERED": "1"}

#: ``SGLANG_TEST_SERVER_FORK=0`` starts every test server as a plain ``python -m sglang.launch_server`` subprocess;
#: by default servers without extra environment are forked from a preloaded zygote (``server_zygote.py``) on
#: machines without a GPU.
FORK_ENV = "SGLANG_TEST_SERVER_FORK"
_zygotes: dict = {}  # this test process's zygote (created on first use), keyed by its pid


def _zygote():
    """This process's server zygote, or None (disabled, a GPU machine, or it failed to start once)."""
    if os.environ.get(FORK_ENV, "1") == "0" or os.path.exists("/dev/nvidia0"):
        return None
    key = os.getpid()
    if key not in _zygotes:
        from server_zygote import Zygote, ZygoteError

        try:
            _zygotes[key] = Zygote(ENV)
        except (ZygoteError, OSError):
            _zygotes[key] = None
    return _zygotes[key]


def free_port() -> int:
    """A TCP port free on 127.0.0.1 a moment ago, picked below the kernel's ephemeral range (see
    ``free_tcp_ports``): no outgoing ``connect()`` of another test process (parallel workers) can take it before the
    server binds it, as it could take a kernel-assigned ``bind(0)`` port."""
    from sglang.srt.utils.common import free_tcp_ports

    return free_tcp_ports(1)[0]


class ServerProcess:
    """A server subprocess on a free port; ``url`` is its base URL. Without ``env`` it is forked from this test
    process's preloaded zygote (``server_zygote.py``: the same ``python -m sglang.launch_server`` run without
    re-importing torch and transformers; ``SGLANG_TEST_SERVER_FORK=0`` turns that off); ``proc`` then is a
    :class:`server_zygote.ZygoteProcess` with the ``subprocess.Popen`` methods the tests use.

    Raises RuntimeError (with the server's log tail) if it exits or is not
    healthy within ``timeout`` seconds.
    """

    def __init__(self, args: list[str], timeout: float = 240.0, api_key: Optional[str] = None, wait: bool = True,
                 env: Optional[dict] = None):
        """``wait=False``: return once the process is started; call :meth:`wait_healthy` (servers start in
        parallel, e.g. :func:`pd_utils.start_servers`). ``env``: variables added to this server's environment."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        cmd = [sys.executable, "-m", "sglang.launch_server", "--port", str(self.port), *args]
        if api_key:
            cmd += ["--api-key", api_key]
        self.log_path = f"/tmp/sglang-test-server-{self.port}.log"
        self._log = open(self.log_path, "w")
        self.proc = None
        zygote = None if env else _zygote()  # extra environment: a fresh interpreter must see it from the start
        if zygote is not None:
            from server_zygote import ZygoteError

            try:
                self.proc = zygote.start(cmd[3:], ENV, self.log_path)
            except ZygoteError:
                self.proc = None
        if self.proc is None:
            self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                         env={**ENV, **(env or {})})
        if wait:
            self.wait_healthy(timeout)

    def wait_healthy(self, timeout: float = 240.0) -> None:
        """Block until ``/health`` answers 200; RuntimeError (with the log tail, the server stopped) if the process
        exits or ``timeout`` seconds pass."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if requests.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"server not healthy after {timeout}s:\n{self.log_tail()}")

    def log_tail(self, n: int = 60) -> str:
        with open(self.log_path) as f:
            return "".join(f.readlines()[-n:])

    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def internal_state(self) -> dict:
        info = requests.get(self.url + "/get_server_info", headers=self.headers(), timeout=30).json()
        return info["internal_states"][0]

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> list[int]:
        """Stop the server; returns the pids of descendants still alive afterwards (should be [])."""
        try:
            children = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            children = []
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        gone, alive = psutil.wait_procs(children, timeout=10)
        for p in alive:
            p.kill()
        self._log.close()
        return [p.pid for p in alive]

    def __enter__(self) -> "ServerProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def start_all(argv: dict, timeout: float = 600.0) -> dict:
    """Start one server per ``name -> launch_server arguments`` at once and wait until every one is healthy (their
    start-ups overlap); returns ``name -> ServerProcess``. On any failure all of them are stopped and the first
    error is re-raised (RuntimeError with that server's log tail)."""
    started: dict = {}
    try:
        for name, args in argv.items():
            started[name] = ServerProcess(args, timeout=timeout, wait=False)
        end = time.time() + timeout
        for srv in started.values():
            srv.wait_healthy(max(end - time.time(), 1.0))
        return started
    except BaseException:
        stop_all(started.values())
        raise


def stop_all(servers) -> None:
    """Stop every server (or anything with a ``stop()``) at once, in threads: the SIGTERM grace periods overlap."""
    import threading

    threads = [threading.Thread(target=s.stop) for s in servers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
