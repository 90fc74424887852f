"""A new user's first mistakes fail fast with one line naming the flag: a busy port and a wrong
--model-path are caught by the launcher before anything loads, ``--device cuda`` without a GPU is one line,
``--help`` documents every option with its default, a detokenizer stopped during startup is quiet, and
``bench_one_batch``'s ``result.jsonl`` is ignored by git."""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from conftest import REPO_ROOT, shared_path

ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}


def _free_port() -> int:
    from sglang.srt.utils.common import free_tcp_ports  # below the ephemeral range (parallel test workers)

    return free_tcp_ports(1)[0]


def _launch(args: list[str], timeout: float = 120) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "sglang.launch_server", *args], capture_output=True, text=True,
                       timeout=timeout, env=ENV)
    return p, time.monotonic() - t0


def test_port_in_use_fails_before_the_model_loads():
    model = shared_path("models", "stories260K")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        p, _ = _launch(["--model-path", model, "--device", "cpu", "--port", str(port)])
    out = p.stdout + p.stderr
    assert p.returncode == 1, out[-2000:]
    assert f"--port={port} is already in use on 127.0.0.1" in out, out[-2000:]
    assert "Scheduler" not in out and "Traceback" not in out, out[-2000:]  # no child was started


@pytest.mark.parametrize("make,expect", [
    (lambda tmp: os.path.join(str(tmp), "no-such-model"), "does not exist"),
    (lambda tmp: str(tmp), "has no config.json"),
])
def test_wrong_model_path_is_checked_by_the_launcher(tmp_path, make, expect):
    path = make(tmp_path)
    p, _ = _launch(["--model-path", path, "--device", "cpu", "--port", str(_free_port())])
    out = p.stdout + p.stderr
    assert p.returncode == 1
    assert f"--model-path={path!r} {expect}" in out, out[-2000:]
    assert "Scheduler" not in out and "Traceback" not in out and "error_already_set" not in out, out[-2000:]


def test_device_cuda_without_gpu_is_one_line():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is usable here")
    p, _ = _launch(["--model-path", shared_path("models", "stories260K"), "--device", "cuda", "--port", str(_free_port())])
    out = p.stdout + p.stderr
    assert p.returncode == 1
    assert "--device=cuda is unusable" in out and "use --device cpu" in out, out[-2000:]
    assert "Traceback" not in out and "AssertionError" not in out
    assert len([line for line in out.splitlines() if line.strip()]) <= 2, out


def test_help_gives_every_option_a_description_and_its_default():
    from sglang.srt.server_args import ServerArgs, prepare_server_args

    parser = argparse.ArgumentParser(formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ServerArgs.add_cli_args(parser)
    missing = [a.option_strings[0] for a in parser._actions if a.option_strings != ["-h", "--help"] and not a.help]
    assert missing == []
    p = subprocess.run([sys.executable, "-m", "sglang.launch_server", "--help"], capture_output=True, text=True,
                       timeout=60, env=ENV)
    assert p.returncode == 0
    text = " ".join(p.stdout.split())
    for a in parser._actions:
        if a.option_strings == ["-h", "--help"]:
            continue
        assert f"(default: {a.default})" in text
    assert "--watchdog-timeout WATCHDOG_TIMEOUT Set watchdog timeout in seconds." in text
    assert "(default: 300.0)" in text and "--max-n MAX_N" in text and "(default: 128)" in text
    assert prepare_server_args(["--watchdog-timeout", "5"]).watchdog_timeout == 5.0


def test_result_jsonl_is_ignored_by_git():
    p = subprocess.run(["git", "-C", REPO_ROOT, "check-ignore", "-q", "result.jsonl"])
    if p.returncode == 128:
        pytest.skip("not a git checkout")
    assert p.returncode == 0


_SLOW_SETUP = r"""
import ctypes, os, sys, time
import sglang.srt.managers.detokenizer_manager as dm
from sglang.srt.server_args import PortArgs, ServerArgs

def slow_tokenizer(*a, **k):  # a tokenizer load running inside C code (as transformers/pybind11 do)
    libc = ctypes.CDLL(None)
    CMP = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)
    def cmp(x, y):
        open(sys.argv[1], "w").close()
        time.sleep(60)
        return 0
    arr = (ctypes.c_int * 2)(2, 1)
    libc.qsort(arr, 2, ctypes.sizeof(ctypes.c_int), CMP(cmp))
    raise SystemExit(3)

dm.get_tokenizer = slow_tokenizer
dm.run_detokenizer_process(ServerArgs(model_path=sys.argv[2]), PortArgs.init_new(), signal_parent_on_crash=False)
"""


def test_detokenizer_stopped_during_startup_exits_quietly(tmp_path):
    marker = tmp_path / "in-setup"
    script = tmp_path / "slow_detok.py"
    script.write_text(_SLOW_SETUP)
    p = subprocess.Popen([sys.executable, str(script), str(marker), shared_path("models", "stories260K")],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    deadline = time.time() + 60
    while not marker.exists():
        assert time.time() < deadline and p.poll() is None, p.communicate()
        time.sleep(0.05)
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=30)
    assert p.returncode == 0, (p.returncode, err[-2000:])
    assert "Traceback" not in err and "SystemExit" not in err and "Exception ignored" not in err, err[-2000:]
