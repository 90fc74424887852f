"""Two emulated nodes: the prefill server in one network namespace and the decode server (plus the router) in
another, joined by a veth pair, with real TCP between them (bootstrap HTTP, control ZMQ, the fake transfer
backend's data path). Greedy output equals the aggregated server's. Needs root (``ip netns``); skips with the
reason otherwise. Only the two namespaces and the veth pair this test creates are touched, and removed after."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
from conftest import shared_path  # noqa: E402
from pd_utils import AGG, FAST, pd_args  # noqa: E402
from server_utils import ENV, ServerProcess  # noqa: E402

pytestmark = pytest.mark.timeout(900)
PREFIX = f"pd13s{os.getpid() % 100000}"
NS_P, NS_D = f"{PREFIX}p", f"{PREFIX}d"
IP_P, IP_D = "10.213.77.1", "10.213.77.2"
PROMPTS = ["Once upon a time", "The little dog"]
GREEDY = {"max_new_tokens": 16, "temperature": 0.0}


def _run(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), capture_output=True, text=True, timeout=30)


@pytest.fixture(scope="module")
def netns():
    if shutil.which("ip") is None:
        pytest.skip("the `ip` tool (iproute2) is missing: cannot create network namespaces")
    r = _run("ip", "netns", "add", NS_P)
    if r.returncode != 0:
        pytest.skip(f"cannot create a network namespace (needs root / CAP_NET_ADMIN): {r.stderr.strip()}")
    try:
        steps = [("ip", "netns", "add", NS_D),
                 ("ip", "link", "add", f"{PREFIX}a", "type", "veth", "peer", "name", f"{PREFIX}b"),
                 ("ip", "link", "set", f"{PREFIX}a", "netns", NS_P),
                 ("ip", "link", "set", f"{PREFIX}b", "netns", NS_D),
                 ("ip", "-n", NS_P, "addr", "add", f"{IP_P}/24", "dev", f"{PREFIX}a"),
                 ("ip", "-n", NS_D, "addr", "add", f"{IP_D}/24", "dev", f"{PREFIX}b"),
                 ("ip", "-n", NS_P, "link", "set", f"{PREFIX}a", "up"),
                 ("ip", "-n", NS_D, "link", "set", f"{PREFIX}b", "up"),
                 ("ip", "-n", NS_P, "link", "set", "lo", "up"),
                 ("ip", "-n", NS_D, "link", "set", "lo", "up")]
        for cmd in steps:
            r = _run(*cmd)
            if r.returncode != 0:
                pytest.skip(f"network namespace setup failed at `{' '.join(cmd)}`: {r.stderr.strip()}")
        yield
    finally:
        _run("ip", "netns", "del", NS_P)  # deleting a namespace removes its end of the veth pair (and the pair)
        _run("ip", "netns", "del", NS_D)


class NsProcess:
    """A command in a namespace, logging to a file; stopped with its whole process group."""

    def __init__(self, ns: str, args: list[str], name: str):
        self.log_path = f"/tmp/{PREFIX}-{name}.log"
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, *args], stdout=self._log,
                                     stderr=subprocess.STDOUT, env=ENV, start_new_session=True)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, 15)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)
                self.proc.wait(5)
        self._log.close()


def ns_http(ns: str, method: str, url: str, body=None, timeout: float = 120) -> tuple[int, str]:
    cmd = ["ip", "netns", "exec", ns, "curl", "-s", "-o", "-", "-w", "\n%{http_code}", "-m", str(timeout),
           "-X", method, url]
    if body is not None:
        cmd += ["-H", "Content-Type: application/json", "-d", json.dumps(body)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout + 10)
    text, _, code = r.stdout.rpartition("\n")
    return int(code or 0), text


def wait_healthy(ns: str, url: str, proc: NsProcess, timeout: float = 600) -> None:
    end = time.time() + timeout
    while time.time() < end:
        if proc.proc.poll() is not None:
            raise RuntimeError(f"{url} exited:\n{open(proc.log_path).read()[-3000:]}")
        if ns_http(ns, "GET", url + "/health", timeout=3)[0] == 200:
            return
        time.sleep(1)
    raise RuntimeError(f"{url} not healthy:\n{open(proc.log_path).read()[-3000:]}")


def test_prefill_and_decode_on_two_emulated_nodes(netns):
    import requests

    model = shared_path("models", "stories260K")
    if model is None or not os.path.isdir(model):
        pytest.skip("stories260K is not in the shared data folder")
    agg = ServerProcess(["--model-path", model, *AGG], timeout=600)
    try:
        want = [requests.post(agg.url + "/generate", json={"text": p, "sampling_params": GREEDY},
                              timeout=60).json()["output_ids"] for p in PROMPTS]
    finally:
        agg.stop()
    procs = []
    try:
        pre = NsProcess(NS_P, ["-m", "sglang.launch_server", *pd_args("prefill", model, bootstrap_port=8998),
                               "--host", IP_P, "--port", "30000"], "prefill")
        procs.append(pre)
        dec = NsProcess(NS_D, ["-m", "sglang.launch_server", *pd_args("decode", model),
                               "--host", IP_D, "--port", "30000"], "decode")
        procs.append(dec)
        wait_healthy(NS_P, f"http://{IP_P}:30000", pre)
        wait_healthy(NS_D, f"http://{IP_D}:30000", dec)
        # the router sits on the decode node; it reaches the prefill node over the veth pair (bootstrap port given
        # with --prefill-bootstrap-ports here; the other tests let the router learn it from the server)
        lb = NsProcess(NS_D, ["-m", "sglang.srt.disaggregation.mini_lb", "--prefill", f"http://{IP_P}:30000",
                              "--decode", f"http://{IP_D}:30000", "--prefill-bootstrap-ports", "8998",
                              "--host", IP_D, "--port", "8000"], "router")
        procs.append(lb)
        wait_healthy(NS_D, f"http://{IP_D}:8000", lb, timeout=120)
        code, text = ns_http(NS_D, "POST", f"http://{IP_D}:8000/generate", {"text": PROMPTS, "sampling_params": GREEDY})
        assert code == 200, text
        outs = json.loads(text)
        assert [o["output_ids"] for o in outs] == want
        assert all(o["meta_info"]["disaggregation"]["transfer_bytes"] > 0 for o in outs)
        # the decode node cannot see the prefill node's loopback: the traffic really crossed the veth pair
        assert ns_http(NS_D, "GET", f"http://127.0.0.1:8998/route", timeout=3)[0] != 200
        assert ns_http(NS_D, "GET", f"http://{IP_P}:8998/route", timeout=10)[0] == 200
    finally:
        for p in reversed(procs):
            p.stop()
