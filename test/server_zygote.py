"""Start test servers by forking a process that has already imported the heavy libraries (a "zygote").

Every ``python -m sglang.launch_server`` the tests start spends about 2.5 CPU-seconds importing torch, transformers
(with the model-config modules its AutoTokenizer pulls in) and the HTTP stack before it does anything; on the 2-core
CI machine the suite starts over a hundred servers. A zygote imports those libraries once per test process and
forks one child per server; the child then runs ``sglang.launch_server`` exactly as ``python -m`` would (its
arguments in ``sys.argv``, ``__main__`` = that module, so its ``spawn``-ed workers re-import it as usual), with the
caller's environment, working directory and log file, and leaves through the normal exit path (non-daemon threads
joined, atexit handlers run, the server's exit code).

Only third-party libraries are preloaded: every ``sglang`` module is imported in the child, after its environment is
set. The zygote is single-threaded when it forks (checked; otherwise it refuses and the caller falls back to a
plain subprocess), never touches CUDA, and reaps its children, reporting each exit code to the caller.

:class:`ZygoteProcess` is the handle the caller gets: the ``subprocess.Popen`` surface the tests use (``pid``,
``poll``, ``wait`` with ``subprocess.TimeoutExpired``, ``returncode``, ``send_signal``, ``terminate``, ``kill``).
Run as a script, this file is the zygote (``python server_zygote.py``: requests on stdin, replies on stdout).
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from typing import Optional

#: What the zygote imports before forking (third-party only; the order puts torch first).
PRELOAD = ["torch", "numpy", "transformers", "transformers.models.llama.configuration_llama",
           "transformers.tokenization_utils_tokenizers", "fastapi", "uvicorn", "pydantic", "zmq", "msgspec",
           "jinja2", "requests", "psutil"]


#: Exit code reported for a server whose zygote died before reaping it (its real code is unknown).
LOST_CODE = -255


def _running(pid: int) -> bool:
    """Whether process ``pid`` still exists and is not a zombie."""
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


class ZygoteError(RuntimeError):
    """The zygote could not start or answer; the caller starts a plain subprocess instead."""


class Zygote:
    """The caller's side: one zygote process, requests serialised by a lock, exit codes read by a thread."""

    def __init__(self, env: dict) -> None:
        """Start the zygote with ``env`` (the servers' environment: it imports its libraries under it).

        Raises:
            ZygoteError: it did not come up.
        """
        self._env = dict(env)
        # numpy's OpenBLAS would start a worker thread at import; the zygote must stay single-threaded to fork
        # (each server gets ``env`` back, so its own processes size their pools as usual)
        self._proc = subprocess.Popen([sys.executable, os.path.abspath(__file__)], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, env={**self._env, "OPENBLAS_NUM_THREADS": "1"},
                                      text=True, bufsize=1)
        self._lock = threading.Lock()
        self._cond = threading.Condition()
        self._codes: dict[int, int] = {}
        self._started: list = []
        self._alive = True
        ready = self._proc.stdout.readline()
        if json.loads(ready or "{}").get("ready") is not True:
            self._proc.kill()
            raise ZygoteError(f"the server zygote did not start: {ready!r}")
        threading.Thread(target=self._read, name="server-zygote-reader", daemon=True).start()

    def _read(self) -> None:
        for line in self._proc.stdout:
            msg = json.loads(line)
            with self._cond:
                if "exit" in msg:
                    self._codes[msg["exit"]] = msg["code"]
                else:
                    self._started.append(msg)
                self._cond.notify_all()
        with self._cond:
            self._alive = False
            self._cond.notify_all()

    def start(self, argv: list[str], env: dict, log_path: str) -> "ZygoteProcess":
        """Fork ``python -m sglang.launch_server`` (``argv``: its arguments) with ``env``, appending its output to
        ``log_path``.

        Raises:
            ZygoteError: the zygote is gone or refused (e.g. it is no longer single-threaded).
        """
        with self._lock:
            req = {"argv": argv, "env": env, "cwd": os.getcwd(), "log": log_path}
            try:
                self._proc.stdin.write(json.dumps(req) + "\n")
                self._proc.stdin.flush()
            except (BrokenPipeError, OSError, ValueError) as e:  # ValueError: our end of the pipe is closed
                raise ZygoteError(f"the server zygote is gone: {e}") from e
            with self._cond:
                if not self._cond.wait_for(lambda: self._started or not self._alive, timeout=60):
                    raise ZygoteError("the server zygote did not answer within 60 s")
                if not self._started:
                    raise ZygoteError("the server zygote exited")
                msg = self._started.pop(0)
        if "error" in msg:
            raise ZygoteError(msg["error"])
        return ZygoteProcess(self, msg["pid"], ["python", "-m", "sglang.launch_server", *argv])

    def returncode(self, pid: int) -> Optional[int]:
        """The exit code of child ``pid`` (negative: killed by that signal); None while it runs. If the zygote
        itself is gone, a child that no longer exists reports ``LOST_CODE`` (its real code died with the zygote)."""
        with self._cond:
            code = self._codes.get(pid)
            if code is None and not self._alive and not _running(pid):
                code = LOST_CODE
            return code

    def wait(self, pid: int, timeout: Optional[float]) -> Optional[int]:
        """Block until child ``pid`` exits (its code) or ``timeout`` seconds pass (None)."""
        with self._cond:
            self._cond.wait_for(lambda: pid in self._codes or not self._alive, timeout=timeout)
        if self._alive:
            return self.returncode(pid)
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode(pid) is None and (deadline is None or time.monotonic() < deadline):
            time.sleep(0.1)  # the zygote is gone: watch the orphan until it disappears
        return self.returncode(pid)


class ZygoteProcess:
    """A server forked by the zygote, with the ``subprocess.Popen`` methods the tests use."""

    def __init__(self, zygote: Zygote, pid: int, args: list[str]) -> None:
        self._zygote, self.pid, self.args = zygote, pid, args

    @property
    def returncode(self) -> Optional[int]:
        """Exit code (negative: the signal that killed it), None while running (as ``Popen.returncode``)."""
        return self._zygote.returncode(self.pid)

    def poll(self) -> Optional[int]:
        """``returncode`` (as ``Popen.poll``)."""
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        """The exit code once the server exits. Raises ``subprocess.TimeoutExpired`` after ``timeout`` seconds."""
        code = self._zygote.wait(self.pid, timeout)
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return code

    def send_signal(self, sig: int) -> None:
        """Send ``sig`` unless it has already exited (its pid may be reused)."""
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        """SIGTERM."""
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL."""
        self.send_signal(signal.SIGKILL)


# ---------------------------------------------------------------------------------------------- the zygote itself
def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _child(req: dict, out_fd: int, in_fd: int) -> None:
    """In the forked child: become ``python -m sglang.launch_server <argv>`` and exit with its code."""
    import atexit
    import runpy

    log = os.open(req["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, in_fd)  # drops the zygote's request pipe (fd 0) and reply pipe (fd 1) from this process
    os.dup2(log, out_fd)
    os.dup2(log, 2)
    for fd in (log, null):
        if fd > 2:
            os.close(fd)
    sys.stdin = open(0, closefd=False)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # PYTHONUNBUFFERED-like: line by line
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    # the atexit handlers the preloaded libraries registered are the ones a fresh interpreter would have too
    if "numpy" in sys.modules:  # python's `random` reseeds itself after a fork; numpy's global generator does not
        sys.modules["numpy"].random.seed()
    sys.path[0] = req["cwd"]  # as `python -m` puts the working directory first (not this file's folder)
    sys.argv = ["sglang.launch_server", *req["argv"]]
    code = 0
    try:
        runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=True)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if e.code is not None and not isinstance(e.code, int):
            print(e.code, file=sys.stderr)
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    for t in threading.enumerate():  # interpreter shutdown: non-daemon threads first, then atexit
        if t is not threading.main_thread() and not t.daemon:
            t.join()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _serve() -> None:
    """The zygote's loop: preload, then fork a server per request line; report every child's exit code."""
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    out = sys.stdout
    reply = lambda msg: (out.write(json.dumps(msg) + "\n"), out.flush())  # noqa: E731
    reply({"ready": True, "threads": _threads()})
    children: set[int] = set()
    buf = ""
    in_fd = sys.stdin.fileno()
    eof = False
    while not eof or children:
        if not eof and select.select([in_fd], [], [], 0.1)[0]:
            chunk = os.read(in_fd, 65536).decode()
            eof = not chunk
            buf += chunk
        while "\n" in buf:
            line, buf = buf.split("\n", 1)
            req = json.loads(line)
            if req.get("start_thread_first"):  # the harness's own test: make this zygote multi-threaded
                threading.Thread(target=select.select, args=([], [], [], 3600), daemon=True).start()
            if _threads() != 1:
                reply({"error": f"the zygote has {_threads()} threads; forking it is unsafe"})
                continue
            pid = os.fork()
            if pid == 0:
                try:
                    _child(req, out.fileno(), in_fd)
                finally:
                    os._exit(1)  # never back into the zygote's loop
            children.add(pid)
            reply({"pid": pid})
        if eof and children:
            select.select([], [], [], 0.1)
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                children.clear()
                break
            if pid == 0:
                break
            children.discard(pid)
            try:
                reply({"exit": pid, "code": os.waitstatus_to_exitcode(status)})
            except (BrokenPipeError, OSError):
                pass


if __name__ == "__main__":
    _serve()
