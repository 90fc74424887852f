"""Prefill/decode disaggregation fails closed (CPU, real processes, SIGKILL):

* the prefill server dies with requests in flight (it is frozen with SIGSTOP first so that the decode side
  has open rooms with preallocated KV, push mode; then SIGKILLed): those requests get an error (never 200
  with wrong tokens), nothing hangs, the decode side frees their KV (back to zero) after the heartbeat
  timeout and keeps serving through another prefill server;
* the decode server dies while KV transfers are in flight (pull: its READs posted, push: the prefill side's WRITEs
  into it posted; the test-only ``SGLANG_PD_FAULT_HOLD_TRANSFER_S`` hook holds them so the kill lands inside the
  transfer on any transport): the router answers with an error, the prefill side fails the rooms and frees their KV
  (heartbeat timeout / failed WRITEs) and keeps serving.

GPU: ``SGLANG_PD_TEST_DEVICE=cuda SGLANG_PD_TEST_BACKEND=nixl SGLANG_PD_TEST_SPLIT_GPUS=1`` (pd_utils.py) runs the same
tests with prefill on GPU 0 and decode on GPU 1 (``scripts/gpu/pd_2gpu.sh``).
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


# the test-only transfer hold (sglang/srt/disaggregation/transfer/fault_hook.py) on the side that posts the transfers:
# pull: the decode side's READs; push: the prefill side's WRITEs. Hold < that side's --disaggregation-transfer-timeout,
# so a push's held WRITEs reach the transport after the kill and meet the dead decode server (not the timeout).
HOLD_S = {"pull": 15.0, "push": 8.0}
TIMEOUTS = {("pull", "prefill"): 6.0, ("pull", "decode"): 20.0, ("push", "prefill"): 15.0, ("push", "decode"): 20.0}
N_KILLED = 3


def _wait_in_flight(server: ServerProcess, n: int, timeout: float) -> tuple[float, dict]:
    """Poll ``server`` (the side that posts the transfers) until ``n`` rooms have their transfer posted and held;
    returns ``(monotonic time the answering query was sent, its internal state)``."""
    end = time.time() + timeout
    st: dict = {}
    while time.time() < end:
        t_ask = time.monotonic()
        st = server.internal_state()
        hold = st.get("disagg_fault_hold") or {}
        if st["disagg_rooms_transferring"] >= n and hold.get("held_now", 0) >= n:
            return t_ask, st
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {n} rooms with held transfers; last state {st}")


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_decode_killed_mid_transfer(model, mode):
    """The decode server is SIGKILLed while the KV transfers of N_KILLED requests are posted and not complete (pull:
    its READs, push: the prefill side's WRITEs into it; held by the fault hook, asserted from /get_server_info
    at the kill): every client gets an error (never 200 with tokens) within 10 s, the prefill side fails the rooms
    and frees their KV (back to the pre-request value), then serves through a second decode server."""
    xmode = ["--disaggregation-transfer-mode", mode]
    hook = {"SGLANG_PD_FAULT_HOLD_TRANSFER_S": str(HOLD_S[mode])}
    servers = []
    try:
        names = ("prefill", "decode", "decode2")  # all three start side by side (GPU: most of it is CUDA init)
        for k in names:
            role = k.rstrip("2")
            env = hook if k == ("decode" if mode == "pull" else "prefill") else None
            servers.append(ServerProcess(pd_args(role, model, xmode, timeouts=TIMEOUTS[(mode, role)]),
                                         timeout=600, wait=False, env=env))
        for s in servers:
            s.wait_healthy(600)
        pre, dec, dec2 = servers
        poster = dec if mode == "pull" else pre
        kv0 = kv_in_use(pre)
        router = Router([pre.url], [dec.url])
        try:
            long = {"max_new_tokens": 200, "temperature": 0.0, "ignore_eos": True}
            with cf.ThreadPoolExecutor(N_KILLED) as pool:
                futs = [pool.submit(requests.post, router.url + "/generate",
                                    json={"text": PROMPT + "!" * i, "sampling_params": long}, timeout=120)
                        for i in range(N_KILLED)]
                t_ask, st = _wait_in_flight(poster, N_KILLED, 90)
                assert kv_in_use(pre) > kv0
                _signal_tree(dec, signal.SIGKILL)
                t_kill = time.monotonic()
                held = st["disagg_fault_hold"]
                # the snapshot was taken after t_ask: every held transfer was still held at the kill
                assert t_kill - t_ask < held["held_min_left_s"], (t_kill - t_ask, held)
                res = [f.result() for f in futs]
                t_err = time.monotonic() - t_kill
            for r in res:  # errors, never 200 with tokens
                assert r.status_code >= 500 and "output_ids" not in r.text, (r.status_code, r.text[:300])
            assert t_err < 10.0, f"clients got their errors {t_err:.1f} s after the decode server died"
            _wait_until(lambda: kv_in_use(pre) == kv0 and pre.internal_state()["disagg_open_rooms"] == 0, 60,
                        "the prefill side to fail the rooms and free their KV")
            t_free = time.monotonic() - t_kill
            end = pre.internal_state()
            assert end["disagg_rooms_failed"] >= N_KILLED and end["disagg_rooms_transferring"] == 0
            if mode == "push":  # the held WRITEs went to the transport after the kill, into the dead decode server;
                # once one of a room's WRITEs failed there, the room's WRITEs still held were cancelled with it
                fh = end["disagg_fault_hold"]
                assert fh["released"] >= 1 and fh["held_now"] == 0 and \
                    fh["released"] + end["disagg_push_writes_cancelled"] >= held["held_now"], (fh, end)
            print(f"[pd-fault] {mode}: decode killed with {st['disagg_rooms_transferring']} rooms' transfers in "
                  f"flight ({held['held_now']} {'READs' if mode == 'pull' else 'WRITEs'} held, >= "
                  f"{held['held_min_left_s'] - (t_kill - t_ask):.1f} s of hold left); {len(res)} clients errored "
                  f"({sorted({r.status_code for r in res})}) within {t_err:.2f} s; prefill KV back to {kv0} within "
                  f"{t_free:.2f} s", flush=True)
        finally:
            router.stop()
        router = Router([pre.url], [dec2.url])  # the prefill server still serves, through the second decode server
        try:
            r = requests.post(router.url + "/generate", json={"text": PROMPT, "sampling_params": {
                **GREEDY, "ignore_eos": True}}, timeout=120)
            assert r.status_code == 200 and len(r.json()["output_ids"]) == GREEDY["max_new_tokens"], r.text[:300]
        finally:
            router.stop()
    finally:
        for s in servers:
            s.stop(signal.SIGKILL) if s.proc.poll() is None else None
