"""SamplingParams: defaults, range checks, dict (de)serialization, normalization."""

from __future__ import annotations

import random

import msgspec
import pytest

from sglang.srt.managers.io_struct import TokenizedGenerateReqInput, decode_msg, encode_msg
from sglang.srt.sampling.sampling_params import SamplingParams

VOCAB = 1000


class ByteTokenizer:
    """Minimal tokenizer: one token per UTF-8 byte (so token counts are known exactly)."""

    def encode(self, text, add_special_tokens=False):
        return list(text.encode("utf-8"))


def test_defaults_match_sglang():
    p = SamplingParams()
    assert (p.max_new_tokens, p.stop, p.stop_token_ids) == (128, None, None)
    assert (p.temperature, p.top_p, p.top_k, p.min_p) == (1.0, 1.0, -1, 0.0)
    assert (p.frequency_penalty, p.presence_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (p.min_new_tokens, p.ignore_eos, p.skip_special_tokens) == (0, False, True)
    assert (p.spaces_between_special_tokens, p.no_stop_trim, p.n, p.seed) == (True, False, 1, None)
    assert (p.regex, p.json_schema, p.ebnf) == (None, None, None)
    p.verify(VOCAB)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"max_new_tokens": -1}, "max_new_tokens"),
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_p": 1.1}, "min_p"),
        ({"frequency_penalty": 2.5}, "frequency_penalty"),
        ({"presence_penalty": -2.5}, "presence_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": 2.1}, "repetition_penalty"),
        ({"min_new_tokens": -1}, "min_new_tokens"),
        ({"min_new_tokens": 10, "max_new_tokens": 5}, "min_new_tokens"),
        ({"n": 0}, "n"),
        ({"logit_bias": {str(VOCAB): 1.0}}, "logit_bias"),
        ({"logit_bias": {"-1": 1.0}}, "logit_bias"),
        ({"stop_regex": "(unclosed"}, "stop_regex"),
        ({"stop_regex": ["ok", ""]}, "stop_regex"),
        ({"stop": ["ok", ""]}, "stop"),
        ({"stop": ""}, "stop"),
        ({"regex": "a+", "ebnf": "root ::= 'a'"}, "regex"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"top_p": float("nan")}, "top_p"),
        ({"frequency_penalty": float("-inf")}, "frequency_penalty"),
        ({"seed": -1}, "seed"),
        ({"seed": 1 << 63}, "seed"),
    ],
)
def test_verify_rejects_and_names_field(kwargs, field):
    with pytest.raises(ValueError) as e:
        SamplingParams(**kwargs).verify(VOCAB)
    assert str(e.value).startswith(field) or field in str(e.value)


def test_verify_message_format():
    with pytest.raises(ValueError, match=r"temperature must be >= 0, got -1"):
        SamplingParams(temperature=-1).verify(VOCAB)


def test_verify_accepts_boundaries():
    SamplingParams(max_new_tokens=None, temperature=0.0, top_p=1.0, top_k=1, min_p=1.0,
                   frequency_penalty=-2, presence_penalty=2, repetition_penalty=2.0,
                   min_new_tokens=0, stop_token_ids=[0, VOCAB - 1], stop=["x"], json_schema="{}").verify(VOCAB)


def test_from_dict_unknown_key_and_types():
    with pytest.raises(ValueError, match="unknown sampling parameter 'temprature'"):
        SamplingParams.from_dict({"temprature": 0.5})
    with pytest.raises(ValueError, match="temperature must be a number"):
        SamplingParams.from_dict({"temperature": "hot"})
    with pytest.raises(ValueError, match="top_p must be a number"):
        SamplingParams.from_dict({"top_p": True})
    with pytest.raises(ValueError, match="max_new_tokens must be an integer"):
        SamplingParams.from_dict({"max_new_tokens": 3.5})
    with pytest.raises(ValueError, match="stop must be a string or a list"):
        SamplingParams.from_dict({"stop": [1, 2]})
    with pytest.raises(ValueError, match="stop_token_ids must be a list"):
        SamplingParams.from_dict({"stop_token_ids": "12"})
    with pytest.raises(ValueError, match="ignore_eos must be a boolean"):
        SamplingParams.from_dict({"ignore_eos": 1})
    with pytest.raises(ValueError, match="must be a JSON object"):
        SamplingParams.from_dict([("temperature", 1.0)])
    for bad in (float("nan"), float("inf"), -float("inf")):
        with pytest.raises(ValueError, match="temperature must be a finite number"):
            SamplingParams.from_dict({"temperature": bad})
    with pytest.raises(ValueError, match="seed must fit in a signed 64-bit integer"):
        SamplingParams.from_dict({"seed": 10 ** 23})


def test_from_dict_null_means_default_and_ints_coerce():
    p = SamplingParams.from_dict({"temperature": None, "top_k": None, "max_new_tokens": None,
                                  "top_p": 1, "n": 2.0})
    assert p.temperature == 1.0 and p.top_k == -1 and p.max_new_tokens is None
    assert isinstance(p.top_p, float) and p.n == 2 and isinstance(p.n, int)


def _random_params(rng: random.Random) -> SamplingParams:
    return SamplingParams(
        max_new_tokens=rng.choice([None, rng.randint(1, 500)]),
        stop=rng.choice([None, "stop" + str(rng.randint(0, 9)), ["a\n", "ü€", "END"]]),
        stop_token_ids=rng.choice([None, rng.sample(range(VOCAB), 3)]),
        temperature=rng.uniform(0.01, 2.0),
        top_p=rng.uniform(0.05, 1.0),
        top_k=rng.choice([-1, rng.randint(1, 50)]),
        min_p=rng.uniform(0, 1),
        frequency_penalty=rng.uniform(-2, 2),
        presence_penalty=rng.uniform(-2, 2),
        repetition_penalty=rng.uniform(0.5, 2.0),
        min_new_tokens=rng.randint(0, 1),
        ignore_eos=rng.random() < 0.5,
        skip_special_tokens=rng.random() < 0.5,
        spaces_between_special_tokens=rng.random() < 0.5,
        no_stop_trim=rng.random() < 0.5,
        n=rng.randint(1, 4),
        seed=rng.choice([None, rng.randint(0, 2**62)]),
        regex=rng.choice([None, "[a-z]+"]),
        stop_regex=rng.choice([None, r"\d+", [r"The end\.", "a{2,3}"]]),
        logit_bias=rng.choice([None, {str(rng.randrange(VOCAB)): rng.uniform(-100, 100)}]),
        custom_params=rng.choice([None, {"k": [1, "x"]}]),
    )


def test_round_trip_through_msgpack_message():
    rng = random.Random(1234)
    tok = ByteTokenizer()
    for _ in range(50):
        p = _random_params(rng)
        if rng.random() < 0.5:
            p.normalize(tok)
        p.verify(VOCAB)
        msg = TokenizedGenerateReqInput(rid="r", input_ids=[1, 2], sampling_params=p.to_dict())
        back = decode_msg(encode_msg(msg))
        q = SamplingParams.from_dict(back.sampling_params)
        assert q == p
        assert q.stop_strs == p.stop_strs and q.stop_str_max_len == p.stop_str_max_len
        assert q.stop_regex_strs == p.stop_regex_strs
        # only plain msgpack types inside
        assert msgspec.msgpack.decode(msgspec.msgpack.encode(p.to_dict())) == p.to_dict()


def test_normalize_stop_strings_and_greedy():
    tok = ByteTokenizer()
    p = SamplingParams(stop="ab€", temperature=0.0, top_k=20)
    p.normalize(tok)
    assert p.stop_strs == ["ab€"]
    assert p.stop_str_max_len == 5  # 2 ASCII bytes + 3 for the euro sign
    assert p.temperature == 1.0 and p.top_k == 1 and p.is_greedy
    p.normalize(tok)  # idempotent
    assert p.stop_strs == ["ab€"] and p.top_k == 1 and p.stop_str_max_len == 5

    rng = random.Random(7)
    stops = ["".join(rng.choice("xyzé日") for _ in range(rng.randint(1, 6))) for _ in range(4)]
    q = SamplingParams(stop=stops, temperature=0.5, top_k=7)
    q.normalize(tok)
    assert q.stop_strs == stops
    assert q.stop_str_max_len == max(len(s.encode()) for s in stops)
    assert q.temperature == 0.5 and q.top_k == 7 and not q.is_greedy

    r = SamplingParams()
    r.normalize(None)
    assert r.stop_strs == [] and r.stop_str_max_len == 0


@pytest.mark.parametrize("bad", [-1, VOCAB, VOCAB + 7, 2**64 + 1, 2**70])
def test_out_of_vocab_stop_token_ids_are_rejected_naming_the_field(bad):
    """A stop id outside [0, vocab) could never match (and would index past the logits): 400 naming it."""
    p = SamplingParams.from_dict({"stop_token_ids": [5, bad]})
    with pytest.raises(ValueError, match=r"^stop_token_ids must be token ids in \[0, " + str(VOCAB)):
        p.verify(VOCAB)
    SamplingParams(stop_token_ids=[0, 5, VOCAB - 1]).verify(VOCAB)  # the edges are fine


@pytest.mark.parametrize("bad", ["-1", str(VOCAB), str(2**70)])
def test_out_of_vocab_logit_bias_keys_are_rejected_naming_the_field(bad):
    p = SamplingParams.from_dict({"logit_bias": {bad: 1.0}})
    with pytest.raises(ValueError, match=r"^logit_bias keys must be token ids"):
        p.verify(VOCAB)


def test_stop_regex_and_logit_bias_parse_and_normalize():
    p = SamplingParams.from_dict({"stop_regex": r"\d+", "logit_bias": {"7": -100, 3: 2.5}})
    assert p.logit_bias == {"7": -100.0, "3": 2.5}
    p.verify(VOCAB)
    p.normalize(ByteTokenizer())
    assert p.stop_regex_strs == [r"\d+"]
    assert SamplingParams.from_dict({"stop_regex": []}).stop_regex == []  # what sgl.gen always sends
    for bad, field in (({"stop_regex": 5}, "stop_regex"), ({"logit_bias": {"x": 1}}, "logit_bias"),
                       ({"logit_bias": {"1": float("inf")}}, "logit_bias"), ({"logit_bias": [1]}, "logit_bias"),
                       ({"custom_params": "x"}, "custom_params")):
        with pytest.raises(ValueError, match=field):
            SamplingParams.from_dict(bad)


def test_max_regex_chars():
    from sglang.srt.sampling.sampling_params import max_regex_chars

    assert max_regex_chars(r"\d+") is None and max_regex_chars(".*") is None
    assert max_regex_chars("ab(c|de)") == 4 and max_regex_chars(r"x{2,5}") == 5
