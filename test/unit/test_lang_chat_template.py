"""Chat-role programs render exactly as transformers' ``apply_chat_template`` with the real Llama-3 and
Qwen2 tokenizers (random conversations, run through the interpreter), with both renderers
(the tokenizer's own and our Jinja environment fed the template text, as a server field would)."""

from __future__ import annotations

import os
import random
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from conftest import shared_path  # noqa: E402
from test_lang_interpreter import FakeBackend, random_words  # noqa: E402

import sglang as sgl  # noqa: E402
from sglang.lang.chat_template import (  # noqa: E402
    default_chat_template,
    from_template,
    from_tokenizer,
)


def _tokenizer(name: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(shared_path("tokenizers", name))


@sgl.function
def conversation(s, turns, with_system, snapshots):
    """``turns`` user/assistant pairs; assistant turns are generated (fake backend) or fixed text."""
    if with_system:
        s += sgl.system(with_system)
    for user_text, fixed_reply in turns:
        with s.user():
            s += user_text
        s += sgl.assistant_begin()
        snapshots.append((s.messages(), s.text()))  # right after the generation prompt
        s += fixed_reply if fixed_reply else sgl.gen(max_tokens=8)
        s += sgl.assistant_end()


@pytest.mark.parametrize("name", ["llama3", "qwen2"])
@pytest.mark.parametrize("renderer", ["tokenizer", "jinja"])
@pytest.mark.parametrize("trial", range(3))
def test_roles_render_like_apply_chat_template(name, renderer, trial):
    tok = _tokenizer(name)
    if renderer == "tokenizer":
        template = from_tokenizer(tok)
    else:
        template = from_template(tok.chat_template, {"bos_token": tok.bos_token, "eos_token": tok.eos_token})
    rng = random.Random(random.randrange(1 << 30))
    turns = [(random_words(rng), random_words(rng) if rng.random() < 0.5 else None)
             for _ in range(rng.randint(1, 3))]
    system = random_words(rng) if trial % 2 == 0 else None
    snapshots: list = []
    state = conversation.run(turns=turns, with_system=system, snapshots=snapshots,
                             backend=FakeBackend(rng, template=template, lead=""))  # Llama-3 trims contents
    msgs = state.messages()
    assert [m["role"] for m in msgs] == (["system"] if system else []) + ["user", "assistant"] * len(turns)
    assert state.text() == tok.apply_chat_template(msgs, tokenize=False)
    for before, text in snapshots:
        assert text == tok.apply_chat_template(before, tokenize=False, add_generation_prompt=True)
    # each assistant turn holds exactly what was generated (or the fixed reply)
    gens = iter(c[3] for c in state.stream_executor.backend.calls)
    for (user_text, fixed), (u, a) in zip(turns, zip(msgs[int(bool(system))::2], msgs[int(bool(system)) + 1::2])):
        assert u["content"] == user_text and a["content"] == (fixed or next(gens))


def test_default_template_and_bos_strip():
    rng = random.Random(random.randrange(1 << 30))
    sys_text, user_text = random_words(rng), random_words(rng)

    @sgl.function
    def prog(s):
        s += sgl.system(sys_text)
        s += sgl.user(user_text)
        s += sgl.assistant(sgl.gen("r"))

    state = prog.run(backend=FakeBackend(rng, template=default_chat_template()))
    assert state.text() == f"system: {sys_text}\nuser: {user_text}\nassistant: {state['r']}\n"
    assert from_tokenizer(_tokenizer("llama3")).strip_prefix is None  # its tokenizer adds no BOS itself
    from transformers import AutoTokenizer

    stories = AutoTokenizer.from_pretrained(shared_path("models", "stories260K"))  # no template, adds BOS
    assert from_tokenizer(stories).name == "default"
    with_template = from_tokenizer(stories, chat_template="{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}")
    assert with_template.strip_prefix == stories.bos_token  # a rendered BOS would be doubled: strip it


def test_endpoint_uses_server_chat_template_field(monkeypatch):
    """When ``/get_model_info`` carries ``chat_template`` (+ ``bos_token``, ``add_bos_token``), the
    endpoint renders with it and strips a BOS the server's tokenizer would add again."""
    from sglang.lang.backend.runtime_endpoint import RuntimeEndpoint

    tok = _tokenizer("llama3")
    info = {"model_path": "m", "chat_template": tok.chat_template, "bos_token": tok.bos_token,
            "eos_token": tok.eos_token, "add_bos_token": True}
    monkeypatch.setattr(RuntimeEndpoint, "_request", lambda self, method, path, body=None, stream=False: info)
    ep = RuntimeEndpoint("http://127.0.0.1:9")
    template = ep.get_chat_template()
    rng = random.Random(random.randrange(1 << 30))
    msgs = [{"role": "user", "content": random_words(rng)}]
    text = template.role_begin([], "user", "") + msgs[0]["content"] + template.role_end(msgs)
    assert text == tok.apply_chat_template(msgs, tokenize=False)

    class S:
        text_ = text

    assert ep._prompt(S()) == text[len(tok.bos_token):]


def test_template_errors_name_the_roles():
    template = from_template("{% for m in messages %}{% if m.role == 'system' and not loop.first %}"
                             "{{ raise_exception('system must come first') }}{% endif %}{{ m.content }}{% endfor %}")
    with pytest.raises(ValueError, match="system must come first"):
        template.role_begin([{"role": "user", "content": "hi"}], "system", "hi")
    with pytest.raises(ValueError, match="does not compile"):
        from_template("{% for %}")
