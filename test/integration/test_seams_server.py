"""Engine seams end to end: a TP=2 server whose inter-process sockets are TCP (``--zmq-transport tcp``),
started through the WorkerLauncher with explicit devices, gives TP=1's greedy tokens on stories260K (dense
and MoE), and its workers leave when the launcher is SIGKILLed (pipe liveness, not os.getppid)."""

from __future__ import annotations

import os
import signal
import sys
import time

import psutil
import pytest
import requests

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "unit"))
from conftest import shared_path  # noqa: E402
from server_utils import ServerProcess  # noqa: E402
from test_tp_cpu import N_NEW, generate, tokenize, tp1_greedy  # noqa: E402


@pytest.mark.parametrize("name", ["stories260K", "stories260K-moe"])
def test_tcp_sockets_tp2_greedy_equals_tp1(name):
    path = shared_path("models", name)
    with ServerProcess(["--model-path", path, "--device", "cpu", "--tp", "2", "--zmq-transport", "tcp",
                        "--chunked-prefill-size", "8"]) as s:
        info = requests.get(s.url + "/get_server_info", timeout=30).json()
        assert info.get("zmq_transport") == "tcp"
        prompts = ["Once upon a time", "The little dog"]
        out = generate(s, {"text": prompts, "sampling_params": {"temperature": 0, "max_new_tokens": N_NEW,
                                                                "ignore_eos": True}})
        for p, o in zip(prompts, out):
            assert o["output_ids"] == tp1_greedy(path, tokenize(path, p)), p


def test_workers_leave_when_the_launcher_is_sigkilled():
    path = shared_path("models", "stories260K")
    s = ServerProcess(["--model-path", path, "--device", "cpu", "--tp", "2"])
    try:
        kids = psutil.Process(s.proc.pid).children(recursive=True)
        assert len(kids) >= 3  # two TP ranks and the detokenizer
        s.proc.send_signal(signal.SIGKILL)  # no cleanup handler runs
        s.proc.wait(30)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(k.is_running() and k.status() != psutil.STATUS_ZOMBIE for k in kids):
            time.sleep(0.2)
        alive = [k.pid for k in kids if k.is_running() and k.status() != psutil.STATUS_ZOMBIE]
        for k in kids:
            if k.pid in alive:
                k.kill()
        assert not alive, f"workers {alive} outlived their SIGKILLed launcher"
    finally:
        if s.proc.poll() is None:
            s.proc.kill()
