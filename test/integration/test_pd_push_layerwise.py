"""Push mode's layerwise path end to end on CPU: a prefill server (chunked prefill of 16 tokens) and a decode server
as separate processes, driven directly (no router) so that the order of the two sides is known:

* decode first (its RoomRequest with the preallocated ``dst_slots`` reaches the prefill side before the forward):
  the prefill side posts each layer's WRITEs right after the layer's attention (``push_layerwise: true``), also for
  a prompt prefilled in several chunks and for a prefix-cache hit;
* prefill first (the forward ran before the RoomRequest): every layer is written after the fact
  (``push_layerwise: false``).

Greedy output equals the aggregated server token for token, ``--disaggregation-verify`` checksums every request's
KV on both sides, and the prefill server's counters show which path each request took; KV returns to zero."""

from __future__ import annotations

import os
import sys
import threading
import time

import pytest
import requests

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
from conftest import shared_path  # noqa: E402
from pd_utils import AGG, kv_in_use, pd_args  # noqa: E402
from server_utils import ServerProcess, free_port  # noqa: E402

pytestmark = pytest.mark.timeout(300)

SHORT = "Once upon a time"  # < 16 tokens: one chunk
LONG = ("Lily and Tom went to the park. They saw a big red ball and a little dog. The dog ran to the ball and "
        "Lily laughed. Tom said")  # > 16 tokens: several chunks on the prefill side
GREEDY = {"max_new_tokens": 12, "temperature": 0.0}


@pytest.fixture(scope="module")
def servers():
    path = shared_path("models", "stories260K")
    if path is None or not os.path.isdir(path):
        pytest.skip("stories260K is not in the shared data folder")
    port = free_port()
    extra = ["--disaggregation-transfer-mode", "push"]
    started = []
    try:
        agg = ServerProcess(["--model-path", path, *AGG])
        started.append(agg)
        prefill = ServerProcess(pd_args("prefill", path, extra + ["--chunked-prefill-size", "16"], bootstrap_port=port))
        started.append(prefill)
        decode = ServerProcess(pd_args("decode", path, extra))
        started.append(decode)
        yield {"agg": agg, "prefill": prefill, "decode": decode, "bootstrap_port": port}
    finally:
        for s in started:
            s.stop()


def _post(url: str, body: dict) -> dict:
    r = requests.post(url + "/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def _wait(cond, what: str, timeout: float = 20.0) -> None:
    end = time.time() + timeout
    while time.time() < end:
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def _disagg(servers, prompt: str, room: int, decode_first: bool) -> dict:
    """One request through both sides, in the given order; returns the decode side's answer."""
    prefill, decode = servers["prefill"], servers["decode"]
    body = {"text": prompt, "sampling_params": GREEDY, "bootstrap_host": "127.0.0.1",
            "bootstrap_port": servers["bootstrap_port"], "bootstrap_room": room}
    out: dict = {}
    first, second = (decode, prefill) if decode_first else (prefill, decode)
    t = threading.Thread(target=lambda: out.setdefault("first", _post(first.url, body)))
    t.start()
    if decode_first:  # the prefill side has the RoomRequest (dst_slots) before the request arrives there
        _wait(lambda: prefill.internal_state()["disagg_rooms_awaiting_prefill"] >= 1, "the RoomRequest")
    else:  # the prefill forward ran and its KV is held before the decode side asks
        _wait(lambda: prefill.internal_state()["disagg_open_rooms"] >= 1, "the held prefill")
    out["second"] = _post(second.url, body)
    t.join(60)
    assert "first" in out, "the first request did not finish"
    return out["first"] if decode_first else out["second"]


def test_layerwise_and_after_the_fact_equal_aggregated(servers):
    agg, prefill, decode = servers["agg"], servers["prefill"], servers["decode"]
    before = prefill.internal_state()
    cases = [(SHORT, True), (LONG, True), (LONG, True), (SHORT, False)]  # LONG twice: chunked, then a prefix hit
    nbytes = []
    for i, (prompt, decode_first) in enumerate(cases):
        ref = _post(agg.url, {"text": prompt, "sampling_params": GREEDY})
        got = _disagg(servers, prompt, 7000 + i, decode_first)
        assert got["output_ids"] == ref["output_ids"] and len(ref["output_ids"]) > 1, (prompt, decode_first)
        assert got["text"] == ref["text"]
        info = got["meta_info"]["disaggregation"]
        assert info["push_layerwise"] is decode_first, (i, info)
        assert info["transfer_bytes"] > 0 and info["transfer_reads"] >= 1
        nbytes.append(info["transfer_bytes"])
        if i == 2:
            assert got["meta_info"]["cached_tokens"] > 0  # the prefill side's prefix hit is in the layerwise rows
    assert nbytes[0] == nbytes[3] and nbytes[1] == nbytes[2]  # both paths move the same bytes
    assert got["meta_info"]["prompt_tokens"] > 0
    after = prefill.internal_state()
    assert after["disagg_push_layerwise"] - before["disagg_push_layerwise"] == 3
    assert after["disagg_push_after_forward"] - before["disagg_push_after_forward"] == 1
    assert after["disagg_rooms_failed"] == before["disagg_rooms_failed"]
    _wait(lambda: kv_in_use(prefill) == 0 and kv_in_use(decode) == 0, "KV back to zero")
