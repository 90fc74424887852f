"""The scheduler: continuous batching over a paged KV pool with a radix prefix cache.

Each step (:meth:`Scheduler.step`):
  1. every running request decodes one token (KV slots allocated first;
     when the pool is full, prefix-cache entries are evicted and, if that is
     not enough, the request with the most remaining work is retracted: its
     KV goes into the prefix cache and it waits to be prefilled again);
  2. waiting requests are admitted by policy (fcfs / lpm) while the step's
     token budget (chunked prefill size) and the free KV (after reserving
     room for the running requests' future tokens) allow; one request may be
     split into chunks;
  3. decodes and prefill chunks run together as one (mixed) batch; with
     ``--disable-mixed-chunk`` (SGLang's default) an admitted prefill batch
     runs alone and the decodes continue in the next step;
  4. tokens are sampled, finish conditions checked, finished requests return
     their KV to the cache at once, outputs are streamed to the detokenizer.

Constrained decoding: a request with a regex / json_schema / ebnf waits in
``grammar_queue`` (not ``waiting``) until its grammar, compiled on the grammar
backend's threads, is ready; other requests keep running meanwhile. Its sampled
tokens are fed to the grammar, and it finishes with ``{"type": "stop",
"matched": <token>}`` once the grammar terminates (see
``constrained/base_grammar_backend.py``).
Overlap scheduling (on by default on CUDA; ``--disable-overlap-schedule``; see
``model_executor/overlap_worker.py`` for the policy and the future-token placeholders): each step
builds and launches batch i+1 *before* processing batch i's result, so the CPU work of scheduling
overlaps the forward. Consequences, all handled here:
  * KV bookkeeping advances at launch (``kv_len``), tokens are appended at result time; meanwhile
    they are *pending* (``Req.pending_slots``) and fed to the next batch as placeholders;
  * results lag one step: a request found finished (EOS, stop string, abort) may already sit in the
    next batch; that batch's token for it is discarded, and ``_release`` frees the KV computed past
    ``Req.committed_kv_len()``, so the cache ends exactly as without overlap; a request that will
    surely hit its length limit is not decoded again;
  * the step falls back to processing the in-flight result *before* scheduling when the next batch
    needs it: a request of the in-flight batch has a grammar (its next bitmask needs the accepted
    token), frequency/presence/repetition penalties (they read the output tokens), or a prefill
    chunk that is not its last and could not be cached at launch (below); and when the KV pool is
    full (retraction only happens with nothing in flight). Outputs are identical either way.
  * a prefill chunk that is not its request's last goes into the prefix cache right at launch (as SGLang caches
    the chunked request while scheduling the next batch): its tokens are known, its KV is computed by the
    in-flight forward before any later forward reads it (one stream), so the next batch needs no result. When
    the tree already holds some of those tokens under another request's slots (inserting would free this
    request's duplicates and rewrite its slot map under the running forward), the chunk waits for the result as
    before. ``SGLANG_CHUNK_CACHE_AT_LAUNCH=0`` always waits (the behaviour before).
DP attention with a MoE model (``runner.dp_attention.lockstep``): every forward is a collective over the DP ranks, so
each step, after this rank picked its batch, the ranks agree on the step (``sglang.srt.dp_attention``: one CPU
all-gather of the batches' token counts); a rank without a batch runs an idle one (``ForwardMode.IDLE``) when another
rank has tokens, and nobody runs a forward when nobody has. Each rank keeps its own queues, radix cache, chunked
prefill, retraction and overlap.
The ZMQ process loop around it lives in ``scheduler_process.py``; result processing in
``scheduler_output_processor.py``; the grammar queue in ``scheduler_grammar.py``; request intake
(add, abort) in ``scheduler_intake.py``.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Optional

import torch

from sglang.srt.constrained.base_grammar_backend import create_grammar_backend
from sglang.srt.managers.io_struct import BatchTokenIDOut, SchedulerStats
from sglang.srt.managers.schedule_batch import PendingTokensView, Req, ScheduleBatch
from sglang.srt.managers.schedule_policy import PrefillBudget, order_waiting_queue
from sglang.srt.managers.scheduler_grammar import SchedulerGrammarMixin
from sglang.srt.managers.scheduler_intake import SchedulerIntakeMixin
from sglang.srt.managers.scheduler_output_processor import SchedulerOutputProcessorMixin
from sglang.srt.forward_batch_info import ForwardMode
from sglang.srt.metrics.step_trace import StepTracer
from sglang.srt.model_executor.overlap_worker import OverlapWorker, overlap_schedule_enabled

logger = logging.getLogger(__name__)

INIT_NEW_TOKEN_RATIO = 0.7  # SGLang's SGLANG_INIT_NEW_TOKEN_RATIO, times --schedule-conservativeness (capped at 1)
MIN_NEW_TOKEN_RATIO_FACTOR = 0.14  # SGLang's: the floor is this fraction of the initial ratio
NEW_TOKEN_RATIO_DECAY_STEPS = 600  # SGLang's: decode steps from the initial ratio to the floor
RESERVE_CLIP = 4096  # at most this many future tokens are reserved per request
DEFAULT_CHUNKED_PREFILL_SIZE = 8192  # --chunked-prefill-size when unset (-1 disables chunking)
GRAMMAR_IDLE_WAIT_S = 0.005  # with nothing to run, wait this long for a grammar compilation per step
CHUNK_CACHE_AT_LAUNCH_ENV = "SGLANG_CHUNK_CACHE_AT_LAUNCH"


def chunk_cache_at_launch_enabled() -> bool:
    """``SGLANG_CHUNK_CACHE_AT_LAUNCH``: ``1`` (default) caches a non-final prefill chunk when it is launched (see
    the module doc); ``0`` caches it when its result is processed, so overlap scheduling waits for that result
    before building the next batch. Raises ValueError for another value."""
    val = os.environ.get(CHUNK_CACHE_AT_LAUNCH_ENV, "1").strip() or "1"
    if val not in ("0", "1"):
        raise ValueError(f"{CHUNK_CACHE_AT_LAUNCH_ENV}={val!r}: use 1 (cache chunks at launch, default) or 0")
    return val == "1"


class Scheduler(SchedulerIntakeMixin, SchedulerGrammarMixin, SchedulerOutputProcessorMixin):
    """Batches requests and drives a :class:`~sglang.srt.model_executor.model_runner.ModelRunner`.

    Args:
        server_args: the frozen :class:`ServerArgs`.
        runner: the model worker: ``kv_cache`` (the :class:`~sglang.srt.mem_cache.kv_cache.KVCache`, the only
            KV object the scheduler talks to), ``max_running_requests``, ``forward(ModelWorkerBatch)``,
            ``make_sampling_info``, ``model_config``, ``device``, ``tp_size``, ``parallel_state`` (None
            without TP).
        tokenizer: used for stop strings and grammars (None with ``--skip-tokenizer-init``).
        grammar_backend: overrides the backend ``--grammar-backend`` selects (tests); by default
            one is created from ``server_args``, the tokenizer and the model config.
        overlap: force overlap scheduling on or off (tests); None applies
            :func:`~sglang.srt.model_executor.overlap_worker.overlap_schedule_enabled`.
        connector: the worker's :class:`~sglang.srt.deployment.plan.ConnectorSpec` (PD prefill/decode; None when
            aggregated): its scheduler side is made by the technique package, and overlap is off with it (the
            connector's hooks assume the plain loop).
        device_futures: with overlap, resolve future tokens on the device (None: on CUDA; see
            ``overlap_worker.py``); tests and benchmarks force it.
    Call :meth:`close` to stop the overlap worker thread.
    """

    def __init__(self, server_args, runner, tokenizer=None, grammar_backend=None, overlap=None, connector=None,
                 device_futures=None):
        self.args = server_args
        self.runner = runner
        self.tokenizer = tokenizer
        self.model_config = runner.model_config
        self.kv = runner.kv_cache
        # request rows free at start (the runner keeps its CUDA-graph padding row): all free again when idle
        self.req_rows = self.kv.req_to_token_pool.available_size()
        self.tree_cache = self.kv.prefix_cache
        self.page_size = server_args.page_size
        cps = server_args.chunked_prefill_size
        if cps is None:
            cps = DEFAULT_CHUNKED_PREFILL_SIZE
        self.chunked_prefill_size = None if cps == -1 else cps
        self.max_running = runner.max_running_requests

        self.waiting: list[Req] = []
        self.grammar_queue: list[Req] = []  # requests whose grammar is still compiling
        self.grammar_backend = grammar_backend if grammar_backend is not None else create_grammar_backend(
            server_args, tokenizer, self.model_config.vocab_size, self.model_config.eos_token_ids)
        self.running: list[Req] = []
        self.chunked_req: Optional[Req] = None
        self.outputs: list[Req] = []  # requests with something to report after this step
        # the future-token reserve of admission (SGLang's new-token ratio: starts conservative, decays per decode
        # step to its floor, jumps up on a retraction)
        self.init_new_token_ratio = min(INIT_NEW_TOKEN_RATIO * server_args.schedule_conservativeness, 1.0)
        self.min_new_token_ratio = self.init_new_token_ratio * MIN_NEW_TOKEN_RATIO_FACTOR
        self.new_token_ratio_decay = (self.init_new_token_ratio - self.min_new_token_ratio) / NEW_TOKEN_RATIO_DECAY_STEPS
        self.new_token_ratio = self.init_new_token_ratio
        # prefill chunks ride in the decode step (MIXED batches) unless --disable-mixed-chunk (see ServerArgs)
        self.mixed_chunk = server_args.resolved_enable_mixed_chunk
        self.stats_prompt_tokens = 0
        self.stats_cached_tokens = 0
        self.stats_gen_tokens = 0
        self.forward_ct = 0

        self.overlap = overlap_schedule_enabled(server_args, runner.device, False if connector else overlap)
        self.cache_chunk_at_launch = chunk_cache_at_launch_enabled()
        self.inflight: Optional[ScheduleBatch] = None  # launched, result not processed yet (overlap)
        self.launching: Optional[ScheduleBatch] = None  # the batch whose inline forward runs now (fail_all)
        self.future_ring_size = 4 * (self.max_running + 2)  # > the sampled rows of two batches
        self.future_ct = 0
        self.worker = OverlapWorker(runner, self.future_ring_size, device_futures) if self.overlap else None
        self.control_group = self._make_control_group()
        self.dp_sync = self._make_dp_sync()
        self.tracer = StepTracer.from_server_args(server_args, getattr(runner, "device", "cpu"),
                                                  getattr(runner, "tp_rank", 0) or 0)
        logger.info("overlap schedule %s, mixed chunk %s", "on" if self.overlap else "off",
                    "on" if self.mixed_chunk else "off")
        # prefill/decode disaggregation: the scheduler side of the KV connector (None when aggregated)
        self.disagg = None
        if connector is not None:
            from sglang.srt.disaggregation.deploy import make_connector

            self.disagg = make_connector(connector, self)

    def _make_control_group(self):
        """The CPU group for the scheduler's own collectives (message broadcast, grammar agreement).

        On CPU the TP device group is the gloo world group, which the overlap worker uses for the
        model's collectives at the same time: ranks would interleave the two threads' collectives
        differently. Overlap then gets a separate gloo group (created on every rank at the same point).
        """
        ps = self.runner.parallel_state
        if ps is None or self.runner.tp_size <= 1:
            return None
        if self.overlap and ps.cpu_group is ps.device_group:
            import torch.distributed as dist

            return dist.new_group(backend="gloo")
        return ps.cpu_group

    def _make_dp_sync(self):
        """The DP step agreement (:class:`~sglang.srt.dp_attention.step_sync.DpStepSync`) when the runner is a DP
        attention rank of a MoE model; None otherwise (ranks of a dense model never wait for each other)."""
        dp = getattr(self.runner, "dp_attention", None)
        if dp is None or not dp.lockstep:
            return None
        graphs = getattr(self.runner, "cuda_graph_runner", None)
        self.dp_graph_max_bs = graphs.max_bs if graphs is not None else None
        dispatcher = getattr(self.runner, "moe_dispatcher", None)  # --moe-a2a-backend: its low-latency capacity
        capacity = dispatcher.config.max_tokens_low_latency if dispatcher is not None else None
        return dp.step_sync(self.runner.dp_graph_size if graphs is not None else None, capacity)

    def close(self) -> None:
        """Process the in-flight batch and stop the overlap worker thread."""
        self.sync()
        self.tracer.close()
        if self.worker is not None:
            self.worker.close()
        if self.disagg is not None:
            self.disagg.close()

    def _release(self, req: Req) -> None:
        """Give a finished/aborted request's KV and pool slot back (through the prefix cache)."""
        if req.req_pool_idx is not None:
            self._drop_uncommitted_kv(req)
            self.tree_cache.cache_finished_req(req)
            req.req_pool_idx = None
        if req in self.running:
            self.running.remove(req)
        if self.chunked_req is req:
            self.chunked_req = None

    def _drop_uncommitted_kv(self, req: Req) -> None:
        """Free the KV that launched batches computed past :meth:`Req.committed_kv_len` (tokens that
        overlap scheduling ran before the request was known to be finished). Whole pages past the
        kept ones go back to the allocator; the kept partial page goes with the prefix cache's tail."""
        keep = req.committed_kv_len()
        if keep >= req.kv_len:
            return
        start = -(-keep // self.page_size) * self.page_size
        if start < req.kv_len:
            self.kv.free_slots(self.kv.slots_of(req.req_pool_idx, start, req.kv_len))
        req.kv_len = keep

    # ---- one step ------------------------------------------------------------
    def step(self) -> list[BatchTokenIDOut]:
        """Schedule and launch one batch, process the previous (overlap) or this batch's result,
        and return the outputs to stream (possibly empty)."""
        self.tracer.begin_step()
        if self.disagg is not None:
            self.apply_connector(self.disagg.poll())  # KV hand-offs: messages, transfers, timeouts (disaggregation/)
        if self.inflight is not None and self._needs_result_first(self.inflight):
            self.sync()
        batch = self.get_next_batch()
        if self.dp_sync is not None:  # DP attention: every rank runs a forward (maybe idle) or none does
            from sglang.srt.dp_attention.scheduler_hook import agree_batch

            batch = agree_batch(self.dp_sync, batch, self.has_work(), self.dp_graph_max_bs, self.runner.device,
                                getattr(getattr(self.runner, "executor", None), "dp_split_ok", None))
        prev, self.inflight = self.inflight, None
        if batch is not None:
            self._launch(batch)
            if self.disagg is not None:  # KV hand-offs while the forward runs (decode: post/poll READs)
                self.disagg.during_forward(self._forward_probe())
        if prev is not None:
            self._process(prev)
        if batch is not None and not self.overlap:
            self._process(batch)
        elif batch is not None:
            self.inflight = batch
        elif prev is None and self.grammar_queue:  # only compilations pending: do not spin
            self._wait_for_grammars(GRAMMAR_IDLE_WAIT_S)
        return self.collect_outputs()

    def _forward_probe(self):
        """Non-blocking "has the launched forward finished?" for the PD connector: a CUDA event recorded now on the
        current stream (its ``query``), or ``lambda: True`` off CUDA (the forward ran synchronously)."""
        if torch.device(getattr(self.runner, "device", "cpu")).type != "cuda":
            return lambda: True
        ev = torch.cuda.Event()
        ev.record()
        return ev.query

    def sync(self) -> None:
        """Wait for the in-flight batch (overlap) and process its result; a no-op without one.
        Its outputs are reported by the next :meth:`step` / :meth:`collect_outputs`."""
        batch, self.inflight = self.inflight, None
        if batch is not None:
            self._process(batch)

    def _needs_result_first(self, batch: ScheduleBatch) -> bool:
        """Whether the next batch cannot be built before ``batch``'s result (see the module doc)."""
        for i, (req, sample) in enumerate(zip(batch.reqs, batch.sample)):
            if req.finished():
                continue
            p = req.sampling_params
            if (not sample and i not in batch.chunk_cached) or req.grammar is not None or p.frequency_penalty != 0.0 \
                    or p.presence_penalty != 0.0 or p.repetition_penalty != 1.0:
                return True
        return False

    def _launch(self, batch: ScheduleBatch) -> None:
        """Hand ``batch`` to the runner (inline) or the overlap worker, then advance the bookkeeping:
        KV counts as written, sampled tokens become pending, requests that will decode join ``running``."""
        mwb = batch.to_model_worker_batch()
        self._trace_launch(batch, mwb)
        if self.disagg is not None:
            self.disagg.before_forward(batch, mwb)  # push mode arms the layerwise KV writes of this forward
        if not self.overlap:
            self.launching = batch
            batch.result = self.runner.forward(mwb)
            self.launching = None
        batch.future_slots = [-1] * len(batch.reqs)
        running = {id(r) for r in self.running}
        for i, req in enumerate(batch.reqs):
            req.kv_len += req.extend_len
            req.extend_len = 0
            if not batch.sample[i] or req.max_new_tokens() == 0:
                continue
            slot = self.future_ct % self.future_ring_size
            self.future_ct += 1
            batch.future_slots[i] = slot
            req.pending_slots.append(slot)
            if id(req) not in running:
                self.running.append(req)
        if self.overlap:
            batch.handle = self.worker.submit(mwb, batch.future_slots)
            if self.cache_chunk_at_launch:
                for i, req in enumerate(batch.reqs):
                    if not batch.sample[i] and self._cache_chunk_now(req):
                        batch.chunk_cached.add(i)
        self.forward_ct += 1
        batch.forward_index = self.forward_ct

    def _cache_chunk_now(self, req: Req) -> bool:
        """Cache a just-launched non-final prefill chunk of ``req`` (its KV still being computed) unless the tree
        already holds any of its new tokens under other slots (then False: it is cached with its result)."""
        probe = getattr(self.tree_cache, "cached_prefix_len", None)
        if probe is not None:
            n = req.kv_len // self.page_size * self.page_size
            if probe(req.fill_ids[:n]) != len(req.prefix_indices):
                return False
        self.tree_cache.cache_unfinished_req(req)
        return True

    def _trace_launch(self, batch: ScheduleBatch, mwb) -> None:
        """Hand a batch about to launch to the step tracer (log lines; trace record and CUDA events when on). A DP
        attention idle batch (no requests) is not traced."""
        if batch.forward_mode == ForwardMode.IDLE:
            return
        graphs = getattr(self.runner, "cuda_graph_runner", None)
        graph = graphs is not None and graphs.can_run(mwb)
        total = max(self.kv.max_total_tokens, 1)
        usage = (total - self.kv.available_size() - self.kv.evictable_size()) / total
        cached = sum(len(r.prefix_indices) for r, e in zip(batch.reqs, mwb.extend_lens)
                     if e > 1 and r.prefix_indices is not None and r.kv_len == len(r.prefix_indices))
        self.tracer.on_launch(batch, mwb, graph, len(self.running), len(self.waiting), usage, cached)

    def _process(self, batch: ScheduleBatch) -> None:
        t0 = self.tracer.clock()
        logits_out, sample_out = batch.result if batch.handle is None else batch.handle.result()
        t1 = self.tracer.clock()
        batch.handle = batch.result = None
        self.process_batch_result(batch, logits_out, sample_out)
        self.tracer.on_processed(batch, batch.forward_index, t1 - t0, self.tracer.clock() - t1)

    def _sampling_reqs(self, reqs: list[Req]) -> list:
        """What ``make_sampling_info`` reads per request; with pending tokens, a view whose
        ``output_ids`` has the right length (their values matter only for penalties, and requests
        with penalties are never built with pending tokens: see :meth:`_needs_result_first`)."""
        if not any(r.pending_slots for r in reqs):
            return reqs
        return [PendingTokensView(r) if r.pending_slots else r for r in reqs]

    def has_work(self) -> bool:
        """True while requests are waiting, running, chunked, waiting for a grammar or in flight."""
        return bool(self.waiting or self.running or self.chunked_req or self.grammar_queue or self.inflight
                    or (self.disagg is not None and self.disagg.has_work()))

    def may_block(self) -> bool:
        """Whether the process loop may wait for messages: nothing to do here, and (DP attention) no rank had work at
        the last step agreement (the ranks step together)."""
        return not self.has_work() and (self.dp_sync is None or not self.dp_sync.peers_busy)

    def get_next_batch(self) -> Optional[ScheduleBatch]:
        """The next batch: running requests' decode tokens plus newly admitted prefills (EXTEND, DECODE or MIXED), with
        their KV slots and sampling info; None when there is nothing to run. Without mixed chunks
        (``--disable-mixed-chunk``) a step is either the prefill batch (when one can be admitted) or the decode batch."""
        self._poll_grammar_queue()
        if self.mixed_chunk:
            decode_reqs, decode_loc = self._prepare_decode()
            prefill_reqs, prefill_locs = self._admit_prefills(len(decode_reqs))
        else:  # SGLang's default: a prefill batch runs alone, the running requests decode in the next steps
            prefill_reqs, prefill_locs = self._admit_prefills(0)
            decode_reqs, decode_loc = self._prepare_decode() if not prefill_reqs else ([], None)
        reqs = prefill_reqs + decode_reqs
        if not reqs:
            return None
        mode = ForwardMode.DECODE if not prefill_reqs else (ForwardMode.MIXED if decode_reqs else ForwardMode.EXTEND)
        locs = prefill_locs + ([decode_loc] if decode_reqs else [])
        out_loc = torch.cat(locs) if len(locs) > 1 else locs[0]
        return ScheduleBatch(reqs=reqs, out_cache_loc=out_loc, forward_mode=mode,
                             sampling_info=self.runner.make_sampling_info(self._sampling_reqs(reqs)))

    def _prepare_decode(self) -> tuple[list[Req], Optional[torch.Tensor]]:
        """Allocate one KV slot per running request, retracting requests if the pool is full.

        Requests whose pending tokens reach their length limit are skipped (they finish when the
        in-flight result arrives). A full pool with a batch in flight first processes that result
        (it may finish requests); retraction happens only with nothing in flight."""
        while True:
            reqs = [r for r in self.running if r.remaining_new_tokens() > 0]
            if not reqs:
                return [], None
            for r in reqs:
                r.extend_len = 1
            loc = self._alloc_extend(reqs)
            if loc is not None:
                self.new_token_ratio = max(self.new_token_ratio - self.new_token_ratio_decay, self.min_new_token_ratio)
                return reqs, loc
            for r in reqs:
                r.extend_len = 0
            if self.inflight is not None:
                self.sync()
            else:
                self._retract_one()

    def _retract_one(self) -> None:
        victim = max(self.running, key=lambda r: (r.remaining_new_tokens(), r.arrival_time))
        logger.info("KV cache full: retracting %s (running=%d, free=%d)", victim.rid, len(self.running),
                    self.kv.available_size())
        self.running.remove(victim)
        self._drop_uncommitted_kv(victim)
        self.tree_cache.cache_finished_req(victim)
        victim.reset_for_retract()
        self.waiting.insert(0, victim)
        self.new_token_ratio = min(1.0, self.new_token_ratio + 0.1)
        self.tracer.retractions += 1

    def _alloc_extend(self, reqs: list[Req]) -> Optional[torch.Tensor]:
        """KV slots for each request's next ``extend_len`` tokens; evicts cache entries if needed."""
        prefix = [r.kv_len for r in reqs]
        seq = [r.kv_len + r.extend_len for r in reqs]
        return self.kv.alloc_extend([r.req_pool_idx for r in reqs], prefix, seq, self._last_locs(reqs))

    def _last_locs(self, reqs: list[Req]) -> list[int]:
        """Slot of each request's position ``kv_len - 1`` when it sits inside a partly filled page (the
        allocator continues that page), else -1. With ``page_size == 1`` no page is ever partly filled,
        so nothing is read; otherwise one gather and one device-to-host copy for the whole batch."""
        last = [-1] * len(reqs)
        if self.page_size == 1:
            return last
        need = [i for i, r in enumerate(reqs) if r.kv_len % self.page_size != 0]
        if need:
            slots = self.kv.last_slots([reqs[i].req_pool_idx for i in need], [reqs[i].kv_len - 1 for i in need])
            for i, v in zip(need, slots):
                last[i] = v
        return last

    def _budget(self, num_decode: int) -> PrefillBudget:
        step = self.args.max_prefill_tokens
        if self.chunked_prefill_size is not None:
            step = min(step, max(self.chunked_prefill_size - num_decode, 0))
        reserve = sum(min(r.remaining_new_tokens(), RESERVE_CLIP) for r in self.running) * self.new_token_ratio
        free = self.kv.available_size() + self.kv.evictable_size()
        return PrefillBudget(step_tokens=step, kv_tokens=int(free - reserve),
                             new_reqs=self.max_running - len(self.running) - (1 if self.chunked_req else 0),
                             chunk=self.chunked_prefill_size is not None, page_size=self.page_size)

    def _admit_prefills(self, num_decode: int) -> tuple[list[Req], list[torch.Tensor]]:
        budget = self._budget(num_decode)
        admitted: list[Req] = []
        locs: list[torch.Tensor] = []
        if self.chunked_req is not None:  # the split request continues first
            req = self.chunked_req
            budget.new_reqs += 1
            n = budget.take(req.remaining_to_fill, self._reserve(req))
            if n is None:
                return [], []
            req.extend_len = n
            loc = self._alloc_extend([req])
            if loc is None:
                return [], []
            admitted.append(req)
            locs.append(loc)
            self.chunked_req = None if n == req.remaining_to_fill else req
            if self.chunked_req is not None:
                return admitted, locs
        for req in order_waiting_queue(self.args.schedule_policy, self.waiting, self.tree_cache):
            if not self._admit_one(req, budget, admitted, locs):
                break
        return admitted, locs

    def _reserve(self, req: Req) -> int:
        return int(min(req.remaining_new_tokens(), RESERVE_CLIP) * self.new_token_ratio)

    def _admit_one(self, req: Req, budget: PrefillBudget, admitted: list, locs: list) -> bool:
        row = self.kv.alloc_req_slot()
        if row is None:
            return False
        req.req_pool_idx = row
        match = self.tree_cache.match_prefix(req.fill_ids[: req.max_prefix_len()])
        prefix = match.device_indices
        before = self.tree_cache.evictable_size()
        self.tree_cache.inc_lock_ref(match.last_node)
        budget.kv_tokens -= before - self.tree_cache.evictable_size()
        req.prefix_indices, req.last_node, req.kv_len = prefix, match.last_node, len(prefix)
        self.kv.set_prefix(req.req_pool_idx, prefix)
        n = budget.take(req.remaining_to_fill, self._reserve(req))
        loc = None
        if n is not None:
            req.extend_len = n
            loc = self._alloc_extend([req])
        if loc is None:  # undo: nothing admitted
            budget.kv_tokens += before - self.tree_cache.evictable_size()
            self.tree_cache.dec_lock_ref(match.last_node)
            self.kv.free_req_slot(req.req_pool_idx)
            req.reset_for_retract()
            req.num_retractions -= 1
            return False
        if not req.admitted_once:
            req.admitted_once = True
            req.admit_time = time.monotonic()
            req.cached_tokens = len(prefix)
            self.stats_prompt_tokens += len(req.origin_input_ids)
            self.stats_cached_tokens += len(prefix)
        self.waiting.remove(req)
        admitted.append(req)
        locs.append(loc)
        if n < req.remaining_to_fill:
            self.chunked_req = req
            return False  # one chunked request per step, and it ends the step's budget
        return True

    def stats(self) -> SchedulerStats:
        """Current load for the TokenizerManager: running/queued requests, token usage (0..1), used and total KV tokens,
        prefix-cache hit rate."""
        total = self.kv.max_total_tokens
        free = self.kv.available_size() + self.kv.evictable_size()
        used = total - self.kv.available_size()
        return SchedulerStats(
            num_running_reqs=len(self.running) + (1 if self.chunked_req else 0),
            num_queue_reqs=len(self.waiting) + len(self.grammar_queue), token_usage=(total - free) / max(total, 1),
            used_tokens=used, max_total_tokens=total,
            cache_hit_rate=self.stats_cached_tokens / max(self.stats_prompt_tokens, 1),
        )

    def flush_cache(self) -> tuple[bool, str]:
        """Reset the prefix cache; refused while requests are in flight."""
        if self.has_work():
            return False, "cannot flush the cache while requests are running or waiting"
        self.tree_cache.reset()
        self.new_token_ratio = self.init_new_token_ratio
        if self.grammar_backend is not None:
            self.grammar_backend.reset()
        return True, ""

    def _dp_state(self) -> dict:
        """DP attention: this scheduler's DP rank, whether the ranks step together, steps agreed and idle forwards."""
        dp = self.runner.dp_attention
        return {"dp_rank": dp.dp_rank, "dp_size": dp.dp_size, "dp_lockstep": self.dp_sync is not None,
                "dp_steps": self.dp_sync.steps if self.dp_sync else 0,
                "dp_idle_forwards": self.dp_sync.idle_forwards if self.dp_sync else 0}

    def internal_state(self) -> dict:
        """``/get_server_info`` internal state: the stats plus pool/cache sizes in tokens, limits and counters."""
        s = self.stats()
        return {
            "num_running_reqs": s.num_running_reqs, "num_waiting_reqs": s.num_queue_reqs,
            "token_usage": s.token_usage, "used_tokens": s.used_tokens,
            "available_tokens": self.kv.available_size(),
            "evictable_tokens": self.tree_cache.evictable_size(),
            "protected_tokens": self.tree_cache.protected_size(),
            "max_total_tokens": s.max_total_tokens, "max_running_requests": self.max_running,
            # request rows (req -> token map) held by requests: 0 when none holds one
            "used_req_slots": self.req_rows - self.kv.req_to_token_pool.available_size(),
            "cache_hit_rate": s.cache_hit_rate, "forward_ct": self.forward_ct,
            "num_grammar_queue_reqs": len(self.grammar_queue),
            "overlap_schedule": self.overlap,
            **(self.disagg.internal_state() if self.disagg is not None else {}),
            **(self._dp_state() if getattr(self.runner, "dp_attention", None) is not None else {}),
            **({"afd": ex.state()} if hasattr(ex := getattr(self.runner, "executor", None), "state") else {}),
        }
