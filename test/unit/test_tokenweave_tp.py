"""TokenWeave on gloo TP ranks (CPU): the tw-comm communicator's reordered AllReduce (ReduceScatter ->
residual add + RMSNorm on owned tokens -> AllGather) and the executor's two token splits, cut at every
boundary of prefill, mixed and decode steps, give the single-process logits (fp32) on random configs of
every architecture (Llama, Qwen2, Qwen3, Mixtral, Qwen2-MoE, Qwen3-MoE) at TP 2, and dense + MoE at TP 4.
The KV slots a step writes are NaN-filled before every run, so a split that reads KV before it is written fails."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
transformers = pytest.importorskip("transformers")

from test_tp_models import ATOL, RTOL, _reference, checkpoints  # noqa: E402,F401  (fixture)
from test_tp_models import CASES  # noqa: E402
from tp_worker import spawn_ranks, tokenweave_logits_many, tokenweave_unsplit_vs_plain  # noqa: E402

MODELS = os.path.join(os.path.dirname(__file__), "..", "..", "..", "shared", "data", "models")


@pytest.mark.parametrize("world,names", [(2, sorted(CASES)), (4, ["qwen3", "qwen2_moe_shared"])],
                         ids=["tp2-every-architecture", "tp4-dense-and-moe"])
def test_tokenweave_splits_equal_single_process(checkpoints, world, names):  # noqa: F811
    results = spawn_ranks(tokenweave_logits_many, world, [checkpoints[n] for n in names], timeout=400)
    for i, name in enumerate(names):
        ref = _reference(checkpoints[name])
        for rank, per_rank in enumerate(results):
            for step, (cuts, want) in enumerate(zip(per_rank[i], ref)):
                assert len(cuts) >= 2 or step >= 2  # prefill and mixed steps have several cuts
                for cut, got in enumerate(cuts, start=1):
                    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL,
                                               msg=lambda m: f"{name} tp{world} rank {rank} step {step} cut {cut}: {m}")


def test_unsplit_forward_runs_the_plain_communicator():
    """A TokenWeave worker's unsplit forwards (below ``--tokenweave-min-tokens``, decode) make exactly the
    plain server's calls: the server's communicator is the plain one composed with tw-comm's, the unsplit forward's
    calls all reach the plain part (spy) and its stories260K logits equal the non-TokenWeave model's bit for bit; a
    split forward's fused norm calls reach tw-comm's part, and its logits match within tolerance."""
    path = os.path.join(MODELS, "stories260K")
    if not os.path.isdir(path):
        pytest.skip(f"{path} is missing")
    for rank, got in enumerate(spawn_ranks(tokenweave_unsplit_vs_plain, 2, path, timeout=300)):
        assert got["types"] == ("TokenWeaveCommunicator", "TorchCommunicator", "TorchCommunicator"), got["types"]
        assert got["unsplit_calls"]["plain"] > 0 and got["unsplit_calls"]["split"] == 0, got["unsplit_calls"]
        assert got["split_calls"]["split"] > 0, got["split_calls"]
        for step, (u, p, s) in enumerate(zip(got["unsplit"], got["plain"], got["split"])):
            assert torch.equal(u, p), f"rank {rank} step {step}: unsplit TokenWeave logits != plain server's"
            assert torch.equal(u.argmax(-1), s.argmax(-1)), f"rank {rank} step {step}: split greedy tokens differ"
            torch.testing.assert_close(s, p, atol=ATOL, rtol=RTOL)


def test_tw_communicator_matches_torch_reference():
    from tp_worker import spawn_ranks as spawn

    results = spawn(_rank_ar_norm, 2)
    for got, want in results:
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


def _rank_ar_norm(ps):
    from sglang.srt.distributed.communicator import TorchCommunicator
    from sglang.srt.distributed.tw_communicator import TwCommunicator

    gen = torch.Generator().manual_seed(100 + ps.tp_rank)
    shared = torch.Generator().manual_seed(7)
    got, want = [], []
    for tokens in (1, 3, 8, 13):
        x = torch.randn(tokens, 24, generator=gen)
        res = torch.randn(tokens, 24, generator=shared)
        w = torch.rand(24, generator=shared) + 0.5
        got.append(torch.cat(TwCommunicator(ps).all_reduce_add_rmsnorm(x.clone(), res.clone(), w, 1e-6)))
        want.append(torch.cat(TorchCommunicator.create(ps).all_reduce_add_rmsnorm(x.clone(), res.clone(), w, 1e-6)))
        # out=: the normed rows land in the caller's tensor (here rows 2.. of a larger one, as TokenWeave's
        # per-split final norms write their rows of the forward's output), which is also what is returned
        big = torch.full((tokens + 2, 24), float("nan"))
        normed, new_res = TwCommunicator(ps).all_reduce_add_rmsnorm(x.clone(), res.clone(), w, 1e-6, out=big[2:])
        if normed.data_ptr() != big[2:].data_ptr() or not torch.isnan(big[:2]).all():
            raise AssertionError("all_reduce_add_rmsnorm(out=) did not write (only) into out")
        got.append(torch.cat([big[2:], new_res]))
        want.append(want[-1])
    return got, want
