"""Per-request scheduler state (``Req``) and the assembly of one step's batch.

The KV of a request is tracked by a single number, ``kv_len``: the first
``kv_len`` tokens of ``fill_ids`` (prompt + generated tokens) have KV in the
pool at ``req_to_token[req_pool_idx, :kv_len]``. A step computes the next
``extend_len`` tokens of ``fill_ids``; once ``kv_len == len(fill_ids)`` the
logits of the last token are sampled and the new token is appended. Prefill,
chunked prefill, extend after a cached prefix and decode are all this one
rule with different ``extend_len``.

Overlap scheduling (``model_executor/overlap_worker.py``) adds *pending* tokens: a launched batch
that samples for a request adds one entry to ``pending_slots`` (the future-token ring slot its token
will land in) until the scheduler processes that batch's result and appends the token to
``output_ids``. ``kv_len`` counts the KV of every launched batch, so it may exceed ``len(fill_ids)``
by the pending tokens; a batch built meanwhile feeds those tokens as placeholders
(:func:`~sglang.srt.model_executor.overlap_worker.placeholder_id`). Without overlap, pending tokens
exist only inside one step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from sglang.srt.managers.io_struct import BatchTokenIDOut
from sglang.srt.forward_batch_info import ForwardMode, ModelWorkerBatch
from sglang.srt.model_executor.overlap_worker import placeholder_id

DECODE_CONTEXT_TOKENS = 5  # prompt tokens the detokenizer decodes the output against (SGLang's surrounding offset)


class Req:
    """One generation request inside the scheduler.

    Attributes:
        origin_input_ids: prompt token ids.
        output_ids: generated token ids (the last one has no KV yet).
        kv_len: tokens of ``fill_ids`` (then of the pending tokens) whose KV sits in the pool or is
            written by a launched batch (see module doc).
        pending_slots: future-token ring slots of tokens sampled by launched batches whose results
            the scheduler has not processed yet (oldest first).
        prefix_indices / last_node: the cached prefix shared from the radix
            tree (owned by the prefix cache's lock protocol).
        cached_tokens: prompt tokens reused from the prefix cache at first admission.
        finished_reason: None while running, else an SGLang finish-reason dict.
        grammar_key: ``(kind, spec)`` of its regex / json_schema / ebnf constraint, or None.
        grammar_future: the pending compilation (a ``concurrent.futures.Future``) while the
            request waits in the scheduler's grammar queue; None afterwards.
        grammar: its grammar matcher (:class:`~sglang.srt.constrained.base_grammar_backend.
            BaseGrammarObject`) once compiled, or None for unconstrained requests.
    """

    def __init__(self, rid: str, origin_input_ids: list[int], sampling_params, *, return_logprob: bool = False,
                 logprob_start_len: int = -1, top_logprobs_num: int = 0, stream: bool = False,
                 eos_token_ids: tuple[int, ...] = (), max_new_tokens_cap: int = 1 << 30):
        self.rid = rid
        self.origin_input_ids = list(origin_input_ids)
        self.output_ids: list[int] = []
        self.sampling_params = sampling_params
        self.return_logprob = return_logprob
        self.logprob_start_len = logprob_start_len if return_logprob else -1
        self.top_logprobs_num = top_logprobs_num if return_logprob else 0
        self.stream = stream
        self.eos_token_ids = set(eos_token_ids)
        self.max_new_tokens_cap = max_new_tokens_cap
        self.arrival_time = time.monotonic()

        # KV state
        self.req_pool_idx: Optional[int] = None
        self.kv_len = 0
        self.prefix_indices = torch.empty(0, dtype=torch.int64)
        self.last_node: Any = None
        self.extend_len = 0
        self.pending_slots: list[int] = []
        self.cached_tokens = 0
        self.admitted_once = False
        self.num_retractions = 0

        # results
        self.finished_reason: Optional[dict[str, Any]] = None
        self.to_abort: Optional[dict[str, Any]] = None
        self.input_token_logprobs: list[tuple[Optional[float], int]] = []
        self.input_top_logprobs: list[list[tuple[float, int]]] = []
        self.output_token_logprobs: list[tuple[float, int]] = []
        self.output_top_logprobs: list[list[tuple[float, int]]] = []
        self.token_ids_logprob: Optional[list[int]] = None  # set by the scheduler from the request
        self.output_token_ids_logprobs: list[list[tuple[Optional[float], int]]] = []
        self.input_token_ids_logprobs: list[list[tuple[Optional[float], int]]] = []
        self.custom_logit_processor: Optional[str] = None
        self.sent_output_len = 0
        self.sent_input_logprobs = False

        # prefill/decode disaggregation (``disaggregation/``): the request's room and its hand-off facts
        # (transfer bytes / reads / time, queue times) reported in meta_info["disaggregation"]
        self.bootstrap_room: Optional[int] = None
        self.disagg_info: Optional[dict[str, Any]] = None
        self.admit_time: float = 0.0

        # constrained decoding
        self.grammar_key: Optional[tuple[str, str]] = None
        self.grammar_future: Any = None
        self.grammar: Any = None

    # ---- token views ------------------------------------------------------
    @property
    def fill_ids(self) -> list[int]:
        """Prompt + generated tokens: every token whose KV must exist before sampling the next."""
        return self.origin_input_ids + self.output_ids

    @property
    def seqlen(self) -> int:
        """Known tokens: prompt plus generated (pending ones excluded)."""
        return len(self.origin_input_ids) + len(self.output_ids)

    @property
    def num_pending(self) -> int:
        """Tokens sampled by launched batches whose results are not processed yet."""
        return len(self.pending_slots)

    @property
    def total_len(self) -> int:
        """Known tokens plus pending ones (sampled by a launched batch, not yet processed)."""
        return len(self.origin_input_ids) + len(self.output_ids) + len(self.pending_slots)

    @property
    def remaining_to_fill(self) -> int:
        """Tokens of ``total_len`` whose KV is not yet in the pool or being written."""
        return self.total_len - self.kv_len

    def finished(self) -> bool:
        """True once a finish reason is set."""
        return self.finished_reason is not None

    def max_new_tokens(self) -> int:
        """The request's ``max_new_tokens`` (``max_new_tokens_cap`` when unset), capped at ``max_new_tokens_cap``."""
        m = self.sampling_params.max_new_tokens
        return self.max_new_tokens_cap if m is None else min(m, self.max_new_tokens_cap)

    def remaining_new_tokens(self) -> int:
        """Tokens it may still sample beyond the known and pending ones."""
        return max(self.max_new_tokens() - len(self.output_ids) - len(self.pending_slots), 0)

    def committed_kv_len(self) -> int:
        """KV worth keeping when the request stops: what a non-overlapped scheduler would hold,
        i.e. the known tokens except the newest output token (whose KV is computed by the step that
        samples the next one), never more than ``kv_len``."""
        known = self.seqlen - (1 if self.output_ids else 0)
        return min(self.kv_len, known)

    def wants_input_logprobs(self) -> bool:
        """True when logprobs were asked for prompt positions (``0 <= logprob_start_len < prompt length``)."""
        return self.logprob_start_len >= 0 and self.logprob_start_len < len(self.origin_input_ids)

    def max_prefix_len(self) -> int:
        """Longest prefix that may come from the cache: at least one token must be
        computed (to get logits), and rows whose input logprobs are wanted must be computed."""
        limit = self.seqlen - 1
        if self.wants_input_logprobs() and not self.sent_input_logprobs:
            limit = min(limit, max(self.logprob_start_len - 1, 0))
        return max(limit, 0)

    def reset_for_retract(self) -> None:
        """Drop all KV bookkeeping; the request will be prefilled again from its fill_ids."""
        self.req_pool_idx = None
        self.kv_len = 0
        self.prefix_indices = torch.empty(0, dtype=torch.int64)
        self.last_node = None
        self.extend_len = 0
        self.pending_slots = []
        self.num_retractions += 1

    def input_logprob_targets(self) -> tuple[list[int], list[int]]:
        """Relative rows of this step whose logits give input logprobs, and their target token ids.

        The logit at absolute position q predicts prompt token q+1; wanted for
        prompt positions ``logprob_start_len .. len(prompt)-1`` (position 0 has no logprob).
        """
        if not self.wants_input_logprobs() or self.sent_input_logprobs:
            return [], []
        prompt = self.origin_input_ids
        lo = max(self.logprob_start_len, 1)
        rows, ids = [], []
        for q in range(self.kv_len, self.kv_len + self.extend_len):
            if lo <= q + 1 < len(prompt):
                rows.append(q - self.kv_len)
                ids.append(prompt[q + 1])
        return rows, ids

    def __repr__(self) -> str:
        return f"Req(rid={self.rid!r}, prompt={len(self.origin_input_ids)}, out={len(self.output_ids)}, kv={self.kv_len})"


@dataclass
class ScheduleBatch:
    """The requests of one step and the KV slots allocated for their new tokens.

    ``reqs[i].extend_len`` new tokens run for request i; ``out_cache_loc`` holds
    the KV slot of each of them, concatenated in request order.

    :meth:`to_model_worker_batch` also records what the result processing needs once the requests
    have moved on (overlap scheduling processes a batch after the next one was built):
    ``sample[i]`` (row i samples a token), ``input_logprob_ids[i]`` (prompt ids its input logprobs
    score). The scheduler fills ``future_slots[i]`` (ring slot of row i's token, -1 if none) and
    ``handle`` (the overlap worker's future) or ``result`` (``(logits_out, sample_out)``) at launch;
    ``trace`` / ``trace_events`` hold the step-trace record and its CUDA events while tracing.
    """

    reqs: list[Req]
    out_cache_loc: torch.Tensor
    forward_mode: ForwardMode
    sampling_info: Any = None
    created: float = field(default_factory=time.monotonic)
    sample: list[bool] = field(default_factory=list)
    input_logprob_ids: list[list[int]] = field(default_factory=list)
    future_slots: list[int] = field(default_factory=list)
    handle: Any = None
    result: Any = None
    dp_step: Any = None  # DP attention: the agreed DpGlobalStep (sglang.srt.dp_attention.step_sync)
    forward_index: int = 0  # the scheduler's forward count at launch (1, 2, ...)
    trace: Optional[dict] = None  # the step-trace record while tracing (metrics/step_trace.py)
    trace_events: Any = None  # its (start, end) CUDA events
    chunk_cached: set = field(default_factory=set)  # rows whose non-final prefill chunk was cached at launch

    def to_model_worker_batch(self) -> ModelWorkerBatch:
        """Flatten into the scheduler -> worker contract.

        Input ids at positions past a request's known tokens (pending tokens) are placeholders
        ``-(slot+1)`` that the overlap worker resolves before the forward.
        """
        input_ids: list[int] = []
        positions: list[int] = []
        rows_all, ids_all = [], []
        for r in self.reqs:
            fill = r.fill_ids
            end = r.kv_len + r.extend_len
            input_ids.extend(fill[r.kv_len:end])
            for p in range(max(r.kv_len, len(fill)), end):
                input_ids.append(placeholder_id(r.pending_slots[p - len(fill)]))
            positions.extend(range(r.kv_len, end))
            rows, ids = r.input_logprob_targets()
            rows_all.append(rows)
            ids_all.append(ids)
        self.sample = [r.kv_len + r.extend_len == r.total_len for r in self.reqs]
        self.input_logprob_ids = ids_all
        return ModelWorkerBatch(
            forward_mode=self.forward_mode,
            input_ids=input_ids,
            positions=positions,
            out_cache_loc=self.out_cache_loc,
            req_pool_indices=[r.req_pool_idx for r in self.reqs],
            prefix_lens=[r.kv_len for r in self.reqs],
            extend_lens=[r.extend_len for r in self.reqs],
            seq_lens=[r.kv_len + r.extend_len for r in self.reqs],
            sample=list(self.sample),
            return_logprob=any(r.return_logprob for r in self.reqs),
            input_logprob_indices=rows_all,
            input_logprob_token_ids=ids_all,
            top_logprobs_nums=[r.top_logprobs_num for r in self.reqs],
            sampling_info=self.sampling_info,
            dp_step=self.dp_step,
        )


class PendingTokensView:
    """A request as ``make_sampling_info`` sees it while it has pending tokens: ``output_ids``
    padded with one placeholder value (0) per pending token (lengths drive seeded sampling and
    min_new_tokens; values are never read: the scheduler builds batches of requests with penalties
    only without pending tokens, see ``Scheduler._sampling_reqs``). Other attributes are the request's."""

    def __init__(self, req: Req):
        self._req = req
        self.output_ids = req.output_ids + [0] * len(req.pending_slots)

    def __getattr__(self, name: str):
        return getattr(self._req, name)


def build_token_id_out(reqs: list[Req]) -> BatchTokenIDOut:
    """Deltas of several requests since their last report (advances their sent offsets)."""
    out = BatchTokenIDOut(rids=[], finished_reasons=[], output_ids=[], prompt_tokens=[], completion_tokens=[],
                          cached_tokens=[], skip_special_tokens=[], spaces_between_special_tokens=[],
                          no_stop_trim=[], stop_strs=[], decode_prefix_ids=[], stop_regexes=[])
    if any(r.disagg_info is not None for r in reqs):
        out.disagg_info = [r.disagg_info if r.finished() or r.sent_output_len == 0 else None for r in reqs]
    any_lp = any(r.return_logprob for r in reqs)
    if any_lp:
        out.output_token_logprobs, out.output_top_logprobs = [], []
        out.output_token_ids_logprobs, out.input_token_ids_logprobs = [], []
        out.input_token_logprobs, out.input_top_logprobs = [], []
    for r in reqs:
        p = r.sampling_params
        start = r.sent_output_len
        out.rids.append(r.rid)
        out.finished_reasons.append(r.finished_reason)
        out.output_ids.append(r.output_ids[start:])
        out.prompt_tokens.append(len(r.origin_input_ids))
        out.completion_tokens.append(len(r.output_ids))
        out.cached_tokens.append(r.cached_tokens)
        out.skip_special_tokens.append(p.skip_special_tokens)
        out.spaces_between_special_tokens.append(p.spaces_between_special_tokens)
        out.no_stop_trim.append(p.no_stop_trim)
        out.stop_strs.append(list(getattr(p, "stop_strs", None) or []))
        out.stop_regexes.append(list(getattr(p, "stop_regex_strs", None) or []))
        out.decode_prefix_ids.append(r.origin_input_ids[-DECODE_CONTEXT_TOKENS:] if start == 0 else None)
        if any_lp:
            first = start == 0 and r.return_logprob
            out.output_token_logprobs.append(r.output_token_logprobs[start:] if r.return_logprob else None)
            out.output_top_logprobs.append(r.output_top_logprobs[start:] if r.top_logprobs_num else None)
            out.output_token_ids_logprobs.append(r.output_token_ids_logprobs[start:] if r.token_ids_logprob else None)
            out.input_token_ids_logprobs.append(r.input_token_ids_logprobs if first and r.token_ids_logprob
                                                and r.wants_input_logprobs() else None)
            out.input_token_logprobs.append(r.input_token_logprobs if first and r.wants_input_logprobs() else None)
            out.input_top_logprobs.append(r.input_top_logprobs if first and r.top_logprobs_num and r.wants_input_logprobs() else None)
        r.sent_output_len = len(r.output_ids)
    return out
