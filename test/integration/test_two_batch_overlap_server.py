"""Two-batch overlap in a real server (CPU, ``--tp 2 --ep-size 2 --moe-a2a-backend nccl``, gloo, TP attention):
forced on (``--tbo-min-tokens 2``) with chunked prefill (mixed prefill + decode batches) and a KV pool small enough
to retract running requests, it returns the TP1 greedy tokens of the shared prompts; requests joining mid-decode and
a request aborted in flight do not disturb the others; the server logs its choice. With DP attention the same
properties (and a killed rank) run in ``test_dp_attention_server.py``'s 4-rank server (all-to-all + two-batch overlap
+ the overlap scheduler), and at 2 ranks through the real scheduler in ``test/unit/test_ep_dp_tbo_schedules.py``."""

from __future__ import annotations

import json
import os
import sys
import threading
import time

import pytest
import requests

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "unit"))
from conftest import shared_path  # noqa: E402
from server_utils import ServerProcess  # noqa: E402
from tbo_worker import N_NEW, PROMPTS, tp1_greedy  # noqa: E402

GREEDY = {"temperature": 0, "max_new_tokens": N_NEW, "ignore_eos": True}


@pytest.fixture(scope="module")
def server():
    path = shared_path("models", "stories260K-moe8")
    # 4 requests of up to 14 + 32 tokens need ~130 KV slots; 96 forces retractions while they decode
    with ServerProcess(["--model-path", path, "--device", "cpu", "--tp", "2", "--ep-size", "2", "--moe-a2a-backend",
                        "nccl", "--max-total-tokens", "96", "--enable-two-batch-overlap", "--tbo-min-tokens", "2",
                        "--chunked-prefill-size", "8", "--disable-radix-cache"]) as s:
        s.model_path = path
        yield s


def _generate(server, payload, timeout=180):
    r = requests.post(server.url + "/generate", json=payload, timeout=timeout)
    assert r.status_code == 200, r.text
    return r.json()


def test_batch_with_retractions_gives_tp1_tokens(server):
    want = tp1_greedy(server.model_path)
    outs = _generate(server, {"text": list(PROMPTS), "sampling_params": GREEDY})
    assert [tuple(o["output_ids"]) for o in outs] == list(want)
    with open(server.log_path) as f:
        log = f.read()
    assert "two-batch overlap on:" in log and "split" in log  # the choice is logged
    assert "KV cache full: retracting" in log  # requests were retracted while the micro-batches ran


def test_join_mid_decode_and_abort_in_flight(server):
    want = tp1_greedy(server.model_path)
    results: dict = {}

    def stream_first() -> None:  # prompt 0 streams; the others join once it decodes
        chunks = []
        with requests.post(server.url + "/generate", stream=True, timeout=180, json={
                "text": PROMPTS[0], "stream": True, "sampling_params": GREEDY}) as r:
            for line in r.iter_lines():
                if line.startswith(b"data: ") and line != b"data: [DONE]":
                    chunks.append(json.loads(line[6:]))
                    results["first_chunk"] = True
        results[0] = chunks[-1]["output_ids"]

    def one(i: int) -> None:
        results[i] = _generate(server, {"text": PROMPTS[i], "sampling_params": GREEDY})["output_ids"]

    def victim() -> None:  # aborted while it decodes beside the others
        results["victim"] = _generate(server, {"text": "Once upon a time, a cat", "rid": "tbo-victim",
                                               "sampling_params": {"temperature": 0, "max_new_tokens": 300,
                                                                   "ignore_eos": True}})

    t0 = threading.Thread(target=stream_first)
    t0.start()
    deadline = time.time() + 120
    while "first_chunk" not in results and time.time() < deadline:
        time.sleep(0.02)
    assert "first_chunk" in results, "the first request never started decoding"
    threads = [threading.Thread(target=one, args=(i,)) for i in (1, 2, 3)] + [threading.Thread(target=victim)]
    for t in threads:
        t.start()
    time.sleep(1.0)
    r = requests.post(server.url + "/abort_request", json={"rid": "tbo-victim"}, timeout=30)
    assert r.status_code == 200, r.text
    for t in [t0, *threads]:
        t.join(180)
        assert not t.is_alive()
    assert [tuple(results[i]) for i in range(4)] == list(want)
    assert results["victim"]["meta_info"]["finish_reason"]["type"] == "abort"
    assert len(results["victim"]["output_ids"]) < 300
    # still serving, same tokens
    assert tuple(_generate(server, {"text": PROMPTS[1], "sampling_params": GREEDY})["output_ids"]) == want[1]
