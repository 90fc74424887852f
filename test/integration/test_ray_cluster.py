"""``--use-ray`` on a two-node ``ray.cluster_utils.Cluster`` (two raylets on this host, no namespaces needed).

One cluster per module (Ray start-up is slow on small machines); the raylet-kill test runs last because it
removes a node. Checks: TP2 with one rank per node gives the single-process server's greedy tokens, and the
remote actors' logs reach the server's log; SIGTERM stops it with no Ray actor left; ``ray job submit`` of the
docs/ray.md example serves and ``ray job stop`` removes every actor; killing the raylet of a node that holds a
TP rank mid-request fails the request, makes the server exit non-zero, and leaves no actor alive.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
import requests

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
from conftest import shared_path  # noqa: E402
from ray_utils import (N_NEW, PROMPTS, generate, greedy_payload, readme_example,  # noqa: E402
                       single_process_reference, wait_healthy)
from server_utils import ENV, ServerProcess, free_port  # noqa: E402

ray_cluster_utils = pytest.importorskip("ray.cluster_utils", reason="ray is not installed (pip install '.[ray]')")
EXIT_WITHIN_S = 60
pytestmark = pytest.mark.timeout(1500)  # a hang fails the module instead of stalling CI


@pytest.fixture(scope="module")
def model_path():
    return shared_path("models", "stories260K")


@pytest.fixture(scope="module")
def reference(model_path):
    return single_process_reference(model_path)


@pytest.fixture(scope="module")
def cluster():
    """Head (3 CPUs, dashboard for jobs and the state API) + one worker node (2 CPUs); fast node-death checks."""
    dash = free_port()
    c = ray_cluster_utils.Cluster(initialize_head=True, connect=False, head_node_args={
        "num_cpus": 3, "resources": {"node_a": 4}, "include_dashboard": True, "dashboard_host": "127.0.0.1", "dashboard_port": dash,
        "_system_config": {"health_check_period_ms": 1000, "health_check_failure_threshold": 3,
                           "health_check_initial_delay_ms": 0}})
    try:
        worker = c.add_node(num_cpus=2, resources={"node_b": 4})
        c.wait_for_nodes()
        c.dashboard_url = f"http://127.0.0.1:{dash}"
        c.worker = worker
        yield c
    finally:
        c.shutdown()


def alive_worker_actors(c) -> list:
    from ray.util.state import list_actors

    return [a for a in list_actors(address=c.address, filters=[("state", "=", "ALIVE")], raise_on_missing_output=False)
            if a.class_name == "_WorkerActor"]


def wait_no_actors(c, timeout: float = 30.0) -> list:
    deadline = time.time() + timeout
    while True:
        left = alive_worker_actors(c)
        if not left or time.time() > deadline:
            return left
        time.sleep(1)


def ray_server(c, model_path) -> ServerProcess:
    return ServerProcess(["--model-path", model_path, "--device", "cpu", "--use-ray", "--ray-address", c.address,
                          "--tp", "2", "--nnodes", "2"], timeout=240)


def test_tp2_across_two_ray_nodes_equals_single_process(cluster, model_path, reference):
    srv = ray_server(cluster, model_path)
    try:
        outs = generate(srv.url, greedy_payload())
        assert [o["output_ids"] for o in outs] == reference
        info = requests.get(srv.url + "/get_server_info", timeout=30).json()
        nodes = info["ray_nodes"]
        assert [n["tp_rank"] for n in nodes] == [0, 1]
        assert len({n["node_id"] for n in nodes}) == 2, nodes  # STRICT_SPREAD: one rank per node
        assert len(alive_worker_actors(cluster)) == 3  # two TP ranks + the detokenizer
        # remote logs reach us: Ray's log monitor forwards worker output asynchronously (20 s was too little on a loaded
        # 2-core CI machine once), so allow it up to a minute
        pattern, deadline = re.compile(r"\(_WorkerActor pid=\d+.*Scheduler TP1\]"), time.time() + 60
        while not pattern.search(log := srv.log_tail(100000)) and time.time() < deadline:
            time.sleep(0.5)
        assert pattern.search(log), log[-3000:]
    finally:
        assert srv.stop(signal.SIGTERM) == []
    assert srv.proc.returncode == 0, srv.log_tail()
    assert wait_no_actors(cluster) == []


def test_ray_job_submit_readme_example(cluster, model_path, reference, tmp_path):
    port = free_port()
    cmd = readme_example("tp2-two-nodes").replace(":8265", ":" + cluster.dashboard_url.rsplit(":", 1)[1])
    cmd = cmd.replace("--port 30000", f"--port {port}")
    env = {**ENV, "HEAD_IP": "127.0.0.1", "MODEL": model_path}
    log_path = tmp_path / "submit.log"
    with open(log_path, "w") as log:
        sub = subprocess.Popen(["bash", "-c", cmd], stdout=log, stderr=subprocess.STDOUT, env=env)
    job_id = None
    try:
        wait_healthy(f"http://127.0.0.1:{port}", 240, alive=lambda: sub.poll() is None, log=log_path.read_text)
        outs = generate(f"http://127.0.0.1:{port}", greedy_payload())
        assert [o["output_ids"] for o in outs] == reference
        job_id = re.search(r"Job '([^']+)' submitted", log_path.read_text()).group(1)
        subprocess.run(["ray", "job", "stop", "--address", cluster.dashboard_url, job_id], env=env, check=True,
                       timeout=120, capture_output=True)
        sub.wait(60)
    finally:
        if sub.poll() is None:
            sub.kill()
            sub.wait(10)
    assert wait_no_actors(cluster) == [], log_path.read_text()[-3000:]


def test_engine_use_ray_tp2_equals_single_process(cluster, model_path, reference):
    import sglang as sgl

    engine = sgl.Engine(model_path=model_path, device="cpu", tp_size=2, nnodes=2, use_ray=True,
                        ray_address=cluster.address)
    try:
        import concurrent.futures as cf

        pool = cf.ThreadPoolExecutor(1)  # bounded: a lost request must fail the test, not hang it
        try:
            outs = pool.submit(engine.generate, PROMPTS, {"temperature": 0, "max_new_tokens": N_NEW}).result(180)
        finally:
            pool.shutdown(wait=False)
        assert [o["output_ids"] for o in outs] == reference
    finally:
        engine.shutdown()
    import ray

    assert not ray.is_initialized()  # the Engine connected, so it disconnected
    assert wait_no_actors(cluster) == []


def test_pd_prefill_on_node_a_decode_on_node_b_equals_single_process(cluster, model_path, reference):
    """PD (KVDirect): the prefill instance pinned to node A and the decode instance to node B through
    --ray-worker-resources; the router learns the bootstrap host from the prefill server."""
    from pd_utils import Router, pd_args

    def side(mode: str, node: str) -> ServerProcess:
        return ServerProcess(pd_args(mode, model_path, ["--use-ray", "--ray-address", cluster.address,
                                                        "--ray-worker-resources", '{"%s": 0.01}' % node]),
                             timeout=240)

    prefill = side("prefill", "node_a")
    decode = router = None
    try:
        decode = side("decode", "node_b")
        router = Router([prefill.url], [decode.url])
        outs = generate(router.url, greedy_payload())
        assert [o["output_ids"] for o in outs] == reference
        pinfo = requests.get(prefill.url + "/get_server_info", timeout=30).json()
        dinfo = requests.get(decode.url + "/get_server_info", timeout=30).json()
        head_id = cluster.head_node.node_id
        assert [n["node_id"] for n in pinfo["ray_nodes"]] == [head_id]
        assert [n["node_id"] for n in dinfo["ray_nodes"]] == [cluster.worker.node_id]
        assert pinfo["disaggregation_bootstrap_host"] == pinfo["ray_nodes"][0]["ip"]
    finally:
        if router is not None:
            router.stop()
        for srv in (decode, prefill):
            if srv is not None:
                assert srv.stop() == []
    assert wait_no_actors(cluster) == []


def test_afd_attention_and_ffn_on_distinct_nodes_equals_single_process(cluster):
    """MegaScale-Infer AFD: one attention worker and two FFN workers with --ray-spread-roles (one STRICT_SPREAD
    placement group: the attention bundle and the FFN pool on different nodes; M2N over TCP between them)."""
    moe = shared_path("models", "stories260K-moe")
    reference = single_process_reference(moe)
    srv = ServerProcess(["--model-path", moe, "--device", "cpu", "--enable-afd", "--afd-attention-workers", "1",
                         "--afd-ffn-workers", "2", "--afd-micro-batches", "2", "--chunked-prefill-size", "16",
                         "--use-ray", "--ray-address", cluster.address, "--ray-spread-roles"], timeout=240)
    try:
        outs = generate(srv.url, greedy_payload())
        assert [o["output_ids"] for o in outs] == reference
        nodes = requests.get(srv.url + "/get_server_info", timeout=30).json()["afd_ray_nodes"]
        att, ffn = {n["node_id"] for n in nodes["attention"]}, {n["node_id"] for n in nodes["ffn"]}
        assert len(att) == 1 and len(ffn) == 1 and att != ffn, nodes
        assert nodes["transport"] == "inline"
        assert len(alive_worker_actors(cluster)) == 4  # attention rank, two FFN workers, detokenizer
    finally:
        assert srv.stop() == []
    assert wait_no_actors(cluster) == []


def test_kill_raylet_mid_request_fails_fast_without_leftovers(cluster, model_path):
    srv = ray_server(cluster, model_path)
    result = {}

    def long_request() -> None:
        try:
            r = requests.post(srv.url + "/generate", json={"text": PROMPTS[0], "sampling_params": {
                "max_new_tokens": 480, "ignore_eos": True, "temperature": 0}}, timeout=EXIT_WITHIN_S)
            result["status"], result["body"] = r.status_code, r.text
        except requests.RequestException as e:  # the connection dropped: also an error, not a hang
            result["error"] = repr(e)

    try:
        generate(srv.url, {"text": PROMPTS[0], "sampling_params": {"max_new_tokens": 4}})
        t = threading.Thread(target=long_request)
        t.start()
        time.sleep(1.0)
        raylet = cluster.worker.all_processes["raylet"][0].process
        t0 = time.monotonic()
        os.kill(raylet.pid, signal.SIGKILL)
        t.join(EXIT_WITHIN_S)
        assert not t.is_alive(), "the in-flight request hung after the node died"
        assert result.get("status", 0) != 200 or '"error"' in result.get("body", ""), result
        srv.proc.wait(EXIT_WITHIN_S)
        assert time.monotonic() - t0 < EXIT_WITHIN_S
        log = srv.log_tail(300)
        assert srv.proc.returncode != 0, log
        assert "stopping the server" in log and "scheduler TP rank" in log, log
    finally:
        srv.stop()
    assert wait_no_actors(cluster) == []
