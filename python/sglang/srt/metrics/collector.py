"""Prometheus metrics of the HTTP process (``GET /metrics`` with ``--enable-metrics``).

Names follow SGLang (``sglang:`` prefix, a ``model_name`` label). Latency
histograms and token counters are fed by the TokenizerManager as outputs
arrive; the gauges mirror the scheduler's periodic
:class:`~sglang.srt.managers.io_struct.SchedulerStats`. Every metric lives in
a private ``CollectorRegistry`` owned by one :class:`MetricsCollector`, so
several servers (or tests) in one process never collide.
"""

from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST

logger = logging.getLogger(__name__)

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 15.0, 20.0, 30.0, 60.0)
_ITL_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.035, 0.04, 0.06, 0.08,
                0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.0, 5.0)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)


class MetricsCollector:
    """Owns the server's Prometheus metrics.

    Args:
        model_name: value of the ``model_name`` label on every metric.

    All times are seconds (float); token counts are ints >= 0.
    """

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._labels = {"model_name": model_name}
        lab = ["model_name"]
        reg = self.registry
        self._ttft = Histogram("sglang:time_to_first_token_seconds", "Time to first token (s).",
                               lab, buckets=_TTFT_BUCKETS, registry=reg)
        self._itl = Histogram("sglang:inter_token_latency_seconds", "Latency between output tokens (s).",
                              lab, buckets=_ITL_BUCKETS, registry=reg)
        self._e2e = Histogram("sglang:e2e_request_latency_seconds", "End-to-end request latency (s).",
                              lab, buckets=_E2E_BUCKETS, registry=reg)
        # prometheus_client appends "_total" to counter names.
        self._prompt_tokens = Counter("sglang:prompt_tokens", "Prompt tokens processed.", lab, registry=reg)
        self._gen_tokens = Counter("sglang:generation_tokens", "Output tokens generated.", lab, registry=reg)
        self._num_requests = Counter("sglang:num_requests", "Requests finished.", lab, registry=reg)
        self._running = Gauge("sglang:num_running_reqs", "Requests in the running batch.", lab, registry=reg)
        self._queued = Gauge("sglang:num_queue_reqs", "Requests waiting in the queue.", lab, registry=reg)
        self._usage = Gauge("sglang:token_usage", "Fraction of KV slots in use (0..1).", lab, registry=reg)
        self._used = Gauge("sglang:num_used_tokens", "KV slots in use.", lab, registry=reg)
        self._hit = Gauge("sglang:cache_hit_rate", "Prefix-cache hit rate (0..1).", lab, registry=reg)
        self._xfer_bytes = Counter("sglang:kv_transfer_bytes", "KV bytes moved between prefill and decode.", lab,
                                   registry=reg)
        self._xfer_reads = Counter("sglang:kv_transfer_reads", "KV transfer operations posted (after coalescing).",
                                   lab, registry=reg)
        self._xfer_time = Histogram("sglang:kv_transfer_seconds", "KV transfer time per request (s).", lab,
                                    buckets=_TTFT_BUCKETS, registry=reg)
        self._handoff = Histogram("sglang:kv_handoff_seconds", "Decode-side KV hand-off phases per request (s): "
                                  "setup (RoomReady -> first READ posted), wait (last READ DONE -> activated), "
                                  "handoff (RoomReady -> activated); push: tail (the prefill side's WRITE time "
                                  "after its forward).", lab + ["phase"], buckets=_TTFT_BUCKETS,
                                  registry=reg)
        self._pd_queue = Histogram("sglang:disagg_queue_seconds", "Queue time per request and side (s).",
                                   lab + ["side"], buckets=_TTFT_BUCKETS, registry=reg)
        self._tput = Gauge("sglang:gen_throughput", "Generation throughput (token/s).", lab, registry=reg)

    # ----------------------------------------------------------- per request
    def observe_time_to_first_token(self, seconds: float) -> None:
        """Record one request's time to first token, in seconds."""
        self._ttft.labels(**self._labels).observe(seconds)

    def observe_inter_token_latency(self, seconds: float, num_tokens: int = 1) -> None:
        """Record ``num_tokens`` tokens that arrived ``seconds`` after the previous ones (one
        observation of ``seconds / num_tokens`` per token)."""
        if num_tokens <= 0:
            return
        per = seconds / num_tokens
        h = self._itl.labels(**self._labels)
        for _ in range(num_tokens):
            h.observe(per)

    def observe_request_finished(self, e2e_seconds: float, prompt_tokens: int, completion_tokens: int) -> None:
        """Count one finished request with its latency and token counts."""
        self._e2e.labels(**self._labels).observe(e2e_seconds)
        self._prompt_tokens.labels(**self._labels).inc(max(prompt_tokens, 0))
        self._gen_tokens.labels(**self._labels).inc(max(completion_tokens, 0))
        self._num_requests.labels(**self._labels).inc()

    def observe_kv_transfer(self, info: dict) -> None:
        """Record one disaggregated request's KV hand-off: ``transfer_bytes``, ``transfer_reads``,
        ``transfer_time_s`` (pure transfer), ``transfer_setup_s`` / ``transfer_wait_s`` / ``handoff_s`` (decode-side
        phases, ``sglang:kv_handoff_seconds{phase}``), push: ``transfer_tail_s`` (phase ``tail``: the WRITE time
        after the prefill forward), ``prefill_queue_s`` / ``decode_queue_s`` (seconds; absent keys are skipped)."""
        if "transfer_bytes" in info:
            self._xfer_bytes.labels(**self._labels).inc(max(int(info["transfer_bytes"]), 0))
            self._xfer_reads.labels(**self._labels).inc(max(int(info.get("transfer_reads", 0)), 0))
            self._xfer_time.labels(**self._labels).observe(max(float(info.get("transfer_time_s", 0.0)), 0.0))
        for phase, key in (("setup", "transfer_setup_s"), ("wait", "transfer_wait_s"), ("handoff", "handoff_s"),
                           ("tail", "transfer_tail_s")):
            if key in info:
                self._handoff.labels(**self._labels, phase=phase).observe(max(float(info[key]), 0.0))
        for side in ("prefill", "decode"):
            if f"{side}_queue_s" in info:
                self._pd_queue.labels(**self._labels, side=side).observe(max(float(info[f"{side}_queue_s"]), 0.0))

    # ---------------------------------------------------------------- gauges
    def update_scheduler_stats(self, stats) -> None:
        """Copy a :class:`~sglang.srt.managers.io_struct.SchedulerStats` into the gauges."""
        self._running.labels(**self._labels).set(stats.num_running_reqs)
        self._queued.labels(**self._labels).set(stats.num_queue_reqs)
        self._usage.labels(**self._labels).set(stats.token_usage)
        self._used.labels(**self._labels).set(stats.used_tokens)
        self._hit.labels(**self._labels).set(stats.cache_hit_rate)
        self._tput.labels(**self._labels).set(stats.gen_throughput)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric (``content_type`` gives its MIME type)."""
        return generate_latest(self.registry)
