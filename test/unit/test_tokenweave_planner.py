"""TokenWeave's wave-aware split planner against a brute-force search over every cut."""

from __future__ import annotations

import random

import pytest

from sglang.srt.tokenweave.planner import GemmShape, layer_gemm_widths, plan_split, total_waves


def brute(tokens, widths, shape):
    whole = total_waves(shape, tokens, widths)
    best = min(((total_waves(shape, t, widths) + total_waves(shape, tokens - t, widths) - whole, abs(2 * t - tokens))
                for t in range(1, tokens)))
    return best


@pytest.mark.parametrize("seed", range(6))
def test_plan_matches_brute_force(seed):
    rng = random.Random(seed)
    shape = GemmShape(tile_m=rng.choice([64, 128, 256]), tile_n=rng.choice([64, 128, 256]),
                      num_sms=rng.choice([78, 108, 132]))
    widths = layer_gemm_widths(rng.choice([4096, 8192]), 64, 8, 128, rng.choice([14336, 28672]), rng.choice([1, 2, 8]))
    for _ in range(40):
        t = rng.randrange(2, 9000)
        plan = plan_split(t, widths, shape)
        assert plan.prefix + plan.suffix == t and plan.prefix >= 1 and plan.suffix >= 1
        extra = total_waves(shape, plan.prefix, widths) + total_waves(shape, plan.suffix, widths) - plan.unsplit_waves
        assert plan.extra_waves == extra
        assert (extra, abs(2 * plan.prefix - t)) == brute(t, widths, shape), (t, plan)


def test_smart_split_beats_the_naive_half():
    """Llama-3.3-70B TP8 layer GEMMs on an H100-class GPU: the naive half split adds waves that the planner's
    cut avoids (all of them at 1920 tokens, 4 of 5 at 1152)."""
    shape = GemmShape(128, 128, 132)
    widths = layer_gemm_widths(8192, 64, 8, 128, 28672, tp_size=8)
    for t, want in ((1920, 0), (1152, 1)):
        naive = total_waves(shape, t // 2, widths) * 2 - total_waves(shape, t, widths)
        plan = plan_split(t, widths, shape)
        assert plan.extra_waves == want < naive and plan.prefix % 128 == 0


def test_bad_input():
    with pytest.raises(ValueError, match="cannot be split"):
        plan_split(1, (128,))
    with pytest.raises(ValueError, match="positive"):
        GemmShape(0, 128, 132)
    with pytest.raises(ValueError, match="no GEMM widths"):
        plan_split(10, ())


def test_executor_decisions_logged_once_per_batch_size(caplog):
    """The executor logs each (batch size, split or not) decision once: decode batches and batches below
    --tokenweave-min-tokens run unsplit, larger prefill batches get the planner's cut."""
    import logging

    import torch

    from sglang.srt.forward_batch_info import ForwardBatch, ForwardMode, ModelWorkerBatch
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
    from sglang.srt.tokenweave.executor import TokenWeaveConfig, TokenWeaveExecutor

    def batch(mode, extend_lens):
        n = sum(extend_lens)
        prefix = [3 if mode == ForwardMode.DECODE else 0] * len(extend_lens)
        mwb = ModelWorkerBatch(forward_mode=mode, input_ids=list(range(n)), positions=list(range(n)),
                               out_cache_loc=torch.arange(n), req_pool_indices=list(range(len(extend_lens))),
                               prefix_lens=prefix, extend_lens=extend_lens,
                               seq_lens=[p + e for p, e in zip(prefix, extend_lens)], sample=[True] * len(extend_lens))
        return ForwardBatch.init_new(mwb, torch.device("cpu"), None, None, TorchNativeAttnBackend())

    ex = TokenWeaveExecutor(TokenWeaveConfig(min_tokens=6, gemm_widths=(256, 128, 512, 128),
                                             gemm_shape=GemmShape(4, 128, 8)), torch.device("cpu"))
    decode, small, big = batch(ForwardMode.DECODE, [1] * 7), batch(ForwardMode.EXTEND, [5]), \
        batch(ForwardMode.EXTEND, [4, 3])
    with caplog.at_level(logging.INFO, logger="sglang.srt.tokenweave.executor"):
        for _ in range(3):
            assert [len(ex.plan(b)) for b in (decode, small, big)] == [1, 1, 2]
    lines = [r.getMessage() for r in caplog.records if r.name == "sglang.srt.tokenweave.executor"]
    assert len(lines) == 3, lines
    assert sorted(line.split(" tokens ")[1].split(" ")[0] for line in lines) == ["run", "run", "split"], lines
    assert any(line.startswith("TokenWeave: 7 tokens split ") for line in lines)
    assert any(line.startswith("TokenWeave: 7 tokens run unsplit") for line in lines)
