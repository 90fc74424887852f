"""``--use-ray`` across two network namespaces: a two-node Ray cluster on this host where each node lives in its
own network namespace and the two talk only over a veth pair (like two hosts on one link).

Node A (head, 10.215.X.1) and node B (10.215.X.2) run ``ray start --block`` inside ``ip netns exec``; the
server runs in A with ``--use-ray --tp 2 --nnodes 2`` so one TP rank lives in each namespace (every socket
between them crosses the veth); its greedy tokens must equal the single-process server's. Then PD (KVDirect):
the prefill instance pinned to A and the decode instance to B (``--ray-worker-resources``), behind the mini_lb
router, must give the same tokens. And expert parallelism by all-to-all across the two nodes: stories260K-moe8 (8 different
experts) with ``--tp 2 --ep-size 2 --moe-a2a-backend nccl``, one EP rank per namespace (every dispatch and combine
crosses the veth), gives the single-process server's tokens. Skipped, with the
reason, where namespaces cannot be created (no root / CAP_NET_ADMIN, no ``ip``). Only addresses inside the two
namespaces this module creates are used; both are deleted afterwards.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import requests

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
from conftest import shared_path  # noqa: E402
from ray_utils import greedy_payload, single_process_reference  # noqa: E402
from server_utils import ENV as _ENV  # noqa: E402

# a private test cluster on addresses only this module can reach: no token handshake needed
ENV = {**_ENV, "RAY_AUTH_MODE": "disabled"}

pytest.importorskip("ray", reason="ray is not installed (pip install '.[ray]')")

pytestmark = pytest.mark.timeout(900)  # a hang fails the module instead of stalling CI
TAG = f"sg15{os.getpid() % 100000}"
NS_A, NS_B = f"{TAG}a", f"{TAG}b"
SUBNET = f"10.215.{os.getpid() % 250}"
IP_A, IP_B = f"{SUBNET}.1", f"{SUBNET}.2"
PORT = 30000


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def _in_ns(ns: str, cmd: list[str], **kw):
    return ["ip", "netns", "exec", ns, *cmd]


def _make_namespaces() -> None:
    if shutil.which("ip") is None:
        pytest.skip("network namespaces: the `ip` tool (iproute2) is not installed")
    r = _ip("netns", "add", NS_A, check=False)
    if r.returncode != 0:
        pytest.skip(f"network namespaces cannot be created here (needs root / CAP_NET_ADMIN): {r.stderr.strip()}")
    _ip("netns", "add", NS_B)
    va, vb = f"{TAG}va"[-15:], f"{TAG}vb"[-15:]
    _ip("link", "add", va, "type", "veth", "peer", "name", vb)
    for ns, dev, ip in ((NS_A, va, IP_A), (NS_B, vb, IP_B)):
        _ip("link", "set", dev, "netns", ns)
        _ip("-n", ns, "addr", "add", f"{ip}/30", "dev", dev)
        _ip("-n", ns, "link", "set", dev, "up")
        _ip("-n", ns, "link", "set", "lo", "up")


def _delete_namespaces() -> None:
    for ns in (NS_A, NS_B):
        pids = _ip("netns", "pids", ns, check=False).stdout.split()
        for pid in pids:  # only processes inside the namespaces this module created
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
        _ip("netns", "del", ns, check=False)


def _stop(p: subprocess.Popen, timeout: float = 30) -> None:
    if p.poll() is None:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(10)


@pytest.fixture(scope="module")
def netns_cluster(tmp_path_factory):
    """A Ray head in namespace A and a worker node in namespace B, joined by a veth pair."""
    model = shared_path("models", "stories260K")
    _make_namespaces()
    logs = tmp_path_factory.mktemp("netns")
    procs = []
    try:
        ray_bin = shutil.which("ray") or "ray"
        common = ["--block", "--disable-usage-stats"]
        for ns, extra, cpus, name in ((NS_A, ["--head", "--port", "6379", f"--node-ip-address={IP_A}",
                                              "--include-dashboard=false", '--resources={"node_a": 4}'], 3, "a"),
                                      (NS_B, [f"--address={IP_A}:6379", f"--node-ip-address={IP_B}",
                                              '--resources={"node_b": 4}'], 2, "b")):
            out = open(logs / f"ray-{name}.log", "w")
            procs.append(subprocess.Popen(_in_ns(ns, [ray_bin, "start", *extra, *common, f"--num-cpus={cpus}"]),
                                          stdout=out, stderr=subprocess.STDOUT, env=ENV, start_new_session=True))
            if name == "a":
                time.sleep(3)
        yield {"model": model, "logs": logs, "ray": procs}
    finally:
        for p in reversed(procs):
            _stop(p)
        _delete_namespaces()


class _NsClient:
    """HTTP from a thread that entered namespace A with setns(2) (the network namespace is per thread), so the
    test reaches the server that only listens inside A without starting a process per request."""

    def __init__(self, ns: str):
        import ctypes
        from concurrent.futures import ThreadPoolExecutor

        libc = ctypes.CDLL(None, use_errno=True)

        def enter() -> None:
            fd = os.open(f"/var/run/netns/{ns}", os.O_RDONLY)
            try:
                if libc.setns(fd, 0x40000000) != 0:  # CLONE_NEWNET
                    raise OSError(ctypes.get_errno(), f"setns into {ns} failed")
            finally:
                os.close(fd)

        self._pool = ThreadPoolExecutor(max_workers=1, initializer=enter)

    def get(self, url: str, timeout: float = 5) -> requests.Response:
        return self._pool.submit(requests.get, url, timeout=timeout).result()

    def post(self, url: str, payload: dict, timeout: float = 180) -> requests.Response:
        return self._pool.submit(requests.post, url, json=payload, timeout=timeout).result()

    def close(self) -> None:
        self._pool.shutdown(wait=False)


def _wait_healthy(client: _NsClient, srv: subprocess.Popen, log_path, timeout: float = 300, port: int = PORT) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if srv.poll() is not None:
            pytest.fail(f"server exited with {srv.returncode}:\n{open(log_path).read()[-4000:]}")
        try:
            if client.get(f"http://{IP_A}:{port}/health").status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(1)
    pytest.fail(f"server not healthy after {timeout} s:\n{open(log_path).read()[-4000:]}")


@pytest.fixture(scope="module")
def reference(netns_cluster):
    return single_process_reference(netns_cluster["model"])


def _popen_in_a(cmd: list[str], log_path) -> subprocess.Popen:
    with open(log_path, "w") as log:
        return subprocess.Popen(_in_ns(NS_A, [sys.executable, "-m", *cmd]), stdout=log, stderr=subprocess.STDOUT,
                                env=ENV)


def _server(model: str, port: int, extra: list[str], log_path) -> subprocess.Popen:
    return _popen_in_a(["sglang.launch_server", "--model-path", model, "--use-ray", "--ray-address", f"{IP_A}:6379",
                        "--host", IP_A, "--port", str(port), *extra], log_path)


def test_tp2_across_namespaced_nodes_equals_single_process(netns_cluster, reference):
    log_path = netns_cluster["logs"] / "server.log"
    srv = _server(netns_cluster["model"], PORT, ["--device", "cpu", "--tp", "2", "--nnodes", "2"], log_path)
    client = _NsClient(NS_A)
    try:
        _wait_healthy(client, srv, log_path)
        r = client.post(f"http://{IP_A}:{PORT}/generate", greedy_payload())
        assert r.status_code == 200, r.text
        assert [o["output_ids"] for o in r.json()] == reference
        nodes = client.get(f"http://{IP_A}:{PORT}/get_server_info", timeout=30).json()["ray_nodes"]
        assert sorted(n["ip"] for n in nodes) == [IP_A, IP_B], nodes  # one TP rank in each namespace
    finally:
        client.close()
        _stop(srv)
    assert srv.returncode == 0, open(log_path).read()[-4000:]


def test_ep2_all_to_all_across_namespaced_nodes_equals_single_process(netns_cluster):
    """One EP rank per namespace: the MoE dispatch/combine all-to-alls (gloo) cross the veth."""
    model = shared_path("models", "stories260K-moe8")
    want = single_process_reference(model)
    log_path = netns_cluster["logs"] / "server_ep.log"
    srv = _server(model, PORT + 5, ["--device", "cpu", "--tp", "2", "--nnodes", "2", "--ep-size", "2",
                                    "--moe-a2a-backend", "nccl"], log_path)
    client = _NsClient(NS_A)
    try:
        _wait_healthy(client, srv, log_path, port=PORT + 5)
        r = client.post(f"http://{IP_A}:{PORT + 5}/generate", greedy_payload())
        assert r.status_code == 200, r.text
        assert [o["output_ids"] for o in r.json()] == want
        info = client.get(f"http://{IP_A}:{PORT + 5}/get_server_info", timeout=30).json()
        assert sorted(n["ip"] for n in info["ray_nodes"]) == [IP_A, IP_B], info["ray_nodes"]
        assert info["moe_a2a_backend"] == "nccl"
        assert "MoE all-to-all (nccl) on 5 MoE layers" in open(log_path).read()
    finally:
        client.close()
        _stop(srv)
    assert srv.returncode == 0, open(log_path).read()[-4000:]


def test_pd_prefill_in_a_decode_in_b_equals_single_process(netns_cluster, reference):
    """KVDirect PD across the veth: prefill workers pinned to node A, decode workers to node B (bootstrap HTTP,
    control ZMQ and the fake transfer backend's data all cross namespaces); drivers and router run in A."""
    from pd_utils import pd_args

    logs, model = netns_cluster["logs"], netns_cluster["model"]
    pp, dp, rp = PORT + 1, PORT + 2, PORT + 3
    procs, client = [], _NsClient(NS_A)
    try:
        for mode, port, node in (("prefill", pp, "node_a"), ("decode", dp, "node_b")):
            args = pd_args(mode, model, ["--ray-worker-resources", '{"%s": 0.01}' % node], bootstrap_port=PORT + 4)
            procs.append(_server(model, port, args[2:], logs / f"{mode}.log"))  # args[:2] is --model-path M
            _wait_healthy(client, procs[-1], logs / f"{mode}.log", port=port)
        procs.append(_popen_in_a(["sglang.srt.disaggregation.mini_lb", "--prefill", f"http://{IP_A}:{pp}",
                                  "--decode", f"http://{IP_A}:{dp}", "--host", IP_A, "--port", str(rp)],
                                 logs / "router.log"))
        _wait_healthy(client, procs[-1], logs / "router.log", port=rp)
        r = client.post(f"http://{IP_A}:{rp}/generate", greedy_payload())
        assert r.status_code == 200, r.text
        assert [o["output_ids"] for o in r.json()] == reference
        pinfo = client.get(f"http://{IP_A}:{pp}/get_server_info", timeout=30).json()
        dinfo = client.get(f"http://{IP_A}:{dp}/get_server_info", timeout=30).json()
        assert [n["ip"] for n in pinfo["ray_nodes"]] == [IP_A] and [n["ip"] for n in dinfo["ray_nodes"]] == [IP_B]
        assert pinfo["disaggregation_bootstrap_host"] == IP_A
    finally:
        client.close()
        for p in reversed(procs):
            _stop(p)
