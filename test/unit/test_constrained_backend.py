"""Grammar validation, the compile cache, and the xgrammar backend on the stories260K tokenizer."""

from __future__ import annotations

import json
import os
import random
import re
import sys
import threading
import time

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from conftest import shared_path  # noqa: E402

from sglang.srt.constrained.base_grammar_backend import create_grammar_backend, grammar_key  # noqa: E402
from sglang.srt.constrained.bitmask import allocate_token_bitmask, unpack_token_bitmask  # noqa: E402
from sglang.srt.constrained.compile_cache import CompileCache  # noqa: E402
from sglang.srt.constrained.xgrammar_backend import (  # noqa: E402
    GrammarValidator,
    XGrammarBackend,
    validate_grammar_spec,
)
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402
from sglang.srt.server_args import ServerArgs  # noqa: E402


# ------------------------------------------------------------------ validation
@pytest.mark.parametrize("kind,spec,needle", [
    ("regex", "(abc", "parenthesis is not closed"),
    ("regex", "[z-a]", "lower bound is larger"),
    ("json_schema", "{not json", "not valid JSON"),
    ("json_schema", "[1, 2]", "must be a JSON object"),
    ("json_schema", '{"type": "foo"}', 'Unsupported type "foo"'),
    ("ebnf", "root ::= foo", 'Rule "foo" is not defined'),
])
def test_invalid_specs_name_the_problem(kind, spec, needle):
    with pytest.raises(ValueError) as e:
        validate_grammar_spec(kind, spec)
    msg = str(e.value)
    assert needle in msg and msg.startswith("invalid ")
    assert ".cc:" not in msg  # no C++ source location


@pytest.mark.parametrize("kind,spec", [
    ("regex", r"[0-9]{3}-[a-z]+"),
    ("json_schema", json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}})),
    ("ebnf", 'root ::= "yes" | "no"'),
])
def test_valid_specs_pass(kind, spec):
    validate_grammar_spec(kind, spec)
    v = GrammarValidator()
    v.validate((kind, spec))
    v.validate((kind, spec))  # memoized path


def test_validator_memoizes_errors():
    v = GrammarValidator(max_entries=2)
    for _ in range(2):
        with pytest.raises(ValueError, match="parenthesis"):
            v.validate(("regex", "(x"))
    v.validate(("regex", "a"))
    v.validate(("regex", "b"))  # evicts "(x"
    with pytest.raises(ValueError, match="parenthesis"):
        v.validate(("regex", "(x"))


def test_grammar_key_picks_the_set_field():
    assert grammar_key(SamplingParams()) is None
    assert grammar_key(SamplingParams(regex="a+")) == ("regex", "a+")
    assert grammar_key(SamplingParams(json_schema="{}")) == ("json_schema", "{}")
    assert grammar_key(SamplingParams(ebnf='root ::= "a"')) == ("ebnf", 'root ::= "a"')


# --------------------------------------------------------------- compile cache
def test_compile_cache_runs_off_thread_once_per_key():
    gate = threading.Event()
    calls: list[tuple[str, str]] = []
    callers: list[str] = []

    def compile_fn(key):
        callers.append(threading.current_thread().name)
        gate.wait(10)
        calls.append(key)
        if key[1] == "bad":
            raise ValueError("bad spec")
        return f"compiled:{key[1]}"

    cache = CompileCache(compile_fn, num_threads=2, max_entries=8)
    try:
        t0 = time.monotonic()
        f1 = cache.get(("regex", "a"))
        f2 = cache.get(("regex", "a"))
        fb = cache.get(("regex", "bad"))
        assert time.monotonic() - t0 < 1.0 and not f1.done()  # get() never waits for compilation
        assert f1 is f2
        gate.set()
        assert f1.result(10) == "compiled:a"
        with pytest.raises(ValueError, match="bad spec"):
            fb.result(10)
        with pytest.raises(ValueError):  # failures are cached, not recompiled
            cache.get(("regex", "bad")).result(10)
        assert sorted(calls) == [("regex", "a"), ("regex", "bad")]
        assert all(name.startswith("grammar-compile") for name in callers)
        assert cache.hits == 2 and cache.misses == 2
    finally:
        cache.shutdown()


def test_compile_cache_lru_eviction():
    cache = CompileCache(lambda k: k * 2, num_threads=1, max_entries=2)
    try:
        cache.get(1).result(5)
        cache.get(2).result(5)
        cache.get(1)  # 1 is now most recent
        cache.get(3).result(5)
        assert 1 in cache and 3 in cache and 2 not in cache and len(cache) == 2
        cache.clear()
        assert len(cache) == 0
    finally:
        cache.shutdown()
    with pytest.raises(ValueError):
        CompileCache(lambda k: k, num_threads=0)


# ---------------------------------------------------------- xgrammar backend
@pytest.fixture(scope="module")
def tokenizer():
    from sglang.srt.utils.common import get_tokenizer

    return get_tokenizer(shared_path("models", "stories260K"), False)


@pytest.fixture(scope="module")
def backend(tokenizer):
    b = XGrammarBackend(tokenizer, 512, [tokenizer.eos_token_id])
    yield b
    b.shutdown()


def random_walk(grammar, tokenizer, rng: random.Random, vocab: int = 512, max_steps: int = 200) -> list[int]:
    """Accept uniformly random allowed tokens until the grammar terminates."""
    out = []
    for _ in range(max_steps):
        mask = allocate_token_bitmask(1, vocab)
        grammar.fill_vocab_mask(mask, 0)
        allowed = unpack_token_bitmask(mask, vocab)[0].nonzero().view(-1).tolist()
        assert allowed, "a live grammar always allows some token"
        tok = rng.choice(allowed)
        assert grammar.accept_token(tok)
        out.append(tok)
        if grammar.is_terminated():
            return out
    raise AssertionError("grammar did not terminate")


def decode(tokenizer, ids):
    return tokenizer.decode(ids, skip_special_tokens=True)


def test_random_walks_match_the_regex(backend, tokenizer):
    pattern = r"(cat|dog)s? [0-9]{1,3}"
    for seed in range(4):
        g = backend.get_future(("regex", pattern)).result(30)
        ids = random_walk(g, tokenizer, random.Random(seed))
        assert ids[-1] == tokenizer.eos_token_id
        assert re.fullmatch(pattern, decode(tokenizer, ids[:-1]))


def test_random_walks_satisfy_the_json_schema(backend, tokenizer):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9},
                                               "ok": {"type": "boolean"}},
              "required": ["n", "ok"], "additionalProperties": False}
    for seed in range(3):
        g = backend.get_future(("json_schema", json.dumps(schema))).result(30)
        ids = random_walk(g, tokenizer, random.Random(seed), max_steps=400)
        obj = json.loads(decode(tokenizer, ids[:-1]))
        assert set(obj) == {"n", "ok"} and 0 <= obj["n"] <= 9 and isinstance(obj["ok"], bool)


def test_each_request_gets_its_own_matcher(backend, tokenizer):
    key = ("ebnf", 'root ::= "yes" | "no"')
    a = backend.get_future(key).result(30)
    b = backend.get_future(key).result(30)
    assert a is not b
    walk = random_walk(a, tokenizer, random.Random(0))
    assert decode(tokenizer, walk[:-1]) in ("yes", "no")
    assert not b.is_terminated()


def test_rejected_token_returns_false(backend, tokenizer):
    g = backend.get_future(("regex", "[0-9]+")).result(30)
    letter = tokenizer.convert_tokens_to_ids("a") if "a" in tokenizer.get_vocab() else 100
    mask = allocate_token_bitmask(1, 512)
    g.fill_vocab_mask(mask, 0)
    assert not bool(unpack_token_bitmask(mask, 512)[0, letter])
    assert g.accept_token(letter) is False


def test_invalid_spec_future_raises(backend):
    with pytest.raises(ValueError, match="parenthesis"):
        backend.get_future(("regex", "(oops")).result(30)


def test_tokens_beyond_the_tokenizer_are_never_allowed(tokenizer):
    b = XGrammarBackend(tokenizer, 640, [tokenizer.eos_token_id])  # model vocab padded past the tokenizer's 512
    try:
        g = b.get_future(("regex", ".+")).result(30)
        mask = allocate_token_bitmask(1, 640)
        g.fill_vocab_mask(mask, 0)
        allowed = unpack_token_bitmask(mask, 640)[0]
        assert allowed[:512].any() and not allowed[512:].any()
    finally:
        b.shutdown()


def test_create_backend_respects_flag(tokenizer):
    assert create_grammar_backend(ServerArgs(grammar_backend="none"), tokenizer, 512, [2]) is None
    assert create_grammar_backend(ServerArgs(), None, 512, [2]) is None
    b = create_grammar_backend(ServerArgs(), tokenizer, 512, [2])
    try:
        assert isinstance(b, XGrammarBackend)
    finally:
        b.shutdown()


# ------------------------------------------------------- tokenizer manager
def _tokenizer_manager(grammar_backend: str):
    import shutil

    from sglang.srt.managers.tokenizer_manager import TokenizerManager
    from sglang.srt.server_args import PortArgs

    args = ServerArgs(model_path=shared_path("models", "stories260K"), grammar_backend=grammar_backend)
    ports = PortArgs.init_new()
    tm = TokenizerManager(args, ports, {"context_len": 512, "max_total_tokens": 4096, "vocab_size": 512,
                                        "max_req_input_len": 511})
    return tm, lambda: (tm.close(), shutil.rmtree(ports.ipc_dir, ignore_errors=True))


def _single(sampling_params):
    from sglang.srt.managers.generate_req import GenerateReqInput

    return GenerateReqInput.from_dict({"text": "Once upon a time", "sampling_params": sampling_params}).normalize()[0]


def test_tokenizer_manager_validates_grammars_before_queueing():
    tm, close = _tokenizer_manager("xgrammar")
    try:
        msg = tm._prepare(_single({"regex": "[0-9]+"}))
        assert msg.sampling_params["regex"] == "[0-9]+"
        with pytest.raises(ValueError, match=r"invalid regex '\(abc'.*parenthesis"):
            tm._prepare(_single({"regex": "(abc"}))
        with pytest.raises(ValueError, match="invalid json_schema.*not valid JSON"):
            tm._prepare(_single({"json_schema": "{"}))
    finally:
        close()


def test_tokenizer_manager_rejects_grammars_when_disabled():
    tm, close = _tokenizer_manager("none")
    try:
        with pytest.raises(ValueError, match="--grammar-backend none"):
            tm._prepare(_single({"ebnf": 'root ::= "a"'}))
        assert tm._prepare(_single({"max_new_tokens": 3})).sampling_params["max_new_tokens"] == 3
    finally:
        close()
