"""AFD with several data-parallel attention workers and an FFN worker count that does not divide the experts
(the 4-GPU layouts 2 attention + 2 FFN and 1 attention + 3 FFN, here on CPU threads): on the trained
stories260K-moe checkpoint (4 experts, top-2), every attention worker's greedy tokens and logits equal the
single-process colocated model's for its own requests, while the FFN workers aggregate all workers' tokens."""

from __future__ import annotations

import os
import sys
import threading

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from conftest import shared_path  # noqa: E402
from test_afd_executor import FfnGroup, _topo  # noqa: E402

from sglang.srt.afd.executor import AfdExecutor  # noqa: E402
from sglang.srt.configs.model_config import ModelConfig  # noqa: E402
from sglang.srt.model_executor.worker_builder import role_spec  # noqa: E402
from sglang.srt.model_loader.loader import load_model  # noqa: E402
from sglang.test.model_harness import ModelHarness, greedy_logits  # noqa: E402

TOL = 2e-5
STEPS = 3


@pytest.fixture(scope="module")
def mc():
    return ModelConfig.from_path(shared_path("models", "stories260K-moe"))


@pytest.mark.parametrize("n_a,n_e,m", [(2, 2, 2), (1, 3, 2), (2, 3, 1)])
def test_afd_data_parallel_attention_equals_colocated(mc, n_a, n_e, m):
    ref_model = load_model(mc, "auto", "cpu")
    refs = [greedy_logits(ModelHarness(ref_model, mc), steps=STEPS, seed=10 + a) for a in range(n_a)]
    topo = _topo(n_a, n_e)
    ffn = FfnGroup(mc, topo)
    held = [len(s.expert_ids) for s in ffn.servers]
    outs: dict[int, list] = {}
    errors: list[BaseException] = []
    execs = [AfdExecutor(mc, topo, a, m, torch.device("cpu")) for a in range(n_a)]

    def worker(a: int) -> None:  # attention worker a: its own model copy, KV and requests (seed 10 + a)
        try:
            attn = load_model(mc, "auto", "cpu", weight_filter=role_spec("attention").weight_filter)
            outs[a] = greedy_logits(ModelHarness(attn, mc), execs[a], steps=STEPS, seed=10 + a)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(a,), daemon=True) for a in range(n_a)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not any(t.is_alive() for t in threads), "an attention worker did not finish within 120 s"
    finally:
        for ex in execs:
            ex.close()
        ffn.close()
    assert not errors, errors
    assert sum(held) == 4 and (n_e != 3 or held == [2, 1, 1])  # uneven static blocks
    for a in range(n_a):
        for i, (got, want) in enumerate(zip(outs[a], refs[a])):
            assert got.argmax(-1).tolist() == want.argmax(-1).tolist(), f"worker {a} step {i}: tokens differ"
            diff = (got - want).abs().max().item()
            assert diff < TOL, f"worker {a} step {i}: logits differ from colocated by {diff:.3g}"
    assert refs[0][0].abs().max() > 0.1
