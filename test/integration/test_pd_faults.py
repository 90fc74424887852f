"""Prefill/decode disaggregation fails closed (CPU, real processes, SIGKILL):

* the prefill server dies with requests in flight (it is frozen with SIGSTOP first so that the decode side
  has open rooms with preallocated KV, push mode; then SIGKILLed): those requests get an error (never 200
  with wrong tokens), nothing hangs, the decode side frees their KV (back to zero) after the heartbeat
  timeout and keeps serving through another prefill server;
* the decode server dies mid-request: the router answers with an error, the prefill side frees the KV it
  held for it (bootstrap/heartbeat timeouts) and keeps serving.
"""

from __future__ import annotations

import concurrent.futures as cf
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
from conftest import shared_path  # noqa: E402
from pd_utils import AGG, FAST, Router, kv_in_use, pd_args  # noqa: E402
from server_utils import ServerProcess  # noqa: E402

pytestmark = pytest.mark.timeout(900)
GREEDY = {"max_new_tokens": 16, "temperature": 0.0}
PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def model():
    path = shared_path("models", "stories260K")
    if path is None or not os.path.isdir(path):
        pytest.skip("stories260K is not in the shared data folder")
    return path


def _tree(server: ServerProcess) -> list[psutil.Process]:
    p = psutil.Process(server.proc.pid)
    return [p, *p.children(recursive=True)]


def _signal_tree(server: ServerProcess, sig: int) -> None:
    for p in _tree(server):
        try:
            p.send_signal(sig)
        except psutil.NoSuchProcess:
            pass


def _wait_until(pred, timeout: float, what: str) -> None:
    end = time.time() + timeout
    while time.time() < end:
        if pred():
            return
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


def test_prefill_killed_with_requests_in_flight(model):
    mode = ["--disaggregation-transfer-mode", "push"]
    servers = []
    try:
        agg = ServerProcess(["--model-path", model, *AGG], timeout=600)
        servers.append(agg)
        want = requests.post(agg.url + "/generate", json={"text": PROMPT, "sampling_params": GREEDY},
                             timeout=60).json()["output_ids"]
        p1 = ServerProcess(pd_args("prefill", model, mode), timeout=600)
        servers.append(p1)
        dec = ServerProcess(pd_args("decode", model, mode), timeout=600)
        servers.append(dec)
        router = Router([p1.url], [dec.url])
        try:
            ok = requests.post(router.url + "/generate", json={"text": PROMPT, "sampling_params": GREEDY}, timeout=60)
            assert ok.status_code == 200 and ok.json()["output_ids"] == want  # connected, heartbeats flowing
            _signal_tree(p1, signal.SIGSTOP)
            with cf.ThreadPoolExecutor(4) as pool:
                futs = [pool.submit(requests.post, router.url + "/generate",
                                    json={"text": PROMPT + "," * i, "sampling_params": GREEDY}, timeout=120)
                        for i in range(4)]
                _wait_until(lambda: dec.internal_state()["disagg_open_rooms"] == 4, 60, "4 open rooms on decode")
                assert kv_in_use(dec) > 0  # push mode preallocated their KV
                _signal_tree(p1, signal.SIGKILL)
                res = [f.result() for f in futs]
            for r in res:  # errors, never 200 with wrong tokens
                assert r.status_code >= 500, r.text
                assert "silent" in r.text or "transfer" in r.text.lower() or "prefill" in r.text
            assert kv_in_use(dec) == 0
            assert dec.internal_state()["disagg_rooms_failed"] >= 4
            # the decode server keeps serving with a new prefill server
            p2 = ServerProcess(pd_args("prefill", model, mode), timeout=600)
            servers.append(p2)
            add = requests.post(router.url + "/add_worker", params={"url": p2.url, "role": "prefill"}, timeout=60)
            assert add.status_code == 200, add.text
            requests.post(router.url + "/remove_worker", params={"url": p1.url}, timeout=10)
            r = requests.post(router.url + "/generate", json={"text": PROMPT, "sampling_params": GREEDY}, timeout=60)
            assert r.status_code == 200 and r.json()["output_ids"] == want
        finally:
            router.stop()
    finally:
        for s in servers:
            s.stop(signal.SIGKILL) if s.proc.poll() is None else None


def test_decode_killed_mid_request(model):
    servers = []
    try:
        with cf.ThreadPoolExecutor(2) as pool:  # both sides start side by side
            fut = {k: pool.submit(ServerProcess, pd_args(k, model, timeouts=6.0 if k == "prefill" else 20.0),
                                  timeout=600) for k in ("prefill", "decode")}
        for f in fut.values():  # keep every server that started, so the finally stops it
            if f.exception() is None:
                servers.append(f.result())
        pre, dec = fut["prefill"].result(), fut["decode"].result()
        router = Router([pre.url], [dec.url])
        try:
            long = {"max_new_tokens": 200, "temperature": 0.0, "ignore_eos": True}
            _signal_tree(dec, signal.SIGSTOP)
            with cf.ThreadPoolExecutor(3) as pool:
                futs = [pool.submit(requests.post, router.url + "/generate",
                                    json={"text": PROMPT + "!" * i, "sampling_params": long}, timeout=120)
                        for i in range(3)]
                _wait_until(lambda: pre.internal_state()["disagg_open_rooms"] == 3, 60, "3 rooms held on prefill")
                assert kv_in_use(pre) > 0
                t_kill = time.time()
                _signal_tree(dec, signal.SIGKILL)
                res = [f.result() for f in futs]
                t_err = time.time() - t_kill
            assert all(r.status_code >= 500 for r in res), [r.status_code for r in res]
            assert t_err < 10.0, f"clients got their errors {t_err:.1f} s after the decode server died"
            _wait_until(lambda: kv_in_use(pre) == 0 and pre.internal_state()["disagg_open_rooms"] == 0, 60,
                        "the prefill side to free the KV held for the dead decode server")
            t_free = time.time() - t_kill
            print(f"[pd-fault] decode killed: {len(res)} clients errored ({sorted({r.status_code for r in res})}) "
                  f"within {t_err:.2f} s; prefill KV freed within {t_free:.2f} s", flush=True)
            assert pre.internal_state()["disagg_rooms_failed"] >= 3
        finally:
            router.stop()
        # the prefill server still serves (with a new decode server)
        dec2 = ServerProcess(pd_args("decode", model), timeout=600)
        servers.append(dec2)
        router = Router([pre.url], [dec2.url])
        try:
            r = requests.post(router.url + "/generate", json={"text": PROMPT, "sampling_params": GREEDY}, timeout=60)
            assert r.status_code == 200 and len(r.json()["output_ids"]) == GREEDY["max_new_tokens"] or \
                r.json()["meta_info"]["finish_reason"]["type"] == "stop"
        finally:
            router.stop()
    finally:
        for s in servers:
            s.stop(signal.SIGKILL) if s.proc.poll() is None else None
