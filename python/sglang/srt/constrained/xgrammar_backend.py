"""Grammar backend on xgrammar (Dong et al. 2024, "XGrammar: Flexible and Efficient Structured
Generation Engine for Large Language Models", sec. 3: byte-level pushdown automata with an
adaptive token-mask cache).

* The tokenizer's vocabulary is turned into an ``xgrammar.TokenizerInfo`` once, lazily (on the
  first compilation, on a compile thread), with the model's vocabulary size (the logits width)
  and the model's EOS ids as stop tokens.
* One ``xgrammar.GrammarCompiler`` (thread-safe) compiles on a :class:`CompileCache` pool.
* Each request gets its own ``xgrammar.GrammarMatcher`` over the shared compiled grammar.
* JSON schemas allow any JSON whitespace between tokens (xgrammar's and SGLang's default) but at
  most :data:`DEFAULT_JSON_MAX_WHITESPACE` characters per gap: small models otherwise loop on
  whitespace forever (the output stays valid JSON either way). ``json_any_whitespace=False``
  (SGLang's ``--constrained-json-disable-any-whitespace``) forces compact separators.

:func:`validate_grammar_spec` parses a spec without a tokenizer (cheap) so the HTTP process can
answer an invalid regex / schema / grammar with a 400 before anything is queued.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future
from typing import Any, Optional

import torch

from sglang.srt.constrained.base_grammar_backend import (
    GRAMMAR_KINDS,
    BaseGrammarBackend,
    BaseGrammarObject,
    GrammarKey,
)
from sglang.srt.constrained.compile_cache import CompileCache
from sglang.srt.constrained.schema_refs import check_schema_refs
from sglang.srt.managers.backend_tokenizer import as_hf_tokenizer

logger = logging.getLogger(__name__)

DEFAULT_JSON_MAX_WHITESPACE = 16

_XGR_PREFIX = re.compile(r"^\s*(\[[^\]]*\]\s*)?(\S+\.(cc|h|cpp):\d+:\s*)?(Check failed: \([^)]*\) is false:\s*)?")
_KIND_NAMES = {"regex": "regex", "json_schema": "json_schema", "ebnf": "ebnf grammar"}


def _clean_error(e: BaseException) -> str:
    """xgrammar's message without its timestamp / C++ source location prefix."""
    return _XGR_PREFIX.sub("", str(e)).strip()


def _check_kind(kind: str, spec: Any) -> None:
    if kind not in GRAMMAR_KINDS:
        raise ValueError(f"unknown grammar kind {kind!r}; use one of {', '.join(GRAMMAR_KINDS)}")
    if not isinstance(spec, str):
        raise ValueError(f"{kind} must be a string, got {type(spec).__name__}")


def validate_grammar_spec(kind: str, spec: str) -> None:
    """Parse a grammar spec (no tokenizer needed) and raise if it is invalid.

    Args:
        kind: ``"regex"``, ``"json_schema"`` or ``"ebnf"``.
        spec: the regex, the JSON schema text, or the EBNF grammar (GBNF dialect, ``root`` rule).
    Raises:
        ValueError: naming the kind and the problem, e.g.
            ``"invalid regex '(abc': Regex parsing error at position 5: The parenthesis is not closed."``.
    """
    import xgrammar as xgr

    _check_kind(kind, spec)
    if kind == "json_schema":
        try:
            schema = json.loads(spec)
        except json.JSONDecodeError as e:
            raise ValueError(f"invalid json_schema: not valid JSON ({e})") from None
        except RecursionError:
            raise ValueError("invalid json_schema: nested too deeply to parse") from None
        if not isinstance(schema, (dict, bool)):
            raise ValueError(f"invalid json_schema: a schema must be a JSON object or boolean, "
                             f"got {type(schema).__name__}")
        check_schema_refs(schema)
    try:
        if kind == "regex":
            xgr.Grammar.from_regex(spec)
        elif kind == "json_schema":
            xgr.Grammar.from_json_schema(spec)
        else:
            xgr.Grammar.from_ebnf(spec)
    except RuntimeError as e:
        shown = spec if len(spec) <= 80 else spec[:77] + "..."
        raise ValueError(f"invalid {_KIND_NAMES[kind]} {shown!r}: {_clean_error(e)}") from None


class GrammarValidator:
    """:func:`validate_grammar_spec` with a bounded memo of the verdicts (one per HTTP process).

    Args:
        max_entries: most specs remembered (LRU).
    """

    def __init__(self, max_entries: int = 1024) -> None:
        self._max_entries = max_entries
        self._verdicts: "OrderedDict[GrammarKey, Optional[str]]" = OrderedDict()

    def validate(self, key: GrammarKey) -> None:
        """Raise ValueError (naming the problem) if ``key = (kind, spec)`` is invalid."""
        if key in self._verdicts:
            self._verdicts.move_to_end(key)
            error = self._verdicts[key]
        else:
            try:
                validate_grammar_spec(*key)
                error = None
            except ValueError as e:
                error = str(e)
            self._verdicts[key] = error
            while len(self._verdicts) > self._max_entries:
                self._verdicts.popitem(last=False)
        if error is not None:
            raise ValueError(error)


class XGrammarGrammar(BaseGrammarObject):
    """One request's xgrammar matcher (see :class:`BaseGrammarObject`)."""

    def __init__(self, matcher: Any, key: GrammarKey) -> None:
        self.matcher = matcher
        self.key = key

    def accept_token(self, token: int) -> bool:
        """Advance the matcher by ``token``; False (state unchanged) if the grammar rejects it."""
        return bool(self.matcher.accept_token(int(token)))

    def is_terminated(self) -> bool:
        """True once the matcher accepted a stop token after a complete match."""
        return bool(self.matcher.is_terminated())

    def fill_vocab_mask(self, vocab_mask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into bitmask row ``row`` (``[bs, ceil(vocab/32)]`` int32, CPU)."""
        self.matcher.fill_next_token_bitmask(vocab_mask, row)

    def __repr__(self) -> str:
        return f"XGrammarGrammar(kind={self.key[0]!r}, terminated={self.is_terminated()})"


class XGrammarBackend(BaseGrammarBackend):
    """xgrammar compilation with a compile cache on a small thread pool.

    Args:
        tokenizer: HF tokenizer of the served model, or a worker's
            :class:`~sglang.srt.managers.backend_tokenizer.BackendTokenizer` (its HF tokenizer is loaded when the
            first grammar compiles).
        vocab_size: the model's logits width (>= the tokenizer's vocabulary; extra ids are never allowed).
        eos_token_ids: stop tokens that end a complete grammar.
        num_threads: compile threads.
        cache_entries: compiled grammars kept (LRU).
        json_any_whitespace: JSON schemas allow whitespace between tokens (else ``", "`` / ``": "`` only).
        json_max_whitespace: most whitespace characters per gap when allowed (None = unbounded).
    """

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: list[int], *,
                 num_threads: int = 2, cache_entries: int = 1024, json_any_whitespace: bool = True,
                 json_max_whitespace: Optional[int] = DEFAULT_JSON_MAX_WHITESPACE) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = int(vocab_size)
        self.eos_token_ids = [int(t) for t in eos_token_ids]
        self.num_threads = num_threads
        self.json_any_whitespace = json_any_whitespace
        self.json_max_whitespace = json_max_whitespace
        self._compiler: Any = None
        self._compiler_lock = threading.Lock()
        self.cache: CompileCache[GrammarKey, Any] = CompileCache(self._compile, num_threads, cache_entries)

    def _get_compiler(self) -> Any:
        with self._compiler_lock:
            if self._compiler is None:
                import xgrammar as xgr

                info = xgr.TokenizerInfo.from_huggingface(  # a worker's backend tokenizer: the HF one, loaded now
                    as_hf_tokenizer(self.tokenizer), vocab_size=self.vocab_size,
                    stop_token_ids=self.eos_token_ids or None)
                self._compiler = xgr.GrammarCompiler(info, max_threads=self.num_threads)
                logger.info("xgrammar tokenizer info built (vocab %d, type %s, stop ids %s)",
                            info.vocab_size, info.vocab_type, list(info.stop_token_ids))
            return self._compiler

    def _compile(self, key: GrammarKey) -> Any:
        kind, spec = key
        _check_kind(kind, spec)
        compiler = self._get_compiler()
        try:
            if kind == "regex":
                return compiler.compile_regex(spec)
            if kind == "json_schema":
                return compiler.compile_json_schema(
                    spec, any_whitespace=self.json_any_whitespace,
                    max_whitespace_cnt=self.json_max_whitespace if self.json_any_whitespace else None)
            return compiler.compile_grammar(spec)
        except RuntimeError as e:
            shown = spec if len(spec) <= 80 else spec[:77] + "..."
            raise ValueError(f"invalid {_KIND_NAMES[kind]} {shown!r}: {_clean_error(e)}") from None

    def get_future(self, key: GrammarKey) -> "Future[BaseGrammarObject]":
        """A future resolving to a new :class:`XGrammarGrammar` for ``key`` (compiled once, cached); it raises
        ValueError if compilation fails."""
        out: Future = Future()
        compiled = self.cache.get(key)

        def done(f: Future) -> None:
            """Wrap the compiled grammar in a matcher, or deliver the failure to ``out`` as ValueError."""
            try:
                import xgrammar as xgr

                out.set_result(XGrammarGrammar(xgr.GrammarMatcher(f.result()), key))
            except BaseException as e:  # noqa: BLE001 - delivered to the waiting request
                out.set_exception(e if isinstance(e, ValueError) else ValueError(
                    f"grammar compilation failed: {type(e).__name__}: {e}"))

        compiled.add_done_callback(done)
        return out

    def reset(self) -> None:
        """Drop the compile cache and xgrammar's compiler cache."""
        self.cache.clear()
        with self._compiler_lock:
            if self._compiler is not None:
                self._compiler.clear_cache()

    def shutdown(self) -> None:
        """Stop the compile threads."""
        self.cache.shutdown()
