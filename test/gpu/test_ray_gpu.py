"""``--use-ray`` on one GPU: the device comes from Ray's assignment (the actor's ``CUDA_VISIBLE_DEVICES``).

A one-node Ray cluster (``ray start --head --num-gpus 1``) serves stories260K with ``--use-ray --device cuda``:
TP1, and TP2 with both ranks sharing the GPU (``--tp-ranks-share-gpu --ray-gpus-per-worker 0.5``); each must give
the greedy tokens of the same configuration without Ray, and ``/get_server_info`` must report the GPU id Ray
assigned. Run by ``scripts/gpu/ray_gpu.sh``.
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
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "integration"))
from conftest import gpu_tiered, shared_path  # noqa: E402
from ray_utils import generate, greedy_payload  # noqa: E402
from server_utils import ENV, ServerProcess, free_port  # noqa: E402

ENV["RAY_AUTH_MODE"] = "disabled"  # ServerProcess passes ENV to the server (the driver joins this test's head)

pytest.importorskip("ray", reason="ray is not installed (pip install '.[ray]')")
RAY_ENV = ENV


@pytest.fixture(scope="module")
def ray_head(tmp_path_factory):
    port = free_port()
    log = open(tmp_path_factory.mktemp("ray") / "head.log", "w")
    p = subprocess.Popen([shutil.which("ray") or "ray", "start", "--head", "--block", f"--port={port}",
                          "--num-gpus=1", "--num-cpus=4", "--include-dashboard=false", "--disable-usage-stats"],
                         stdout=log, stderr=subprocess.STDOUT, env=RAY_ENV, start_new_session=True)
    time.sleep(5)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()
        log.close()


def _tokens(args: list[str]) -> tuple[list, dict]:
    with ServerProcess(args, timeout=300) as srv:
        outs = generate(srv.url, greedy_payload())
        info = requests.get(srv.url + "/get_server_info", timeout=30).json()
    return [o["output_ids"] for o in outs], info


@pytest.mark.parametrize("extra", gpu_tiered([[], ["--tp", "2", "--tp-ranks-share-gpu"]],
                                             ids=["tp1", "tp2-shared-gpu"]))
def test_use_ray_on_gpu_equals_plain(ray_head, extra):
    base = ["--model-path", shared_path("models", "stories260K"), "--device", "cuda", *extra]
    plain, _ = _tokens(base)
    ray_args = base + ["--use-ray", "--ray-address", ray_head] + (["--ray-gpus-per-worker", "0.5"] if extra else [])
    got, info = _tokens(ray_args)
    assert got == plain
    assert [n["gpu_ids"] for n in info["ray_nodes"]] == [["0"]] * len(info["ray_nodes"]), info["ray_nodes"]
