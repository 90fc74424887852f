"""check_finish: length, stop tokens, EOS, min_new_tokens, stop strings (real tokenizer)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from sglang.srt.sampling.finish import check_finish, stop_str_window
from sglang.srt.sampling.sampling_params import SamplingParams

DATA = Path(__file__).resolve().parents[2] / ".." / "shared" / "data"
STORIES = DATA / "models" / "stories260K"
EOS = {2}


@pytest.fixture(scope="module")
def tok():
    if not (STORIES / "tokenizer.json").exists():
        pytest.skip(f"stories260K tokenizer not found at {STORIES} (shared test data absent)")
    from sglang.srt.utils.common import get_tokenizer

    return get_tokenizer(str(STORIES))


def _p(tokenizer=None, **kw) -> SamplingParams:
    p = SamplingParams(**kw)
    p.normalize(tokenizer)
    return p


def test_length_and_cap():
    rng = random.Random(0)
    for _ in range(50):
        mx = rng.randint(1, 40)
        cap = rng.choice([None, rng.randint(1, 40)])
        p = _p(max_new_tokens=mx)
        limit = mx if cap is None else min(mx, cap)
        ids = [rng.randint(10, 500) for _ in range(limit)]
        for k in range(1, limit):
            assert check_finish(ids[:k], p, EOS, None, cap) is None
        assert check_finish(ids, p, EOS, None, cap) == {"type": "length", "length": limit}
    p = _p(max_new_tokens=None)
    assert check_finish([5] * 30, p, EOS, None, None) is None
    assert check_finish([5] * 30, p, EOS, None, 30) == {"type": "length", "length": 30}
    # length wins over a stop token on the same step (SGLang's order)
    assert check_finish([5, 2], _p(max_new_tokens=2), EOS, None) == {"type": "length", "length": 2}


def test_stop_token_ids_eos_ignore_eos_and_min_new_tokens():
    rng = random.Random(1)
    body = [rng.randint(10, 500) for _ in range(6)]
    p = _p(stop_token_ids=[77, 88])
    assert check_finish(body + [88], p, EOS, None) == {"type": "stop", "matched": 88}
    assert check_finish(body + [2], p, EOS, None) == {"type": "stop", "matched": 2}
    assert check_finish(body + [88, 5], p, EOS, None) is None  # only the newest token counts
    q = _p(ignore_eos=True, stop_token_ids=[77])
    assert check_finish(body + [2], q, EOS, None) is None
    assert check_finish(body + [77], q, EOS, None) == {"type": "stop", "matched": 77}
    m = _p(min_new_tokens=4, stop_token_ids=[77])
    for k in range(4):  # the stop token as token 1..min_new_tokens does not finish
        assert check_finish(body[:k] + [77], m, EOS, None) is None
        assert check_finish(body[:k] + [2], m, EOS, None) is None
    assert check_finish(body[:4] + [77], m, EOS, None) == {"type": "stop", "matched": 77}


def _first_stop_index(tok, ids, stops):
    """Reference: first k whose full decode contains a stop string, and which one (list order)."""
    for k in range(1, len(ids) + 1):
        text = tok.decode(ids[:k])
        for s in stops:
            if s in text:
                return k, s
    return None, None


def test_stop_string_spanning_token_boundaries(tok):
    text = "Once upon a time, there was a little girl named Lily. She loved to play outside."
    ids = tok.encode(text, add_special_tokens=False)
    pieces = [tok.decode(ids[: k + 1]) for k in range(len(ids))]
    rng = random.Random(5)
    checked = 0
    for _ in range(40):
        a = rng.randrange(0, len(text) - 6)
        stop = text[a:a + rng.randint(2, 9)]
        if not stop.strip():
            continue
        other = "zq" + stop[::-1] + "zq"
        p = _p(tok, stop=[other, stop], max_new_tokens=500)
        k_ref, s_ref = _first_stop_index(tok, ids, [other, stop])
        got = None
        for k in range(1, len(ids) + 1):
            r = check_finish(ids[:k], p, EOS, tok)
            if r is not None:
                got = (k, r["matched"])
                break
        assert got == (k_ref, s_ref), (stop, got, k_ref, pieces[:3])
        checked += 1
    assert checked > 20


def test_stop_string_spelled_one_byte_token_at_a_time(tok):
    # "Lily" is one or two tokens alone, but a model may spell it with byte/char tokens
    stop = "Lily"
    single = [tok.convert_tokens_to_ids(c) for c in stop]
    assert all(isinstance(t, int) and t > 2 for t in single)
    prefix = tok.encode("Once upon a time", add_special_tokens=False)
    ids = prefix + single
    assert stop in tok.decode(ids)
    p = _p(tok, stop=stop)
    assert p.stop_str_max_len < len(single)  # the SGLang bound alone would miss it
    assert stop_str_window(p) > len(single)
    results = [check_finish(ids[:k], p, EOS, tok) for k in range(1, len(ids) + 1)]
    assert results[:-1] == [None] * (len(ids) - 1)
    assert results[-1] == {"type": "stop", "matched": stop}


def test_stop_string_before_min_new_tokens_is_ignored(tok):
    ids = tok.encode("the dog ran. the cat sat. the dog sat.", add_special_tokens=False)
    stop = "dog"
    first, _ = _first_stop_index(tok, ids, [stop])
    p = _p(tok, stop=stop, min_new_tokens=first + 1)
    results = [check_finish(ids[:k], p, EOS, tok) for k in range(1, len(ids) + 1)]
    hits = [k + 1 for k, r in enumerate(results) if r is not None]
    text = tok.decode(ids)
    second = text.index(stop, text.index(stop) + 1)
    k2 = next(k for k in range(1, len(ids) + 1) if len(tok.decode(ids[:k])) >= second + len(stop))
    assert hits[0] == k2  # the old occurrence does not finish at min_new_tokens
    assert results[k2 - 1] == {"type": "stop", "matched": stop}


class CountingTokenizer:
    def __init__(self, tok):
        self.tok, self.max_ids = tok, 0

    def decode(self, ids, **kw):
        self.max_ids = max(self.max_ids, len(ids))
        return self.tok.decode(ids, **kw)


def test_decodes_only_a_bounded_tail(tok):
    rng = random.Random(9)
    ids = [rng.randint(3, 511) for _ in range(400)]
    counting = CountingTokenizer(tok)
    p = _p(tok, stop=["@@never@@", "#"], max_new_tokens=1000)
    for k in range(1, len(ids) + 1):
        check_finish(ids[:k], p, EOS, counting)
    # the window, widened by at most 3 tokens when it starts inside a multi-byte character
    assert 0 < counting.max_ids <= stop_str_window(p) + 3 <= 15
