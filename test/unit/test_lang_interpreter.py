"""The frontend interpreter with a scripted backend (:class:`FakeBackend`, also used by
test_lang_chat_template.py): text composition, variables, sampling-parameter
merging, fork/join, run_batch, streaming, errors, and the lazy ``import sglang``."""

from __future__ import annotations

import random
import subprocess
import sys
import threading
from typing import Any, Optional

import pytest

import sglang as sgl
from sglang.lang.backend.base_backend import BaseBackend
from sglang.lang.chat_template import ChatTemplate, default_chat_template

WORDS = ["sun", "tree", "Lily", "ball", "park", "happy", "red", "jumped", "bird", "cake", "blue", "Tom"]


def random_words(rng: random.Random, lo: int = 1, hi: int = 6) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


class FakeBackend(BaseBackend):
    """Generates random words; records every call as ``(kind, prompt, params_or_choices, result)``.

    Args:
        rng: source of the generated text and select scores.
        template: chat template (default: ``role: content``).
        fail_on: raise RuntimeError when a prompt contains this string.
        barrier: every ``generate`` waits on it (tests concurrency).
        lead: text put before every generated text.
    """

    def __init__(self, rng: random.Random, template: Optional[ChatTemplate] = None, fail_on: Optional[str] = None,
                 barrier: Optional[threading.Barrier] = None, lead: str = " ") -> None:
        self.lead = lead
        self.rng = rng
        self.template = template or default_chat_template()
        self.fail_on = fail_on
        self.barrier = barrier
        self.calls: list[tuple[str, str, Any, Any]] = []
        self.lock = threading.Lock()

    def get_chat_template(self) -> ChatTemplate:
        return self.template

    def _text(self, prompt: str) -> str:
        if self.fail_on is not None and self.fail_on in prompt:
            raise RuntimeError(f"scripted failure on {self.fail_on!r}")
        with self.lock:
            return self.lead + random_words(self.rng)

    def generate(self, s, sampling_params):
        if self.barrier is not None:
            self.barrier.wait(timeout=10)
        text = self._text(s.text_)
        with self.lock:
            self.calls.append(("gen", s.text_, sampling_params, text))
        return text, {"words": len(text.split())}

    def generate_stream(self, s, sampling_params):
        text = self._text(s.text_)
        with self.lock:
            self.calls.append(("gen", s.text_, sampling_params, text))
        for i in range(0, len(text), 3):
            yield text[i:i + 3], None

    def select(self, s, choices, temperature, choices_method):
        with self.lock:
            entries = [[[-self.rng.uniform(0.1, 5.0), j, None] for j in range(self.rng.randint(1, 3))]
                       for _ in choices]
        means = [sum(e[0] for e in x) / len(x) for x in entries]
        decision = choices_method(choices=list(choices), normalized_prompt_logprobs=means,
                                  input_token_logprobs=entries, output_token_logprobs=[None] * len(choices),
                                  unconditional_token_logprobs=[[[None, 0, None]] * len(x) for x in entries])
        with self.lock:
            self.calls.append(("select", s.text_, list(choices), decision.decision))
        return decision


@pytest.fixture
def rng():
    seed = random.randrange(1 << 30)
    print(f"random seed {seed}")
    return random.Random(seed)


def test_text_variables_and_params(rng):
    be = FakeBackend(rng)
    head, mid = random_words(rng), random_words(rng)
    n = rng.randint(1, 50)

    @sgl.function
    def prog(s, head, mid):
        s += head
        s += sgl.gen("a", max_tokens=n, stop=["."])
        s += mid + sgl.gen("b", temperature=0.0)
        s += sgl.select("c", choices=["x", "yy", "zzz"])

    state = prog.run(head=head, mid=mid, temperature=0.7, top_p=0.9, backend=be)
    (k1, p1, sp1, a), (k2, p2, sp2, b), (k3, p3, ch, c) = be.calls
    assert (k1, k2, k3) == ("gen", "gen", "select")
    assert p1 == head and p2 == head + a + mid and p3 == p2 + b
    assert (sp1.max_new_tokens, sp1.stop, sp1.temperature, sp1.top_p) == (n, (".",), 0.7, 0.9)
    assert (sp2.max_new_tokens, sp2.stop, sp2.temperature) == (128, (), 0.0)
    assert sp1.to_srt_kwargs()["stop"] == ["."] and "stop" not in sp2.to_srt_kwargs()
    assert (state["a"], state["b"], state["c"]) == (a, b, c) and c in ch
    assert state.text() == head + a + mid + b + c
    assert state.get_meta_info("a") == {"words": len(a.split())}
    assert "normalized_prompt_logprobs" in state.get_meta_info("c")
    with pytest.raises(KeyError, match="no variable 'missing'"):
        state["missing"]


def test_gen_with_choices_is_select_and_argument_checks(rng):
    e = sgl.gen("v", choices=["a", "b"])
    assert type(e).__name__ == "SglSelect" and e.temperature == 0.0
    bad = [lambda: sgl.gen(max_tokens=-1), lambda: sgl.gen(regex="a", json_schema={}),
           lambda: sgl.gen(stop=3), lambda: sgl.gen(temperature="hot"), lambda: sgl.select("x", []),
           lambda: sgl.gen(json_schema="{not json"), lambda: sgl.gen(name="")]
    for f in bad:
        with pytest.raises(ValueError):
            f()
    assert sgl.gen(json_schema={"type": "object"}).overrides["json_schema"] == '{"type": "object"}'

    @sgl.function
    def prog(s, x):
        s += x

    be = FakeBackend(rng)
    with pytest.raises(TypeError, match="bad arguments"):
        prog.run(y=1, backend=be)
    with pytest.raises(ValueError, match="num_threads"):
        prog.run_batch([{"x": "a"}], backend=be, num_threads=0)
    with pytest.raises(ValueError, match="list of keyword-argument dicts"):
        prog.run_batch(["a"], backend=be)
    with pytest.raises(TypeError, match="only strings"):
        prog.run(x=3, backend=be)
    with pytest.raises(TypeError, match="inside another program"):
        prog("a")


def test_nested_program_and_bind(rng):
    be = FakeBackend(rng)

    @sgl.function
    def inner(s, word):
        s += f"<{word}>"

    @sgl.function
    def outer(s, a, b):
        inner(s, a)
        s += sgl.gen("g", max_tokens=3)
        inner(s, word=b)

    a, b = random_words(rng), random_words(rng)
    state = outer.bind(b=b).run(a=a, backend=be)
    assert state.text() == f"<{a}>{be.calls[0][3]}<{b}>"


def test_fork_runs_concurrently_and_joins(rng):
    n = rng.randint(2, 4)
    be = FakeBackend(rng, barrier=threading.Barrier(n))  # every gen waits until n run at once
    head = random_words(rng)
    tags = [f"{i}:{random_words(rng)}" for i in range(n)]  # distinct prompts

    @sgl.function
    def prog(s):
        s += head
        forks = s.fork(n)
        forks += [f"[{t}]" for t in tags]
        forks += sgl.gen("x", max_tokens=5)
        forks.join()
        s += "|".join(forks[i]["x"] for i in range(n))

    state = prog.run(backend=be)
    by_prompt = {c[1]: c[3] for c in be.calls}
    xs = [by_prompt[f"{head}[{t}]"] for t in tags]
    assert state["x"] == xs and state.get_meta_info("x") == [{"words": len(x.split())} for x in xs]
    assert state.text() == head + "|".join(xs)

    @sgl.function
    def concat(s):
        s += head
        forks = s.fork(2)
        for i, f in enumerate(forks):
            f += f"<{i}>"
        forks.join("concate_and_append")

    assert concat.run(backend=FakeBackend(rng)).text() == head + "<0><1>"
    with pytest.raises(ValueError, match="fork size"):
        sgl.function(lambda s: s.fork(0)).run(backend=be)


def test_run_batch_order_and_errors(rng):
    be = FakeBackend(rng, fail_on="BAD")

    @sgl.function
    def prog(s, x):
        s += x
        s += sgl.gen("g", max_tokens=4)

    xs = [random_words(rng) for _ in range(7)] + ["BAD one"]
    for threads in (1, 4, "auto"):
        states = prog.run_batch([{"x": x} for x in xs], backend=be, num_threads=threads)
        assert [s.text().startswith(x) for s, x in zip(states, xs)] == [True] * len(xs)
        for s, x in zip(states[:-1], xs):
            assert s.text() == x + s["g"] and s.error() is None
        assert isinstance(states[-1].error(), RuntimeError)
        with pytest.raises(RuntimeError, match="scripted failure"):
            states[-1]["g"]
    with pytest.raises(RuntimeError, match="scripted failure"):
        prog.run(x="BAD", backend=be)


def test_streaming_text_iter(rng):
    be = FakeBackend(rng)
    head, tail = random_words(rng), random_words(rng)

    @sgl.function
    def prog(s):
        s += head
        s += sgl.gen("a", max_tokens=9)
        s += tail

    state = prog.run(backend=be, stream=True)
    chunks = list(state.text_iter())
    assert "".join(chunks) == state.text() == head + state["a"] + tail
    assert len(chunks) >= 3
    state = prog.run(backend=be, stream=True)
    assert "".join(state.text_iter("a")) == state["a"]
    failing = FakeBackend(rng, fail_on=head)
    state = prog.run(backend=failing, stream=True)
    with pytest.raises(RuntimeError, match="scripted failure"):
        list(state.text_iter())


class BurstLogprobBackend(BaseBackend):
    """Streams ``pieces`` (text per chunk; "" for a chunk whose tokens have no text yet) with one token per chunk,
    as fast as possible, each meta_info holding the full logprob lists so far (what generate_stream promises)."""

    def __init__(self, pieces: list[str]) -> None:
        self.pieces = pieces

    def generate_stream(self, s, sampling_params):
        lps, tops = [], []
        for k, piece in enumerate(self.pieces):
            lps.append([-0.1 * k, 100 + k, piece])
            tops.append([[-0.1 * k, 100 + k, piece]])
            yield piece, {"completion_tokens": k + 1, "output_token_logprobs_length": k + 1,
                          "output_token_logprobs": list(lps), "output_top_logprobs": list(tops)}


def test_text_async_iter_with_meta_data_yields_each_chunks_new_tokens(rng):
    import asyncio

    pieces = [random_words(rng, 1, 2) if rng.random() > 0.3 else "" for _ in range(200)]
    pieces[0] = "first"

    @sgl.function
    def prog(s):
        s += "x"
        s += sgl.gen("a", return_logprob=True)

    async def collect(state):
        return [pair async for pair in state.text_async_iter("a", return_meta_data=True)]

    state = prog.run(backend=BurstLogprobBackend(pieces), stream=True)
    pairs = asyncio.run(collect(state))
    assert [t for t, _ in pairs] == [p for p in pieces if p]  # every chunk once, none lost to a fast producer
    prev, ids = 0, []
    for text, meta in pairs:
        assert len(meta["output_token_logprobs"]) == meta["completion_tokens"] - prev == len(meta["output_top_logprobs"])
        assert meta["output_token_logprobs"][-1][2] == text  # a textless chunk's tokens ride with the next text
        prev = meta["completion_tokens"]
        ids += [e[1] for e in meta["output_token_logprobs"]]
    assert ids == list(range(100, 100 + len(ids)))
    assert len(state.get_meta_info("a")["output_token_logprobs"]) == len(pieces)

    async def whole_text(state):  # without a variable name: plain text, as in SGLang
        return [x async for x in state.text_async_iter(return_meta_data=True)]

    assert "".join(asyncio.run(whole_text(state))) == state.text()


def test_role_errors_and_var_scope(rng):
    be = FakeBackend(rng)

    @sgl.function
    def nested(s):
        s += sgl.user_begin()
        s += sgl.assistant_begin()

    with pytest.raises(ValueError, match="still open"):
        nested.run(backend=be)

    @sgl.function
    def scoped(s, w):
        with s.var_scope("v"):
            s += w
            s += sgl.gen("g", max_tokens=2)
        s += "!"

    w = random_words(rng)
    st = scoped.run(w=w, backend=be)
    assert st["v"] == w + st["g"] and st.text() == st["v"] + "!"


def test_default_backend_and_lazy_import(rng):
    be = FakeBackend(rng)

    @sgl.function
    def prog(s):
        s += "x" + sgl.gen("g")

    from sglang.lang import run as run_mod

    old = run_mod.get_default_backend()
    try:
        run_mod._default_backend[0] = None
        with pytest.raises(ValueError, match="no backend"):
            prog.run()
        sgl.set_default_backend(be)
        assert prog.run().text() == "x" + be.calls[-1][3]
        with pytest.raises(TypeError):
            sgl.set_default_backend("http://x")
    finally:
        run_mod._default_backend[0] = old
    code = ("import sys, sglang as sgl; assert 'torch' not in sys.modules and 'requests' not in sys.modules; "
            "assert callable(sgl.gen) and callable(sgl.function); assert sgl.Runtime.__name__ == 'Runtime'; "
            "assert sgl.RuntimeEndpoint.__name__ == 'RuntimeEndpoint' and 'Engine' in dir(sgl)")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
