"""The frontend DSL (``import sglang as sgl``) against a real CPU server on stories260K.

Every program's text is compared with the same requests issued directly to ``/generate`` (or
``/v1/*`` for the OpenAI backend): multi-step gen, select (three choice methods, scores recomputed
from raw input logprobs), fork with greedy branches, run_batch, streaming, roles, regex- and
json_schema-constrained gen. The server is an ``sgl.Runtime`` (started and stopped through the
public API).
"""

from __future__ import annotations

import json
import os
import random
import re
import sys

import pytest
import requests

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from conftest import shared_path  # noqa: E402

import sglang as sgl  # noqa: E402

WORDS = ["Lily", "Tom", "the dog", "a bird", "the park", "a big tree", "the sun", "her mom", "a red ball", "the cat"]
STARTS = ["Once upon a time", "One day", "The little dog", "Lily and Tom went to the park. They"]


@pytest.fixture(scope="module")
def server():
    """The one server of this file, started through the public ``sgl.Runtime`` (which this also tests:
    the teardown checks that ``shutdown`` leaves no process behind)."""
    import psutil

    path = shared_path("models", "stories260K")
    rt = sgl.Runtime(model_path=path, device="cpu", launch_timeout=240)
    rt.model_path = path
    children = psutil.Process(rt.pid).children(recursive=True)
    try:
        yield rt
    finally:
        rt.shutdown()
        assert rt.proc.poll() is not None
        _, alive = psutil.wait_procs(children, timeout=20)
        assert not alive, f"server children left running: {alive}"


@pytest.fixture(scope="module")
def backend(server):
    return sgl.RuntimeEndpoint(server.url)


@pytest.fixture
def rng():
    seed = random.randrange(1 << 30)
    print(f"random seed {seed}")
    return random.Random(seed)


def generate(server, payload: dict):
    r = requests.post(server.url + "/generate", json=payload, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def gen_text(server, text: str, **params) -> str:
    return generate(server, {"text": text, "sampling_params": {"temperature": 0, **params}})["text"]


def test_multi_step_gen_matches_generate(server, backend, rng):
    start, word = rng.choice(STARTS), rng.choice(WORDS)
    n1, n2 = rng.randint(4, 16), rng.randint(4, 16)

    @sgl.function
    def story(s, start, word):
        s += start
        s += sgl.gen("a", max_tokens=n1)
        s += f" Then {word}"
        s += sgl.gen("b", max_tokens=n2, stop=".")
        s += "!"

    state = story.run(start=start, word=word, temperature=0, backend=backend)
    text = start
    a = gen_text(server, text, max_new_tokens=n1)
    text += a + f" Then {word}"
    b = gen_text(server, text, max_new_tokens=n2, stop=["."])
    text += b + "!"
    assert (state["a"], state["b"]) == (a, b)
    assert state.text() == text
    assert state.get_meta_info("a")["completion_tokens"] <= n1


def _ids_and_logprobs(server, texts: list[str]) -> list[list]:
    """Input ids and logprobs of every token of each text (entry 0 has logprob None)."""
    outs = generate(server, {"text": texts, "sampling_params": {"max_new_tokens": 0, "temperature": 0},
                             "return_logprob": True, "logprob_start_len": 0})
    return [o["meta_info"]["input_token_logprobs"] for o in outs]


def _reference_scores(server, prefix: str, choices: list[str]):
    """Per choice: the scored (logprob, id) entries, recomputed from full-prompt logprobs; token
    healing by comparing ids: the prefix's last token is part of the choice iff it changed."""
    full = _ids_and_logprobs(server, [prefix] + [prefix + c for c in choices])
    prefix_ids = [e[1] for e in full[0]]
    out = []
    for entries in full[1:]:
        k = len(prefix_ids) - 1
        if entries[k][1] == prefix_ids[k]:
            k += 1
        out.append([(e[0], e[1]) for e in entries[k:]])
    return out


@pytest.mark.parametrize("method", ["token_length_normalized", "greedy_token_selection",
                                    "unconditional_likelihood_normalized"])
def test_select_matches_reference_scoring(server, backend, rng, method):
    prefix = rng.choice(["Once upon a time, there was a little", "One day, Lily went to the ",
                         "The dog saw a big"])
    choices = rng.sample([" girl", " boy named Tim", " dog", "park", " red ball", " cat", "tree"], 4)

    @sgl.function
    def pick(s):
        s += prefix
        s += sgl.select("c", choices=choices, choices_method=getattr(sgl, method))
        s += "."

    state = pick.run(backend=backend)
    ref = _reference_scores(server, prefix, choices)
    means = [sum(lp for lp, _ in r) / len(r) for r in ref]
    meta = state.get_meta_info("c")
    assert [[e[1] for e in x] for x in meta["input_token_logprobs"]] == [[i for _, i in r] for r in ref]
    assert meta["normalized_prompt_logprobs"] == pytest.approx(means, abs=1e-3)
    if method == "token_length_normalized":
        expected = choices[max(range(len(choices)), key=lambda i: (means[i], -i))]
    elif method == "greedy_token_selection":
        width = max(len(r) for r in ref)
        rows = [[lp for lp, _ in r] + [means[i]] * (width - len(r)) for i, r in enumerate(ref)]
        expected = choices[max(range(len(choices)), key=lambda i: (rows[i], -i))]
    else:
        uncond = _ids_and_logprobs_from_ids(server, [[i for _, i in r] for r in ref])
        pmi = [sum(c[0] - (u[0] or 0.0) for c, u in zip(r, un)) / len(r) for r, un in zip(ref, uncond)]
        assert meta["normalized_unconditional_prompt_logprobs"] == pytest.approx(pmi, abs=1e-3)
        expected = choices[max(range(len(choices)), key=lambda i: (pmi[i], -i))]
    assert state["c"] == expected
    assert state.text() == prefix + expected + "."


def _ids_and_logprobs_from_ids(server, ids: list[list[int]]) -> list[list]:
    outs = generate(server, {"input_ids": ids, "sampling_params": {"max_new_tokens": 0, "temperature": 0},
                             "return_logprob": True, "logprob_start_len": 0})
    return [o["meta_info"]["input_token_logprobs"] for o in outs]


def test_fork_greedy_branches_match_generate(server, backend, rng):
    start = rng.choice(STARTS)
    words = rng.sample(WORDS, 3)
    n = rng.randint(5, 12)

    @sgl.function
    def branches(s):
        s += start
        forks = s.fork(len(words))
        for f, w in zip(forks, words):
            f += f" and {w}"
            f += sgl.gen("x", max_tokens=n, temperature=0)
        forks.join()
        for i in range(len(words)):
            s += f"\n{i}:" + forks[i]["x"]

    state = branches.run(backend=backend)
    expected = [gen_text(server, f"{start} and {w}", max_new_tokens=n) for w in words]
    assert state["x"] == expected  # gathered by join
    assert state.text() == start + "".join(f"\n{i}:{x}" for i, x in enumerate(expected))


def test_run_batch_matches_generate(server, backend, rng):
    @sgl.function
    def cont(s, start, word):
        s += f"{start} {word}"
        s += sgl.gen("x", max_tokens=10)

    args = [{"start": rng.choice(STARTS), "word": rng.choice(WORDS)} for _ in range(5)]
    expected = [gen_text(server, f"{a['start']} {a['word']}", max_new_tokens=10) for a in args]
    for threads in (1, 3, "auto"):
        states = cont.run_batch(args, backend=backend, temperature=0, num_threads=threads, progress_bar=True)
        assert [s["x"] for s in states] == expected
        assert all(s.error() is None for s in states)


def test_streaming_matches_non_streaming(backend, rng):
    start = rng.choice(STARTS)

    @sgl.function
    def story(s):
        s += start
        s += sgl.gen("a", max_tokens=24, temperature=0)
        s += " The end."

    full = story.run(backend=backend)
    streamed = story.run(backend=backend, stream=True)
    chunks = list(streamed.text_iter())
    assert "".join(chunks) == full.text() == streamed.text()
    assert len(chunks) > 3  # the generation arrived in pieces
    var_only = story.run(backend=backend, stream=True)
    assert "".join(var_only.text_iter("a")) == full["a"]


def test_roles_without_chat_template_match_generate(server, backend, rng):
    word = rng.choice(WORDS)

    @sgl.function
    def chat(s):
        s += sgl.system("Tell a story.")
        with s.user():
            s += f"About {word}."
        s += sgl.assistant(sgl.gen("reply", max_tokens=8, temperature=0))

    state = chat.run(backend=backend)
    prompt = f"system: Tell a story.\nuser: About {word}.\nassistant: "
    reply = gen_text(server, prompt, max_new_tokens=8)
    assert state.text() == prompt + reply + "\n"
    assert state.messages() == [{"role": "system", "content": "Tell a story."},
                                {"role": "user", "content": f"About {word}."},
                                {"role": "assistant", "content": reply}]


def test_regex_gen_parses_and_matches_generate(server, backend):
    pattern = r"[0-9]{1,3} (apples|birds|trees)"

    @sgl.function
    def count(s):
        s += "Lily saw "
        s += sgl.gen("n", regex=pattern, max_tokens=16, temperature=0)

    state = count.run(backend=backend)
    assert re.fullmatch(pattern, state["n"]), state["n"]
    assert state["n"] == gen_text(server, "Lily saw ", max_new_tokens=16, regex=pattern)


def test_json_schema_gen_parses_and_matches_generate(server, backend):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                               "happy": {"type": "boolean"}},
              "required": ["name", "happy"], "additionalProperties": False}

    @sgl.function
    def person(s):
        s += "Once upon a time, there was a girl: "
        s += sgl.gen("p", json_schema=schema, max_tokens=256, temperature=0)

    state = person.run(backend=backend)
    obj = json.loads(state["p"])
    assert set(obj) == {"name", "happy"} and isinstance(obj["happy"], bool) and len(obj["name"]) <= 8
    direct = gen_text(server, "Once upon a time, there was a girl: ", max_new_tokens=256,
                      json_schema=json.dumps(schema))
    assert state["p"] == direct


def test_openai_backend_matches_v1_routes(server, rng):
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    model = client.models.list().data[0].id
    start = rng.choice(STARTS)

    @sgl.function
    def story(s):
        s += start
        s += sgl.gen("a", max_tokens=12)

    completion = sgl.OpenAI(model, is_chat_model=False, base_url=server.url + "/v1")
    state = story.run(backend=completion, temperature=0)
    ref = client.completions.create(model=model, prompt=start, max_tokens=12, temperature=0)
    assert state["a"] == ref.choices[0].text
    streamed = story.run(backend=completion, temperature=0, stream=True)
    assert "".join(streamed.text_iter()) == start + ref.choices[0].text

    @sgl.function
    def chat(s):
        s += sgl.user(start)
        s += sgl.assistant(sgl.gen("a", max_tokens=12))

    chat_backend = sgl.OpenAI(model, base_url=server.url + "/v1")
    state = chat.run(backend=chat_backend, temperature=0)
    ref = client.chat.completions.create(model=model, messages=[{"role": "user", "content": start}],
                                         max_tokens=12, temperature=0)
    assert state["a"] == ref.choices[0].message.content

    @sgl.function
    def misplaced(s):
        s += sgl.user(start)
        s += "x" + sgl.gen("a", max_tokens=4)

    with pytest.raises(ValueError, match="assistant turn"):
        misplaced.run(backend=chat_backend)


def test_runtime_as_backend_and_startup_failure(server):
    assert server.url.startswith("http://127.0.0.1:")

    @sgl.function
    def story(s):
        s += "Once upon a time"
        s += sgl.gen("a", max_tokens=10, temperature=0)

    state = story.run(backend=server)  # a Runtime stands for its endpoint
    assert state["a"] == gen_text(server, "Once upon a time", max_new_tokens=10)
    with pytest.raises(RuntimeError, match="exited with code 2"):  # a bad flag fails fast, with the log
        sgl.Runtime(model_path=server.model_path, device="cpu", not_a_server_flag=1, launch_timeout=120)


def test_backend_errors_surface(backend):
    @sgl.function
    def bad(s):
        s += "Once"
        s += sgl.gen("a", max_tokens=10_000)  # beyond the context length

    with pytest.raises(ValueError, match="context length"):
        bad.run(backend=backend)
    states = bad.run_batch([{}, {}], backend=backend)
    assert all(isinstance(s.error(), ValueError) for s in states)


def test_typed_gen_and_min_tokens_match_generate(server, backend, rng):
    from sglang.api import DTYPE_REGEX

    start = rng.choice(STARTS)

    @sgl.function
    def typed(s):
        s += start + " She was "
        s += sgl.gen_int("age", max_tokens=6, temperature=0)
        s += " years old and said "
        s += sgl.gen_string("said", max_tokens=12, temperature=0)
        s += ". Then "
        s += sgl.gen("more", max_tokens=6, min_tokens=6, temperature=0, stop_token_ids=[1, 2])

    st = typed.run(backend=backend)
    assert re.fullmatch(DTYPE_REGEX[int], st["age"]), st["age"]
    int(st["age"])
    assert st["age"] == gen_text(server, start + " She was ", max_new_tokens=6, regex=DTYPE_REGEX[int])
    prefix = f"{start} She was {st['age']} years old and said "
    assert st["said"] == gen_text(server, prefix, max_new_tokens=12, regex=DTYPE_REGEX[str])
    prefix += st["said"] + ". Then "
    out = generate(server, {"text": prefix, "sampling_params": {"temperature": 0, "max_new_tokens": 6,
                                                                 "min_new_tokens": 6, "stop_token_ids": [1, 2]}})
    assert st["more"] == out["text"] and out["meta_info"]["completion_tokens"] == 6
    with pytest.raises(ValueError, match="dtype"):
        sgl.gen("x", dtype=list)
    with pytest.raises(ValueError, match="min_tokens"):
        sgl.gen("x", min_tokens=-1)


def test_run_batch_generator_style_yields_in_order(server, backend, rng):
    @sgl.function
    def cont(s, start):
        s += start
        s += sgl.gen("x", max_tokens=8)

    args = [{"start": rng.choice(STARTS)} for _ in range(4)]
    listed = cont.run_batch(args, backend=backend, temperature=0, num_threads=2)
    it = cont.run_batch(args, backend=backend, temperature=0, num_threads=2, generator_style=True)
    assert not isinstance(it, list)
    assert [s["x"] for s in it] == [s["x"] for s in listed]


def test_named_chat_template_renders_roles(server):
    ep = sgl.RuntimeEndpoint(server.url, chat_template_name="chatml")

    @sgl.function
    def chat(s):
        s += sgl.user("Hi")
        s += sgl.assistant(sgl.gen("r", max_tokens=4, temperature=0))

    st = chat.run(backend=ep)
    assert st.text().startswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    reply = gen_text(server, "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n", max_new_tokens=4)
    assert st["r"] == reply
    with pytest.raises(ValueError, match="unknown chat_template_name"):
        sgl.RuntimeEndpoint(server.url, chat_template_name="no-such-template")


def test_runtime_generate_api_matches_sglang(server):
    import asyncio

    raw = server.generate("Once upon a time", {"max_new_tokens": 12, "temperature": 0})
    assert isinstance(raw, str)  # SGLang's Runtime.generate returns the JSON text
    out = json.loads(raw)
    assert out["text"] == gen_text(server, "Once upon a time", max_new_tokens=12)

    async def collect():
        return [piece async for piece in server.async_generate("Once upon a time",
                                                                {"max_new_tokens": 12, "temperature": 0})]

    pieces = asyncio.run(collect())
    assert "".join(pieces) == out["text"] and len(pieces) > 1
    tok = server.get_tokenizer()
    assert server.encode("Once upon a time") == list(tok.encode("Once upon a time"))
