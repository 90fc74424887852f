"""Per-request output state held by the TokenizerManager while a request is in flight.

CPU-only. One :class:`ReqState` per (sub-)request accumulates the detokenizer's deltas
(:class:`~sglang.srt.managers.io_struct.BatchStrOut`) and renders SGLang's ``/generate`` dict.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from sglang.srt.managers.generate_req import SingleGenerateReq
from sglang.srt.managers.io_struct import BatchStrOut


@dataclass
class ReqState:
    """Accumulated output of one in-flight request (owned by the event loop thread).

    Times are ``time.time()`` seconds; logprob entries are ``[logprob, token_id, text or None]``
    as SGLang returns them.
    """

    req: SingleGenerateReq
    input_ids: list[int]
    event: asyncio.Event  # shared by all requests of one generate_request call
    created_time: float
    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    finished: bool = False
    finish_reason: Optional[dict[str, Any]] = None
    finished_time: float = 0.0
    dirty: bool = False
    abort_requested: bool = False  # /abort_request named it: its final output comes from the scheduler
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    first_token_time: float = 0.0
    last_token_time: float = 0.0
    input_token_logprobs: list = field(default_factory=list)
    output_token_logprobs: list = field(default_factory=list)
    input_top_logprobs: list = field(default_factory=list)
    output_top_logprobs: list = field(default_factory=list)
    input_token_ids_logprobs: list = field(default_factory=list)
    output_token_ids_logprobs: list = field(default_factory=list)
    disagg_info: Optional[dict[str, Any]] = None  # disaggregated servers: transfer facts of the KV hand-off

    def add_logprobs(self, msg: BatchStrOut, i: int, token_text: Callable[[int], Optional[str]]) -> None:
        """Append row ``i`` of ``msg``'s logprobs (``(logprob, token_id)`` pairs) in SGLang's format;
        ``token_text`` maps an id to its text, used when the request set ``return_text_in_logprobs``."""
        wt = self.req.return_text_in_logprobs

        def fmt(entries) -> list:
            return [[lp, tid, token_text(tid) if wt else None] for lp, tid in entries]

        if msg.output_token_logprobs is not None and msg.output_token_logprobs[i] is not None:
            self.output_token_logprobs.extend(fmt(msg.output_token_logprobs[i]))
        if msg.output_top_logprobs is not None and msg.output_top_logprobs[i] is not None:
            self.output_top_logprobs.extend(None if e is None else fmt(e) for e in msg.output_top_logprobs[i])
        if msg.input_token_logprobs is not None and msg.input_token_logprobs[i] is not None:
            self.input_token_logprobs.extend(fmt(msg.input_token_logprobs[i]))
        if msg.input_top_logprobs is not None and msg.input_top_logprobs[i] is not None:
            self.input_top_logprobs.extend(None if e is None else fmt(e) for e in msg.input_top_logprobs[i])
        for src, dst in ((getattr(msg, "output_token_ids_logprobs", None), self.output_token_ids_logprobs),
                         (getattr(msg, "input_token_ids_logprobs", None), self.input_token_ids_logprobs)):
            if src is not None and src[i] is not None:
                dst.extend(None if e is None else fmt(e) for e in src[i])

    def to_output(self) -> dict[str, Any]:
        """SGLang's ``/generate`` dict: cumulative ``text`` and ``output_ids`` and a ``meta_info``
        (id, finish_reason, prompt/completion/cached tokens, e2e_latency in s, logprobs if asked, with
        ``output_token_logprobs_length`` = how many output logprob entries exist so far, and, for
        ``token_ids_logprob``, ``input_token_ids_logprobs`` / ``output_token_ids_logprobs``: per position
        the ``[logprob or None, id, text]`` entries of the requested ids))."""
        end = self.finished_time if self.finished_time else time.time()
        meta: dict[str, Any] = {
            "id": self.req.rid,
            "finish_reason": self.finish_reason,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "cached_tokens": self.cached_tokens,
            "e2e_latency": end - self.created_time,
        }
        if self.disagg_info is not None:
            meta["disaggregation"] = dict(self.disagg_info)
        if self.req.return_logprob:
            meta["input_token_logprobs"] = list(self.input_token_logprobs)
            meta["output_token_logprobs"] = list(self.output_token_logprobs)
            if self.req.top_logprobs_num > 0:
                meta["input_top_logprobs"] = list(self.input_top_logprobs)
                meta["output_top_logprobs"] = list(self.output_top_logprobs)
            if getattr(self.req, "token_ids_logprob", None):
                meta["input_token_ids_logprobs"] = list(self.input_token_ids_logprobs)
                meta["output_token_ids_logprobs"] = list(self.output_token_ids_logprobs)
            meta["output_token_logprobs_length"] = len(self.output_token_logprobs)
        return {"text": self.text, "output_ids": list(self.output_ids), "meta_info": meta}
