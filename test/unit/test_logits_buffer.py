"""LogitsProcessor: the CUDA graphs' shared logits buffer (written in place, same values as a fresh tensor, checked
shape) and prompt log-probs computed in row chunks (same values as one pass over all rows)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sglang.srt.forward_batch_info import ForwardMode
from sglang.srt.layers import logits_processor as lp_mod
from sglang.srt.layers.logits_processor import LogitsProcessor


def _flat(x) -> list[float]:
    """Every number of a nested list/tuple structure, in order."""
    if isinstance(x, (list, tuple)):
        return [v for e in x for v in _flat(e)]
    return [float(x)]


def _batch(mode, **kw):
    base = dict(forward_mode=mode, return_logprob=False, input_logprob_indices=[], logits_buffer=None,
                token_ids_logprobs=None, top_logprobs_nums=[])
    base.update(kw)
    return SimpleNamespace(**base)


@pytest.mark.parametrize("scale", [1.0, 0.5])
def test_logits_buffer_is_written_in_place(scale):
    gen = torch.Generator().manual_seed(1)
    vocab, hidden = 37, 16
    w = torch.randn(40, hidden, generator=gen)  # padded vocabulary rows beyond 37
    h = torch.randn(5, hidden, generator=gen)
    proc = LogitsProcessor(vocab, logit_scale=scale)
    plain = proc(h, w, _batch(ForwardMode.DECODE)).next_token_logits
    buf = torch.full((8, vocab), float("nan"))
    got = proc(h, w, _batch(ForwardMode.DECODE, logits_buffer=buf[:5])).next_token_logits
    assert got.data_ptr() == buf.data_ptr() and torch.equal(got, plain) and torch.isnan(buf[5:]).all()
    with pytest.raises(ValueError, match="logits buffer"):
        proc(h, w, _batch(ForwardMode.DECODE, logits_buffer=buf[:4]))
    with pytest.raises(ValueError, match="logits buffer"):
        proc(h, w, _batch(ForwardMode.DECODE, logits_buffer=torch.empty(5, vocab, dtype=torch.float16)))


def test_prompt_logprobs_in_chunks_equal_one_pass(monkeypatch):
    """Three requests' prompt log-probs (token, top-k, requested ids), rows split across chunks of 3 and within a
    request: identical to computing all rows at once."""
    gen = torch.Generator().manual_seed(2)
    vocab, hidden = 50, 12
    w = torch.randn(vocab, hidden, generator=gen)
    lens = [4, 6, 3]
    h = torch.randn(sum(lens), hidden, generator=gen)
    starts = torch.tensor([0, 4, 10])
    idx = [[0, 1, 2], [0, 2, 3, 4, 5], [1]]
    tgt = [torch.randint(0, vocab, (len(i),), generator=gen).tolist() for i in idx]
    fb = _batch(ForwardMode.EXTEND, return_logprob=True, extend_start_loc=starts, extend_lens=torch.tensor(lens),
                input_logprob_indices=idx, input_logprob_token_ids=tgt, top_logprobs_nums=[2, 0, 3],
                token_ids_logprobs=[[3, 7], None, [1]])
    proc = LogitsProcessor(vocab)
    one = proc(h, w, fb)
    monkeypatch.setattr(lp_mod, "INPUT_LOGPROB_CHUNK_ROWS", 3)
    chunked = proc(h, w, fb)
    # same values up to float rounding (a matmul over fewer rows may block its sums differently); same ids
    assert _flat(chunked.input_token_logprobs) == pytest.approx(_flat(one.input_token_logprobs), abs=1e-4)
    assert _flat(chunked.input_top_logprobs) == pytest.approx(_flat(one.input_top_logprobs), abs=1e-4)
    assert _flat(chunked.input_token_ids_logprobs) == pytest.approx(_flat(one.input_token_ids_logprobs), abs=1e-4)
    assert [[i for _, i in row] for req in chunked.input_top_logprobs for row in req] == \
        [[i for _, i in row] for req in one.input_top_logprobs for row in req]
    assert [len(x) for x in one.input_token_logprobs] == [3, 5, 1]
    assert len(one.input_token_ids_logprobs[0]) == 3 and one.input_token_ids_logprobs[1] == []
    ref = torch.log_softmax(h[4 + 2] @ w.t(), -1)  # request 1, prompt position 2
    assert one.input_token_logprobs[1][1] == pytest.approx(ref[tgt[1][1]].item(), abs=1e-5)
