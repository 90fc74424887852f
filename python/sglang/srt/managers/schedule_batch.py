"""Per-request scheduler state (``Req``) and the assembly of one step's batch.

The KV of a request is tracked by a single number, ``kv_len``: the first
``kv_len`` tokens of ``fill_ids`` (prompt + generated tokens) have KV in the
pool at ``req_to_token[req_pool_idx, :kv_len]``. A step computes the next
``extend_len`` tokens of ``fill_ids``; once ``kv_len == len(fill_ids)`` the
logits of the last token are sampled and the new token is appended. Prefill,
chunked prefill, extend after a cached prefix and decode are all this one
rule with different ``extend_len``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from sglang.srt.model_executor.forward_batch_info import ForwardMode, ModelWorkerBatch


class Req:
    """One generation request inside the scheduler.

    Attributes:
        origin_input_ids: prompt token ids.
        output_ids: generated token ids (the last one has no KV yet).
        kv_len: tokens of ``fill_ids`` whose KV sits in the pool (see module doc).
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
        self.sent_output_len = 0
        self.sent_input_logprobs = False

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
        return len(self.origin_input_ids) + len(self.output_ids)

    @property
    def remaining_to_fill(self) -> int:
        return self.seqlen - self.kv_len

    def finished(self) -> bool:
        return self.finished_reason is not None

    def max_new_tokens(self) -> int:
        m = self.sampling_params.max_new_tokens
        return self.max_new_tokens_cap if m is None else min(m, self.max_new_tokens_cap)

    def remaining_new_tokens(self) -> int:
        return max(self.max_new_tokens() - len(self.output_ids), 0)

    def wants_input_logprobs(self) -> bool:
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
    """

    reqs: list[Req]
    out_cache_loc: torch.Tensor
    forward_mode: ForwardMode
    sampling_info: Any = None
    created: float = field(default_factory=time.monotonic)

    def to_model_worker_batch(self) -> ModelWorkerBatch:
        """Flatten into the scheduler -> worker contract."""
        input_ids: list[int] = []
        positions: list[int] = []
        rows_all, ids_all = [], []
        for r in self.reqs:
            fill = r.fill_ids
            input_ids.extend(fill[r.kv_len:r.kv_len + r.extend_len])
            positions.extend(range(r.kv_len, r.kv_len + r.extend_len))
            rows, ids = r.input_logprob_targets()
            rows_all.append(rows)
            ids_all.append(ids)
        return ModelWorkerBatch(
            forward_mode=self.forward_mode,
            input_ids=input_ids,
            positions=positions,
            out_cache_loc=self.out_cache_loc,
            req_pool_indices=[r.req_pool_idx for r in self.reqs],
            prefix_lens=[r.kv_len for r in self.reqs],
            extend_lens=[r.extend_len for r in self.reqs],
            seq_lens=[r.kv_len + r.extend_len for r in self.reqs],
            sample=[r.kv_len + r.extend_len == r.seqlen for r in self.reqs],
            return_logprob=any(r.return_logprob for r in self.reqs),
            input_logprob_indices=rows_all,
            input_logprob_token_ids=ids_all,
            top_logprobs_nums=[r.top_logprobs_num for r in self.reqs],
            sampling_info=self.sampling_info,
        )
