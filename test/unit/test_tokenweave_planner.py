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
