"""Request intake of :class:`~sglang.srt.managers.scheduler.Scheduler`: a tokenized request is validated
and queued (``waiting``, or ``grammar_queue`` while its grammar compiles, or the disaggregation connector's
transfer queue), and aborts take requests out of every queue, their KV returned at once.

Contract with the scheduler (the mixin's host must provide): ``model_config`` (``vocab_size``,
``context_len``, ``eos_token_ids``), ``tokenizer``, ``kv`` (``max_total_tokens``), ``grammar_backend``,
``waiting``, ``grammar_queue``, ``running``, ``chunked_req``, ``outputs``, ``disagg``, ``inflight``, ``launching``,
``tree_cache``, ``stats_prompt_tokens``, ``stats_cached_tokens``, ``_release(req)``, ``sync()`` and ``flush_cache()``.

The PD connector (``disagg``) never touches that state: its hooks return decisions
(:mod:`sglang.srt.disaggregation.connector`) that :meth:`SchedulerIntakeMixin.apply_connector` carries out.
"""

from __future__ import annotations

import logging
from typing import Optional

from sglang.srt.constrained.base_grammar_backend import grammar_key
from sglang.srt.managers.io_struct import AbortReq, TokenizedGenerateReqInput
from sglang.srt.managers.schedule_batch import Req
from sglang.srt.sampling.finish import check_finish
from sglang.srt.sampling.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class SchedulerIntakeMixin:
    """Adds requests to the scheduler's queues and aborts them."""

    def add_request(self, msg: TokenizedGenerateReqInput) -> Optional[Req]:
        """Queue a tokenized request. Invalid ones finish at once with an abort reason (HTTP 400)."""
        mc = self.model_config
        params = SamplingParams.from_dict(msg.sampling_params)
        params.verify(mc.vocab_size)
        params.normalize(self.tokenizer)
        cap = mc.context_len - len(msg.input_ids)
        req = Req(msg.rid, msg.input_ids, params, return_logprob=msg.return_logprob,
                  logprob_start_len=msg.logprob_start_len, top_logprobs_num=msg.top_logprobs_num,
                  stream=msg.stream, eos_token_ids=mc.eos_token_ids, max_new_tokens_cap=max(cap, 0))
        req.token_ids_logprob = msg.token_ids_logprob if msg.return_logprob else None
        req.custom_logit_processor = msg.custom_logit_processor
        error = None
        if not msg.input_ids:
            error = "the prompt is empty (input_ids has no tokens)"
        elif cap <= 0:
            error = f"The input ({len(msg.input_ids)} tokens) is longer than the model's context length ({mc.context_len} tokens)."
        elif len(msg.input_ids) + 1 > self.kv.max_total_tokens:
            error = f"The input ({len(msg.input_ids)} tokens) does not fit in the KV cache ({self.kv.max_total_tokens} tokens)."
        elif max(msg.input_ids) >= mc.vocab_size or min(msg.input_ids) < 0:
            error = f"input_ids contain a token id outside [0, {mc.vocab_size})"
        req.grammar_key = grammar_key(params)
        if error is None and req.grammar_key is not None and self.grammar_backend is None:
            error = (f"{req.grammar_key[0]} needs constrained decoding, which is disabled on this server "
                     "(--grammar-backend none or no tokenizer); restart with --grammar-backend xgrammar")
        if error:
            req.finished_reason = {"type": "abort", "message": error, "status_code": 400}
            self.outputs.append(req)
            return req
        if req.wants_input_logprobs() and req.logprob_start_len == 0:
            req.input_token_logprobs.append((None, req.origin_input_ids[0]))
            if req.top_logprobs_num:
                req.input_top_logprobs.append([])
            if req.token_ids_logprob:
                req.input_token_ids_logprobs.append([])
        if self.disagg is not None:  # queued, kept (decode transfer queue, push-mode wait) or rejected
            self.apply_connector(self.disagg.intercept(req, msg))
            return req
        self.enqueue(req)
        return req

    def enqueue(self, req: Req) -> None:
        """Queue an accepted request: behind its grammar's compilation, or straight into ``waiting``."""
        if req.grammar_key is not None:
            req.grammar_future = self.grammar_backend.get_future(req.grammar_key)
            self.grammar_queue.append(req)  # admitted by the next step's _poll_grammar_queue
        else:
            self.waiting.append(req)

    def abort(self, msg: AbortReq) -> None:
        """Abort one or all requests; their KV is returned immediately."""
        reason = {"type": "abort", "message": "aborted by the client", "status_code": 499}
        for queue in (self.waiting, self.grammar_queue):
            for req in list(queue):
                if msg.abort_all or req.rid == msg.rid:
                    queue.remove(req)
                    req.grammar_future = None
                    req.finished_reason = dict(reason)
                    self.outputs.append(req)
        for req in list(self.running) + ([self.chunked_req] if self.chunked_req else []):
            if msg.abort_all or req.rid == msg.rid:
                req.finished_reason = dict(reason)
                self._release(req)
                self.outputs.append(req)
        if self.disagg is not None:
            for rid in ([msg.rid] if not msg.abort_all else self.disagg.open_rids()):
                self.apply_connector(self.disagg.abort(rid))
        if self.inflight is not None and all(r.finished() for r in self.inflight.reqs):
            self.sync()  # nothing left to wait for but the forward itself

    def fail_all(self, message: str, status_code: int = 503) -> None:
        """A forward raised and no later one can succeed (AFD: an FFN worker is gone): every request this scheduler
        holds (waiting, compiling its grammar, running, chunked, in the failed or the in-flight batch) finishes with
        an abort (``status_code``, ``message``; reported by the next ``collect_outputs``) and its KV goes back, that of
        the failed forward included; then the prefix cache is reset (it may hold KV the failed forward half wrote), so
        the whole pool is free. The scheduler keeps answering control messages (``/get_server_info``, flush)."""
        reason = {"type": "abort", "message": message, "status_code": status_code}
        batches = [b for b in (self.launching, self.inflight) if b is not None]
        self.launching = self.inflight = None
        held = [*self.waiting, *self.grammar_queue, *self.running, *([self.chunked_req] if self.chunked_req else []),
                *(r for b in batches for r in b.reqs)]
        self.waiting.clear()
        self.grammar_queue.clear()
        seen: set[int] = set()
        for req in held:
            if id(req) in seen or (req.finished() and req.req_pool_idx is None):
                continue  # listed twice, or finished and released before
            seen.add(id(req))
            if req.extend_len:  # slots allocated for the failed inline forward (kv_len not advanced yet)
                req.kv_len += req.extend_len
                req.extend_len = 0
            req.grammar_future = None
            if not req.finished():
                req.finished_reason = dict(reason)
            self._release(req)
            self.outputs.append(req)
        for b in batches:
            b.handle = b.result = None  # their results never come
        ok, why = self.flush_cache()
        if not ok:
            logger.warning("fail_all: the prefix cache was not reset: %s", why)

    def apply_connector(self, decisions: list) -> None:
        """Carry out the PD connector's decisions in order (:mod:`sglang.srt.disaggregation.connector`): queue a
        request, finish one (KV back through the prefix cache, reported), or start decoding one whose prompt KV
        arrived. Raises TypeError for anything else."""
        from sglang.srt.disaggregation.connector import FinishRequest, QueueRequest, StartDecode

        for d in decisions:
            if isinstance(d, QueueRequest):
                self.enqueue(d.req)
            elif isinstance(d, FinishRequest):
                self._release(d.req)
                self.outputs.append(d.req)
            elif isinstance(d, StartDecode):
                self._start_decode(d.req, d.prompt_tokens, d.cached_tokens)
            else:
                raise TypeError(f"unknown connector decision {d!r}")

    def _start_decode(self, req: Req, prompt_tokens: int, cached_tokens: int) -> None:
        """A request whose prompt KV another server computed (in its ``req_pool_idx`` row, first token in
        ``output_ids``) continues as if it had prefilled here: the prefix-cache root is locked for it (the KV
        joins the tree when it ends), its first token is reported and it decodes, or is released at once when
        that token finished it."""
        match = self.tree_cache.match_prefix([])
        self.tree_cache.inc_lock_ref(match.last_node)
        req.prefix_indices, req.last_node = match.device_indices, match.last_node
        self.stats_prompt_tokens += prompt_tokens
        self.stats_cached_tokens += cached_tokens
        req.finished_reason = check_finish(req.output_ids, req.sampling_params, req.eos_token_ids, self.tokenizer,
                                           req.max_new_tokens())
        self.outputs.append(req)
        if req.finished():
            self._release(req)
        else:
            self.running.append(req)
