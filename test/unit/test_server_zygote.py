"""The test servers' zygote (``test/server_zygote.py``): a forked ``sglang.launch_server`` behaves like the
``python -m`` subprocess it replaces: the same exit code and error for bad flags, a working server whose workers
are its children, ``wait`` timing out with ``subprocess.TimeoutExpired``, ``kill`` giving ``-9``, a SIGTERM'd
server leaving no process behind; and the zygote refuses to fork once it is not single-threaded."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import psutil
import pytest
import requests

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
from conftest import shared_path  # noqa: E402
from server_utils import ENV, ServerProcess, free_port  # noqa: E402
from server_zygote import Zygote, ZygoteError  # noqa: E402


@pytest.fixture(scope="module")
def zygote():
    return Zygote(ENV)


def test_bad_flags_give_the_same_exit_code_and_message_as_python_m(zygote, tmp_path):
    argv = ["--port", str(free_port()), "--model-path", str(tmp_path / "no-such-model"), "--device", "cpu"]
    plain = subprocess.run([sys.executable, "-m", "sglang.launch_server", *argv], capture_output=True, text=True,
                           env=ENV, timeout=120)
    log = tmp_path / "forked.log"
    log.write_text("")
    forked = zygote.start(argv, ENV, str(log))
    assert forked.wait(120) == plain.returncode != 0
    assert "no-such-model" in log.read_text() and "no-such-model" in plain.stdout + plain.stderr


def test_forked_server_serves_waits_and_is_killed(zygote, tmp_path):
    model = shared_path("models", "stories260K")
    if not os.path.isdir(model):
        pytest.skip(f"{model} is not present (shared test data)")
    s = ServerProcess(["--model-path", model, "--device", "cpu"])
    try:
        assert type(s.proc).__name__ == "ZygoteProcess"  # the harness forks when no extra environment is given
        r = requests.post(s.url + "/generate", json={"text": "Once upon a time",
                                                    "sampling_params": {"temperature": 0, "max_new_tokens": 4}})
        assert r.status_code == 200 and r.json()["text"]
        kids = psutil.Process(s.proc.pid).children(recursive=True)
        assert len(kids) >= 2  # scheduler + detokenizer, spawned by the forked server
        with pytest.raises(subprocess.TimeoutExpired):
            s.proc.wait(0.2)
        assert s.stop() == [] and s.proc.returncode is not None
    finally:
        s.stop()
    s2 = ServerProcess(["--model-path", model, "--device", "cpu"], wait=False)
    s2.proc.kill()
    assert s2.proc.wait(30) == -signal.SIGKILL
    s2.stop()


def test_a_multi_threaded_zygote_refuses_to_fork(tmp_path):
    """A zygote that is not single-threaded answers with an error (the harness then starts a plain subprocess)."""
    z = Zygote(ENV)
    z._proc.stdin.write('{"argv": [], "env": {}, "cwd": "/", "log": "/dev/null", "start_thread_first": true}\n')
    z._proc.stdin.flush()
    with z._cond:
        assert z._cond.wait_for(lambda: z._started, timeout=30)
        msg = z._started.pop(0)
    assert "error" in msg and "threads" in msg["error"]
    z._proc.stdin.close()
    z._proc.wait(30)
    with pytest.raises(ZygoteError, match="gone"):
        z.start([], ENV, str(tmp_path / "x.log"))


def test_a_lost_zygote_still_reports_its_exited_server(tmp_path):
    """If the zygote dies, a server it forked is not waited on forever: once that process is gone, ``wait`` returns
    ``LOST_CODE`` (its real code died with the zygote) and ``poll`` stops saying it runs."""
    from server_zygote import LOST_CODE

    z = Zygote(ENV)
    log = tmp_path / "lost.log"
    log.write_text("")
    p = z.start(["--port", str(free_port()), "--model-path", str(tmp_path / "none"), "--device", "cpu"], ENV,
                str(log))
    z._proc.kill()  # the zygote dies before (or while) it reaps the child
    z._proc.wait(30)
    assert p.wait(120) in (LOST_CODE, 2) and p.poll() is not None
