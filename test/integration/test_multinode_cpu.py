"""Multi-node TP without Ray, emulated on one CPU machine: two ``python -m sglang.launch_server`` processes
(``--tp 2 --nnodes 2 --node-rank 0|1 --dist-init-addr 127.0.0.1:PORT``), one gloo rank each.

Checks: greedy /generate equals HF transformers' greedy; node 1 logs that it is a worker node (and serves
no HTTP); SIGTERM on node 0 ends node 1 too and SIGKILL on node 1 stops node 0 with a clear error and a
non-zero exit, both within a bounded time and without orphans; bad multi-node flags fail fast.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest
import requests

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
from conftest import shared_path  # noqa: E402
from server_utils import ENV, ServerProcess, free_port  # noqa: E402
from test_server_e2e import hf_greedy  # noqa: E402

PROMPTS = ["Once upon a time", "The little dog", "Lily and Tom went to the park. They", "One day, a bird"]
N_NEW = 24
EXIT_WITHIN_S = 30  # a node must be gone this long after its peer stopped (observed: ~5 s)


class Cluster:
    """Node 1 (plain subprocess, no HTTP) started first, then node 0 (:class:`ServerProcess`, HTTP)."""

    def __init__(self, tmp_path):
        self.model_path = shared_path("models", "stories260K")
        addr = f"127.0.0.1:{free_port()}"
        common = ["--model-path", self.model_path, "--device", "cpu", "--tp", "2", "--nnodes", "2",
                  "--dist-init-addr", addr]
        self.node1_log = tmp_path / "node1.log"
        self._node1_out = open(self.node1_log, "w")
        self.node1 = subprocess.Popen([sys.executable, "-m", "sglang.launch_server", *common, "--node-rank", "1"],
                                      stdout=self._node1_out, stderr=subprocess.STDOUT, env=ENV)
        try:
            self.node0 = ServerProcess([*common, "--node-rank", "0"], timeout=180)
        except BaseException:
            self.node1.kill()
            self.node1.wait(10)
            raise
        self.tree = self._descendants(self.node0.proc.pid) + self._descendants(self.node1.pid)

    @staticmethod
    def _descendants(pid: int) -> list[psutil.Process]:
        try:
            return psutil.Process(pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def node1_text(self) -> str:
        self._node1_out.flush()
        return self.node1_log.read_text()

    def wait_exit(self, proc, timeout: float) -> int:
        try:
            return proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"pid {proc.pid} still running {timeout} s after its peer node stopped "
                        f"(node 0 log:\n{self.node0.log_tail(30)}\nnode 1 log:\n{self.node1_text()[-3000:]})")

    def orphans(self) -> list[int]:
        """Descendants (of either node) still alive a few seconds after both launchers are gone."""
        _, alive = psutil.wait_procs(self.tree, timeout=10)
        return [p.pid for p in alive]

    def close(self) -> None:
        left = self.node0.stop()  # idempotent
        if self.node1.poll() is None:
            self.node1.send_signal(signal.SIGTERM)
            try:
                self.node1.wait(30)
            except subprocess.TimeoutExpired:
                self.node1.kill()
                self.node1.wait(5)
        self._node1_out.close()
        for pid in left + self.orphans():
            try:
                psutil.Process(pid).kill()
            except psutil.NoSuchProcess:
                pass


@pytest.fixture
def cluster(tmp_path):
    c = Cluster(tmp_path)
    try:
        yield c
    finally:
        c.close()


@pytest.fixture(scope="module")
def served_cluster(tmp_path_factory):
    """One cluster for the greedy test and then the SIGTERM test, which ends it (two cluster start-ups were a
    large part of this file's time on the 2-core CI machine)."""
    c = Cluster(tmp_path_factory.mktemp("served"))
    try:
        yield c
    finally:
        c.close()


def generate(url: str, payload: dict):
    r = requests.post(url + "/generate", json=payload, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_two_nodes_greedy_equals_hf_and_node1_is_worker(served_cluster):
    cluster = served_cluster
    outs = generate(cluster.node0.url, {"text": PROMPTS, "sampling_params": {"temperature": 0, "max_new_tokens": N_NEW}})
    assert [o["output_ids"] for o in outs] == [hf_greedy(cluster.model_path, p, N_NEW) for p in PROMPTS]
    assert outs[0]["text"].startswith(", there was a little girl named Lily")
    single = generate(cluster.node0.url, {"text": PROMPTS[2], "sampling_params": {"temperature": 0,
                                                                                  "max_new_tokens": N_NEW}})
    assert single["output_ids"] == outs[2]["output_ids"]  # batch of 4 == alone
    info = requests.get(cluster.node0.url + "/get_server_info", timeout=30).json()
    assert info["tp_size"] == 2 and info["nnodes"] == 2 and info["node_rank"] == 0
    log1 = cluster.node1_text()
    assert "node 1 is a worker node: TP ranks [1] serving" in log1, log1[-3000:]
    assert "Uvicorn running" not in log1 and "Uvicorn running" in cluster.node0.log_tail(200)
    assert "TP rank 1/2 joining tcp://127.0.0.1:" in log1  # the rank lives on node 1, not node 0
    assert cluster.node1.poll() is None and cluster.node0.proc.poll() is None


def test_sigterm_node0_ends_node1_without_orphans(served_cluster):
    """Runs after the greedy test on its cluster (or on a fresh one when selected alone) and ends it."""
    cluster = served_cluster
    generate(cluster.node0.url, {"text": PROMPTS[0], "sampling_params": {"max_new_tokens": 4}})
    t0 = time.monotonic()
    assert cluster.node0.stop(signal.SIGTERM) == []
    assert cluster.node0.proc.returncode == 0  # a deliberate stop
    cluster.wait_exit(cluster.node1, EXIT_WITHIN_S)
    assert time.monotonic() - t0 < EXIT_WITHIN_S
    log1 = cluster.node1_text()
    assert cluster.node1.returncode == 1, log1[-3000:]  # from node 1's view its TP peer is gone
    assert "scheduler TP rank 1" in log1 and "exited unexpectedly" in log1 and "another node" in log1
    assert cluster.orphans() == []


def test_sigkill_node1_stops_node0_with_clear_error(cluster):
    generate(cluster.node0.url, {"text": PROMPTS[0], "sampling_params": {"max_new_tokens": 4}})
    result = {}

    def long_request() -> None:  # in flight when node 1 dies: must end (error or cut), not hang
        try:
            r = requests.post(cluster.node0.url + "/generate", timeout=EXIT_WITHIN_S * 2, json={
                "text": PROMPTS[1], "sampling_params": {"max_new_tokens": 480, "ignore_eos": True}})
            result["status"] = r.status_code
            result["body"] = r.text
        except requests.RequestException as e:
            result["status"] = type(e).__name__

    t = threading.Thread(target=long_request, daemon=True)
    t.start()
    time.sleep(0.5)
    t0 = time.monotonic()
    cluster.node1.kill()
    cluster.node1.wait(10)
    code = cluster.wait_exit(cluster.node0.proc, EXIT_WITHIN_S)
    assert time.monotonic() - t0 < EXIT_WITHIN_S
    log0 = cluster.node0.log_tail(300)
    assert code == 1, log0
    assert "scheduler TP rank 0" in log0 and "exited unexpectedly" in log0, log0
    assert "server stopped:" in log0 and "a TP rank on another node may have stopped" in log0, log0
    with pytest.raises(requests.ConnectionError):
        requests.get(cluster.node0.url + "/health", timeout=5)
    t.join(EXIT_WITHIN_S)
    assert not t.is_alive(), "the in-flight request hung after node 1 died"
    assert result["status"] != 200 or '"completion_tokens":480' not in result["body"].replace(" ", ""), result
    assert cluster.orphans() == []


MODEL_ARGS = ["--device", "cpu", "--port", "1"]


@pytest.mark.parametrize("args, code, message", [
    (["--tp", "2", "--nnodes", "2", "--node-rank", "2", "--dist-init-addr", "127.0.0.1:5999"], 2,
     "--node-rank=2 is invalid: use 0..1 (--nnodes=2)"),
    (["--tp", "2", "--nnodes", "2", "--node-rank", "1"], 2,
     "--dist-init-addr=None is invalid: multi-node runs need --dist-init-addr HOST:PORT of node 0"),
    (["--tp", "2", "--nnodes", "2", "--node-rank", "1", "--dist-init-addr", "localhost"], 1,
     "--dist-init-addr='localhost' must be HOST:PORT"),
    (["--tp", "2", "--nnodes", "4", "--node-rank", "0", "--dist-init-addr", "127.0.0.1:5999"], 1,
     "--tp-size=2 must be a multiple of --nnodes=4"),
], ids=["node-rank-out-of-range", "no-dist-init-addr", "addr-without-port", "tp-not-multiple-of-nnodes"])
def test_bad_multinode_args_fail_fast(args, code, message):
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "sglang.launch_server", "--model-path",
                        shared_path("models", "stories260K"), *MODEL_ARGS, *args],
                       capture_output=True, text=True, timeout=60, env=ENV)
    assert p.returncode == code, p.stdout + p.stderr
    assert message in p.stdout + p.stderr
    assert time.monotonic() - t0 < 30  # fails before any rank waits on a rendezvous


def test_missing_peer_node_times_out_with_dist_timeout():
    """A node whose peer never starts fails after --dist-timeout seconds instead of hanging."""
    t0 = time.time()
    p = subprocess.run([sys.executable, "-m", "sglang.launch_server", "--model-path",
                        shared_path("models", "stories260K"), "--device", "cpu", "--tp", "2", "--nnodes", "2",
                        "--node-rank", "0", "--dist-init-addr", f"127.0.0.1:{free_port()}", "--dist-timeout", "8",
                        "--port", str(free_port())], capture_output=True, text=True, timeout=120, env=ENV)
    assert p.returncode != 0
    assert time.time() - t0 < 100
    assert "rendezvous" in p.stdout + p.stderr and "1/2 clients joined" in p.stdout + p.stderr
