"""SGLang protocol parity against a real CPU server on stories260K: the request shapes that unmodified
SGLang clients send (the frontend's ``sgl.gen`` / ``sgl.select`` / ``sgl.get_server_info``,
``bench_serving``'s ``/generate`` stream, the ``openai`` SDK) get SGLang's answers.

The bodies are written from SGLang's documented API (``SglSamplingParams.to_srt_kwargs`` sends every
sampling field, with ``"stop_regex": []`` by default); each test compares against an independent
reference request on the same server (greedy, so deterministic) rather than hard-coded text.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys

import pytest
import requests

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from conftest import shared_path  # noqa: E402
from server_utils import ServerProcess  # noqa: E402
from stream_logprob_checks import check_frontend_stream_logprobs  # noqa: E402

PROMPT = "Once upon a time"
FLAG = "--enable-custom-logit-processor"
# SGLANG_TEST_DEVICE=cuda runs the same tests on a GPU (scripts/gpu/protocol_parity.sh).
DEVICE = os.environ.get("SGLANG_TEST_DEVICE", "cpu")
DEVICE_ARGS = ["--device", DEVICE] + (["--dtype", "float32"] if DEVICE == "cuda" else [])


POISON = "the plain server imported flashinfer"


def poisoned_flashinfer_env(root) -> dict:
    """An environment whose ``import flashinfer`` raises RuntimeError(:data:`POISON`): the server under test runs
    with it, so any import of the optional library on the plain path (no ``--attention-backend flashinfer``) fails."""
    pkg = root / "flashinfer"
    pkg.mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text(f"raise RuntimeError({POISON!r})\n")
    return {"PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    env = poisoned_flashinfer_env(tmp_path_factory.mktemp("poison"))
    with ServerProcess(["--model-path", shared_path("models", "stories260K"), *DEVICE_ARGS], env=env) as s:
        s.poison_env = env
        yield s


@pytest.fixture(scope="module")
def client(server):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none")


def post(server, path, body, status=200):
    r = requests.post(server.url + path, json=body, timeout=120)
    assert r.status_code == status, r.text
    return r.json()


def sse_events(resp) -> list:
    assert resp.status_code == 200, resp.text
    lines = [ln for ln in resp.iter_lines(decode_unicode=True) if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(ln[len("data: "):]) for ln in lines[:-1]]


def srt_kwargs(**over) -> dict:
    """What ``SglSamplingParams.to_srt_kwargs()`` sends for ``sgl.gen`` (defaults, tuples as lists)."""
    d = {"max_new_tokens": 128, "min_new_tokens": 0, "n": 1, "stop": [], "stop_token_ids": [], "stop_regex": [],
         "temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "frequency_penalty": 0.0,
         "presence_penalty": 0.0, "ignore_eos": False, "regex": None, "json_schema": None}
    d.update(over)
    return d


def greedy(server, n=40, **extra):
    return post(server, "/generate", {"text": PROMPT, "sampling_params": {"temperature": 0, "max_new_tokens": n,
                                                                          **extra}})


# --------------------------------------------------------------- 1 stop_regex
def test_sgl_gen_request_shape_with_empty_stop_regex(server):
    body = {"text": PROMPT, "sampling_params": {"skip_special_tokens": True, "spaces_between_special_tokens": True,
                                                **srt_kwargs(max_new_tokens=24, temperature=0.0)}}
    out = post(server, "/generate", body)
    assert out["text"] == greedy(server, 24)["text"]


def test_stop_regex_trims_and_names_the_pattern(server):
    full = greedy(server, 60)["text"]
    word = re.findall(r"[a-z]{4,}", full)[2]
    pattern = word[:2] + "[a-z]{2}" + word[4:]  # a regex that first matches at that word
    first = re.search(pattern, full)
    for sr in (pattern, [r"\d{5}", pattern]):
        out = greedy(server, 60, stop_regex=sr)
        assert out["text"] == full[:first.start()]
        assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": pattern}
    kept = greedy(server, 60, stop_regex=pattern, no_stop_trim=True)
    assert kept["text"].startswith(full[:first.end()]) and re.search(pattern, kept["text"])
    # streamed: the held-back suffix never leaks, the concatenated deltas equal the final text
    r = requests.post(server.url + "/generate", json={"text": PROMPT, "stream": True, "sampling_params": {
        "temperature": 0, "max_new_tokens": 60, "stop_regex": pattern}}, stream=True, timeout=120)
    chunks = sse_events(r)
    assert chunks[-1]["text"] == full[:first.start()]
    assert all(c["text"] == full[:len(c["text"])] for c in chunks)
    # OpenAI routes: an extra field, matched_stop names the pattern
    c = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 60, "temperature": 0, "stop_regex": pattern})
    assert c["choices"][0]["text"] == full[:first.start()] and c["choices"][0]["matched_stop"] == pattern
    assert c["choices"][0]["finish_reason"] == "stop"
    post(server, "/generate", {"text": PROMPT, "sampling_params": {"stop_regex": "(bad"}}, status=400)


# ------------------------------------------------------------- 2 /server_info
def test_server_info_alias_with_sglang_fields(server):
    a = requests.get(server.url + "/server_info", timeout=30).json()
    b = requests.get(server.url + "/get_server_info", timeout=30).json()
    for info in (a, b):
        assert isinstance(info["max_total_num_tokens"], int) and info["max_total_num_tokens"] > 0
        assert info["max_total_num_tokens"] == info["max_total_tokens"]
        assert isinstance(info["version"], str) and info["version"]
        assert isinstance(info["internal_states"], list)
    assert set(a) == set(b)


# ---------------------------------------------- 3 streamed /generate logprobs
def test_streamed_generate_logprobs_are_cumulative_like_text(server):
    # bench_serving's /generate body, plus return_logprob as its --return-logprob sends it. SGLang's default stream is
    # cumulative: each chunk's logprob lists cover exactly its output_ids, so a client reading the last chunk's
    # meta_info (SGLang's frontend) gets every token's logprob whatever the chunking.
    body = {"text": PROMPT, "sampling_params": {"temperature": 0.0, "max_new_tokens": 12, "ignore_eos": True},
            "stream": True, "return_logprob": True, "logprob_start_len": -1, "top_logprobs_num": 2}
    chunks = sse_events(requests.post(server.url + "/generate", json=body, stream=True, timeout=120))
    ref = post(server, "/generate", {**body, "stream": False})["meta_info"]
    for c in chunks:
        m = c["meta_info"]
        assert len(m["output_token_logprobs"]) == len(c["output_ids"]) == m["output_token_logprobs_length"]
        assert len(m["output_top_logprobs"]) == len(c["output_ids"])
    m = chunks[-1]["meta_info"]
    assert len(chunks) > 2 and m["output_token_logprobs_length"] == 12
    assert [t for _, t, _ in m["output_token_logprobs"]] == [t for _, t, _ in ref["output_token_logprobs"]]
    assert [lp for lp, _, _ in m["output_token_logprobs"]] == pytest.approx(
        [lp for lp, _, _ in ref["output_token_logprobs"]], abs=1e-4)
    assert [[t for _, t, _ in row] for row in m["output_top_logprobs"]] == [[t for _, t, _ in row]
                                                                          for row in ref["output_top_logprobs"]]


def test_streamed_generate_input_logprobs(server):
    # the prompt's logprobs: complete in every chunk, in both stream modes (the incremental one in
    # test_sglang_api_parity.py)
    body = {"text": PROMPT, "sampling_params": {"temperature": 0.0, "max_new_tokens": 12, "ignore_eos": True},
            "stream": True, "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 2}
    chunks = sse_events(requests.post(server.url + "/generate", json=body, stream=True, timeout=120))
    ref = post(server, "/generate", {**body, "stream": False})["meta_info"]
    assert len(chunks) >= 2 and len(ref["input_token_logprobs"]) == ref["prompt_tokens"] > 1
    for c in chunks:
        m = c["meta_info"]
        assert [t for _, t, _ in m["input_token_logprobs"]] == [t for _, t, _ in ref["input_token_logprobs"]]
        assert len(m["input_top_logprobs"]) == len(ref["input_top_logprobs"])
    assert len(chunks[-1]["meta_info"]["output_token_logprobs"]) == 12


# ----------------------------------------------------------- 4 chat deltas
def test_chat_stream_deltas_have_sglang_keys(server, client):
    body = {"messages": [{"role": "user", "content": "Tell me a story"}], "max_tokens": 6, "stream": True}
    chunks = sse_events(requests.post(server.url + "/v1/chat/completions", json=body, stream=True, timeout=120))
    deltas = [ch["choices"][0]["delta"] for ch in chunks if ch["choices"]]
    assert len(deltas) >= 3
    for d in deltas:
        assert set(d) >= {"role", "content", "reasoning_content", "tool_calls"}, d
    assert deltas[-1] == {"role": None, "content": None, "reasoning_content": None, "tool_calls": None}
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    stream = client.chat.completions.create(model="default", messages=body["messages"], max_tokens=6, stream=True)
    for ch in stream:
        for choice in ch.choices:
            assert choice.delta.reasoning_content is None  # the attribute exists (SGLang's delta field)


# ------------------------------------------------------------- 5 echo ids
def test_echo_of_a_token_id_prompt_skips_special_tokens(server):
    ids = post(server, "/tokenize", {"prompt": PROMPT})["tokens"]
    assert ids[0] == 1  # the stories tokenizer adds BOS <s>
    out = post(server, "/v1/completions", {"prompt": ids, "max_tokens": 4, "temperature": 0, "echo": True})
    text = out["choices"][0]["text"]
    plain = post(server, "/v1/completions", {"prompt": ids, "max_tokens": 4, "temperature": 0})["choices"][0]["text"]
    assert "<s>" not in text and text == PROMPT + plain


# ------------------------------------------------------------- 6 routes
def test_models_retrieve_tokenize_detokenize(server, client):
    listed = client.models.list().data[0].id
    assert client.models.retrieve(listed).id == listed
    r = requests.get(server.url + "/v1/models/not-this-model", timeout=30)
    assert r.status_code == 404 and "not-this-model" in r.json()["error"]["message"]
    for path in ("/tokenize", "/v1/tokenize"):
        t = post(server, path, {"model": listed, "prompt": PROMPT, "add_special_tokens": False})
        assert t["count"] == len(t["tokens"]) and isinstance(t["max_model_len"], int)
        assert post(server, "/detokenize", {"tokens": t["tokens"]})["text"] == PROMPT
    batch = post(server, "/tokenize", {"prompt": [PROMPT, "The dog"]})
    assert batch["count"] == [len(x) for x in batch["tokens"]] and batch["tokens"][0][0] == 1
    assert post(server, "/detokenize", {"tokens": batch["tokens"]})["text"] == [PROMPT, "The dog"]
    assert "<s>" in post(server, "/detokenize", {"tokens": batch["tokens"][0], "skip_special_tokens": False})["text"]
    post(server, "/detokenize", {"tokens": [10 ** 7]}, status=400)


def test_responses_api(server, client):
    openai = pytest.importorskip("openai")
    msgs = [{"role": "system", "content": "Be short."}, {"role": "user", "content": "Tell me a story"}]
    chat = client.chat.completions.create(model="default", messages=msgs, max_tokens=8, temperature=0)
    r = client.responses.create(model="default", instructions="Be short.", input="Tell me a story",
                                max_output_tokens=8, temperature=0, top_p=1.0)
    assert r.object == "response" and r.output_text == chat.choices[0].message.content
    assert r.status == "completed" and r.incomplete_details is None  # SGLang reports a max_output_tokens cut so
    assert r.usage.output_tokens == 8 and r.usage.input_tokens == chat.usage.prompt_tokens
    r2 = client.responses.create(model="default", max_output_tokens=8, temperature=0, input=[
        {"role": "system", "content": "Be short."},
        {"role": "user", "content": [{"type": "input_text", "text": "Tell me a story"}]}])
    assert r2.output_text == r.output_text
    events = list(client.responses.create(model="default", instructions="Be short.", input="Tell me a story",
                                          max_output_tokens=8, temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == r.output_text
    assert events[-1].response.output_text == r.output_text
    bad = requests.post(server.url + "/v1/responses", json={"input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": "http://x"}]}]}, timeout=30)
    assert bad.status_code == 400 and "input[0].content[0]" in bad.json()["error"]["message"]
    assert bad.json()["error"]["type"] == "BadRequestError"


WEATHER = {"type": "function", "name": "get_weather", "description": "Weather of a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Tokyo"]}},
                          "required": ["city"], "additionalProperties": False}}
NOTE = {"type": "custom", "name": "note", "description": "Write a note"}


def test_responses_tools_are_validated_and_served_like_sglang(server, client):
    openai = pytest.importorskip("openai")
    # SGLang's protocol model: the 400 lists the allowed tool types
    err = post(server, "/v1/responses", {"input": "x", "tools": [{"type": "retrieval"}]}, status=400)["error"]
    assert err["message"].startswith("tools.0.type: Input should be 'function', 'web_search', 'web_search_preview', "
                                     "'code_interpreter', 'file_search', 'image_generation', 'computer_use_preview', "
                                     "'local_shell', 'shell', 'mcp', 'custom', 'namespace' or 'tool_search'")
    for body, text in (({"tools": [{"type": "function"}]}, "Function tools must include a name."),
                       ({"tools": [{"type": "shell"}]}, "Shell tools are not supported by this model"),
                       ({"tools": [{"type": "web_search"}], "tool_choice": "required"},
                        'tool_choice="required" requires at least one tool with type="function"'),
                       ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "f"}},
                        "Tool 'f' is not declared in tools")):
        assert text in post(server, "/v1/responses", {"input": "x", **body}, status=400)["error"]["message"]
    # valid tools with tool_choice auto: the model's text (this server has no tool-call parser, like SGLang without
    # --tool-call-parser); stories260K has no chat template, so the fallback prompt (no tools) is the same
    plain = client.responses.create(model="default", input="Tell me a story", max_output_tokens=8, temperature=0)
    r = client.responses.create(model="default", input="Tell me a story", max_output_tokens=8, temperature=0,
                                tools=[WEATHER, NOTE, {"type": "web_search_preview"}])
    assert r.output_text == plain.output_text and [o.type for o in r.output] == ["message"]
    assert [t.type for t in r.tools] == ["function", "custom", "web_search_preview"]
    assert r.tools[0].name == "get_weather"
    # a forced tool_choice: the output is constrained to a JSON array of calls and returned as call items
    kw = dict(model="default", input="What is the weather?", max_output_tokens=400, temperature=0,
              parallel_tool_calls=False)
    r = client.responses.create(tools=[WEATHER, NOTE], tool_choice="required", **kw)
    assert len(r.output) == 1 and r.output[0].type in ("function_call", "custom_tool_call")
    r = client.responses.create(tools=[WEATHER, NOTE], tool_choice={"type": "function", "name": "get_weather"}, **kw)
    call = r.output[0]
    assert [o.type for o in r.output] == ["function_call"] and call.name == "get_weather" and call.status == "completed"
    assert json.loads(call.arguments)["city"] in ("Paris", "Tokyo") and call.call_id.startswith("call_")
    r = client.responses.create(tools=[WEATHER, NOTE], tool_choice={"type": "custom", "name": "note"}, **kw)
    assert [o.type for o in r.output] == ["custom_tool_call"] and r.output[0].name == "note"
    assert isinstance(r.output[0].input, str)
    events = list(client.responses.create(tools=[WEATHER], tool_choice="required", stream=True, **kw))
    kinds = [e.type for e in events]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.function_call_arguments.delta", "response.function_call_arguments.done",
                     "response.output_item.done", "response.completed"]
    assert events[3].delta == events[4].arguments == events[-1].response.output[0].arguments == call.arguments
    # JSON cut by max_output_tokens does not parse: it stays the message, as in SGLang
    r = client.responses.create(model="default", input="What is the weather?", max_output_tokens=6, temperature=0,
                                tools=[WEATHER], tool_choice="required")
    assert [o.type for o in r.output] == ["message"] and r.output_text.lstrip().startswith("[")
    with pytest.raises(openai.BadRequestError, match="Tool 0 function has invalid 'parameters' schema"):
        client.responses.create(model="default", input="x", tools=[{**WEATHER, "parameters": {"type": 5}}])


# --------------------------------------------- 7 logit_bias / token_ids_logprob
def test_logit_bias_native_and_openai(server):
    ref = greedy(server, 5, ignore_eos=True)
    target = 300
    assert target not in ref["output_ids"]
    forced = greedy(server, 5, ignore_eos=True, logit_bias={str(target): 100.0})
    assert forced["output_ids"] == [target] * 5
    banned = greedy(server, 5, ignore_eos=True, logit_bias={str(ref["output_ids"][0]): -100.0})
    assert banned["output_ids"][0] != ref["output_ids"][0]
    c = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 3, "temperature": 0,
                                         "logit_bias": {str(target): 100}})
    assert c["usage"]["completion_tokens"] == 3
    assert c["choices"][0]["text"] == greedy(server, 3, logit_bias={str(target): 100.0})["text"]
    post(server, "/generate", {"text": PROMPT, "sampling_params": {"logit_bias": {"99999999": 1}}}, status=400)


def test_token_ids_logprob(server):
    ref = post(server, "/generate", {"text": PROMPT, "return_logprob": True, "logprob_start_len": 0,
                                     "top_logprobs_num": 3, "sampling_params": {"temperature": 0, "max_new_tokens": 4}})
    m = ref["meta_info"]
    ids = [m["output_token_logprobs"][0][1], 300]
    out = post(server, "/generate", {"text": PROMPT, "return_logprob": True, "logprob_start_len": 0,
                                     "token_ids_logprob": ids, "sampling_params": {"temperature": 0,
                                                                                   "max_new_tokens": 4}})
    mo = out["meta_info"]
    assert len(mo["output_token_ids_logprobs"]) == 4 and len(mo["input_token_ids_logprobs"]) == m["prompt_tokens"]
    first = mo["output_token_ids_logprobs"][0]
    assert [e[1] for e in first] == ids
    assert first[0][0] == pytest.approx(m["output_token_logprobs"][0][0], abs=1e-4)
    # input position k holds the logprobs of the requested ids after prompt[:k] (position 0 has none)
    assert mo["input_token_ids_logprobs"][0] in ([], None)
    for k in range(1, m["prompt_tokens"]):
        row = mo["input_token_ids_logprobs"][k]
        assert [e[1] for e in row] == ids and all(e[0] <= 0 for e in row)
        top = {t: lp for lp, t, _ in m["input_top_logprobs"][k]}
        for lp, t, _ in row:
            if t in top:
                assert lp == pytest.approx(top[t], abs=1e-4)
    post(server, "/generate", {"text": PROMPT, "return_logprob": True, "token_ids_logprob": [10 ** 7]}, status=400)


# ----------------------------------------------------- 8 grammar logprobs
def test_logprobs_under_a_grammar_answer_200_on_every_route(server):
    regex = "(Lily|Tom) (ran|sat)"
    out = post(server, "/generate", {"text": PROMPT, "return_logprob": True, "top_logprobs_num": 5,
                                     "sampling_params": {"temperature": 0, "max_new_tokens": 10, "regex": regex}})
    assert re.fullmatch(regex, out["text"])
    for row in out["meta_info"]["output_top_logprobs"]:
        assert 1 <= len(row) <= 5 and all(math.isfinite(lp) for lp, _, _ in row)
    c = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 10, "temperature": 0, "regex": regex,
                                         "logprobs": 5})
    assert c["choices"][0]["text"] == out["text"]
    assert all(all(math.isfinite(v) for v in top.values()) for top in c["choices"][0]["logprobs"]["top_logprobs"])
    ch = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 10,
                                                "temperature": 0, "regex": regex, "logprobs": True, "top_logprobs": 5})
    assert re.fullmatch(regex, ch["choices"][0]["message"]["content"])
    r = requests.post(server.url + "/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 10, "temperature": 0, "regex": regex,
        "logprobs": True, "top_logprobs": 5, "stream": True}, stream=True, timeout=120)
    assert sse_events(r)


# ---------------------------------------------- 9 stop_token_ids / 10 flag
def test_out_of_vocab_stop_token_ids_are_rejected_naming_the_field(server):
    for ids in ([10 ** 6], [-1], [2 ** 70]):
        err = post(server, "/generate", {"text": PROMPT, "sampling_params": {"stop_token_ids": ids}}, status=400)
        assert err["error"]["message"].startswith("stop_token_ids must be token ids in [0, ")
        err = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "stop_token_ids": ids}, status=400)
        assert err["error"]["message"].startswith("stop_token_ids")
    assert greedy(server, 8, stop_token_ids=[511])["meta_info"]["finish_reason"]["type"] in ("length", "stop")


def test_custom_logit_processor_is_refused_without_the_flag(server):
    blob = json.dumps({"callable": "80049500"})  # never deserialized: refused before anything looks at it
    for path, body in (("/generate", {"text": PROMPT, "custom_logit_processor": blob}),
                       ("/v1/completions", {"prompt": PROMPT, "custom_logit_processor": blob}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                 "custom_logit_processor": blob})):
        err = post(server, path, body, status=400)["error"]["message"]
        assert FLAG in err


def test_sgl_select_request_shape(server):
    texts = [PROMPT + c for c in (" there", " a dog")]
    outs = post(server, "/generate", {"text": texts, "sampling_params": {"max_new_tokens": 0, "temperature": 0},
                                      "return_logprob": True, "return_text_in_logprobs": True,
                                      "logprob_start_len": 3, "token_ids_logprob": None})
    assert len(outs) == 2 and all(o["meta_info"]["input_token_logprobs"] for o in outs)


# -------------------------------------------------- custom processor ON
PROCESSOR_SRC = '''
class BanToken:
    """Bans custom_params["ban"] in each row (SGLang's CustomLogitProcessor protocol)."""

    def __call__(self, logits, custom_param_list=None):
        for i, p in enumerate(custom_param_list or []):
            logits[i, p["ban"]] = float("-inf")
        return logits


class Broken:
    def __call__(self, logits, custom_param_list=None):
        raise RuntimeError("boom")
'''


def processor_str(name: str) -> str:
    """``CustomLogitProcessor.to_str()``'s format for a class defined in ``__main__`` (as SGLang users do)."""
    dill = pytest.importorskip("dill")
    ns = {"__name__": "__main__"}
    exec(PROCESSOR_SRC, ns)
    return json.dumps({"callable": dill.dumps(ns[name]).hex()})


def test_custom_logit_processor_with_the_flag():
    ban, broken = processor_str("BanToken"), processor_str("Broken")
    with ServerProcess(["--model-path", shared_path("models", "stories260K"), *DEVICE_ARGS, FLAG]) as s:
        ref = post(s, "/generate", {"text": PROMPT, "sampling_params": {"temperature": 0, "max_new_tokens": 6}})
        first = ref["output_ids"][0]
        out = post(s, "/generate", {"text": PROMPT, "custom_logit_processor": ban, "sampling_params": {
            "temperature": 0, "max_new_tokens": 6, "custom_params": {"ban": first}}})
        assert first not in out["output_ids"] and out["output_ids"] != ref["output_ids"]
        c = post(s, "/v1/completions", {"prompt": PROMPT, "max_tokens": 6, "temperature": 0,
                                        "custom_logit_processor": ban, "custom_params": {"ban": first}})
        assert c["choices"][0]["text"] == out["text"]
        err = post(s, "/generate", {"text": PROMPT, "custom_logit_processor": broken,
                                    "sampling_params": {"max_new_tokens": 3}}, status=400)
        assert "boom" in err["error"]["message"]
        again = post(s, "/generate", {"text": PROMPT, "sampling_params": {"temperature": 0, "max_new_tokens": 6}})
        assert again["output_ids"] == ref["output_ids"]  # the server is unharmed


def test_own_frontend_streaming_gen_accumulates_incremental_logprobs(server):
    """This project's frontend (``import sglang as sgl``) reads the incremental stream back into full lists."""
    import sglang as sgl

    backend = sgl.RuntimeEndpoint(server.url)

    @sgl.function
    def story(s):
        s += PROMPT
        s += sgl.gen("a", max_tokens=10, temperature=0, ignore_eos=True, return_logprob=True, top_logprobs_num=2)

    full = story.run(backend=backend)
    streamed = story.run(backend=backend, stream=True)
    assert "".join(streamed.text_iter()) == full.text()
    a, b = full.get_meta_info("a"), streamed.get_meta_info("a")
    assert len(b["output_token_logprobs"]) == 10 == b["output_token_logprobs_length"]
    assert [e[1] for e in b["output_token_logprobs"]] == [e[1] for e in a["output_token_logprobs"]]
    assert len(b["output_top_logprobs"]) == 10


def test_frontend_stream_logprobs_per_chunk_on_a_cumulative_stream(server):
    """SGLang's ``test_stream_logprobs`` contract through ``text_async_iter(name, return_meta_data=True)`` on the
    default (cumulative) stream: each chunk's logprob lists hold only its new tokens."""
    check_frontend_stream_logprobs(server.url)


def test_plain_server_never_imports_flashinfer(server):
    """The module's server runs with a ``flashinfer`` whose import raises: it started and served every request above
    (the optional backend's library is imported only by ``--attention-backend flashinfer``)."""
    import subprocess

    assert requests.get(server.url + "/health", timeout=30).status_code == 200
    assert greedy(server, 4)["meta_info"]["completion_tokens"] == 4
    r = subprocess.run([sys.executable, "-c", "import flashinfer"], env={**os.environ, **server.poison_env},
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and POISON in r.stderr  # the poison is live in that environment
