"""OpenAI protocol models and the OpenAI -> SGLang mapping (no server, no tokenizer)."""

import json
import random

import pydantic
import pytest

from sglang.srt.entrypoints.http_server import format_validation_error
from sglang.srt.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionStreamChoice,
    CompletionRequest,
    DeltaMessage,
    error_body,
)
from sglang.srt.entrypoints.openai.serving_chat import OpenAIServingChat, chat_logprobs, messages_to_dicts
from sglang.srt.entrypoints.openai.serving_completions import (
    _completion_logprobs,
    build_sampling_params,
    usage_of,
)
from sglang.srt.server_args import ServerArgs


def test_completion_mapping_random():
    rng = random.Random(0)
    for _ in range(20):
        body = {
            "model": "m", "prompt": "hi", "max_tokens": rng.randint(1, 50),
            "temperature": rng.uniform(0, 2), "top_p": rng.uniform(0.1, 1), "n": rng.randint(1, 3),
            "stop": ["\n", "x"], "presence_penalty": rng.uniform(-2, 2), "frequency_penalty": rng.uniform(-2, 2),
            "seed": rng.randrange(10**6), "top_k": rng.randint(1, 40), "min_p": rng.random(),
            "repetition_penalty": rng.uniform(0.5, 1.5), "min_tokens": 1, "ignore_eos": True,
            "regex": "[a-z]+", "skip_special_tokens": False,
        }
        sp = build_sampling_params(CompletionRequest.model_validate(body), body["max_tokens"])
        assert sp["max_new_tokens"] == body["max_tokens"]
        assert sp["min_new_tokens"] == 1
        for k in ("temperature", "top_p", "n", "stop", "presence_penalty", "frequency_penalty", "seed",
                  "top_k", "min_p", "repetition_penalty", "ignore_eos", "regex", "skip_special_tokens"):
            assert sp[k] == body[k], k
        # the dict is accepted by SamplingParams
        from sglang.srt.sampling.sampling_params import SamplingParams

        SamplingParams.from_dict(sp).verify(512)


def test_unset_fields_are_left_to_defaults_and_sglang_extras_pass_through():
    sp = build_sampling_params(CompletionRequest(model="m", prompt="x"), 16)
    assert sp == {"max_new_tokens": 16, "n": 1, "ignore_eos": False, "skip_special_tokens": True,
                  "spaces_between_special_tokens": True, "no_stop_trim": False}
    sp = build_sampling_params(CompletionRequest(model="m", prompt="x", logit_bias={"5": 1.0}, stop_regex=[r"\d+"],
                                                 custom_params={"k": 1}), 16)
    assert (sp["logit_bias"], sp["stop_regex"], sp["custom_params"]) == ({"5": 1.0}, [r"\d+"], {"k": 1})
    from sglang.srt.sampling.sampling_params import SamplingParams

    SamplingParams.from_dict(sp).verify(512)


@pytest.mark.parametrize("prompt", ["abc", ["a", "b"], [1, 2, 3], [[1, 2], [3]]])
def test_prompt_union_keeps_shape(prompt):
    assert CompletionRequest(model="m", prompt=prompt).prompt == prompt


@pytest.mark.parametrize(
    "body, field",
    [
        ({"model": "m", "prompt": "x", "temperature": "hot"}, "temperature"),
        ({"model": "m", "prompt": "x", "n": 1.5}, "n"),
        ({"model": "m", "prompt": 5}, "prompt"),
        ({"model": 3, "prompt": "x"}, "model"),
        ({"model": "m", "prompt": "x", "max_tokens": "many"}, "max_tokens"),
    ],
)
def test_validation_messages_name_the_field(body, field):
    with pytest.raises(pydantic.ValidationError) as ei:
        CompletionRequest.model_validate(body)
    msg = format_validation_error(ei.value)
    assert msg.split(":")[0] == field, msg


def test_chat_validation_message_names_nested_field():
    with pytest.raises(pydantic.ValidationError) as ei:
        ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "wizard", "content": "x"}]})
    assert format_validation_error(ei.value).startswith("messages.0.role")
    with pytest.raises(pydantic.ValidationError) as ei:
        ChatCompletionRequest.model_validate({"model": "m", "messages": [], "top_logprobs": 21})
    assert format_validation_error(ei.value).startswith("top_logprobs")


def test_messages_to_dicts_joins_text_parts_and_rejects_images():
    req = ChatCompletionRequest.model_validate({"model": "m", "messages": [
        {"role": "system", "content": "be nice"},
        {"role": "user", "content": [{"type": "text", "text": "he"}, {"type": "text", "text": "llo"}]}]})
    assert messages_to_dicts(req) == [{"role": "system", "content": "be nice"}, {"role": "user", "content": "hello"}]
    bad = ChatCompletionRequest.model_validate({"model": "m", "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]})
    with pytest.raises(ValueError, match=r"messages\[0\].content"):
        messages_to_dicts(bad)
    with pytest.raises(ValueError, match="messages"):
        messages_to_dicts(ChatCompletionRequest(model="m", messages=[]))


class _StubTM:
    context_len = 100

    class preparer:  # noqa: N801 (the TokenizerManager's RequestPreparer: no text bound here)
        check_text_bound = staticmethod(lambda text, field="text": None)

    def __init__(self, rng):
        self.ids = [rng.randrange(1, 500) for _ in range(rng.randint(1, 30))]

    def apply_chat_template(self, messages, tools=None, add_generation_prompt=True):
        return list(self.ids)


def test_chat_to_generate_max_tokens_and_response_format():
    rng = random.Random(3)
    tm = _StubTM(rng)
    serving = OpenAIServingChat(tm, ServerArgs())
    msgs = [{"role": "user", "content": "hi"}]
    obj = serving._to_generate(ChatCompletionRequest(model="m", messages=msgs))
    assert obj.input_ids == tm.ids
    assert obj.sampling_params["max_new_tokens"] == tm.context_len - len(tm.ids)
    obj = serving._to_generate(ChatCompletionRequest(model="m", messages=msgs, max_tokens=7, max_completion_tokens=5))
    assert obj.sampling_params["max_new_tokens"] == 5
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    obj = serving._to_generate(ChatCompletionRequest.model_validate({
        "model": "m", "messages": msgs,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}))
    assert json.loads(obj.sampling_params["json_schema"]) == schema
    obj = serving._to_generate(ChatCompletionRequest.model_validate({
        "model": "m", "messages": msgs, "response_format": {"type": "json_object"}}))
    assert json.loads(obj.sampling_params["json_schema"]) == {"type": "object"}
    obj = serving._to_generate(ChatCompletionRequest(model="m", messages=msgs, logprobs=True, top_logprobs=3))
    assert obj.return_logprob and obj.top_logprobs_num == 3 and obj.return_text_in_logprobs


def _rand_entries(rng, k, texts):
    return [[-rng.random() * 5, rng.randrange(500), rng.choice(texts)] for _ in range(k)]


def test_logprob_conversions():
    rng = random.Random(4)
    texts = ["a", " b", "cd", "é"]
    out = _rand_entries(rng, 6, texts)
    tops = [_rand_entries(rng, 2, texts) for _ in range(6)]
    meta = {"output_token_logprobs": out, "output_top_logprobs": tops,
            "input_token_logprobs": [[None, 1, "<s>"]] + _rand_entries(rng, 2, texts),
            "input_top_logprobs": [None] + [_rand_entries(rng, 2, texts) for _ in range(2)]}
    lp, end = _completion_logprobs(meta, 2, 10, False)
    assert end == 10 + sum(len(e[2]) for e in out[2:])
    assert lp.tokens == [e[2] for e in out[2:]]
    assert lp.token_logprobs == [e[0] for e in out[2:]]
    assert lp.top_logprobs[0] == {t: v for v, _i, t in tops[2]}
    offs = [10]
    for e in out[2:-1]:
        offs.append(offs[-1] + len(e[2]))
    assert lp.text_offset == offs
    lp_echo, _ = _completion_logprobs(meta, 0, 0, True)
    assert lp_echo.token_logprobs[0] is None and len(lp_echo.tokens) == 3 + 6
    clp = chat_logprobs(meta, 1)
    assert [c.token for c in clp.content] == [e[2] for e in out[1:]]
    assert clp.content[0].bytes == list(out[1][2].encode())
    assert [t.logprob for t in clp.content[0].top_logprobs] == [v for v, _i, _t in tops[1]]


def test_logprobs_with_token_pieces_keep_spaces_and_index_the_text():
    from transformers import AutoTokenizer

    from conftest import shared_path
    from sglang.srt.managers.token_pieces import TokenPieces

    tok = AutoTokenizer.from_pretrained(shared_path("models", "stories260K"))
    pieces = TokenPieces(tok)
    rng = random.Random(random.randrange(1 << 30))
    prompt = "Once upon a time"
    out_text = ", there was a little girl"
    in_ids = tok.encode(prompt)  # BOS first
    out_ids = tok.encode(prompt + out_text, add_special_tokens=False)[len(in_ids) - 1:]
    assert tok.decode(out_ids).strip() == out_text.strip()
    meta = {"input_token_logprobs": [[None, in_ids[0], None]] + [[-rng.random(), t, None] for t in in_ids[1:]],
            "output_token_logprobs": [[-rng.random(), t, None] for t in out_ids]}
    lp, end = _completion_logprobs(meta, 0, 0, True, pieces)
    text = prompt + out_text  # what the echo response returns
    assert end == len(text)
    for t, off, tid in zip(lp.tokens, lp.text_offset, in_ids + out_ids):
        if tid in pieces.special_ids:
            assert off == 0  # BOS adds no text
        elif off == 0:
            assert t.lstrip(" ") == text[:len(t.lstrip(" "))]
        else:
            assert text[off:off + len(t)] == t
    clp = chat_logprobs(meta, 0, pieces)
    assert clp.content[1].token.startswith(" ") and bytes(clp.content[1].bytes) == clp.content[1].token.encode()


def test_usage_counts_prompt_once_per_prompt():
    rng = random.Random(5)
    n, prompts = 3, 2
    pt = [rng.randint(1, 50) for _ in range(prompts)]
    outs = [{"meta_info": {"prompt_tokens": pt[i // n], "cached_tokens": i // n,
                           "completion_tokens": rng.randint(1, 9)}} for i in range(n * prompts)]
    u = usage_of(outs, n)
    assert u.prompt_tokens == sum(pt)
    assert u.completion_tokens == sum(o["meta_info"]["completion_tokens"] for o in outs)
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert u.prompt_tokens_details.cached_tokens == sum(range(prompts))


def test_stream_delta_has_sglang_keys_and_error_shape():
    c = ChatCompletionStreamChoice(index=0, delta=DeltaMessage(content="x"))
    assert c.model_dump()["delta"] == {"role": None, "content": "x", "reasoning_content": None, "tool_calls": None}
    assert ChatCompletionStreamChoice(index=0, delta=DeltaMessage()).model_dump()["delta"] == {
        "role": None, "content": None, "reasoning_content": None, "tool_calls": None}
    assert c.model_dump()["finish_reason"] is None
    e = error_body("temperature must be >= 0", 400)
    assert e == {"error": {"message": "temperature must be >= 0", "type": "BadRequestError",
                           "param": None, "code": 400}}
    assert error_body("no", 404, code="model_not_found")["error"]["type"] == "NotFoundError"
