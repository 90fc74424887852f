"""The grammar-backend contract used by the scheduler and the sampler.

Constrained decoding (regex / JSON schema / EBNF) follows SGLang's design on top of a
grammar engine (xgrammar: Dong et al. 2024, "XGrammar: Flexible and Efficient Structured
Generation Engine for Large Language Models"): a per-request *matcher* tracks the grammar
state; before each sampling step it writes the set of allowed next tokens into a packed
bitmask (bit ``j`` of int32 word ``i`` is token ``32 * i + j``); the sampler sets the
logits of disallowed tokens to ``-inf``; after sampling the scheduler feeds the token
back (:meth:`BaseGrammarObject.accept_token`).

Contract
--------
* A request names at most one grammar: ``("regex", pattern)``, ``("json_schema", schema
  text)`` or ``("ebnf", grammar text)`` (:func:`grammar_key`).
* :meth:`BaseGrammarBackend.get_future` never blocks on compilation: it returns a
  ``concurrent.futures.Future`` that resolves to a fresh :class:`BaseGrammarObject` (one
  per request: matchers hold per-request state) or raises ``ValueError`` naming the
  problem (invalid regex / schema / grammar). Compiled grammars are cached by key, so a
  repeated spec resolves at once.
* The scheduler keeps a request out of the running queue until its future is done; it
  never waits on one future while others could run.
* After every sampled token the scheduler calls ``accept_token(token)``. With the bitmask
  applied the token is always allowed; a ``False`` return (e.g. every allowed token was
  masked by something else) aborts the request.
* When the grammar is complete only its stop tokens (the model's EOS ids) are allowed;
  accepting one makes :meth:`BaseGrammarObject.is_terminated` true and the request
  finishes with ``{"type": "stop", "matched": <that token>}`` (SGLang's
  ``FINISH_MATCHED_TOKEN``), whatever ``ignore_eos`` says.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from concurrent.futures import Future
from typing import Any, Optional

import torch

logger = logging.getLogger(__name__)

GRAMMAR_KINDS = ("regex", "json_schema", "ebnf")
"""Sampling-parameter names that carry a grammar, in the order they are looked up."""

GrammarKey = tuple[str, str]
"""``(kind, spec)`` with kind one of :data:`GRAMMAR_KINDS`."""


def grammar_key(params: Any) -> Optional[GrammarKey]:
    """The grammar a request asks for, or None.

    Args:
        params: a :class:`~sglang.srt.sampling.sampling_params.SamplingParams` (or anything
            with ``regex`` / ``json_schema`` / ``ebnf`` attributes).
    Returns:
        ``(kind, spec)`` for the first non-None of regex, json_schema, ebnf.
    """
    for kind in GRAMMAR_KINDS:
        spec = getattr(params, kind, None)
        if spec is not None:
            return kind, spec
    return None


class BaseGrammarObject(ABC):
    """Per-request grammar state (a matcher over one compiled grammar)."""

    @abstractmethod
    def accept_token(self, token: int) -> bool:
        """Advance by one sampled token. Returns False (state unchanged) if the grammar rejects it."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """True once a stop token was accepted after a complete match (no token may follow)."""

    @abstractmethod
    def fill_vocab_mask(self, vocab_mask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into ``vocab_mask[row]``.

        Args:
            vocab_mask: [bs, ceil(vocab_size / 32)] int32 on CPU; bit ``j`` of word ``i`` set
                means token ``32 * i + j`` is allowed.
            row: the row of this request.
        """


class BaseGrammarBackend(ABC):
    """Compiles grammars off the caller's thread and caches them by key.

    Subclasses implement :meth:`get_future` and :meth:`reset`; :meth:`shutdown` releases threads.
    """

    @abstractmethod
    def get_future(self, key: GrammarKey) -> "Future[BaseGrammarObject]":
        """A future resolving to a new grammar object for ``key`` (see the module contract).

        The future raises ValueError (naming the problem) if the spec is invalid.
        """

    @abstractmethod
    def reset(self) -> None:
        """Drop cached compiled grammars (e.g. on ``/flush_cache``)."""

    def shutdown(self) -> None:
        """Stop the compile threads (pending compilations are cancelled). Default: nothing."""


def create_grammar_backend(server_args: Any, tokenizer: Any, vocab_size: int,
                           eos_token_ids: Any) -> Optional[BaseGrammarBackend]:
    """The backend ``--grammar-backend`` selects, or None when disabled.

    Args:
        server_args: :class:`~sglang.srt.server_args.ServerArgs` (``grammar_backend``:
            ``"xgrammar"`` or ``"none"``).
        tokenizer: the HF tokenizer; None (``--skip-tokenizer-init``) disables grammars.
        vocab_size: the model's logits width (may exceed the tokenizer's vocabulary).
        eos_token_ids: the model's EOS ids; they end a complete grammar.
    Returns:
        A backend, or None (requests with a grammar are then rejected with a 400).
    Raises:
        ValueError: an unknown backend name.
    """
    name = server_args.grammar_backend or "none"
    if name == "none":
        return None
    if tokenizer is None:
        logger.info("constrained decoding is off: the server runs without a tokenizer")
        return None
    if name == "xgrammar":
        from sglang.srt.constrained.xgrammar_backend import XGrammarBackend

        return XGrammarBackend(
            tokenizer, vocab_size, list(eos_token_ids or ()),
            json_any_whitespace=not server_args.constrained_json_disable_any_whitespace)
    raise ValueError(f"--grammar-backend={name!r} is invalid: use xgrammar or none")
