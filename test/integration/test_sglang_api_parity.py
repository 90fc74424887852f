"""SGLang API parity, the rest: ``/v1/score``, ``/v1/tokenize`` with chat ``messages``, ``/v1/responses``
status/usage/events, SGLang's tool error texts, logprobs under a grammar, SGLang's ``CustomLogitProcessor``,
token ids outside the vocabulary, and streamed logprobs under any chunking (many concurrent streams), against a
real CPU server on stories260K with the request shapes of SGLang's own server tests
(``test_openai_server.py``'s ``TestOpenAIV1Score`` / ``TestOpenAIServerv1Responses`` /
``TestOpenAIServerCustomLogitProcessor`` and ``test_srt_endpoint.py``'s ``test_logprob_grammar`` /
``run_custom_logit_processor``). References are independent requests on the same server or the tokenizer.
"""

from __future__ import annotations

import json
import math
import os
import random
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from conftest import shared_path  # noqa: E402
from server_utils import ServerProcess  # noqa: E402
from stream_logprob_checks import check_frontend_stream_logprobs, raw_stream  # noqa: E402

MODEL = shared_path("models", "stories260K")
PROMPT = "Once upon a time"
API_KEY = "sk-123456"
HEADERS = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def server():
    with ServerProcess(["--model-path", MODEL, "--enable-custom-logit-processor"], api_key=API_KEY) as s:
        yield s


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(MODEL)


@pytest.fixture(scope="module")
def client(server):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY)


def post(server, path, body, status=200):
    r = requests.post(server.url + path, json=body, headers=HEADERS, timeout=300)
    assert r.status_code == status, r.text
    return r.json()


def sse(resp) -> list:
    assert resp.status_code == 200, resp.text
    lines = [ln for ln in resp.iter_lines(decode_unicode=True) if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(ln[6:]) for ln in lines[:-1]]


# ------------------------------------------------------------------ /v1/score
def test_score_text_and_token_input_match_generate(server, tok):
    query, items = "The capital of France is", ["Paris", "London", "Berlin"]
    labels = [tok.encode(x, add_special_tokens=False)[0] for x in items]
    text = post(server, "/v1/score", {"model": "m", "query": query, "items": items, "label_token_ids": labels,
                                      "apply_softmax": True, "item_first": False})
    assert text["object"] == "scoring" and len(text["scores"]) == len(items)
    for row in text["scores"]:
        assert len(row) == len(labels) and all(isinstance(v, float) for v in row)
        assert sum(row) == pytest.approx(1.0, abs=1e-6)
    # independent reference: the labels' logprobs after each prompt from /generate
    for item, row in zip(items, text["scores"]):
        ref = post(server, "/generate", {"text": query + item, "return_logprob": True, "token_ids_logprob": labels,
                                         "sampling_params": {"max_new_tokens": 1, "temperature": 0}})
        lps = [e[0] for e in ref["meta_info"]["output_token_ids_logprobs"][0]]
        z = sum(math.exp(v) for v in lps)
        assert row == pytest.approx([math.exp(v) / z for v in lps], rel=1e-4)
        raw = post(server, "/v1/score", {"query": query, "items": [item], "label_token_ids": labels})
        assert raw["scores"][0] == pytest.approx([math.exp(v) for v in lps], rel=1e-4)
    ids = post(server, "/v1/score", {"query": tok.encode(query, add_special_tokens=False), "apply_softmax": True,
                                     "items": [tok.encode(x, add_special_tokens=False) for x in items],
                                     "label_token_ids": labels})
    assert len(ids["scores"]) == 3 and all(sum(r) == pytest.approx(1.0, abs=1e-6) for r in ids["scores"])
    first = post(server, "/v1/score", {"query": " is big.", "items": ["Lily"], "label_token_ids": labels,
                                       "item_first": True})
    ref = post(server, "/v1/score", {"query": "", "items": ["Lily is big."], "label_token_ids": labels})
    assert first["scores"][0] == pytest.approx(ref["scores"][0], rel=1e-5)


def test_score_errors_as_sglang(server):
    err = post(server, "/v1/score", {"model": "m", "query": "The capital of France is", "items": ["Paris"],
                                     "label_token_ids": [999999], "apply_softmax": True}, status=400)
    assert err["type"] == "BadRequestError" and "Token ID 999999 is out of vocabulary" in err["message"]
    assert err["error"]["message"] == err["message"]  # OpenAI's nested shape too
    for body in ({"query": "q", "items": ["a"], "label_token_ids": [-1]}, {"query": "q", "items": ["a"]},
                 {"query": "q", "items": [[1]], "label_token_ids": [1]}, {"query": "q", "items": 5}):
        assert post(server, "/v1/score", body, status=400)["type"] == "BadRequestError"


# ----------------------------------------------------------- /v1/tokenize
def test_tokenize_chat_messages_applies_the_template(server, client):
    msgs = [{"role": "system", "content": "Be short."}, {"role": "user", "content": "Tell me a story"}]
    t = post(server, "/v1/tokenize", {"model": "m", "messages": msgs})
    assert t["count"] == len(t["tokens"]) and isinstance(t["max_model_len"], int)
    chat = client.chat.completions.create(model="m", messages=msgs, max_tokens=1)
    assert chat.usage.prompt_tokens == t["count"]  # exactly the prompt /v1/chat/completions runs
    rendered = post(server, "/detokenize", {"tokens": t["tokens"]})["text"]
    assert "Be short." in rendered and "Tell me a story" in rendered
    no_gen = post(server, "/tokenize", {"messages": msgs, "add_generation_prompt": False})
    assert no_gen["count"] < t["count"]
    post(server, "/v1/tokenize", {"messages": [{"role": "nobody", "content": "x"}]}, status=400)
    post(server, "/v1/tokenize", {"messages": msgs, "prompt": "x"}, status=400)


# --------------------------------------------------------- /v1/responses
def test_responses_status_usage_and_events_as_sglang(server, client):
    payload = dict(model="m", input="The capital of France is", temperature=0.0, top_p=1.0, max_output_tokens=16,
                   store=True, parallel_tool_calls=True, tool_choice="auto", truncation="disabled")
    resp = client.responses.create(**payload)
    assert resp.status == "completed" and resp.incomplete_details is None and resp.error is None
    raw = post(server, "/v1/responses", {**payload, "frequency_penalty": 1.0})
    u = raw["usage"]
    assert u["prompt_tokens"] == u["input_tokens"] > 0 and u["completion_tokens"] == u["output_tokens"] == 16
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
    kinds, text, final = [], "", None
    with client.responses.stream(**{k: v for k, v in payload.items()}) as stream:
        for ev in stream:
            kinds.append(ev.type)
            if ev.type == "response.output_text.delta":
                text += ev.delta
            if ev.type == "response.completed":
                final = ev.response
        stream.get_final_response()
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert final.status == "completed" and text == resp.output_text == final.output_text
    assert final.usage.output_tokens == 16
    err = requests.post(server.url + "/v1/responses", headers=HEADERS, timeout=60,
                        json={"model": "m", "input": "Hi", "previous_response_id": "bad"})
    assert err.status_code == 400 and {"message", "type", "code"} <= set(err.json()["error"])


# ------------------------------------------------------------------ tools
def test_invalid_tools_errors_use_sglang_texts(client):
    openai = pytest.importorskip("openai")
    msgs = [{"role": "user", "content": "What is the weather?"}]
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
    cases = [
        (dict(tool_choice="required"), "Tools cannot be empty if tool choice is set to required."),
        (dict(tools=[tool], tool_choice={"type": "function", "function": {"name": "nonexistent_function"}}),
         "Tool 'nonexistent_function' not found in tools list."),
        (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": 7}}}]),
         "Tool 0 function has invalid 'parameters' schema"),
    ]
    for kw, msg in cases:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="m", messages=msgs, max_tokens=4, **kw)
        assert msg in str(e.value)
    ok = client.chat.completions.create(model="m", messages=msgs, max_tokens=4, tools=[tool], tool_choice="auto")
    assert ok.choices[0].finish_reason in ("stop", "length")


# ----------------------------------------------------- grammar logprobs
def test_logprob_grammar_reports_the_constrained_tokens(server, tok):
    """``test_logprob_grammar``'s request: the top logprobs are the grammar's allowed tokens with their
    probabilities after masking (they sum to 1), and the chosen token is one of them with the same logprob."""
    regex = "( he| she)"
    allowed = {i for piece, i in tok.get_vocab().items()
               if piece and any(alt.startswith(piece.replace("\u2581", " ")) for alt in (" he", " she"))}
    assert 2 <= len(allowed) <= 5  # so the top 5 must be exactly the allowed tokens
    for prompt in ("Lily was sad because", "Question: Is Paris the Capital of France? Answer:"):
        out = post(server, "/generate", {"text": prompt, "sampling_params": {
            "temperature": 1.0, "max_new_tokens": 1, "regex": regex}, "return_logprob": True, "top_logprobs_num": 5,
            "return_text_in_logprobs": True})
        top = out["meta_info"]["output_top_logprobs"][0]
        assert {e[1] for e in top} == allowed
        assert [e[2] for e in top] == [tok.decode([e[1]]) for e in top]
        assert sum(math.exp(e[0]) for e in top) == pytest.approx(1.0, abs=1e-4)
        lp, tid, _ = out["meta_info"]["output_token_logprobs"][0]
        assert tid in allowed and tid == out["output_ids"][0]
        assert lp == pytest.approx({e[1]: e[0] for e in top}[tid], abs=1e-6)


# --------------------------------------------------- custom logit processor
SGLANG_PROCESSOR_SRC = '''
from sglang.srt.sampling.custom_logit_processor import CustomLogitProcessor


class DeterministicLogitProcessor(CustomLogitProcessor):
    """SGLang's test processor: always samples custom_params["token_id"]."""

    def __call__(self, logits, custom_param_list):
        assert logits.shape[0] == len(custom_param_list)
        for i, param_dict in enumerate(custom_param_list):
            logits[i, :] = -float("inf")
            logits[i, param_dict["token_id"]] = 0.0
        return logits
'''


def _sglang_processor_str(method_call: bool) -> str:
    """``to_str()`` of SGLang's test processor defined in a user's script (``__main__``, so dill sends the class
    by value and only the base class by reference to SGLang's module path)."""
    pytest.importorskip("dill")
    ns = {"__name__": "__main__"}
    exec(SGLANG_PROCESSOR_SRC, ns)
    cls = ns["DeterministicLogitProcessor"]
    return cls().to_str() if method_call else cls.to_str()


def test_sglang_custom_logit_processors_load_and_run(server, client, tok):
    proc = _sglang_processor_str(method_call=False)

    def run(target):  # test_srt_endpoint.run_custom_logit_processor's request
        body = {"text": "Question: Is Paris the Capital of France? Answer:",
                "sampling_params": {"temperature": 0.0, "max_new_tokens": 24}, "return_logprob": True}
        if target is not None:
            body["custom_logit_processor"] = proc
            body["sampling_params"]["custom_params"] = {"token_id": target}
        sampled = [x[1] for x in post(server, "/generate", body)["meta_info"]["output_token_logprobs"]]
        return target is None or (sampled and all(x == target for x in sampled))

    targets = list(range(3, 19)) + [None] * 8
    random.Random(0).shuffle(targets)
    with ThreadPoolExecutor(len(targets)) as ex:
        assert all(ex.map(run, targets))
    extra = {"custom_logit_processor": _sglang_processor_str(method_call=True), "custom_params": {"token_id": 5}}
    out = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Is Paris the Capital?"}],
                                         temperature=0.0, max_tokens=20, extra_body=extra)
    assert out.choices[0].message.content == tok.decode([5] * 20)


# ------------------------------------------------------ token-id ranges
@pytest.mark.parametrize("bad", [-1, 512, 2 ** 64 + 5])
def test_out_of_vocab_ids_are_a_400_naming_the_field(server, bad):
    cases = [
        ("/generate", {"text": PROMPT, "sampling_params": {"stop_token_ids": [bad]}}, "stop_token_ids"),
        ("/generate", {"text": PROMPT, "sampling_params": {"logit_bias": {str(bad): 1}}}, "logit_bias"),
        ("/generate", {"text": PROMPT, "return_logprob": True, "token_ids_logprob": [bad]}, "token_ids_logprob"),
        ("/v1/completions", {"prompt": PROMPT, "stop_token_ids": [bad]}, "stop_token_ids"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "stop_token_ids": [bad]},
         "stop_token_ids"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logit_bias": {str(bad): 1}},
         "logit_bias"),
    ]
    for path, body, field in cases:
        msg = post(server, path, body, status=400)["error"]["message"]
        assert msg.startswith(field) and "serializ" not in msg and "scheduler" not in msg, msg


# ------------------------------------------------------ streamed logprobs
def _stream_checks(server, i: int) -> list:
    """One /generate, chat and completions stream; returns the mismatches found (empty: all consistent)."""
    n, bad = 1 + (i * 7) % 24, []
    body = {"text": PROMPT + " x" * (i % 4), "stream": True, "return_logprob": True, "top_logprobs_num": 2,
            "return_text_in_logprobs": True, "sampling_params": {"temperature": 0.8, "max_new_tokens": n}}
    chunks = sse(requests.post(server.url + "/generate", json=body, headers=HEADERS, stream=True, timeout=300))
    for c in chunks:  # cumulative (the default): every chunk's lists cover exactly its output_ids
        m = c["meta_info"]
        if not len(m["output_token_logprobs"]) == len(c["output_ids"]) == len(m["output_top_logprobs"]):
            bad.append(("generate", len(c["output_ids"]), len(m["output_token_logprobs"])))
    if chunks[-1]["meta_info"]["completion_tokens"] != len(chunks[-1]["meta_info"]["output_token_logprobs"]):
        bad.append(("generate-final", chunks[-1]["meta_info"]))
    for path, body, key in (
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "logprobs": True,
                                      "top_logprobs": 2}, "content"),
            ("/v1/completions", {"prompt": PROMPT, "logprobs": 2}, "tokens")):
        body = {**body, "stream": True, "max_tokens": n, "stream_options": {"include_usage": True}}
        chunks = sse(requests.post(server.url + path, json=body, headers=HEADERS, stream=True, timeout=300))
        got = sum(len((c["choices"][0].get("logprobs") or {}).get(key) or []) for c in chunks if c["choices"])
        if got != chunks[-1]["usage"]["completion_tokens"]:
            bad.append((path, got, chunks[-1]["usage"]["completion_tokens"]))
    return bad


def test_streamed_logprobs_one_per_token_under_concurrency(server):
    with ThreadPoolExecutor(24) as ex:
        bad = [b for b in ex.map(lambda i: _stream_checks(server, i), range(48)) if b]
    assert not bad, bad[:3]


@pytest.fixture(scope="module")
def incremental_server():
    with ServerProcess(["--model-path", MODEL, "--incremental-streaming-output"]) as s:
        yield s


def test_incremental_streaming_output_sends_aligned_deltas(incremental_server):
    """``--incremental-streaming-output`` (how SGLang's own CI runs its frontend tests): every chunk carries only its
    new tokens' text, ids and output logprob lists, ``completion_tokens`` / ``output_token_logprobs_length`` are
    running totals, and the prompt's logprob lists are complete in every chunk (SGLang's tokenizer manager)."""
    s = incremental_server

    def one(i):
        body = {"text": PROMPT + " y" * (i % 3), "return_logprob": True, "top_logprobs_num": 2,
                "logprob_start_len": 0, "token_ids_logprob": [5, 300],
                "sampling_params": {"temperature": 0, "max_new_tokens": 4 + i % 20}}
        ref = requests.post(s.url + "/generate", json=body, timeout=300).json()
        chunks = raw_stream(s.url, body)
        ids, text, lps, tids, prev_tokens = [], "", [], [], 0
        for c in chunks:
            m = c["meta_info"]
            new = m["completion_tokens"] - prev_tokens
            assert m["output_token_logprobs_length"] == m["completion_tokens"]
            assert len(c["output_ids"]) == len(m["output_token_logprobs"]) == new == len(m["output_top_logprobs"])
            assert len(m["output_token_ids_logprobs"]) == new
            assert [e[1] for e in m["input_token_logprobs"]] == [e[1] for e in ref["meta_info"]["input_token_logprobs"]]
            prompt_tokens = ref["meta_info"]["prompt_tokens"]
            assert len(m["input_top_logprobs"]) == len(m["input_token_ids_logprobs"]) == prompt_tokens
            prev_tokens = m["completion_tokens"]
            ids, text = ids + c["output_ids"], text + c["text"]
            lps, tids = lps + m["output_token_logprobs"], tids + m["output_token_ids_logprobs"]
        assert ids == ref["output_ids"] and text == ref["text"]
        assert [e[1] for e in lps] == [e[1] for e in ref["meta_info"]["output_token_logprobs"]]
        assert [[e[1] for e in row] for row in tids] == [[5, 300]] * len(ids)
        return len(chunks)

    with ThreadPoolExecutor(16) as ex:
        assert sum(ex.map(one, range(32))) > 32  # most streams came in several chunks


def test_frontend_stream_logprobs_per_chunk_on_an_incremental_stream(incremental_server):
    """SGLang's ``test_stream_logprobs`` contract through ``text_async_iter(name, return_meta_data=True)`` on the
    incremental stream (the frontend reads delta text and delta lists as such)."""
    check_frontend_stream_logprobs(incremental_server.url)
