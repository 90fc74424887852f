"""Result processing for :class:`~sglang.srt.managers.scheduler.Scheduler`: apply a batch's sampled
tokens and logprobs to its requests, advance their grammars, check finish conditions, release
finished requests' KV, and gather the outputs to stream.

Contract with the scheduler (the mixin's host must provide): ``tree_cache``, ``outputs`` (requests
with news), ``tokenizer``, ``args.stream_interval``, ``stats_gen_tokens`` and ``_release(req)``.
"""

from __future__ import annotations

import logging

from sglang.srt.managers.io_struct import BatchTokenIDOut
from sglang.srt.managers.schedule_batch import Req, ScheduleBatch, build_token_id_out
from sglang.srt.sampling.finish import check_finish

logger = logging.getLogger(__name__)


class SchedulerOutputProcessorMixin:
    """Turns a launched batch's result into request state and streamed outputs (see the module doc)."""

    def process_batch_result(self, batch: ScheduleBatch, logits_out, sample_out) -> None:
        """Apply a launched batch's result: input logprobs, prefix caching of finished chunks, and
        for sampling rows the new token (finish checks, grammar, release, streaming). Requests that
        finished meanwhile (abort, or a finish found in the previous result) drop their token."""
        next_ids = sample_out.next_token_ids.tolist()
        lps = sample_out.logprobs.tolist() if sample_out.logprobs is not None else None
        for i, req in enumerate(batch.reqs):
            if logits_out.input_token_logprobs is not None and logits_out.input_token_logprobs[i]:
                req.input_token_logprobs.extend(zip(logits_out.input_token_logprobs[i], batch.input_logprob_ids[i]))
                if req.top_logprobs_num:
                    req.input_top_logprobs.extend(logits_out.input_top_logprobs[i])
                tids_in = getattr(logits_out, "input_token_ids_logprobs", None)
                if req.token_ids_logprob and tids_in:
                    req.input_token_ids_logprobs.extend(tids_in[i])
            if req.finished():  # aborted while in flight, or finished by the previous result
                continue
            if not batch.sample[i]:  # a prefill chunk that is not the last (cached at launch, or now)
                if i not in batch.chunk_cached:
                    self.tree_cache.cache_unfinished_req(req)
                continue
            if req.wants_input_logprobs():
                req.sent_input_logprobs = True  # the prompt has been fully computed
            if req.max_new_tokens() == 0:  # prefill only (scoring, input logprobs): nothing is generated
                req.finished_reason = {"type": "length", "length": 0}
                self._release(req)
                self.outputs.append(req)
                continue
            req.pending_slots.pop(0)
            tok = next_ids[i]
            req.output_ids.append(tok)
            self.stats_gen_tokens += 1
            if req.return_logprob:
                req.output_token_logprobs.append((lps[i] if lps else 0.0, tok))
                if req.top_logprobs_num:
                    req.output_top_logprobs.append(list(sample_out.top_logprobs[i][: req.top_logprobs_num]))
                if req.token_ids_logprob:
                    tids = getattr(sample_out, "token_ids_logprobs", None)
                    req.output_token_ids_logprobs.append(list(tids[i]) if tids and tids[i] is not None else [])
            req.finished_reason = check_finish(req.output_ids, req.sampling_params, req.eos_token_ids,
                                               self.tokenizer, req.max_new_tokens())
            row_errors = getattr(sample_out, "row_errors", None)
            if row_errors and i in row_errors:  # its custom logit processor failed: fail closed
                req.finished_reason = {"type": "abort", "message": row_errors[i], "status_code": 400}
            if req.grammar is not None:
                self._advance_grammar(req, tok)
            if req.finished():
                if self.disagg is not None and self.disagg.hold(req):
                    if req in self.running:  # prefill role: the KV stays until the decode side has it; the
                        self.running.remove(req)  # connector finishes the request later (disaggregation/prefill.py)
                    continue
                self._release(req)
            if req.finished() or req.stream or req.sent_output_len == 0:  # first token: TTFT
                self.outputs.append(req)

    def _advance_grammar(self, req: Req, tok: int) -> None:
        """Feed the sampled token to the request's grammar (xgrammar semantics, as SGLang):
        a rejected token aborts the request; a terminated grammar finishes it, matched on the token."""
        if not req.grammar.accept_token(tok):
            logger.warning("request %s: grammar rejected token %d; aborting it", req.rid, tok)
            req.finished_reason = {"type": "abort",
                                   "message": f"the grammar ({req.grammar_key[0]}) rejected the sampled token {tok}"}
        elif req.finished_reason is None and req.grammar.is_terminated():
            req.finished_reason = {"type": "stop", "matched": tok}

    def collect_outputs(self) -> list[BatchTokenIDOut]:
        """Turn the requests with news into (at most) one BatchTokenIDOut."""
        reqs, seen = [], set()
        for r in self.outputs:
            if id(r) in seen:
                continue
            seen.add(id(r))
            new = len(r.output_ids) - r.sent_output_len
            # the first token is always reported (also without streaming): it times TTFT in /metrics
            if r.finished() or (r.stream and new >= self.args.stream_interval) or (new and r.sent_output_len == 0):
                reqs.append(r)
        self.outputs = [r for r in self.outputs if id(r) not in {id(x) for x in reqs} and not r.finished()]
        if not reqs:
            return []
        return [build_token_id_out(reqs)]
