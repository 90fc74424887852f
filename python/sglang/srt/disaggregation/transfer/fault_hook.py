"""Test-only fault hook: hold every transfer this process posts for a fixed time before the transport sees it.

Killing the decode server during a GPU transfer (the PD fault tests) needs a kill that lands *after* a READ (pull) or
WRITE (push) was posted and *before* it completed, deterministically on any transport: a NIXL transfer between two
GPUs finishes in microseconds, so no test can aim a SIGKILL into it. With the environment variable
:data:`FAULT_HOLD_ENV` set to ``S`` seconds (> 0) in a server process, :func:`maybe_hold_transfers` wraps that
process's transfer agent in :class:`HeldTransferBackend`: ``read``/``write`` validate and return a PENDING handle at
once (the queue counts the transfer as posted), and the first ``poll`` at least ``S`` seconds later hands the ops to
the real backend, whose state the handle then mirrors. A peer killed within the hold is therefore killed with the
transfer in flight, and the real transport then meets the dead peer (connection refused, a NIXL error, or the
transfer timeout). The hold counts against ``transfer_timeout_s`` (the handle's deadline runs from the post).

The hook is inert unless the variable is set (no wrapper, no cost); it is reachable from no command-line flag.
While set, the process logs one warning at start and one line per held transfer (``fault hook: holding ...``), and
``/get_server_info`` carries ``disagg_fault_hold`` (:meth:`HeldTransferBackend.snapshot`) so a test can assert that
transfers were held at the moment it killed the peer.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Mapping, Optional

import numpy as np

from sglang.srt.disaggregation.transfer.base import (MemRegion, OpsLike, TransferBackend, TransferError,
                                                     TransferHandle, TransferState)

logger = logging.getLogger(__name__)

FAULT_HOLD_ENV = "SGLANG_PD_FAULT_HOLD_TRANSFER_S"


def fault_hold_seconds(environ: Optional[Mapping[str, str]] = None) -> float:
    """Seconds of :data:`FAULT_HOLD_ENV` in ``environ`` (default ``os.environ``); 0.0 when unset or empty.

    Raises:
        ValueError: the value is not a number >= 0 (names the variable and the value).
    """
    raw = (os.environ if environ is None else environ).get(FAULT_HOLD_ENV, "").strip()
    if not raw:
        return 0.0
    try:
        hold = float(raw)
    except ValueError:
        raise ValueError(f"{FAULT_HOLD_ENV}={raw!r} is not a number of seconds (unset it outside fault tests)") \
            from None
    if not hold >= 0.0:
        raise ValueError(f"{FAULT_HOLD_ENV}={raw!r} must be >= 0 seconds")
    return hold


@dataclass
class _Held:
    """A posted transfer the transport has not seen yet: ``op`` "read" | "write", ops ``int64 [N, 3]``."""

    op: str
    ops: np.ndarray
    notif: Optional[bytes]


class HeldTransferBackend(TransferBackend):
    """A :class:`TransferBackend` that passes every call to ``inner`` except that each READ/WRITE reaches ``inner``
    only ``hold_s`` seconds after it was posted (module doc). Thread-safe as ``inner`` (one lock around the hook's
    own state; the layerwise posting thread and the scheduler both call it).

    Args:
        inner: the real agent (fake or NIXL); its name and config are this agent's.
        hold_s: seconds each transfer stays held (> 0).
    Raises:
        ValueError: ``hold_s`` <= 0.
    """

    def __init__(self, inner: TransferBackend, hold_s: float):
        if not hold_s > 0:
            raise ValueError(f"hold_s={hold_s} must be > 0")
        super().__init__(inner.agent_name, inner.config)
        self.inner, self.hold_s, self.name = inner, float(hold_s), f"held-{inner.name}"
        self._peers: set[str] = set()
        self._held: dict[int, TransferHandle] = {}  # handle id -> handle still held
        self._lock = threading.RLock()
        self.num_held_total = 0
        self.num_released = 0

    def __getattr__(self, attr):  # backend-specific extras (e.g. NIXL's ``abandon``, the fake agent's ``port``)
        inner = self.__dict__.get("inner")
        if inner is None:
            raise AttributeError(attr)
        return getattr(inner, attr)

    # ---- memory and peers: straight through ------------------------------------------------------------
    def register(self, regions: list[MemRegion]) -> None:
        self.inner.register(regions)
        self._regions.extend(regions)

    def local_metadata(self) -> bytes:
        return self.inner.local_metadata()

    def connect(self, peer: str, peer_metadata: bytes) -> None:
        self.inner.connect(peer, peer_metadata)
        with self._lock:
            self._peers.add(peer)

    def disconnect(self, peer: str) -> None:
        with self._lock:
            self._peers.discard(peer)
            doomed = [h for h in self._held.values() if h.peer == peer]
        for h in doomed:
            self._fail(h, f"peer {peer} disconnected")
        self.inner.disconnect(peer)

    # ---- data --------------------------------------------------------------------------------------------
    def _hold(self, op: str, peer: str, ops: OpsLike, notif: Optional[bytes]) -> TransferHandle:
        arr = self._check_local(ops)
        with self._lock:
            if peer not in self._peers:
                raise TransferError(f"unknown peer {peer!r}; connect() it first")
            handle = self._new_handle(peer, op.upper(), arr)
            handle.impl = _Held(op, arr, None if notif is None else bytes(notif))
            self._held[handle.id] = handle
            self.num_held_total += 1
        logger.warning("fault hook %s: holding %s %d to %s (%d ops, %d bytes) for %.1f s", FAULT_HOLD_ENV,
                       handle.op, handle.id, peer, handle.num_ops, handle.nbytes, self.hold_s)
        return handle

    def read(self, peer: str, ops: OpsLike, notif: Optional[bytes] = None) -> TransferHandle:
        return self._hold("read", peer, ops, notif)

    def write(self, peer: str, ops: OpsLike, notif: Optional[bytes] = None) -> TransferHandle:
        return self._hold("write", peer, ops, notif)

    def _release(self, handle: TransferHandle) -> None:
        """Hand a held transfer whose hold is over to ``inner`` (an error there fails the handle)."""
        with self._lock:
            held = self._held.pop(handle.id, None)
            if held is None or not isinstance(handle.impl, _Held):
                return
            self.num_released += 1
        logger.warning("fault hook %s: releasing %s %d to %s after %.1f s", FAULT_HOLD_ENV, handle.op, handle.id,
                       handle.peer, time.monotonic() - handle.posted_at)
        h = handle.impl
        try:
            post = self.inner.read if h.op == "read" else self.inner.write
            handle.impl = post(handle.peer, h.ops, h.notif)
        except (TransferError, ValueError) as e:
            handle.impl = None
            self._fail(handle, f"{type(e).__name__}: {e}")

    def _release_due(self) -> None:
        """Release every held transfer whose hold is over, polled or not (a real transport moves a posted transfer
        whether or not its owner still polls it, e.g. the other layers' WRITEs of a room that already failed)."""
        t = time.monotonic()
        with self._lock:
            due = [h for h in self._held.values() if t - h.posted_at >= self.hold_s]
        for h in due:
            self._release(h)

    def poll(self, handle: TransferHandle) -> TransferState:
        self._release_due()
        if handle.state is TransferState.PENDING:
            inner = handle.impl
            if isinstance(inner, TransferHandle):
                state = self.inner.poll(inner)
                if state is TransferState.DONE:
                    handle.finish(TransferState.DONE)
                elif state is TransferState.FAILED:
                    self._fail(handle, inner.error or "transfer failed")
        self._timed_out(handle)
        return handle.state

    def in_flight(self, handle: TransferHandle) -> bool:
        """Held (not cancelled): True; released: as the inner transfer; else False."""
        with self._lock:
            if handle.id in self._held:
                return True
        inner = handle.impl
        return isinstance(inner, TransferHandle) and self.inner.in_flight(inner)

    def _fail(self, handle: TransferHandle, reason: str) -> None:
        super()._fail(handle, reason)
        with self._lock:
            self._held.pop(handle.id, None)
        inner = handle.impl
        if isinstance(inner, TransferHandle) and inner.state is TransferState.PENDING:
            self.inner.cancel(inner, reason)

    def snapshot(self) -> dict:
        """``{"hold_s", "held_now", "held_min_left_s", "held_total", "released"}``: transfers held right now and the
        least time (s) any of them is still held (``held_min_left_s`` None when none is), for ``/get_server_info``.
        Releases the transfers whose hold is over first."""
        self._release_due()
        t = time.monotonic()
        with self._lock:
            left = [self.hold_s - (t - h.posted_at) for h in self._held.values()]
            return {"hold_s": self.hold_s, "held_now": len(left), "held_min_left_s": min(left) if left else None,
                    "held_total": self.num_held_total, "released": self.num_released}

    # ---- control: straight through ---------------------------------------------------------------------
    def send_notif(self, peer: str, msg: bytes) -> None:
        self.inner.send_notif(peer, msg)

    def get_notifs(self) -> dict[str, list[bytes]]:
        return self.inner.get_notifs()

    def close(self) -> None:
        with self._lock:
            doomed = list(self._held.values())
        for h in doomed:
            self._fail(h, "agent closed")
        self.inner.close()


def maybe_hold_transfers(backend: TransferBackend, environ: Optional[Mapping[str, str]] = None) -> TransferBackend:
    """``backend`` itself unless :data:`FAULT_HOLD_ENV` is set to seconds > 0 in ``environ`` (default ``os.environ``);
    then a :class:`HeldTransferBackend` around it (test-only; one warning names the variable).

    Raises:
        ValueError: the variable holds something other than seconds >= 0.
    """
    hold = fault_hold_seconds(environ)
    if hold <= 0:
        return backend
    logger.warning("TEST-ONLY fault hook %s=%g is set: every KV transfer of agent %s is held %g s before the "
                   "transport sees it (unset it outside fault tests)", FAULT_HOLD_ENV, hold, backend.agent_name, hold)
    return HeldTransferBackend(backend, hold)
