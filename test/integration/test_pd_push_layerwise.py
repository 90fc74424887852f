"""Push mode's layerwise path end to end on CPU: a prefill server (chunked prefill of 16 tokens, push wait of 3 s)
and a decode server as separate processes, driven directly (no router) so that the order of the two sides is known:

* decode first (its RoomRequest with the preallocated ``dst_slots`` reaches the prefill side before the forward):
  the prefill side posts each layer's WRITEs right after the layer's attention (``push_layerwise: true``), also for
  a prompt prefilled in several chunks and for a prefix-cache hit;
* prefill first, decode while the prefill request waits for its RoomRequest (``--disaggregation-push-wait-timeout``):
  layerwise too;
* prefill first, decode only after the wait expired and the forward ran: every layer is written after the fact
  (``push_layerwise: false``).

Greedy output equals the aggregated server token for token, ``--disaggregation-verify`` checksums every request's
KV on both sides, and the prefill server's counters show which path each request took; KV returns to zero."""

from __future__ import annotations

import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
from conftest import shared_path  # noqa: E402
from pd_utils import AGG, generate_in_order, kv_in_use, pd_args, wait_for  # noqa: E402
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
    argv = {"agg": ["--model-path", path, *AGG],
            "prefill": pd_args("prefill", path, extra + ["--chunked-prefill-size", "16",
                                                        "--disaggregation-push-wait-timeout", "3"], bootstrap_port=port),
            "decode": pd_args("decode", path, extra)}
    with ThreadPoolExecutor(3) as pool:  # the three servers start side by side (stopped even if one fails)
        futures = {k: pool.submit(ServerProcess, v) for k, v in argv.items()}
    started, errors = {}, []
    for k, f in futures.items():
        try:
            started[k] = f.result()
        except Exception as e:  # noqa: BLE001 - re-raised below after the others are stopped
            errors.append(e)
    try:
        if errors:
            raise errors[0]
        yield {**started, "bootstrap_port": port}
    finally:
        with ThreadPoolExecutor(3) as pool:
            list(pool.map(lambda srv: srv.stop(), started.values()))


def _post(url: str, body: dict) -> dict:
    r = requests.post(url + "/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_layerwise_and_after_the_fact_equal_aggregated(servers):
    agg, prefill, decode = servers["agg"], servers["prefill"], servers["decode"]
    before = prefill.internal_state()
    # (prompt, decode first, counter to wait for before the second side, layerwise expected); LONG twice: chunked,
    # then a prefix hit
    cases = [(SHORT, True, None, True), (LONG, True, None, True), (LONG, True, None, True),
             (SHORT, False, "disagg_push_waiting", True), (SHORT, False, "disagg_open_rooms", False)]
    nbytes = []
    for i, (prompt, decode_first, key, layerwise) in enumerate(cases):
        ref = _post(agg.url, {"text": prompt, "sampling_params": GREEDY})
        got = generate_in_order(prefill, decode, servers["bootstrap_port"], {"text": prompt, "sampling_params": GREEDY},
                                7000 + i, decode_first, wait_key=key)
        assert got["output_ids"] == ref["output_ids"] and len(ref["output_ids"]) > 1, (prompt, decode_first)
        assert got["text"] == ref["text"]
        info = got["meta_info"]["disaggregation"]
        assert info["push_layerwise"] is layerwise, (i, info)
        assert info["transfer_bytes"] > 0 and info["transfer_reads"] >= 1
        # the WRITE time after the forward (bench_pd_serving's push share of TTFT): all of it after the fact
        assert 0.0 <= info["transfer_tail_s"] <= info["transfer_time_s"], info
        if not layerwise:
            assert info["transfer_tail_s"] == info["transfer_time_s"], info
        nbytes.append(info["transfer_bytes"])
        if i == 2:
            assert got["meta_info"]["cached_tokens"] > 0  # the prefill side's prefix hit is in the layerwise rows
    assert nbytes[0] == nbytes[3] == nbytes[4] and nbytes[1] == nbytes[2]  # both paths move the same bytes
    assert got["meta_info"]["prompt_tokens"] > 0
    after = prefill.internal_state()
    assert after["disagg_push_layerwise"] - before["disagg_push_layerwise"] == 4
    assert after["disagg_push_after_forward"] - before["disagg_push_after_forward"] == 1
    assert after["disagg_rooms_failed"] == before["disagg_rooms_failed"] and after["disagg_push_waiting"] == 0
    wait_for(lambda: kv_in_use(prefill) == 0 and kv_in_use(decode) == 0, "KV back to zero")


def test_abort_while_waiting_for_the_room_request(servers):
    """A push-mode prefill request aborted while it waits for its RoomRequest finishes at once (finish_reason
    abort, no tokens), holds no KV, and a decode request for its room then fails (never hangs, never HTTP 200)."""
    prefill, decode = servers["prefill"], servers["decode"]
    body = {"text": SHORT, "sampling_params": GREEDY, "rid": "push-wait-abort", "bootstrap_host": "127.0.0.1",
            "bootstrap_port": servers["bootstrap_port"], "bootstrap_room": 7100}
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("r", requests.post(prefill.url + "/generate", json=body,
                                                                          timeout=60)))
    t.start()
    wait_for(lambda: prefill.internal_state()["disagg_push_waiting"] >= 1, "the waiting request")
    requests.post(prefill.url + "/abort_request", json={"rid": "push-wait-abort"}, timeout=30).raise_for_status()
    t.join(30)
    res = out["r"]  # /abort_request answers like SGLang: the request ends with finish_reason abort, no tokens
    assert res.status_code != 200 or (res.json()["meta_info"]["finish_reason"]["type"] == "abort"
                                      and res.json()["output_ids"] == []), res.text
    assert prefill.internal_state()["disagg_push_waiting"] == 0
    r = requests.post(decode.url + "/generate", json={**body, "rid": "push-wait-abort-d"}, timeout=60)
    assert r.status_code >= 400, r.text
    wait_for(lambda: kv_in_use(prefill) == 0 and kv_in_use(decode) == 0, "KV back to zero")
