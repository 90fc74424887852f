"""Layerwise push: the prefill side WRITEs layer ``l`` of a request's KV into the blocks the decode side
preallocated as soon as the forward stored it, while layers ``> l`` still run (push mode's overlap, as in
SGLang's and vLLM's layerwise KV connectors; KVDirect sec. 4.3 compares it with pull).

The prefill connector plans a :class:`LayerwisePush` per request before the forward of the request's last
chunk (the decode side's ``RoomRequest`` with its ``dst_slots`` must have arrived by then), arms the
:class:`LayerwisePushListener` with the batch, and the executor calls the listener after each layer's
attention stage (:class:`~sglang.srt.model_executor.executors.base.KVLayerListener`).

Ordering argument (why the bytes a WRITE of layer ``l`` reads are final):

* Layer ``l``'s KV of the batch's tokens is stored by layer ``l``'s attention stage; the listener is called
  after that stage was issued for every (sub-)batch. Each layer has its own KV region and the request's slots
  stay held until the decode side's ``RoomAck``, so nothing later in this forward (layers ``> l``, the logits)
  or before the ACK rewrites them: a WRITE of layer ``l`` may run concurrently with layers ``> l``.
* The rows also cover the prompt positions computed by *earlier* forwards (prefix-cache hits, earlier chunks of
  a chunked prefill): those were stored before this forward started (CPU: synchronous; CUDA: earlier on the same
  stream), so the last chunk's per-layer WRITEs carry every chunk's tokens.
* CPU: the forward runs synchronously on the scheduler thread, so when the call returns the KV is in memory
  and the WRITE is posted directly.
* CUDA: at the call the KV store is only enqueued. The listener records a CUDA event on the current stream
  (the stream the attention ran on) and hands ``(layer, event)`` to one posting thread, which waits on the
  event (``cudaEventSynchronize``, the host thread of the forward never blocks) and then posts the layer's
  WRITEs. An event completes only after every kernel enqueued before it on that stream, i.e. after the
  stores of layers ``0..l``. Layers are posted in order.

Failures (a planning error, a WRITE that cannot be posted, a forward that stopped early) mark the job failed;
the connector then fails the room closed exactly as an after-the-fact push does (RoomFailed, KV freed).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np

from sglang.srt.model_executor.executors.base import KVLayerListener

logger = logging.getLogger(__name__)


@dataclass
class LayerwisePush:
    """The WRITEs of one room, grouped by layer.

    ``peers``: ``[(decode agent name, [rows of layer 0, rows of layer 1, ...])]``; rows are ``int64 [N, 3]`` =
    ``(remote = decode address, local = prefill address, nbytes)`` as ``TransferBackend.write`` takes them.
    ``handles`` grows as layers are posted (by the posting thread on CUDA); ``done`` turns True after the
    last layer was posted or ``error`` was set, and only then are ``handles`` complete.
    """

    room: int
    peers: list[tuple[str, list[np.ndarray]]]
    num_layers: int
    handles: list = field(default_factory=list)
    layers_posted: int = 0
    started: bool = False  # the forward armed for it ran (the executor called the listener)
    done: bool = False
    error: str = ""
    start: float = 0.0  # time.monotonic() of the first layer's call
    end: float = 0.0  # time.monotonic() when the last layer was posted

    @property
    def nbytes(self) -> int:
        """Bytes this rank writes for the room (all layers, all decode ranks)."""
        return int(sum(int(rows[:, 2].sum()) for _, layers in self.peers for rows in layers if len(rows)))

    @property
    def num_ops(self) -> int:
        """Copy rows (after coalescing) this rank writes for the room."""
        return int(sum(len(rows) for _, layers in self.peers for rows in layers))


class LayerwisePushListener(KVLayerListener):
    """Posts the armed jobs' WRITEs layer by layer (see the module doc).

    Args:
        backend: the :class:`~sglang.srt.disaggregation.transfer.base.TransferBackend` that posts the WRITEs.
        event_factory: ``device -> event`` with ``synchronize()``, recorded at each layer's call; default: a
            ``torch.cuda.Event`` recorded on the current stream for CUDA forwards and direct posting (no event) for
            CPU ones. Given, it is used on every device (tests drive the posting thread on CPU with it).
    ``lock`` serializes every call into ``backend`` between the posting thread and the scheduler thread (the
    connector takes it around ``poll``).
    """

    def __init__(self, backend: Any, event_factory: Optional[Callable[[Any], Any]] = None):
        self.backend = backend
        self.event_factory = event_factory
        self.lock = threading.Lock()
        self._armed: Optional[tuple[list[int], list[LayerwisePush]]] = None
        self._queue: Optional[queue.Queue] = None
        self._thread: Optional[threading.Thread] = None

    # ---- the connector's side ---------------------------------------------------------------------------
    def arm(self, req_pool_indices: list[int], jobs: list[LayerwisePush]) -> None:
        """The next forward of the batch with these request rows carries ``jobs`` (replaces any armed ones)."""
        self._armed = (list(req_pool_indices), list(jobs))

    def disarm(self) -> None:
        """Forget armed jobs whose forward never ran (their rooms fall back to the after-the-fact push)."""
        self._armed = None

    # ---- the executor's side ----------------------------------------------------------------------------
    def wants(self, forward_batch) -> bool:
        """True for the forward of the armed batch (compared by its host-side request rows; no sync)."""
        armed = self._armed
        return armed is not None and list(forward_batch.req_pool_indices_cpu) == armed[0]

    def on_layer_kv_written(self, layer_id: int, forward_batch) -> None:
        """Post (CPU) or schedule behind a CUDA event (CUDA) the WRITEs of layer ``layer_id``."""
        if self._armed is None:
            return
        jobs = self._armed[1]
        t = time.monotonic()
        for job in jobs:
            if not job.started:
                job.started, job.start = True, t
        device = forward_batch.input_ids.device
        if self.event_factory is not None:
            self._submit((layer_id, self.event_factory(device), jobs))
        elif device.type == "cuda":
            import torch

            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
            self._submit((layer_id, event, jobs))
        else:
            self._post(layer_id, jobs)

    def on_forward_done(self, forward_batch) -> None:
        """Close the armed jobs: ``done`` once every layer was posted (on CUDA after the posting thread)."""
        if self._armed is None:
            return
        jobs = self._armed[1]
        self._armed = None
        if self.event_factory is not None or forward_batch.input_ids.device.type == "cuda":
            self._submit((None, None, jobs))
        else:
            self._finish(jobs)

    # ---- posting ------------------------------------------------------------------------------------------
    def _post(self, layer_id: int, jobs: list[LayerwisePush]) -> None:
        for job in jobs:
            if job.error or job.done:
                continue
            if layer_id != job.layers_posted:
                job.error = f"layer {layer_id} reported out of order (expected layer {job.layers_posted})"
                continue
            try:
                with self.lock:
                    if job.error:  # the room failed meanwhile (PushDrain.begin sets it under this lock)
                        continue
                    for name, layers in job.peers:
                        rows = layers[layer_id]
                        if len(rows):
                            job.handles.append(self.backend.write(name, rows))
                job.layers_posted += 1
            except Exception as e:  # noqa: BLE001 - one room fails, the others continue
                logger.warning("room %d: layer %d WRITE could not be posted: %s", job.room, layer_id, e)
                job.error = f"layerwise push of layer {layer_id} failed to post: {e}"

    def _finish(self, jobs: list[LayerwisePush]) -> None:
        t = time.monotonic()
        for job in jobs:
            if not job.error and job.layers_posted != job.num_layers:
                job.error = (f"the forward reported {job.layers_posted} of {job.num_layers} layers "
                             "(it stopped early); the layerwise push is incomplete")
            job.end = t
            job.done = True

    def _submit(self, item: tuple) -> None:
        if self._thread is None:
            self._queue = queue.Queue()
            self._thread = threading.Thread(target=self._run, name="kv-layerwise-push", daemon=True)
            self._thread.start()
        self._queue.put(item)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            layer_id, event, jobs = item
            try:
                if event is None:
                    self._finish(jobs)
                    continue
                event.synchronize()  # this thread waits; the forward's thread never blocks per layer
                self._post(layer_id, jobs)
            except Exception as e:  # noqa: BLE001 - e.g. a CUDA error: the jobs fail closed
                for job in jobs:
                    job.error = job.error or f"layerwise push failed: {e}"
                    if event is None:
                        job.done = True

    def close(self) -> None:
        """Stop the posting thread (after the queued layers)."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=5.0)
            self._thread = None
