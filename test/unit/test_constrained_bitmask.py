"""Token bitmask packing/application vs a plain-Python/torch reference, and the sampler's use of it."""

from __future__ import annotations

import random

import pytest
import torch

from sglang.srt.constrained.bitmask import (
    allocate_token_bitmask,
    apply_token_bitmask_,
    bitmask_width,
    revive_dead_rows_,
    unpack_token_bitmask,
)
from sglang.srt.layers.sampler import Sampler
from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo
from sglang.srt.sampling.sampling_params import SamplingParams

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def random_bitmask(rng: random.Random, bs: int, vocab: int, density: float) -> tuple[torch.Tensor, torch.Tensor]:
    """A packed bitmask with random allowed sets, and the reference bool mask built bit by bit."""
    allowed = torch.zeros(bs, vocab, dtype=torch.bool)
    packed = torch.zeros(bs, bitmask_width(vocab), dtype=torch.int32)
    for r in range(bs):
        for t in range(vocab):
            if rng.random() < density:
                allowed[r, t] = True
                word, bit = divmod(t, 32)
                value = int(packed[r, word]) & 0xFFFFFFFF | (1 << bit)
                packed[r, word] = value - (1 << 32) if value >= 1 << 31 else value
    return packed, allowed


@pytest.mark.parametrize("vocab", [1, 31, 32, 33, 100, 512])
def test_unpack_matches_bit_by_bit_reference(vocab):
    rng = random.Random(vocab)
    packed, allowed = random_bitmask(rng, 5, vocab, 0.4)
    assert torch.equal(unpack_token_bitmask(packed, vocab), allowed)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("vocab,density", [(512, 0.3), (1000, 0.02), (64, 0.9)])
def test_apply_matches_torch_reference(device, vocab, density):
    rng = random.Random(vocab * 7 + int(density * 100))
    bs = 6
    packed, allowed = random_bitmask(rng, bs, vocab, density)
    packed[2] = -1  # a row without a grammar: every bit set
    allowed[2] = True
    logits = torch.randn(bs, vocab, generator=torch.Generator().manual_seed(vocab)) * 4
    ref = torch.where(allowed, logits, torch.full_like(logits, float("-inf")))
    out = logits.to(device).clone()
    apply_token_bitmask_(out, packed.to(device))
    assert torch.equal(out.cpu(), ref)
    assert torch.equal(out.cpu()[2], logits[2])  # untouched, bit for bit


def test_allocate_allows_everything_and_apply_is_identity():
    vocab = 77
    logits = torch.randn(3, vocab) * 2
    out = logits.clone()
    mask = allocate_token_bitmask(3, vocab)
    assert mask.shape == (3, bitmask_width(vocab)) and mask.dtype == torch.int32
    apply_token_bitmask_(out, mask)
    assert torch.equal(out, logits)


def test_apply_agrees_with_xgrammar_cpu_kernel():
    xgr = pytest.importorskip("xgrammar")
    rng = random.Random(3)
    packed, _ = random_bitmask(rng, 4, 300, 0.25)
    logits = torch.randn(4, 300) * 3
    ours, theirs = logits.clone(), logits.clone()
    apply_token_bitmask_(ours, packed)
    xgr.apply_token_bitmask_inplace(theirs, packed, vocab_size=300, backend="cpu")
    assert torch.equal(ours, theirs)


def test_bad_shapes_raise():
    with pytest.raises(ValueError, match="bitmask"):
        apply_token_bitmask_(torch.randn(2, 40), torch.zeros(3, 2, dtype=torch.int32))
    with pytest.raises(ValueError, match="int32"):
        unpack_token_bitmask(torch.zeros(2, 2, dtype=torch.int64), 40)
    with pytest.raises(ValueError, match="int32"):
        unpack_token_bitmask(torch.zeros(2, 1, dtype=torch.int32), 40)


def test_revive_dead_rows_only_touches_all_masked_rows():
    rng = random.Random(11)
    vocab = 90
    packed, allowed = random_bitmask(rng, 3, vocab, 0.3)
    logits = torch.randn(3, vocab) * 2
    apply_token_bitmask_(logits, packed)
    logits[1] = float("-inf")  # a penalty killed every allowed token of row 1
    before = logits.clone()
    revive_dead_rows_(logits, packed)
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    assert torch.equal(torch.isfinite(logits[1]), allowed[1])
    assert torch.all(logits[1][allowed[1]] == 0)


def _info(params, vocab, grammars=None):
    for p in params:
        p.normalize(None)
    return SamplingBatchInfo.from_reqs(params, "cpu", vocab, [[] for _ in params], grammars=grammars)


class _FixedGrammar:
    """A stand-in grammar allowing a fixed token set."""

    def __init__(self, allowed: list[int]):
        self.allowed = allowed

    def fill_vocab_mask(self, mask, row):
        mask[row] = 0
        for t in self.allowed:
            word, bit = divmod(t, 32)
            value = int(mask[row, word]) & 0xFFFFFFFF | (1 << bit)
            mask[row, word] = value - (1 << 32) if value >= 1 << 31 else value


def test_sampler_respects_mask_and_leaves_other_rows_alone():
    vocab, bs = 200, 6
    gen = torch.Generator().manual_seed(5)
    rng = random.Random(5)
    allowed = [sorted(rng.sample(range(vocab), 7)) for _ in range(bs)]
    grammars = [_FixedGrammar(a) if i % 2 == 0 else None for i, a in enumerate(allowed)]
    for temperature in (0.0, 1.0):
        params = [SamplingParams(temperature=temperature, seed=i) for i in range(bs)]
        info = _info(params, vocab, grammars)
        plain = _info([SamplingParams(temperature=temperature, seed=i) for i in range(bs)], vocab)
        assert plain.vocab_mask is None and info.vocab_mask is not None
        logits = torch.randn(bs, vocab, generator=gen) * 3
        out = Sampler(0).forward(logits.clone(), info, return_logprob=True).next_token_ids.tolist()
        ref = Sampler(0).forward(logits.clone(), plain).next_token_ids.tolist()
        for i in range(bs):
            if grammars[i] is not None:
                assert out[i] in allowed[i]
                if temperature == 0.0:
                    best = max(allowed[i], key=lambda t: float(logits[i, t]))
                    assert out[i] == best
            else:
                assert out[i] == ref[i]  # seeded / greedy rows without a grammar are unchanged


def test_min_new_tokens_conflict_does_not_produce_nan():
    """The grammar allows only EOS while min_new_tokens bans it: the grammar wins, no NaN."""
    vocab, eos = 64, 2
    params = [SamplingParams(temperature=1.0, min_new_tokens=5)]
    params[0].normalize(None)
    info = SamplingBatchInfo.from_reqs(params, "cpu", vocab, [[7]], None, [[eos]], grammars=[_FixedGrammar([eos])])
    out = Sampler(0).forward(torch.randn(1, vocab), info)
    assert out.next_token_ids.tolist() == [eos]
