"""GenerateReqInput: validation (errors name the field) and batch / n expansion."""

import random

import pytest

from sglang.srt.managers.generate_req import GenerateReqInput


def _rand_text(rng: random.Random) -> str:
    return "".join(rng.choice("abcdefgh ") for _ in range(rng.randint(1, 20))) + "x"


def _rand_ids(rng: random.Random) -> list[int]:
    return [rng.randrange(1, 500) for _ in range(rng.randint(1, 12))]


def test_single_text_is_not_batch():
    rng = random.Random(1)
    text = _rand_text(rng)
    temp = rng.uniform(0.1, 1.5)
    obj = GenerateReqInput(text=text, sampling_params={"temperature": temp}, rid="r1")
    reqs = obj.normalize()
    assert not obj.is_batch
    assert len(reqs) == 1
    r = reqs[0]
    assert (r.text, r.input_ids, r.rid, r.parent_rid, r.index) == (text, None, "r1", "r1", 0)
    assert r.sampling_params == {"temperature": temp, "n": 1}


def test_batch_ids_with_per_prompt_params_and_n_expansion():
    rng = random.Random(2)
    for _ in range(20):
        b = rng.randint(1, 4)
        ids = [_rand_ids(rng) for _ in range(b)]
        ns = [rng.randint(1, 3) for _ in range(b)]
        seeds = [rng.randrange(1000) for _ in range(b)]
        sps = [{"n": n, "seed": s, "max_new_tokens": rng.randint(1, 9)} for n, s in zip(ns, seeds)]
        lps = [rng.random() < 0.5 for _ in range(b)]
        obj = GenerateReqInput(input_ids=ids, sampling_params=sps, return_logprob=lps, top_logprobs_num=2)
        reqs = obj.normalize()
        assert obj.is_batch
        assert len(reqs) == sum(ns)
        expected = [(i, j) for i in range(b) for j in range(ns[i])]  # prompt-major
        assert [r.index for r in reqs] == list(range(len(reqs)))
        for r, (i, j) in zip(reqs, expected):
            assert r.input_ids == ids[i]
            assert r.return_logprob == lps[i]
            assert r.top_logprobs_num == 2
            assert r.sampling_params["n"] == 1
            assert r.sampling_params["max_new_tokens"] == sps[i]["max_new_tokens"]
            assert r.sampling_params["seed"] == seeds[i] + (j if ns[i] > 1 else 0)
        assert len({r.rid for r in reqs}) == len(reqs)
        # the caller's dicts are not modified
        assert [p["n"] for p in sps] == ns


def test_single_prompt_with_n_is_a_batch_of_copies():
    obj = GenerateReqInput(text="hello", sampling_params={"n": 3, "temperature": 0.0}, rid="abc")
    reqs = obj.normalize()
    assert obj.is_batch and len(reqs) == 3
    assert {r.parent_rid for r in reqs} == {"abc"}
    assert all(r.sampling_params == {"n": 1, "temperature": 0.0} for r in reqs)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({}, "text"),
        ({"text": "a", "input_ids": [1]}, "text"),
        ({"text": ""}, "text"),
        ({"text": []}, "text"),
        ({"text": ["a", ""]}, "text[1]"),
        ({"text": 5}, "text"),
        ({"input_ids": []}, "input_ids"),
        ({"input_ids": [1, "2"]}, "input_ids"),
        ({"input_ids": [[1], []]}, "input_ids[1]"),
        ({"input_ids": [[1], [2.5]]}, "input_ids[1]"),
        ({"input_ids": [True, 2]}, "input_ids"),
        ({"text": "a", "sampling_params": [{}]}, "sampling_params"),
        ({"text": ["a", "b"], "sampling_params": [{}]}, "sampling_params"),
        ({"text": "a", "sampling_params": "hot"}, "sampling_params"),
        ({"text": "a", "sampling_params": {"n": 0}}, "n"),
        ({"text": "a", "sampling_params": {"n": "2"}}, "n"),
        ({"text": ["a", "b"], "rid": ["x"]}, "rid"),
        ({"text": ["a", "b"], "rid": ["x", "x"]}, "rid"),
        ({"text": ["a", "b"], "rid": "x"}, "rid"),
        ({"text": ["a", "b"], "return_logprob": [True]}, "return_logprob"),
        ({"text": "a", "return_logprob": "yes"}, "return_logprob"),
        ({"text": "a", "logprob_start_len": -2}, "logprob_start_len"),
        ({"text": "a", "top_logprobs_num": -1}, "top_logprobs_num"),
        ({"text": "a", "stream": "true"}, "stream"),
    ],
)
def test_bad_input_names_the_field(kwargs, field):
    with pytest.raises(ValueError) as ei:
        GenerateReqInput(**kwargs).normalize()
    assert field in str(ei.value)


def test_from_dict_ignores_unknown_rejects_unsupported():
    obj = GenerateReqInput.from_dict({"text": "a", "modalities": None, "some_new_flag": 1})
    assert obj.normalize()[0].text == "a"
    with pytest.raises(ValueError, match="image_data"):
        GenerateReqInput.from_dict({"text": "a", "image_data": "x.png"})
    with pytest.raises(ValueError, match="JSON object"):
        GenerateReqInput.from_dict(["a"])
