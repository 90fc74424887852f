"""Per-step record of the scheduler: SGLang's periodic batch log lines and an optional JSON-lines trace.

Log lines (always on, as SGLang's scheduler prints them): every prefill batch (EXTEND or MIXED) logs
``Prefill batch. #new-seq: .., #new-token: .., #cached-token: .., token usage: .., #running-req: .., #queue-req: ..``
and every ``--decode-log-interval`` decode steps (SGLang's flag, default 40) one line
``Decode batch. #running-req: .., #token: .., token usage: .., cuda graph: .., gen throughput (token/s): ..,
#queue-req: ..``. They cost a few counter updates per step.

Trace (off by default): with ``SGLANG_STEP_TRACE=/path/file.jsonl`` in the scheduler's environment (see
:meth:`StepTracer.from_server_args` for several schedulers), every launched
batch appends one JSON object when its result has been processed (line-buffered, so a killed server keeps every
finished line). Fields (times in ms unless named ``_s``):

* ``i`` forward index; ``t_s`` host launch time, seconds since the first traced launch;
* ``mode`` ``extend`` / ``decode`` / ``mixed``; ``bs`` requests; ``dec`` decode rows (one new token each);
  ``pre_tok`` prefill tokens (all new tokens of the non-decode rows); ``kv_tok`` KV tokens the decode rows attend
  to (sum of their context lengths including the new token, the bytes a decode step must read);
* ``graph`` the forward replays a CUDA graph; ``running`` / ``waiting`` queue lengths after the launch;
  ``usage`` KV pool usage (0..1); ``retract`` retractions so far (``running``, ``waiting`` and ``usage`` as
  before the launch);
* ``build`` host time of the step that built and launched this batch (scheduling + input preparation + submit);
  ``wait`` host time blocked on this batch's result; ``proc`` host time processing its result;
* ``gpu`` device time of the forward (CUDA events around ``ModelRunner.forward``: the model, the sampler or the
  graph replay and its input copy), ``gpu_t`` its start on the device's clock, ms after the first traced forward's
  start (gaps between ``gpu_t + gpu`` and the next ``gpu_t`` are device idle time); both null off CUDA.

``benchmark/serving/step_trace_report.py`` turns a trace into the breakdown (prefill share of the wall time, decode
batch-size histogram, eager decode steps above the largest graph, host time, device idle time, decode step time
against the memory floor).
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any, Optional

logger = logging.getLogger(__name__)

STEP_TRACE_ENV = "SGLANG_STEP_TRACE"
DEFAULT_DECODE_LOG_INTERVAL = 40  # SGLang's --decode-log-interval default


class StepTracer:
    """SGLang-style batch log lines plus the optional JSON-lines trace (see the module docstring).

    Args:
        decode_log_interval: decode steps between ``Decode batch.`` lines (>= 1).
        path: the trace file (appended); None: no trace, no CUDA events.
        cuda: the runner's device is CUDA (CUDA events time the forwards).
        clock: host clock in seconds (tests pass a fake).
    Raises:
        ValueError: ``decode_log_interval < 1``; OSError: the trace file cannot be opened.
    """

    def __init__(self, decode_log_interval: int = DEFAULT_DECODE_LOG_INTERVAL, path: Optional[str] = None,
                 cuda: bool = False, clock=time.perf_counter):
        if decode_log_interval < 1:
            raise ValueError(f"--decode-log-interval={decode_log_interval} is invalid: use a positive integer")
        self.interval = decode_log_interval
        self.clock = clock
        self.cuda = cuda
        self.file = open(path, "a", buffering=1, encoding="utf-8") if path else None  # noqa: SIM115 (closed in close)
        self.t0: Optional[float] = None
        self.ref_event = None  # the first traced forward's start event (device clock origin)
        self.decode_steps = 0
        self.gen_tokens = 0  # decode tokens since the last Decode line
        self.last_log = clock()
        self.retractions = 0
        self.step_start = 0.0
        self.processed_in_step = 0.0  # seconds of result processing (and waiting) inside the current step

    @classmethod
    def from_server_args(cls, server_args: Any, device: Any, tp_rank: int = 0) -> "StepTracer":
        """The tracer for a scheduler: ``--decode-log-interval`` (default 40) and ``SGLANG_STEP_TRACE`` (``{pid}`` in
        the path becomes the process id, for several schedulers of one server; TP rank r > 0 appends ``.tp<r>``)."""
        path = os.environ.get(STEP_TRACE_ENV, "").strip().replace("{pid}", str(os.getpid())) or None
        if path and tp_rank:
            path = f"{path}.tp{tp_rank}"
        cuda = str(device).startswith("cuda")
        tracer = cls(getattr(server_args, "decode_log_interval", DEFAULT_DECODE_LOG_INTERVAL), path, cuda)
        if path:
            logger.info("step trace on: %s", path)
        return tracer

    @property
    def enabled(self) -> bool:
        """Whether the JSON-lines trace is on."""
        return self.file is not None

    def close(self) -> None:
        """Close the trace file (idempotent)."""
        if self.file is not None:
            self.file.close()
            self.file = None

    # ---- hooks called by the scheduler --------------------------------------------------------------
    def begin_step(self) -> None:
        """The scheduler starts a step (the build time of a batch launched in it is measured from here, less the
        time spent processing earlier results within the step)."""
        self.step_start = self.clock()
        self.processed_in_step = 0.0

    def on_launch(self, batch: Any, mwb: Any, graph: bool, running: int, waiting: int, usage: float,
                  cached_tokens: int) -> None:
        """A batch was built and is about to launch in this step: log a ``Prefill batch.`` / ``Decode batch.`` line
        and, when tracing, keep its record in ``batch.trace`` and arm its CUDA events (``mwb.gpu_timing``, recorded
        by the runner). ``running`` / ``waiting``: the scheduler's queues before this launch; ``usage``: KV pool
        usage (0..1); ``cached_tokens``: prefix-cache hits of the newly admitted requests."""
        now = self.clock()
        if self.t0 is None:
            self.t0 = now
        mode = batch.forward_mode.name.lower()
        lens, seq = mwb.extend_lens, mwb.seq_lens
        # decode rows: every row of a decode batch; in a mixed batch the one-token rows past their prompt
        is_dec = [True] * len(lens) if mode == "decode" else [e == 1 and p > 0 and mode == "mixed"
                                                             for e, p in zip(lens, mwb.prefix_lens)]
        dec = sum(is_dec)
        new_tok = sum(lens)
        self.gen_tokens += dec
        if mode == "decode":
            self.decode_steps += 1
            if self.decode_steps % self.interval == 0:
                span = max(now - self.last_log, 1e-9)
                logger.info("Decode batch. #running-req: %d, #token: %d, token usage: %.2f, cuda graph: %s, "
                            "gen throughput (token/s): %.2f, #queue-req: %d", len(lens), sum(seq), usage, graph,
                            self.gen_tokens / span, waiting)
                self.gen_tokens, self.last_log = 0, now
        else:
            logger.info("Prefill batch. #new-seq: %d, #new-token: %d, #cached-token: %d, token usage: %.2f, "
                        "#running-req: %d, #queue-req: %d", len(lens) - dec, new_tok - dec, cached_tokens, usage,
                        running, waiting)
        if self.file is None:
            return
        batch.trace = {
            "i": 0, "t_s": round(now - self.t0, 6), "mode": mode, "bs": len(lens), "dec": dec,
            "pre_tok": new_tok - dec, "kv_tok": sum(s for s, d in zip(seq, is_dec) if d), "graph": bool(graph),
            "running": running, "waiting": waiting, "usage": round(usage, 4), "retract": self.retractions,
            "build": round((now - self.step_start - self.processed_in_step) * 1e3, 3),
        }
        if self.cuda:
            import torch

            mwb.gpu_timing = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            batch.trace_events = mwb.gpu_timing

    def on_processed(self, batch: Any, forward_index: int, wait_s: float, proc_s: float) -> None:
        """``batch``'s result was processed (``wait_s`` blocked on it, ``proc_s`` processing it): write its trace line
        (no-op without the trace)."""
        self.processed_in_step += wait_s + proc_s
        rec = getattr(batch, "trace", None)
        if self.file is None or rec is None:
            return
        rec["i"] = forward_index
        rec["wait"] = round(wait_s * 1e3, 3)
        rec["proc"] = round(proc_s * 1e3, 3)
        rec["gpu"] = rec["gpu_t"] = None
        events = getattr(batch, "trace_events", None)
        if events is not None:
            start, end = events
            end.synchronize()  # already complete: the result that needed it has arrived
            if self.ref_event is None:
                self.ref_event = start
            rec["gpu"] = round(start.elapsed_time(end), 4)
            rec["gpu_t"] = round(self.ref_event.elapsed_time(start), 4)
        self.file.write(json.dumps(rec, separators=(",", ":")) + "\n")
        batch.trace = batch.trace_events = None
