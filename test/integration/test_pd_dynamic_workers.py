"""Dynamic prefill/decode workers under a running ``bench_serving`` load through the mini_lb router:

* join: a second prefill and a second decode server are added (``POST /add_worker``) while the load runs;
  decode servers connect lazily to the new prefill server; zero requests fail and the new workers serve;
* leave: a decode server is removed (``POST /remove_worker``) and then stopped while the load runs; only
  requests it held may fail (at most the load's concurrency), everything else completes; the survivors'
  KV returns to zero.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import requests

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
from conftest import shared_path  # noqa: E402
from pd_utils import Router, kv_in_use, pd_args  # noqa: E402
from server_utils import ENV, ServerProcess  # noqa: E402

pytestmark = pytest.mark.timeout(1200)
CONC = 4


def _bench(router: str, model: str, out: str, n: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "sglang.bench_serving", "--disable-tqdm", "--backend", "sglang", "--base-url", router,
           "--tokenizer", model, "--model", model, "--dataset-name", "random", "--num-prompts", str(n),
           "--random-input-len", "24", "--random-output-len", "24", "--random-range-ratio", "0.5",
           "--max-concurrency", str(CONC), "--seed", "1", "--output-file", out]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV)


def _result(proc: subprocess.Popen, out: str) -> dict:
    log, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, log[-3000:]
    with open(out) as f:
        return json.loads(f.read().strip().splitlines()[-1])


def test_join_and_leave_under_load(tmp_path):
    model = shared_path("models", "stories260K")
    if model is None or not os.path.isdir(model):
        pytest.skip("stories260K is not in the shared data folder")
    servers = []
    try:
        for mode in ("prefill", "decode", "prefill", "decode"):
            servers.append(ServerProcess(pd_args(mode, model), timeout=600))
        p1, d1, p2, d2 = servers
        router = Router([p1.url], [d1.url])
        try:
            n = 48
            out = str(tmp_path / "join.jsonl")
            bench = _bench(router.url, model, out, n)
            time.sleep(3)
            for url, role in ((p2.url, "prefill"), (d2.url, "decode")):
                r = requests.post(router.url + "/add_worker", params={"url": url, "role": role}, timeout=60)
                assert r.status_code == 200, r.text
            rec = _result(bench, out)
            assert rec["completed"] == n  # joining never fails a request
            assert d2.internal_state()["disagg_rooms_done"] > 0 and p2.internal_state()["disagg_rooms_done"] > 0
            assert {"prefill", "decode"} <= set(requests.get(router.url + "/get_server_info", timeout=10).json())

            out = str(tmp_path / "leave.jsonl")
            bench = _bench(router.url, model, out, n)
            time.sleep(3)
            r = requests.post(router.url + "/remove_worker", params={"url": d2.url}, timeout=10)
            assert r.status_code == 200, r.text
            time.sleep(0.5)
            d2.stop()  # leaves for good; requests it still held may fail
            rec = _result(bench, out)
            assert n - CONC <= rec["completed"] <= n
            assert requests.post(router.url + "/remove_worker", params={"url": d2.url}, timeout=10).status_code == 404
        finally:
            router.stop()
        time.sleep(8)  # rooms held for the departed decode server expire (heartbeat / bootstrap timeouts)
        for s in (p1, d1, p2):
            assert kv_in_use(s) == 0, s.url
    finally:
        for s in servers:
            s.stop()
