"""Overlap scheduling: the model forward of step i runs on a background thread while the scheduler
builds step i+1 (SGLang's overlap schedule, the "zero-overhead batch scheduler" of SGLang v0.4;
the same idea as vLLM v1's async scheduling).

Timeline of one scheduler step with overlap on::

    scheduler thread:  build batch i+1 | submit i+1 | wait for + process result of i | stream outputs
    worker thread:     ...forward i............... | resolve i+1 placeholders, forward i+1 ...

Future tokens. A decode request in batch i+1 needs the token that batch i is still sampling. The
scheduler writes a *placeholder* instead, ``-(slot + 1)``, where ``slot`` indexes a ring of future
token ids; when batch i has been sampled the worker stores row r's token at its slot, and before
running batch i+1 it replaces every negative input id by the ring entry. The ModelRunner never sees a
placeholder and its contract (``forward(ModelWorkerBatch) -> (LogitsProcessorOutput,
SamplerOutput)``) is unchanged. The ring lives on the CPU because ``ModelWorkerBatch.input_ids`` is a
host list: the worker thread (never the scheduler thread) waits for batch i's sampled ids, which
leaves the GPU idle only for the runner's own input preparation of batch i+1 (SGLang resolves on the
device instead; that needs the runner to accept device input ids).

CUDA: the worker runs forwards on its own stream, which first waits for an event the scheduler
records at submission, so the scheduler's ``req_to_token`` writes and batch tensors are visible to
the forward while the scheduler's later device work never queues behind a running forward.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import os
import queue
import threading
from typing import Any, Optional

import torch

logger = logging.getLogger(__name__)

OVERLAP_ENV = "SGLANG_ENABLE_OVERLAP_SCHEDULE"  # "1": overlap on CPU too (until ServerArgs has a flag)


def placeholder_id(slot: int) -> int:
    """The input id standing for the future token stored at ring ``slot`` (always negative)."""
    return -(slot + 1)


def overlap_schedule_enabled(server_args: Any, device: Any, override: Optional[bool] = None) -> bool:
    """Whether the scheduler overlaps CPU scheduling with the forward.

    Policy: ``override`` (tests; the scheduler passes False for a PD worker, whose connector hooks assume the plain
    loop) wins; then ``--disable-overlap-schedule`` turns it off; then
    ``enable_overlap_schedule`` (a ServerArgs flag) or the environment variable
    ``SGLANG_ENABLE_OVERLAP_SCHEDULE=1`` turn it on; otherwise it is on for CUDA devices only. On CPU
    the forward and the scheduler share the cores and the GIL, so overlap rarely pays; it is
    supported (and tested) there but off by default.
    """
    if override is not None:
        return bool(override)
    if server_args.disable_overlap_schedule:
        return False
    if server_args.enable_overlap_schedule:
        return True
    if os.environ.get(OVERLAP_ENV, "").strip().lower() in ("1", "true", "yes", "on"):
        return True
    return torch.device(device).type == "cuda"


class FutureTokenRing:
    """Host ring of sampled token ids addressed by placeholder slots.

    Args:
        size: number of slots; must exceed the sampled rows of two consecutive batches (a slot is
            reused only after the batch reading it has been resolved).
    Raises:
        ValueError: ``size < 1``.
    """

    def __init__(self, size: int):
        if size < 1:
            raise ValueError(f"FutureTokenRing size={size} must be >= 1")
        self.size = size
        self.ids = [0] * size

    def store(self, slots: list[int], token_ids: list[int]) -> None:
        """``ring[slots[r]] = token_ids[r]`` for every row with ``slots[r] >= 0``."""
        for s, t in zip(slots, token_ids):
            if s >= 0:
                self.ids[s] = t

    def resolve(self, input_ids: list[int]) -> list[int]:
        """``input_ids`` with every placeholder ``-(slot+1)`` replaced by the stored token."""
        if not input_ids or min(input_ids) >= 0:
            return input_ids
        ring = self.ids
        return [t if t >= 0 else ring[-t - 1] for t in input_ids]


class OverlapWorker:
    """Runs ``runner.forward`` on one background thread, in submission order.

    Args:
        runner: anything with ``forward(ModelWorkerBatch) -> (logits_out, sample_out)``; its
            ``device`` attribute (default CPU) picks CUDA stream handling.
        ring_size: slots of the :class:`FutureTokenRing`.
    The future returned by :meth:`submit` yields ``(logits_out, sample_out)`` with
    ``sample_out.next_token_ids`` moved to the CPU (int64 ``[bs]``), or raises the forward's exception.
    """

    def __init__(self, runner: Any, ring_size: int):
        self.runner = runner
        self.device = torch.device(runner.device)
        self.ring = FutureTokenRing(ring_size)
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._queue: "queue.Queue[Optional[tuple]]" = queue.Queue()
        self._error: Optional[BaseException] = None  # after a failed forward, later batches fail too
        self._thread = threading.Thread(target=self._loop, name="overlap-worker", daemon=True)
        self._thread.start()

    def submit(self, batch: Any, future_slots: list[int]) -> cf.Future:
        """Queue ``batch`` (a ModelWorkerBatch whose input ids may hold placeholders of earlier
        batches); row r's sampled token goes to ring slot ``future_slots[r]`` (-1: none)."""
        if not self._thread.is_alive():
            raise RuntimeError("the overlap worker thread has stopped; the scheduler cannot run batches")
        fut: cf.Future = cf.Future()
        event = None
        if self.stream is not None:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
        self._queue.put((batch, list(future_slots), event, fut))
        return fut

    def close(self) -> None:
        """Stop the thread after the queued batches (idempotent)."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout=60)

    def _loop(self) -> None:
        if self.stream is not None:
            with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
                self._serve()
        else:
            self._serve()

    def _serve(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            batch, slots, event, fut = item
            if self._error is not None:  # its placeholders may name tokens that were never sampled
                fut.set_exception(RuntimeError(f"an earlier forward failed: {self._error!r}"))
                continue
            try:
                if event is not None:
                    self.stream.wait_event(event)
                batch.input_ids = self.ring.resolve(batch.input_ids)
                logits_out, sample_out = self.runner.forward(batch)
                ids = sample_out.next_token_ids.to("cpu")  # waits for this forward (this thread only)
                self.ring.store(slots, ids.tolist())
                sample_out.next_token_ids = ids
                fut.set_result((logits_out, sample_out))
            except BaseException as e:  # handed to the scheduler thread, which re-raises it
                logger.error("overlap worker: forward failed: %s: %s", type(e).__name__, e)
                self._error = e
                fut.set_exception(e)
