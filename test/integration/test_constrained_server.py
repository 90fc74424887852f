"""Constrained decoding end to end: a CPU server on stories260K with regex / json_schema / ebnf
constraints (greedy and seeded temperature-1 sampling), the OpenAI ``response_format`` through the
official client, 400s for invalid specs, and constrained + unconstrained requests sharing batches."""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import re
import sys

import pytest
import requests

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from conftest import shared_path  # noqa: E402
from server_utils import ServerProcess  # noqa: E402

# SGLANG_TEST_DEVICE=cuda runs the same tests on a GPU.
DEVICE = os.environ.get("SGLANG_TEST_DEVICE", "cpu")
DEVICE_ARGS = ["--device", DEVICE] + (["--dtype", "float32"] if DEVICE == "cuda" else [])
EOS = 2
PROMPTS = ["Once upon a time", "The little dog", "Lily and Tom went to the park. They", "One day, a bird"]
REGEX = r"(Lily|Tom|Ben) (ran|sat|jumped)( [a-z]+){1,5}\."
PHONE = r"[0-9]{3}-[0-9]{4}"
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 1, "maximum": 99},
        "pet": {"enum": ["cat", "dog", "bird"]},
        "happy": {"type": "boolean"},
    },
    "required": ["name", "age", "pet", "happy"],
    "additionalProperties": False,
}


def check_schema(obj) -> None:
    """``obj`` satisfies :data:`SCHEMA` (jsonschema when installed, plus explicit checks)."""
    try:
        import jsonschema

        jsonschema.validate(obj, SCHEMA)
    except ImportError:
        pass
    assert isinstance(obj, dict) and set(obj) == {"name", "age", "pet", "happy"}
    assert isinstance(obj["name"], str) and len(obj["name"]) <= 12
    assert isinstance(obj["age"], int) and 1 <= obj["age"] <= 99
    assert obj["pet"] in ("cat", "dog", "bird") and isinstance(obj["happy"], bool)


def is_json_object_prefix(text: str) -> bool:
    """``text`` can be continued into a JSON object (checked with xgrammar's matcher, char by char)."""
    import xgrammar as xgr
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(shared_path("models", "stories260K"))
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tok))
    matcher = xgr.GrammarMatcher(compiler.compile_json_schema('{"type": "object"}'))
    return text.startswith("{") and matcher.accept_string(text)


@pytest.fixture(scope="module")
def server():
    path = shared_path("models", "stories260K")
    with ServerProcess(["--model-path", path, *DEVICE_ARGS]) as s:
        yield s


def post(server, payload, status=200):
    r = requests.post(server.url + "/generate", json=payload, timeout=120)
    assert r.status_code == status, r.text
    return r.json()


def gen(server, prompt, **sp):
    return post(server, {"text": prompt, "sampling_params": {"max_new_tokens": 200, **sp}})


def assert_stopped_by_grammar(out):
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": EOS}, out["meta_info"]


@pytest.mark.parametrize("temperature,seed", [(0.0, None), (1.0, 1), (1.0, 2), (1.0, 3)])
def test_regex(server, temperature, seed):
    for prompt in PROMPTS[:2]:
        for pattern in (REGEX, PHONE):
            out = gen(server, prompt, regex=pattern, temperature=temperature, seed=seed)
            assert re.fullmatch(pattern, out["text"]), (pattern, out["text"])
            assert_stopped_by_grammar(out)


@pytest.mark.parametrize("temperature,seed", [(0.0, None), (1.0, 1), (1.0, 2), (1.0, 3)])
def test_json_schema(server, temperature, seed):
    out = gen(server, PROMPTS[0], json_schema=json.dumps(SCHEMA), temperature=temperature, seed=seed,
              max_new_tokens=400)
    assert_stopped_by_grammar(out)
    check_schema(json.loads(out["text"]))


def test_seeded_constrained_sampling_is_reproducible_and_varies(server):
    outs = [gen(server, PROMPTS[1], regex=REGEX, temperature=1.0, seed=s)["text"] for s in (5, 5, 6, 7, 8)]
    assert outs[0] == outs[1]
    assert len(set(outs)) > 1


def test_ebnf(server):
    grammar = 'root ::= name " " verb " home."\nname ::= "Lily" | "Tom"\nverb ::= "ran" | "walked" | "flew"'
    lang = re.compile(r"(Lily|Tom) (ran|walked|flew) home\.")
    for temperature, seed in ((0.0, None), (1.0, 1), (1.0, 2)):
        out = gen(server, PROMPTS[2], ebnf=grammar, temperature=temperature, seed=seed)
        assert lang.fullmatch(out["text"]), out["text"]
        assert_stopped_by_grammar(out)


def test_batch_n_and_streaming(server):
    outs = post(server, {"text": PROMPTS, "sampling_params": {"regex": PHONE, "temperature": 1.0, "n": 2,
                                                             "max_new_tokens": 50}})
    assert len(outs) == 2 * len(PROMPTS)
    assert all(re.fullmatch(PHONE, o["text"]) for o in outs)
    payload = {"text": PROMPTS[0], "stream": True,
               "sampling_params": {"regex": REGEX, "temperature": 0, "max_new_tokens": 100}}
    r = requests.post(server.url + "/generate", json=payload, stream=True, timeout=120)
    events = [line for line in r.iter_lines(decode_unicode=True) if line]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[len("data: "):]) for e in events[:-1]]
    assert len(chunks) > 1
    assert chunks[-1]["text"] == gen(server, PROMPTS[0], regex=REGEX, temperature=0, max_new_tokens=100)["text"]


@pytest.mark.parametrize("field,spec,needle", [
    ("regex", "(abc", "parenthesis is not closed"),
    ("regex", "[z-a]", "lower bound is larger"),
    ("json_schema", "{not json", "not valid JSON"),
    ("json_schema", '{"type": "foo"}', 'Unsupported type "foo"'),
    ("json_schema", '{"type": "object", "properties": {"a": {"$ref": "#/missing"}}}', "missing"),
    ("ebnf", "root ::= undefined_rule", "undefined_rule"),
])
def test_invalid_spec_is_400_naming_the_problem(server, field, spec, needle):
    body = post(server, {"text": "Hi", "sampling_params": {field: spec}}, status=400)
    msg = body["error"]["message"]
    assert needle in msg and field.split("_")[0] in msg, msg


def test_two_constraints_is_400(server):
    body = post(server, {"text": "Hi", "sampling_params": {"regex": "a", "ebnf": 'root ::= "a"'}}, status=400)
    assert "only one of regex" in body["error"]["message"]


def test_openai_response_format(server):
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    model = client.models.list().data[0].id
    msgs = [{"role": "user", "content": "Tell me about a girl."}]
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    for seed in (None, 1, 2):
        c = client.chat.completions.create(model=model, messages=msgs, response_format=rf, max_tokens=400,
                                           temperature=0 if seed is None else 1.0, seed=seed)
        assert c.choices[0].finish_reason == "stop"
        check_schema(json.loads(c.choices[0].message.content))
    # json_object: this story model never closes a free-form object, so check a valid JSON-object prefix
    c = client.chat.completions.create(model=model, messages=msgs, response_format={"type": "json_object"},
                                       max_tokens=40, temperature=0)
    plain = client.chat.completions.create(model=model, messages=msgs, max_tokens=40, temperature=0)
    assert is_json_object_prefix(c.choices[0].message.content)
    assert not is_json_object_prefix(plain.choices[0].message.content)
    chunks = client.chat.completions.create(model=model, messages=msgs, response_format=rf, max_tokens=400,
                                            temperature=0, stream=True)
    check_schema(json.loads("".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)))
    # SGLang's extras through extra_body on completions
    c = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=60, temperature=0,
                                  extra_body={"regex": REGEX})
    assert re.fullmatch(REGEX, c.choices[0].text)
    c = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=60, temperature=0,
                                  extra_body={"ebnf": 'root ::= "yes" | "no"'})
    assert c.choices[0].text in ("yes", "no")
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=msgs, max_tokens=5,
                                       response_format={"type": "json_schema",
                                                        "json_schema": {"name": "x", "schema": {"type": "nah"}}})
    assert 'Unsupported type "nah"' in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, prompt="Hi", max_tokens=5, extra_body={"regex": "(abc"})
    assert "parenthesis" in str(e.value)


def test_mixed_concurrent_batch_leaves_unconstrained_unchanged(server):
    plain = {"temperature": 0, "max_new_tokens": 60}
    alone = post(server, {"text": PROMPTS, "sampling_params": plain})
    jobs = [("plain", p, plain) for p in PROMPTS]
    jobs += [("regex", p, {"regex": REGEX, "temperature": 1.0, "seed": i, "max_new_tokens": 100})
             for i, p in enumerate(PROMPTS)]
    jobs += [("json", p, {"json_schema": json.dumps(SCHEMA), "temperature": 1.0, "seed": i, "max_new_tokens": 400})
             for i, p in enumerate(PROMPTS)]
    jobs = jobs[::2] + jobs[1::2]  # interleave kinds
    with cf.ThreadPoolExecutor(len(jobs)) as pool:
        futs = [(kind, p, pool.submit(post, server, {"text": p, "sampling_params": sp})) for kind, p, sp in jobs]
        results = [(kind, p, f.result()) for kind, p, f in futs]
    for kind, p, out in results:
        if kind == "plain":
            ref = alone[PROMPTS.index(p)]
            assert out["output_ids"] == ref["output_ids"] and out["text"] == ref["text"], p
        elif kind == "regex":
            assert re.fullmatch(REGEX, out["text"]), out["text"]
        else:
            check_schema(json.loads(out["text"]))
    # plain requests also unchanged when sent as one batch together with constrained ones
    outs = post(server, {"text": PROMPTS + PROMPTS,
                         "sampling_params": [plain] * 4 + [{"regex": PHONE, "max_new_tokens": 50}] * 4})
    assert [o["output_ids"] for o in outs[:4]] == [o["output_ids"] for o in alone]
    assert all(re.fullmatch(PHONE, o["text"]) for o in outs[4:])
    st = requests.get(server.url + "/get_server_info", timeout=30).json()["internal_states"][0]
    assert st["num_grammar_queue_reqs"] == 0
