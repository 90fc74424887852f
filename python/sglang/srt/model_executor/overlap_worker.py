"""Overlap scheduling: the model forward of step i runs on a background thread while the scheduler
builds step i+1 (SGLang's overlap schedule, the "zero-overhead batch scheduler" of SGLang v0.4;
the same idea as vLLM v1's async scheduling).

Timeline of one scheduler step with overlap on::

    scheduler thread:  build batch i+1 | submit i+1 | wait for + process result of i | stream outputs
    worker thread:     ...forward i............... | resolve i+1 placeholders, forward i+1 ...

Future tokens. A decode request in batch i+1 needs the token that batch i is still sampling. The
scheduler writes a *placeholder* instead, ``-(slot + 1)``, where ``slot`` indexes a ring of future
token ids. The ModelRunner's contract (``forward(ModelWorkerBatch) -> (LogitsProcessorOutput,
SamplerOutput)``) is unchanged; the worker resolves placeholders in one of two ways:

* device futures (default on CUDA): the ring is a device tensor. After launching batch i the worker
  scatters its sampled ids into the ring and starts their copy to pinned host memory, both on its stream, and
  goes straight on to batch i+1, whose ``ModelWorkerBatch.future_token_ids`` names the ring: the runner replaces
  the placeholders on the device (:func:`resolve_future_ids`) after staging the inputs. Batch i+1 is therefore
  queued on the GPU behind batch i and the GPU does not idle for the host between decode steps (SGLang's overlap
  scheduler resolves on the device the same way). A completion thread waits for each batch's copy and completes
  its future, so the scheduler reads tokens one step late.
* host futures (CPU, or ``device_futures=False``): the ring is a host list; the worker waits for batch i's ids,
  stores them, and replaces the placeholders of batch i+1 on the host before its forward (the GPU idles for the
  runner's input preparation of every batch).

CUDA: the worker runs forwards on its own stream, which first waits for an event the scheduler
records at submission, so the scheduler's ``req_to_token`` writes and batch tensors are visible to
the forward while the scheduler's later device work never queues behind a running forward. A batch's
outputs that are views of a CUDA graph's static buffers (its logits) are overwritten by the next replay, which
may already be queued when the scheduler reads the result: the scheduler reads only the sampled ids (copied in
stream order before the next replay) and the sampler's own tensors.
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
DEVICE_FUTURES_ENV = "SGLANG_OVERLAP_DEVICE_FUTURES"  # "0"/"1": force host/device futures (A/B on a live server)


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


def device_futures_enabled(device: Any, override: Optional[bool] = None) -> bool:
    """Whether the overlap worker resolves future tokens on the device (see the module doc).

    Policy: ``override`` (tests, benchmarks) wins; then ``SGLANG_OVERLAP_DEVICE_FUTURES`` (``1``/``0``); otherwise on
    for CUDA devices only (on CPU a forward runs synchronously, so launching ahead gains nothing).
    """
    if override is not None:
        return bool(override)
    env = os.environ.get(DEVICE_FUTURES_ENV, "").strip().lower()
    if env in ("1", "true", "yes", "on"):
        return True
    if env in ("0", "false", "no", "off"):
        return False
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


def resolve_future_ids(ids: torch.Tensor, ring: torch.Tensor) -> torch.Tensor:
    """``ids`` with every placeholder ``-(slot + 1)`` replaced by ``ring[slot]``, on ``ids``' device, no host sync.

    Args:
        ids: ``[n]`` int64 input ids (real ids >= 0, placeholders < 0).
        ring: ``[size]`` int64 future token ids on the same device; every placeholder's slot must be < ``size``.
    Returns:
        A new ``[n]`` int64 tensor.
    """
    return torch.where(ids < 0, ring[(-ids - 1).clamp(min=0)], ids)


class _Done:
    """A launched batch whose sampled ids are being copied to the host (device futures)."""

    __slots__ = ("fut", "logits_out", "sample_out", "ids_host", "event")

    def __init__(self, fut, logits_out, sample_out, ids_host, event):
        self.fut, self.logits_out, self.sample_out, self.ids_host, self.event = (fut, logits_out, sample_out,
                                                                                 ids_host, event)


class OverlapWorker:
    """Runs ``runner.forward`` on one background thread, in submission order.

    Args:
        runner: anything with ``forward(ModelWorkerBatch) -> (logits_out, sample_out)``; its
            ``device`` attribute (default CPU) picks CUDA stream handling.
        ring_size: slots of the future token ring.
        device_futures: resolve placeholders on the device and launch the next batch without waiting for the
            previous one's ids (see the module doc); None: :func:`device_futures_enabled`. Works on CPU too.
    The future returned by :meth:`submit` yields ``(logits_out, sample_out)`` with
    ``sample_out.next_token_ids`` moved to the CPU (int64 ``[bs]``), or raises the forward's exception.
    """

    def __init__(self, runner: Any, ring_size: int, device_futures: Optional[bool] = None):
        self.runner = runner
        self.device = torch.device(getattr(runner, "device", "cpu"))
        self.ring = FutureTokenRing(ring_size)
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.device_futures = device_futures_enabled(self.device, device_futures)
        self.dev_ring = torch.zeros(ring_size, dtype=torch.int64, device=self.device) if self.device_futures else None
        self._queue: "queue.Queue[Optional[tuple]]" = queue.Queue()
        self._done: "queue.Queue[Optional[_Done]]" = queue.Queue()
        self._error: Optional[BaseException] = None  # after a failed forward, later batches fail too
        self._thread = threading.Thread(target=self._loop, name="overlap-worker", daemon=True)
        self._thread.start()
        self._completer = None
        if self.device_futures:
            self._completer = threading.Thread(target=self._complete, name="overlap-completer", daemon=True)
            self._completer.start()

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
        """Stop the threads after the queued batches (idempotent)."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout=60)
        if self._completer is not None and self._completer.is_alive():
            self._done.put(None)
            self._completer.join(timeout=60)

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
                if self.device_futures:
                    self._launch_device(batch, slots, fut)
                else:
                    self._run_host(batch, slots, fut)
            except BaseException as e:  # handed to the scheduler thread, which re-raises it
                logger.error("overlap worker: forward failed: %s: %s", type(e).__name__, e)
                self._error = e
                fut.set_exception(e)

    def _run_host(self, batch: Any, slots: list[int], fut: cf.Future) -> None:
        """Host futures: resolve on the host, run, wait for the ids, store them, complete ``fut``."""
        batch.input_ids = self.ring.resolve(batch.input_ids)
        logits_out, sample_out = self.runner.forward(batch)
        ids = sample_out.next_token_ids.to("cpu")  # waits for this forward (this thread only)
        self.ring.store(slots, ids.tolist())
        sample_out.next_token_ids = ids
        fut.set_result((logits_out, sample_out))

    def _launch_device(self, batch: Any, slots: list[int], fut: cf.Future) -> None:
        """Device futures: launch the forward (placeholders resolved by the runner on the device), scatter the
        sampled ids into the device ring, start their copy to the host and hand the batch to the completer."""
        ids_in = batch.input_ids
        if len(ids_in) and min(ids_in) < 0:
            batch.future_token_ids = self.dev_ring
        logits_out, sample_out = self.runner.forward(batch)
        ids = sample_out.next_token_ids
        rows = [r for r, s in enumerate(slots) if s >= 0]
        if rows:
            dst = torch.tensor([slots[r] for r in rows], dtype=torch.int64).to(self.device, non_blocking=True)
            src = ids if len(rows) == ids.shape[0] else ids[torch.tensor(rows, dtype=torch.int64).to(self.device)]
            self.dev_ring.index_copy_(0, dst, src.to(torch.int64))
        pinned = self.stream is not None
        ids_host = torch.empty(ids.shape, dtype=ids.dtype, pin_memory=pinned)
        ids_host.copy_(ids, non_blocking=pinned)
        done_event = None
        if pinned:
            done_event = torch.cuda.Event()
            done_event.record(self.stream)
        self._done.put(_Done(fut, logits_out, sample_out, ids_host, done_event))

    def _complete(self) -> None:
        """Completer thread (device futures): in launch order, wait for each batch's ids and complete its future."""
        while True:
            d = self._done.get()
            if d is None:
                return
            try:
                if d.event is not None:
                    d.event.synchronize()  # this batch's forward, ring scatter and id copy have finished
                d.sample_out.next_token_ids = d.ids_host
                d.fut.set_result((d.logits_out, d.sample_out))
            except BaseException as e:
                if self._error is None:
                    logger.error("overlap worker: batch failed: %s: %s", type(e).__name__, e)
                    self._error = e
                d.fut.set_exception(e)
