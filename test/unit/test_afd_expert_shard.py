"""ExpertShard (the FFN worker's experts of one layer): a shard holding every expert computes the fused-MoE reference
(no per-layer host check), a partial shard skips zero-weight pairs of experts it does not hold, and a non-zero
weight for such an expert fails closed with ValueError."""

from __future__ import annotations

import pytest
import torch

from sglang.srt.afd.experts import ExpertShard, MoeLayerSpec
from sglang.srt.ops_ref import fused_moe_ref

E, K, H, I, T = 6, 2, 16, 24, 10


def _weights(gen):
    return torch.randn(E, 2 * I, H, generator=gen) / 4, torch.randn(E, H, I, generator=gen) / 4


def _routing(gen):
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
    return ids, torch.rand(T, K, generator=gen)


def test_full_shard_equals_reference_in_any_order():
    gen = torch.Generator().manual_seed(0)
    spec = MoeLayerSpec(0, "model.layers.0.mlp.experts", E, K, H, I, True)
    w13, w2 = _weights(gen)
    order = [3, 0, 5, 1, 4, 2]  # held in a permuted order (after a placement change)
    shard = ExpertShard(spec, order, w13[order], w2[order])
    assert shard.holds_all
    x = torch.randn(T, H, generator=gen)
    ids, w = _routing(gen)
    torch.testing.assert_close(shard.compute(x, ids, w), fused_moe_ref(x, w13, w2, w, ids), rtol=1e-5, atol=1e-5)


def test_partial_shard_skips_zero_weights_and_fails_closed_on_stray():
    gen = torch.Generator().manual_seed(1)
    spec = MoeLayerSpec(0, "model.layers.0.mlp.experts", E, K, H, I, True)
    w13, w2 = _weights(gen)
    held = [0, 1, 2]
    shard = ExpertShard(spec, held, w13[held], w2[held])
    assert not shard.holds_all
    x = torch.randn(T, H, generator=gen)
    ids, w = _routing(gen)
    mine = ids < 3
    w_mine = torch.where(mine, w, 0.0)
    torch.testing.assert_close(shard.compute(x, ids, w_mine), fused_moe_ref(x, w13, w2, w_mine, ids),
                               rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="does not hold"):
        shard.compute(x, ids, w)
