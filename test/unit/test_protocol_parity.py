"""Unit tests of the SGLang-parity pieces below the HTTP layer: stop_regex (finish check and detokenizer
trim), logit_bias, token_ids_logprob, grammar-masked (-inf) top logprobs, custom logit processors
(flag gate, per-row failure), incremental streamed logprobs and non-finite JSON."""

from __future__ import annotations

import json
import os
import random
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from conftest import shared_path  # noqa: E402

from sglang.srt.entrypoints.parity_routes import IncrementalLogprobs, dumps, finite_json  # noqa: E402
from sglang.srt.layers.sampler import Sampler  # noqa: E402
from sglang.srt.managers.detokenizer_manager import IncrementalDetokenizer  # noqa: E402
from sglang.srt.sampling.custom_logit_processor import ProcessorCache, check_allowed  # noqa: E402
from sglang.srt.sampling.finish import check_finish  # noqa: E402
from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo  # noqa: E402
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402

EOS = {2}


@pytest.fixture(scope="module")
def tok():
    from sglang.srt.utils.common import get_tokenizer

    return get_tokenizer(shared_path("models", "stories260K"))


def _p(tokenizer=None, **kw) -> SamplingParams:
    p = SamplingParams(**kw)
    p.verify(512)
    p.normalize(tokenizer)
    return p


# ------------------------------------------------------------- stop_regex
def test_stop_regex_finishes_on_the_token_that_completes_the_first_match(tok):
    text = " Lily saw 3 cats and 12 dogs. The end."
    ids = tok.encode(text, add_special_tokens=False)
    for pattern in (r"\d+", r"c[a-z]ts", r"The end\.", r"(dogs|birds)"):
        p = _p(tok, stop_regex=[pattern], max_new_tokens=100)
        first = next(k for k in range(1, len(ids) + 1) if check_finish(ids[:k], p, EOS, tok) is not None)
        assert check_finish(ids[:first], p, EOS, tok) == {"type": "stop", "matched": pattern}
        import re

        # the first prefix whose decoded text matches, exactly
        assert re.search(pattern, tok.decode(ids[:first]))
        assert not re.search(pattern, tok.decode(ids[:first - 1]))
    # a stop string listed too wins only where it matches first; min_new_tokens delays the regex
    p = _p(tok, stop_regex=r"\d+", min_new_tokens=len(ids) - 1, max_new_tokens=100)
    assert all(check_finish(ids[:k], p, EOS, tok) is None for k in range(1, len(ids) - 1))


class _CharTok:
    """One token per character (token id = code point)."""

    def decode(self, ids, **kw):
        return "".join(chr(i) for i in ids)

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]


def test_pathological_stop_regex_aborts_the_request_instead_of_stalling():
    ct = _CharTok()
    p = _p(ct, stop_regex=r"(a|aa)+c", max_new_tokens=1000)
    assert p.stop_regex_max_len == 1 << 30  # unbounded: the whole output is searched
    ids = [ord("a")] * 40 + [ord("b")]
    reason = check_finish(ids, p, EOS, ct)
    assert reason["type"] == "abort" and reason["status_code"] == 400 and "(a|aa)+c" in reason["message"]
    bounded = _p(ct, stop_regex=r"x\d{3}", max_new_tokens=1000)
    assert bounded.stop_regex_max_len == 4
    ids = [ord(c) for c in "q" * 500 + "x12"]
    assert check_finish(ids, bounded, EOS, ct) is None
    assert check_finish(ids + [ord("7")], bounded, EOS, ct) == {"type": "stop", "matched": r"x\d{3}"}


def test_detokenizer_trims_at_the_regex_match(tok):
    text = " Lily saw 3 cats and 12 dogs."
    ids = tok.encode(text, add_special_tokens=False)
    pattern = r"\d+ dogs"
    p = _p(tok, stop_regex=pattern, max_new_tokens=100)
    end = next(k for k in range(1, len(ids) + 1) if check_finish(ids[:k], p, EOS, tok) is not None)
    rng = random.Random(7)
    for no_trim in (False, True):
        d = IncrementalDetokenizer(tok, stop_regexes=[pattern], no_stop_trim=no_trim)
        out, pos = [], 0
        while pos < end:
            k = min(rng.randint(1, 3), end - pos)
            fin = {"type": "stop", "matched": pattern} if pos + k == end else None
            out.append(d.step(ids[pos:pos + k], fin))
            pos += k
        full = tok.decode(ids[:end])
        expect = full if no_trim else full[:full.index("12 dogs")]
        assert "".join(out) == expect


# -------------------------------------------------- logit_bias / logprobs
def _info(params, vocab, device="cpu", **kw):
    return SamplingBatchInfo.from_reqs(params, device, vocab, [[] for _ in params], **kw)


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", DEVICES)
def test_logit_bias_is_added_to_the_logits(device):
    g = torch.Generator().manual_seed(random.randrange(1 << 30))
    vocab = 50
    logits = torch.randn(3, vocab, generator=g)
    params = [_p(logit_bias={"4": 100.0}, temperature=0.0), _p(temperature=0.0),
              _p(logit_bias={"7": -1.5, "9": 2.0}, temperature=0.0)]
    info = _info(params, vocab, device)
    ref = logits.clone()
    ref[0, 4] += 100.0
    ref[2, 7] -= 1.5
    ref[2, 9] += 2.0
    out = Sampler(device=device).forward(logits.clone().to(device), info, return_logprob=True,
                                         top_logprobs_nums=[0, 0, 0])
    ids = out.next_token_ids.cpu()
    assert ids.tolist() == ref.argmax(-1).tolist() and ids[0] == 4
    torch.testing.assert_close(out.logprobs.cpu(), torch.log_softmax(ref, -1).gather(1, ids.view(-1, 1)).view(-1))


@pytest.mark.parametrize("device", DEVICES)
def test_token_ids_logprobs_and_masked_top_logprobs(device):
    from sglang.srt.constrained.bitmask import allocate_token_bitmask

    g = torch.Generator().manual_seed(random.randrange(1 << 30))
    vocab = 64
    logits = torch.randn(2, vocab, generator=g)
    allowed = [3, 17]  # row 0: a grammar allowing two tokens only

    class OnlyTwo:
        def fill_vocab_mask(self, mask, i):
            mask[i] = 0
            for t in allowed:
                mask[i, t // 32] |= (1 << (t % 32)) if t % 32 < 31 else -(1 << 31)

    info = _info([_p(temperature=0.0), _p(temperature=0.0)], vocab, device, grammars=[OnlyTwo(), None],
                 token_ids_logprobs=[[3, 5], [5, 60]])
    assert allocate_token_bitmask(1, vocab).shape[1] == 2
    out = Sampler(device=device).forward(logits.clone().to(device), info, return_logprob=True,
                                         top_logprobs_nums=[5, 5])
    ref0 = torch.log_softmax(logits[0, allowed], -1)
    assert len(out.top_logprobs[0]) == 2  # the 62 masked tokens are left out, not -inf
    assert sorted(t for _, t in out.top_logprobs[0]) == allowed
    assert all(v != float("-inf") for v, _ in out.top_logprobs[0])
    assert out.token_ids_logprobs[0][0][1] == 3 and out.token_ids_logprobs[0][0][0] == pytest.approx(
        ref0[0].item(), abs=1e-5)
    assert out.token_ids_logprobs[0][1] == (None, 5)  # masked: None, never -inf
    full1 = torch.log_softmax(logits[1], -1)
    assert [t for _, t in out.token_ids_logprobs[1]] == [5, 60]
    assert [v for v, _ in out.token_ids_logprobs[1]] == pytest.approx([full1[5].item(), full1[60].item()], abs=1e-5)
    assert len(out.top_logprobs[1]) == 5
    json.dumps(out.top_logprobs, allow_nan=False)


def test_out_of_vocab_stop_token_ids_are_a_400_and_do_not_break_min_new_tokens():
    with pytest.raises(ValueError, match="^stop_token_ids must be token ids"):
        _p(stop_token_ids=[5, 1000])
    vocab = 40
    raw = SamplingParams(stop_token_ids=[5, 1000, -3], min_new_tokens=2, temperature=0.0)  # past verify()
    raw.normalize(None)
    info = _info([raw], vocab,
                 min_tokens_banned=[[5, 1000, -3, 2]])
    logits = torch.zeros(1, vocab)
    logits[0, 5] = 10.0
    out = Sampler().forward(logits, info)
    assert out.next_token_ids.item() != 5  # banned while under min_new_tokens, and no IndexError


# ---------------------------------------------------- custom processors
class _Ban(object):
    """A stand-in processor: bans the token named in each row's custom_params."""

    def __call__(self, logits, custom_param_list=None):
        for i, p in enumerate(custom_param_list or []):
            logits[i, p["ban"]] = float("-inf")
        return logits


def _to_str(cls) -> str:
    import dill

    return json.dumps({"callable": dill.dumps(cls).hex()})


def test_custom_logit_processor_gate_and_application():
    pytest.importorskip("dill")
    s = _to_str(_Ban)
    with pytest.raises(ValueError, match="--enable-custom-logit-processor"):
        check_allowed(s, enabled=False)
    with pytest.raises(ValueError, match="--enable-custom-logit-processor"):
        check_allowed("not even json", enabled=False)  # off: never parsed, never deserialized
    assert check_allowed(None, enabled=False) is None
    assert check_allowed(s, enabled=True) == s
    with pytest.raises(ValueError, match="callable"):
        check_allowed('{"x": 1}', enabled=True)
    vocab = 30
    logits = torch.zeros(3, vocab)
    logits[:, 7] = 5.0
    params = [_p(temperature=0.0, custom_params={"ban": 7}), _p(temperature=0.0), _p(temperature=0.0)]
    bad = json.dumps({"callable": "00ff"})
    info = _info(params, vocab, custom_logit_processors=[s, None, bad])
    out = Sampler().forward(logits, info)
    ids = out.next_token_ids.tolist()
    assert ids[0] != 7 and ids[1] == 7
    assert set(out.row_errors) == {2} and "custom_logit_processor" in out.row_errors[2]
    cache = ProcessorCache()
    assert cache.get(s) is cache.get(s)


# ------------------------------------------------------------ HTTP shapes
def _cumulative_outputs(lp: list, cuts: list[int], index: int = 0) -> list[dict]:
    """The cumulative /generate outputs a stream of ``lp``'s tokens produces when chunked at ``cuts``."""
    return [{"index": index, "text": "".join(f"t{e[1]}" for e in lp[:n]), "output_ids": [e[1] for e in lp[:n]],
             "meta_info": {"output_token_logprobs": lp[:n], "output_top_logprobs": [[x] for x in lp[:n]],
                           "output_token_logprobs_length": n}} for n in cuts]


def test_streamed_logprobs_one_per_token_under_any_chunking():
    import random

    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 30)
        lp = [[-0.1 * k, 100 + k, None] for k in range(n)]
        cuts = sorted({rng.randint(0, n) for _ in range(rng.randint(1, 6))} | {n})
        # cumulative (default): every chunk's lists cover exactly its output_ids
        plain = IncrementalLogprobs()
        for c in map(plain, _cumulative_outputs(lp, cuts)):
            assert len(c["meta_info"]["output_token_logprobs"]) == len(c["output_ids"])
            assert len(c["meta_info"]["output_top_logprobs"]) == len(c["output_ids"])
        # incremental: each chunk holds exactly its new tokens' entries; the pieces rebuild everything
        inc, ids, text, rebuilt = IncrementalLogprobs(incremental=True), [], "", []
        for c in map(inc, _cumulative_outputs(lp, cuts)):
            m = c["meta_info"]
            assert len(m["output_token_logprobs"]) == len(c["output_ids"]) == len(m["output_top_logprobs"])
            assert m["output_token_logprobs_length"] - len(m["output_token_logprobs"]) == len(rebuilt)
            ids, text, rebuilt = ids + c["output_ids"], text + c["text"], rebuilt + m["output_token_logprobs"]
        assert rebuilt == lp and ids == [e[1] for e in lp] and text == "".join(f"t{e[1]}" for e in lp)


def test_incremental_stream_keeps_input_logprobs_complete_and_finite_json():
    # the prompt's logprobs: complete in every chunk of every batch index (SGLang's tokenizer manager sends them so)
    inc, ilp = IncrementalLogprobs(incremental=True), [[None, 1, None], [-1.5, 5, None]]
    sent = [inc({"index": i % 2, "text": "", "output_ids": [], "meta_info": {
        "input_token_logprobs": ilp, "input_top_logprobs": [None, [ilp[1]]], "output_token_logprobs": [],
        "output_token_logprobs_length": 0}}) for i in range(4)]
    assert [c["meta_info"]["input_token_logprobs"] for c in sent] == [ilp] * 4
    assert [c["meta_info"]["input_top_logprobs"] for c in sent] == [[None, [ilp[1]]]] * 4
    assert finite_json({"a": [float("-inf"), 1.5, (float("nan"),)]}) == {"a": [None, 1.5, [None]]}
    assert json.loads(dumps({"x": float("inf")})) == {"x": None}
