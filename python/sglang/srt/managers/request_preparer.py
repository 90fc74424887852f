"""Turn a ``/generate`` request into scheduler messages off the event loop, all or nothing.

The TokenizerManager's event loop must stay free for ``/health``, streams and other clients while a
request is expanded and tokenized: a 50 MB prompt took 95 s to tokenize on the loop, and ``n=1e30``
expanded forever on it. :class:`RequestPreparer` therefore

* bounds ``n`` (``--max-n``) before anything is expanded (:func:`~sglang.srt.entrypoints.request_limits.check_n`),
* rejects a text prompt that provably cannot fit the context before tokenizing it
  (:meth:`RequestPreparer.check_text_bound`),
* runs expansion, tokenization and validation of the whole request on one worker thread (one thread, so the
  tokenizer is never used concurrently by two preparations; HF fast tokenizers release the GIL while
  encoding), and
* encodes every message before returning, so a request whose later part is bad is rejected before its
  earlier parts are registered or sent (a rejected batch leaks nothing and keeps no ``rid`` busy).
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Optional

from sglang.srt.entrypoints.request_limits import check_n
from sglang.srt.managers.generate_req import GenerateReqInput, SingleGenerateReq
from sglang.srt.managers.io_struct import TokenizedGenerateReqInput, encode_msg
from sglang.srt.managers.req_state import ReqState
from sglang.srt.managers.request_extras import extra_fields

logger = logging.getLogger(__name__)

TEXT_BOUND_SLACK = 4
"""Safety factor of the byte bound: a prompt is refused untokenized only when it has more than
``slack * longest_token_bytes * context_len`` UTF-8 bytes (normalizers such as NFKC may shrink text by up
to ~3x before tokenization, so a factor of 1 could refuse a prompt that fits)."""


def longest_token_bytes(tokenizer) -> int:
    """An upper bound on the UTF-8 bytes of text one token can stand for: the longest vocabulary entry
    (vocabulary strings over-count: ``'▁'``/``'Ġ'`` markers and ``<0xNN>`` byte tokens are longer than the
    bytes they stand for).

    Args:
        tokenizer: a HF tokenizer with ``get_vocab()``.
    Returns:
        bytes (>= 1).
    """
    vocab = tokenizer.get_vocab()
    return max([len(k.encode("utf-8", errors="replace")) for k in vocab] + [1])


class RequestPreparer:
    """Expand, tokenize and validate requests on a worker thread.

    Args:
        prepare_one: ``SingleGenerateReq -> TokenizedGenerateReqInput`` (tokenize + validate one
            sequence; raises ValueError naming the field).
        tokenizer: the HF tokenizer, or None (``--skip-tokenizer-init``).
        context_len: the model's context length in tokens.
        max_n: the most samples per prompt (``--max-n``).
        grammar_enabled / grammar_validator: whether constrained decoding is on, and the
            :class:`~sglang.srt.constrained.xgrammar_backend.GrammarValidator` that checks specs.
    """

    def __init__(self, prepare_one: Callable[[SingleGenerateReq], TokenizedGenerateReqInput], tokenizer,
                 context_len: int, max_n: int, grammar_enabled: bool = False, grammar_validator=None) -> None:
        self.prepare_one = prepare_one
        self.grammar_enabled = grammar_enabled
        self.grammar_validator = grammar_validator
        self.tokenizer = tokenizer
        self.context_len = int(context_len)
        self.max_n = int(max_n)
        self._max_text_bytes: Optional[int] = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sglang-tokenize")

    # ---------------------------------------------------------------- checks
    def check_text_bound(self, text: str, field: str = "text") -> None:
        """Refuse ``text`` untokenized when even the longest tokens could not make it fit the context.

        Raises:
            ValueError: the prompt's UTF-8 size proves it is longer than the context (names ``field``).
        """
        if self.tokenizer is None or len(text) * 4 <= self.context_len:  # 4: most UTF-8 bytes per char
            return
        if self._max_text_bytes is None:
            self._max_text_bytes = TEXT_BOUND_SLACK * longest_token_bytes(self.tokenizer) * self.context_len
        if len(text) > self._max_text_bytes or len(text.encode("utf-8", errors="replace")) > self._max_text_bytes:
            raise ValueError(f"{field}: the prompt ({len(text)} characters) is longer than the model's context "
                             f"length ({self.context_len} tokens) could hold; shorten the prompt")

    def check_grammar(self, params) -> None:
        """Reject a constrained request before it is queued: grammars disabled, or an invalid
        regex / json_schema / ebnf (ValueError naming the problem; the HTTP layer answers 400)."""
        from sglang.srt.constrained.base_grammar_backend import grammar_key

        key = grammar_key(params)
        if key is None:
            return
        if not self.grammar_enabled:
            raise ValueError(f"{key[0]} needs constrained decoding, which is disabled on this server "
                             "(--grammar-backend none or --skip-tokenizer-init); restart with "
                             "--grammar-backend xgrammar")
        self.grammar_validator.validate(key)

    def prepare_sync(self, obj: GenerateReqInput) -> tuple[list[ReqState], list[TokenizedGenerateReqInput],
                                                           list[bytes]]:
        """Validate and expand ``obj``, tokenize every sequence, encode every message and build the output
        states (on the calling thread).

        Returns:
            ``(states, prepared, encoded)``: one entry per sequence (the states share one ``asyncio.Event``),
            ``encoded[i]`` the wire bytes of ``prepared[i]``.
        Raises:
            ValueError: the first problem (naming the field); nothing is registered or sent.
        """
        sps = obj.sampling_params if isinstance(obj.sampling_params, list) else [obj.sampling_params or {}]
        for sp in sps:
            if isinstance(sp, dict):
                check_n(sp.get("n"), self.max_n)
        singles = obj.normalize()
        prepared = [self.prepare_one(s) for s in singles]
        try:
            encoded = [encode_msg(p) for p in prepared]
        except (UnicodeEncodeError, OverflowError, TypeError) as e:  # the body checks make this rare
            raise ValueError(f"the request cannot be sent to the scheduler: {e}") from None
        event = asyncio.Event()  # binds to the loop on first use (Python >= 3.10)
        states = [ReqState(req=s, input_ids=p.input_ids, event=event, created_time=p.created_time,
                           prompt_tokens=len(p.input_ids)) for s, p in zip(singles, prepared)]
        return states, prepared, encoded

    async def prepare(self, obj: GenerateReqInput):
        """:meth:`prepare_sync` on the worker thread (the event loop stays free)."""
        return await self.run(self.prepare_sync, obj)

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(*args)`` on the tokenizer's worker thread and return its result (exceptions propagate)."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def close(self) -> None:
        """Stop the worker thread (a running preparation finishes; queued ones are dropped)."""
        self._executor.shutdown(wait=False, cancel_futures=True)


def tokenize_one(req: SingleGenerateReq, tokenizer, preparer: "RequestPreparer", *, vocab_size: int,
                 context_len: int, max_req_input_len: int, server_args) -> TokenizedGenerateReqInput:
    """Tokenize and validate one sequence of a ``/generate`` request (the TokenizerManager's ``prepare_one``).

    Args:
        req: one normalized sequence (text or ``input_ids``, sampling params, logprob options).
        tokenizer: the HF tokenizer, or None (``--skip-tokenizer-init``: only ``input_ids`` are accepted).
        preparer: the :class:`RequestPreparer` whose text bound and grammar checks apply.
        vocab_size / context_len / max_req_input_len: the scheduler's limits, in tokens.
        server_args: the frozen ``ServerArgs`` (for the optional request fields).
    Returns:
        The scheduler message, ``created_time`` in ``time.time()`` seconds.
    Raises:
        ValueError: bad input, naming the field and the limit.
    """
    from sglang.srt.sampling.sampling_params import SamplingParams

    if req.input_ids is not None:
        ids = req.input_ids
        for t in ids:
            if not 0 <= t < vocab_size:
                raise ValueError(f"input_ids must lie in [0, {vocab_size}) (the vocabulary size), got {t}")
    else:
        if tokenizer is None:
            raise ValueError("text needs a tokenizer but the server runs with --skip-tokenizer-init; "
                             "send input_ids instead")
        preparer.check_text_bound(req.text)
        ids = tokenizer.encode(req.text)
        if not ids:
            raise ValueError("text tokenizes to zero tokens; send a non-empty prompt")
    n = len(ids)
    if n >= context_len:
        raise ValueError(f"The input ({n} tokens) is longer than the model's context length "
                         f"({context_len} tokens).")
    if n > max_req_input_len:
        raise ValueError(f"The input ({n} tokens) is longer than the longest prompt this server "
                         f"accepts ({max_req_input_len} tokens); shorten the prompt.")
    params = SamplingParams.from_dict(req.sampling_params)
    params.verify(vocab_size)
    params.normalize(tokenizer)
    preparer.check_grammar(params)
    if params.max_new_tokens is not None and n + params.max_new_tokens > context_len:
        raise ValueError(
            f"Requested token count exceeds the model's maximum context length of {context_len} "
            f"tokens: {n} tokens from the input plus max_new_tokens={params.max_new_tokens}. "
            "Reduce max_new_tokens or the prompt.")
    if req.return_logprob and req.logprob_start_len >= n:
        raise ValueError(f"logprob_start_len ({req.logprob_start_len}) must be smaller than the "
                         f"prompt length ({n} tokens), or -1 for no input logprobs")
    if req.top_logprobs_num > vocab_size:
        raise ValueError(f"top_logprobs_num must be <= the vocabulary size {vocab_size}, "
                         f"got {req.top_logprobs_num}")
    return TokenizedGenerateReqInput(
        rid=req.rid, input_ids=list(ids), sampling_params=params.to_dict(), input_text=req.text,
        return_logprob=req.return_logprob,
        logprob_start_len=req.logprob_start_len if req.return_logprob else -1,
        top_logprobs_num=req.top_logprobs_num if req.return_logprob else 0,
        stream=req.stream, created_time=time.time(), bootstrap_host=req.bootstrap_host,
        bootstrap_port=req.bootstrap_port, bootstrap_room=req.bootstrap_room,
        **extra_fields(req, vocab_size, server_args))
