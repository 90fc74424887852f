"""Heterogeneous prefill/decode: prefill TP != decode TP (1->2, 2->1 and 2->4, gloo ranks on CPU) and different
page sizes (1 and 16) on the two sides. Each decode rank reads the whole token rows of the prefill ranks that hold
its KV heads into a staging chunk and copies its heads into its KV slots (staging.py), through its TransferQueue
(per-token ops coalesced into one READ per run of consecutive prefill slots, COMPLETE/ACK over the backend's
notifications, the prefill KV released on COMPLETE); the output equals the aggregated TP=1
server token for token, ``--disaggregation-verify`` checksums every request's KV per (layer, K/V, head), and
KV is back to zero on both sides. stories260K has 4 KV heads: decode TP 4 holds one head per rank."""

from __future__ import annotations

import os
import sys

import pytest
import requests

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
from conftest import shared_path  # noqa: E402
from pd_utils import AGG, FAST, Router, generate_in_order, kv_in_use, pd_args, progress, start_servers  # noqa: E402
from server_utils import ServerProcess, free_port  # noqa: E402

# SGLANG_PD_TEST_TIMEOUT bounds each test (a timed-out test still stops its servers and prints every stack)
pytestmark = pytest.mark.timeout(int(os.environ.get("SGLANG_PD_TEST_TIMEOUT", "900")))

PROMPTS = ["Once upon a time", "Lily and Tom went to the park. They saw a big red ball and a little"]
GREEDY = {"max_new_tokens": 24, "temperature": 0.0}
LAYERS = 5  # stories260K


@pytest.fixture(scope="module")
def model():
    path = shared_path("models", "stories260K")
    if path is None or not os.path.isdir(path):
        pytest.skip("stories260K is not in the shared data folder")
    return path


class _Expected:
    """The aggregated TP=1 server's greedy outputs, taken once per module: the server starts when first asked for
    (its start-up overlaps the PD servers' of the first test) and stops once the outputs are taken."""

    def __init__(self, model: str):
        self.model, self.agg, self.outs = model, None, None

    def start(self) -> None:
        if self.outs is None and self.agg is None:
            self.agg = ServerProcess(["--model-path", self.model, *AGG], wait=False)
            progress(f"starting aggregated on port {self.agg.port} (log {self.agg.log_path})")

    def get(self) -> list:
        if self.outs is None:
            self.start()
            try:
                self.agg.wait_healthy(600)
                progress("aggregated up")
                self.outs = [requests.post(self.agg.url + "/generate", json={"text": p, "sampling_params": GREEDY},
                                           timeout=120).json()["output_ids"] for p in PROMPTS]
                progress("aggregated outputs taken")
            finally:
                self.stop()
        return self.outs

    def stop(self) -> None:
        if self.agg is not None:
            self.agg.stop()
            self.agg = None


@pytest.fixture(scope="module")
def expected(model):
    e = _Expected(model)
    yield e
    e.stop()


@pytest.mark.parametrize("p_tp,p_page,d_tp,d_page,mode", [
    (1, 1, 2, 16, "pull"),
    (2, 16, 1, 1, "pull"),
    (2, 1, 4, 16, "pull"),
    (2, 1, 1, 16, "push"),
], ids=["tp1p1-to-tp2p16-pull", "tp2p16-to-tp1p1-pull", "tp2p1-to-tp4p16-pull", "tp2p1-to-tp1p16-push"])
def test_hetero_tp_and_page_size(model, expected, p_tp, p_page, d_tp, d_page, mode):
    m = ["--disaggregation-transfer-mode", mode]
    port = free_port()
    expected.start()
    servers = start_servers([pd_args("prefill", model, ["--tp", str(p_tp), "--page-size", str(p_page), *m],
                                     bootstrap_port=port),
                             pd_args("decode", model, ["--tp", str(d_tp), "--page-size", str(d_page), *m])],
                            [f"prefill tp{p_tp}", f"decode tp{d_tp}"])
    try:
        prefill, decode = servers
        router = Router([prefill.url], [decode.url])
        progress("router up; request sent")
        try:
            outs = requests.post(router.url + "/generate", json={"text": PROMPTS, "sampling_params": GREEDY},
                                 timeout=120)
            assert outs.status_code == 200, outs.text
            got = [o["output_ids"] for o in outs.json()]
            progress(f"answered: {[o['meta_info']['disaggregation'] for o in outs.json()]}")
            assert got == expected.get()
            progress("tokens compared: equal")
            for o in outs.json():
                info = o["meta_info"]["disaggregation"]
                assert info["transfer_bytes"] > 0
                if mode == "pull":  # ops per (source rank, run of tokens contiguous on both sides) of every decode
                    # rank (slot_plan._token_runs; one per token where rows are strided); reads coalesced
                    pairs = max(p_tp, d_tp)  # (prefill rank, decode rank) pairs that share heads (4 KV heads)
                    # the head ranges differ on every pair here, so each decode rank stages whole prefill rows
                    # (staging.py) in the source's order: pull mode's auto layout is token_major, so a whole row of
                    # every layer fills a slot on both sides and the plan already holds one row per run of
                    # consecutive prefill slots, all layers and K/V in it (token_major; layer_major: one per (layer,
                    # K/V, run)), and its READs are as many; a short prompt's slots form at most 2 runs (one page
                    # boundary), never one row or READ per token
                    reads, planned = info["transfer_reads"], info["transfer_ops_planned"]
                    assert pairs <= reads <= planned <= pairs * 2, info
        finally:
            router.stop()
        if mode == "push":  # every prefill rank writes its heads layer by layer during the forward
            out = generate_in_order(prefill, decode, port, {"text": PROMPTS[1], "sampling_params": GREEDY}, 4242,
                                    decode_first=True)
            assert out["output_ids"] == expected.get()[1] and out["meta_info"]["disaggregation"]["push_layerwise"] is True
            st = prefill.internal_state()
            assert st["disagg_push_layerwise"] >= 1
            assert st["disagg_push_layerwise"] + st["disagg_push_after_forward"] == len(PROMPTS) + 1
        assert kv_in_use(prefill) == 0 and kv_in_use(decode) == 0
        st = prefill.internal_state()  # released on the decode side's COMPLETE (pull) / RoomAck (push), not expired
        sent = len(PROMPTS) + (1 if mode == "push" else 0)  # push also sent one decode-first request
        assert st["disagg_rooms_done"] == sent and st["disagg_rooms_failed"] == 0, st
    finally:
        for s in servers:
            s.stop()
