"""Two prefill servers : one decode server behind the mini_lb router (the 2P:1D layout): the router sends
requests to the prefill servers round robin, the decode server connects lazily to each one's bootstrap server and
pulls the KV from whichever prefilled the request; the greedy output equals the aggregated server's token for token
(``--disaggregation-verify`` checksums the KV), both prefill servers handed rooms over (released on COMPLETE, none
failed), and KV is back to zero everywhere. Pull mode, stories260K.

GPU: ``SGLANG_PD_TEST_DEVICE=cuda SGLANG_PD_TEST_BACKEND=nixl SGLANG_PD_TEST_SPLIT_GPUS=1`` puts the decode server on
GPU 1 and, with ``SGLANG_PD_TEST_PREFILL_GPUS=0,2``, prefill server i on the i-th GPU listed
(``scripts/gpu/pd_layouts_4gpu.sh``). The aggregated server and the three PD servers start at once; run with ``-s``
for timestamped progress lines (servers up, each request, tokens compared)."""

from __future__ import annotations

import os
import sys

import pytest
import requests

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
from conftest import shared_path  # noqa: E402
from pd_utils import AGG, DEVICE, Router, kv_in_use, pd_args, progress, start_servers  # noqa: E402

# SGLANG_PD_TEST_TIMEOUT bounds the test (a timed-out test still stops its servers and prints every stack)
pytestmark = pytest.mark.timeout(int(os.environ.get("SGLANG_PD_TEST_TIMEOUT", "900")))

PROMPTS = ["Once upon a time", "Lily and Tom went to the park. They saw a big red ball and a little",
           "The cat sat on the", "One day, a little girl named Sue"]
GREEDY = {"max_new_tokens": 16, "temperature": 0.0}


def _prefill_gpus() -> list[list[str]]:
    """``--base-gpu-id`` flags of the two prefill servers (empty off CUDA or without SGLANG_PD_TEST_PREFILL_GPUS)."""
    spec = os.environ.get("SGLANG_PD_TEST_PREFILL_GPUS", "")
    if DEVICE != "cuda" or not spec:
        return [[], []]
    gpus = [g.strip() for g in spec.split(",") if g.strip()]
    if len(gpus) != 2:
        raise ValueError(f"SGLANG_PD_TEST_PREFILL_GPUS={spec!r}: name two GPU indices, e.g. 0,2")
    return [["--base-gpu-id", g] for g in gpus]


def test_two_prefill_one_decode_equals_aggregated():
    model = shared_path("models", "stories260K")
    if model is None or not os.path.isdir(model):
        pytest.skip("stories260K is not in the shared data folder")
    places = _prefill_gpus()
    servers = start_servers([["--model-path", model, *AGG], pd_args("prefill", model, places[0]),
                             pd_args("prefill", model, places[1]), pd_args("decode", model)],
                            ["aggregated", f"prefill 1 {places[0]}", f"prefill 2 {places[1]}", "decode"])
    try:
        agg, p1, p2, dec = servers
        expected = [requests.post(agg.url + "/generate", json={"text": p, "sampling_params": GREEDY},
                                  timeout=120).json()["output_ids"] for p in PROMPTS]
        progress("aggregated outputs taken")
        router = Router([p1.url, p2.url], [dec.url])
        progress("router up")
        try:
            got = []
            for i, p in enumerate(PROMPTS):  # one at a time: round robin alternates the prefill servers
                progress(f"request {i} sent")
                r = requests.post(router.url + "/generate", json={"text": p, "sampling_params": GREEDY}, timeout=120)
                assert r.status_code == 200, r.text
                got.append(r.json()["output_ids"])
                progress(f"request {i} answered: {r.json()['meta_info']['disaggregation']}")
                assert r.json()["meta_info"]["disaggregation"]["transfer_bytes"] > 0
        finally:
            router.stop()
        assert got == expected
        progress("tokens compared: equal")
        done = [p.internal_state() for p in (p1, p2)]
        assert [d["disagg_rooms_done"] for d in done] == [2, 2], done
        assert all(d["disagg_rooms_failed"] == 0 for d in done), done
        assert kv_in_use(p1) == 0 and kv_in_use(p2) == 0 and kv_in_use(dec) == 0
    finally:
        for s in servers:
            s.stop()
