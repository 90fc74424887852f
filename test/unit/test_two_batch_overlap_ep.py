"""Two-batch overlap at EP 2 and 4 (one gloo rank per process, TP attention + the all-reduce expert parallelism) on
stories260K-moe8 (8 different experts: a token reaching the wrong expert changes the logits): forced on, it gives
the TP1 greedy tokens (32 tokens, the shared prompts) over a schedule with mixed prefill + decode batches, chunked
prefills and requests joining mid-decode. Every configuration of one EP size runs in ONE spawned process group."""

from __future__ import annotations

import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
from conftest import shared_path  # noqa: E402
from tbo_worker import N_NEW, prompt_ids, run_schedule, tbo_greedy_many, tp1_greedy  # noqa: E402
from tp_worker import spawn_ranks  # noqa: E402

# (executor, token-distribution threshold, prefill chunk): the all-reduce EP unsplit (the baseline the overlap must
# match), the overlap with SGLang's threshold (cuts inside requests), at 0 (request boundaries only), and whole
# prefills (long single-request prefills cut in half)
CONFIGS = [dict(executor="sequential", chunk=3), dict(executor="tbo", threshold=0.48, chunk=3),
           dict(executor="tbo", threshold=0.0, chunk=3), dict(executor="tbo", threshold=0.48, chunk=None)]


# with expert parallelism by all-to-all, per EP size (tdist runs under the Triton interpreter: one configuration)
A2A_CONFIGS = {
    2: [dict(executor="sequential", chunk=3, a2a="nccl"), dict(executor="tbo", threshold=0.48, chunk=3, a2a="nccl"),
        dict(executor="tbo", threshold=0.48, chunk=None, a2a="nccl"),
        dict(executor="tbo", threshold=0.48, chunk=3, a2a="tdist")],
    4: [dict(executor="tbo", threshold=0.48, chunk=3, a2a="nccl")],
}


@pytest.mark.parametrize("ep", [2, 4])
def test_forced_overlap_gives_tp1_greedy_tokens(ep):
    path = shared_path("models", "stories260K-moe8")
    want = [list(t) for t in tp1_greedy(path)]
    prompts = [list(p) for p in prompt_ids(path)]
    ranks = spawn_ranks(tbo_greedy_many, ep, path, prompts, N_NEW, CONFIGS, timeout=600)
    for rank, results in enumerate(ranks):
        for cfg, res in zip(CONFIGS, results):
            assert res["tokens"] == want, (rank, cfg)
    stats = [res["stats"] for res in ranks[0]]
    assert stats[0] == {"unsplit": stats[0]["unsplit"]}  # the baseline never splits
    # the forced overlap really split: decode and mixed batches by requests, chunked prefills inside a request
    assert stats[1]["by_requests"] >= 20 and stats[1]["by_tokens"] >= 1 and stats[1]["straddling"] >= 1
    assert stats[2].get("by_tokens", 0) == 0 and stats[2]["by_requests"] >= 20  # threshold 0: request cuts only
    assert stats[3]["straddling"] >= 1  # a whole single-request prefill cut in half


def test_tp1_reference_is_batch_independent():
    """The reference the EP test compares with: each prompt alone equals the joined, chunked, mixed schedule at TP1
    (so a difference at EP is the overlap's or the expert parallelism's, not the batching's)."""
    from model_harness import ModelHarness

    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_loader.loader import load_model

    path = shared_path("models", "stories260K-moe8")
    config = ModelConfig.from_path(path)
    h = ModelHarness(load_model(config, "auto", "cpu"), config)
    assert run_schedule(h, None, [list(p) for p in prompt_ids(path)], N_NEW, chunk=3) == [list(t) for t in tp1_greedy(path)]


@pytest.mark.parametrize("ep", [2, 4])
def test_forced_overlap_over_all_to_all_gives_tp1_greedy_tokens(ep):
    """The same with expert parallelism by all-to-all (``--moe-a2a-backend nccl`` over gloo, and at EP 2 ``tdist``
    under the Triton interpreter): dispatch / combine are the micro-batches' communication stages; decode batches
    use the low-latency mode, prefill and mixed ones the normal mode (both counted)."""
    import importlib.util

    if importlib.util.find_spec("sglang.srt.expert_parallel") is None:
        pytest.skip("expert parallelism by all-to-all (--moe-a2a-backend) is not in this checkout")
    path = shared_path("models", "stories260K-moe8")
    want = [list(t) for t in tp1_greedy(path)]
    configs = A2A_CONFIGS[ep]
    prompts = [list(p) for p in prompt_ids(path)]
    ranks = spawn_ranks(tbo_greedy_many, ep, path, prompts, N_NEW, configs, ep_size=ep, timeout=900)
    for rank, results in enumerate(ranks):
        for cfg, res in zip(configs, results):
            assert res["tokens"] == want, (rank, cfg)
    for cfg, res in zip(configs, ranks[0]):
        calls = res["a2a_calls"]
        assert calls and all(v > 0 for v in calls.values()), (cfg, calls)  # both modes dispatched
        if cfg["executor"] == "tbo":
            assert res["stats"].get("by_requests", 0) >= 20 and res["stats"].get("straddling", 0) >= 1, cfg
