"""Pull/push transfer protocol on top of a :class:`~.base.TransferBackend` (KVDirect, Chen et al. 2024,
sec. 4.2): a per-peer queue of pending reads and COMPLETE markers, coalescing, and the COMPLETE/ACK
handshake.

Initiator side (decode in pull mode, prefill in push mode):

* ``enqueue(peer, room, ops)`` adds a request's per-block ops; ``complete(peer, room)`` adds its COMPLETE
  marker (``submit`` does both).
* ``progress()`` pops each peer's pending ops **up to the first COMPLETE**, coalesces them (merge only
  when both the remote and the local ranges are contiguous) and posts one backend transfer per request.
  When all of a request's transfers are DONE the request is ready (event ``"done"``) and its COMPLETE is
  sent to the peer, but only once the peer ACKed the previous COMPLETE (one completion slot per peer pair:
  no write-after-write on it). Reads of later requests are posted meanwhile, never waiting for an ACK.

Target side (prefill in pull mode, decode in push mode): ``progress()`` answers each COMPLETE with an ACK
and *then* reports event ``"complete"``; the owner releases the request's KV only on that event.

Failures (a FAILED transfer, e.g. a dead peer or ``transfer_timeout_s``) give event ``"failed"``; the
request's other pending ops are dropped and no COMPLETE is sent. One instance per agent; all methods are
called from one thread (the scheduler loop).
"""

from __future__ import annotations

import collections
import logging
import time
import zlib
from dataclasses import dataclass, field
from typing import Optional, Union

import ctypes
import numpy as np

from sglang.srt.disaggregation.transfer.base import (OpsLike, TransferBackend, TransferError, TransferHandle,
                                                     TransferState, as_op_array)
from sglang.srt.disaggregation.transfer.kv_plan import coalesce_array

logger = logging.getLogger(__name__)

_PREFIX = b"kvd|"
_MAX_FINISHED = 10_000  # finished requests whose stats are kept until pop_stats (oldest dropped first)
Room = Union[int, str]


def encode_ctrl(kind: str, room: Room) -> bytes:
    """Control message ``b"kvd|<kind>|<room>"`` (kind "C" = COMPLETE, "A" = ACK)."""
    return _PREFIX + kind.encode() + b"|" + str(room).encode()


def decode_ctrl(msg: bytes) -> Optional[tuple[str, str]]:
    """``(kind, room)`` of a control message, None for any other notification."""
    if not msg.startswith(_PREFIX):
        return None
    parts = msg[len(_PREFIX):].split(b"|", 1)
    return (parts[0].decode(), parts[1].decode()) if len(parts) == 2 else None


@dataclass
class TransferStats:
    """Per-request transfer statistics (for ``meta_info`` and ``/metrics``).

    Attributes:
        room: request id (``bootstrap_room``) as str; peer: remote agent.
        bytes: bytes moved; ops_planned: per-block ops enqueued; reads_posted: ranges posted after
            coalescing; transfers_posted: backend calls.
        enqueued_at / first_post_at / done_at: ``time.monotonic()`` stamps (None until reached).
        state: "queued", "posted", "done", "failed", "aborted"; error: reason when failed.
    """

    room: str
    peer: str
    bytes: int = 0
    ops_planned: int = 0
    reads_posted: int = 0
    transfers_posted: int = 0
    enqueued_at: float = field(default_factory=time.monotonic)
    first_post_at: Optional[float] = None
    done_at: Optional[float] = None
    state: str = "queued"
    error: str = ""

    @property
    def transfer_time_s(self) -> float:
        """Seconds from the first post to the last transfer DONE (0 before)."""
        if self.first_post_at is None or self.done_at is None:
            return 0.0
        return self.done_at - self.first_post_at

    @property
    def queue_time_s(self) -> float:
        """Seconds from the first enqueue to the first post (0 before)."""
        return 0.0 if self.first_post_at is None else self.first_post_at - self.enqueued_at

    def to_dict(self) -> dict:
        """Flat dict with SGLang-style ``meta_info`` keys."""
        return {"transfer_bytes": self.bytes, "transfer_reads_posted": self.reads_posted,
                "transfer_ops_planned": self.ops_planned, "transfer_time": self.transfer_time_s,
                "transfer_queue_time": self.queue_time_s, "transfer_state": self.state}


@dataclass(frozen=True)
class TransferEvent:
    """What ``progress`` reports.

    kind: "done" (initiator: request's data moved), "failed" (initiator: it did not; ``detail`` says
    why), "acked" (initiator: peer ACKed the COMPLETE), "ack_timeout" (no ACK within
    ``transfer_timeout_s``; the slot is freed), "complete" (target: peer finished the request; we ACKed,
    release its KV now), "notif" (any other notification, raw in ``msg``).
    """

    kind: str
    room: str
    peer: str
    detail: str = ""
    msg: bytes = b""


@dataclass
class _Req:
    stats: TransferStats
    handles: list[TransferHandle] = field(default_factory=list)
    completed: bool = False  # its COMPLETE marker was popped


class TransferQueue:
    """KVDirect's transfer queue for one agent (see the module docstring).

    Args:
        backend: this process's transfer agent.
        mode: "read" (pull: the initiator reads the peer's KV) or "write" (push: it writes into the peer's).
        max_unacked_completes: COMPLETEs in flight per peer before an ACK (1 = one completion slot).
    Raises:
        ValueError: unknown mode or a non-positive ``max_unacked_completes``.
    """

    def __init__(self, backend: TransferBackend, mode: str = "read", max_unacked_completes: int = 1):
        if mode not in ("read", "write"):
            raise ValueError(f"mode={mode!r}; use 'read' (pull) or 'write' (push)")
        if max_unacked_completes < 1:
            raise ValueError(f"max_unacked_completes={max_unacked_completes} must be >= 1")
        self.backend, self.mode, self.max_unacked = backend, mode, max_unacked_completes
        self._pending: dict[str, collections.deque] = {}  # peer -> deque of ("ops", room, arr) | ("C", room)
        self._reqs: dict[str, _Req] = {}
        self._unacked: dict[str, dict[str, float]] = {}  # peer -> {room: sent at}
        self._waiting_complete: dict[str, collections.deque] = {}  # peer -> rooms whose COMPLETE waits a slot
        self._done_stats: dict[str, TransferStats] = {}

    # ---- initiator API ---------------------------------------------------------------------------
    def enqueue(self, peer: str, room: Room, ops: OpsLike) -> None:
        """Queue per-block ops of request ``room`` towards ``peer`` (not coalesced yet).

        Raises:
            ValueError: the request already completed/failed, or it was queued for another peer.
        """
        key = str(room)
        arr = as_op_array(ops)
        req = self._reqs.get(key)
        if req is None:
            if key in self._done_stats:
                raise ValueError(f"request {key} already finished its transfer")
            req = self._reqs[key] = _Req(TransferStats(room=key, peer=peer))
        elif req.stats.peer != peer or req.completed:
            raise ValueError(f"request {key} is queued for {req.stats.peer!r} and completed={req.completed}")
        req.stats.ops_planned += len(arr)
        if len(arr):
            self._pending.setdefault(peer, collections.deque()).append(("ops", key, arr))

    def complete(self, peer: str, room: Room) -> None:
        """Queue request ``room``'s COMPLETE marker (no more ops follow)."""
        key = str(room)
        if key not in self._reqs:
            self._reqs[key] = _Req(TransferStats(room=key, peer=peer))
        self._pending.setdefault(peer, collections.deque()).append(("C", key))

    def submit(self, peer: str, room: Room, ops: OpsLike) -> None:
        """``enqueue`` + ``complete``."""
        self.enqueue(peer, room, ops)
        self.complete(peer, room)

    def handles(self, room: Room) -> list[TransferHandle]:
        """The posted transfers of request ``room`` while it is in the queue (``[]`` once finished or unknown); after
        :meth:`abort` the caller may check them with ``backend.in_flight`` before reusing their memory."""
        req = self._reqs.get(str(room))
        return list(req.handles) if req is not None else []

    def abort(self, room: Room, reason: str = "aborted") -> None:
        """Stop request ``room``: drop its pending ops and cancel its posted transfers that are still PENDING
        (:meth:`~.base.TransferBackend.cancel`: the fake backend never copies after that; NIXL aborts the
        transfer where the plugin can), so the caller may reuse the memory. No COMPLETE is sent."""
        key = str(room)
        req = self._reqs.get(key)
        if req is None:
            return
        for dq in self._pending.values():
            kept = [e for e in dq if e[1] != key]
            dq.clear()
            dq.extend(kept)
        for h in req.handles:
            if h.state is TransferState.PENDING:
                self.backend.cancel(h, f"aborted: {reason}")
        self._finish(req, "aborted", reason)

    def stats(self, room: Room) -> Optional[TransferStats]:
        """Stats of a request in flight or finished (None if unknown)."""
        key = str(room)
        req = self._reqs.get(key)
        return req.stats if req is not None else self._done_stats.get(key)

    def pop_stats(self, room: Room) -> Optional[TransferStats]:
        """Stats of a finished request, forgetting them."""
        return self._done_stats.pop(str(room), None)

    def busy_rooms(self) -> set[str]:
        """Requests with ops queued or transfers still PENDING."""
        busy = {k for k, r in self._reqs.items() if any(h.state is TransferState.PENDING for h in r.handles)}
        return busy | {e[1] for dq in self._pending.values() for e in dq}

    def has_pending(self) -> bool:
        """True while ops are queued, requests are in flight, or COMPLETEs wait for a slot or an ACK (the owner
        keeps calling :meth:`progress` until False)."""
        return bool(self._reqs or any(self._pending.values()) or any(self._unacked.values())
                    or any(self._waiting_complete.values()))

    # ---- the loop --------------------------------------------------------------------------------
    def progress(self, notifs: Optional[dict[str, list[bytes]]] = None) -> list[TransferEvent]:
        """Post queued ops, poll posted transfers, handle COMPLETE/ACK. ``notifs``: already-drained
        notifications (default: drain the backend). Never blocks."""
        events: list[TransferEvent] = []
        for peer in list(self._pending):
            self._post_until_complete(peer, events)
        self._poll(events)
        if notifs is None:
            notifs = self.backend.get_notifs()
        for peer, msgs in notifs.items():
            for msg in msgs:
                self._on_notif(peer, msg, events)
        self._expire_acks(events)
        return events

    def _post_until_complete(self, peer: str, events: list[TransferEvent]) -> None:
        dq = self._pending[peer]
        while dq:
            groups: dict[str, list[np.ndarray]] = {}
            completed: list[str] = []
            while dq:  # pop up to (and including) the first COMPLETE
                e = dq.popleft()
                if e[0] == "C":
                    completed.append(e[1])
                    break
                groups.setdefault(e[1], []).append(e[2])
            for key, arrs in groups.items():
                req = self._reqs.get(key)
                if req is None or req.stats.state in ("failed", "aborted"):
                    continue
                merged = coalesce_array(np.concatenate(arrs))
                self._post(peer, req, merged, events)
            for key in completed:
                req = self._reqs.get(key)
                if req is not None:
                    req.completed = True

    def _post(self, peer: str, req: _Req, arr: np.ndarray, events: list[TransferEvent]) -> None:
        st = req.stats
        now = time.monotonic()
        if st.first_post_at is None:
            st.first_post_at = now
        st.state = "posted"
        try:
            post = self.backend.read if self.mode == "read" else self.backend.write
            h = post(peer, arr)
        except (TransferError, ValueError) as e:
            self._fail(req, f"{type(e).__name__}: {e}", events)
            return
        req.handles.append(h)
        st.transfers_posted += 1
        st.reads_posted += len(arr)
        st.bytes += int(arr[:, 2].sum())

    def _poll(self, events: list[TransferEvent]) -> None:
        for key, req in list(self._reqs.items()):
            if req.stats.state != "posted" and not (req.completed and req.stats.state == "queued"):
                continue
            states = [self.backend.poll(h) for h in req.handles]
            failed = [h for h in req.handles if h.state is TransferState.FAILED]
            if failed:
                self._fail(req, failed[0].error or "transfer failed", events)
            elif req.completed and all(s is TransferState.DONE for s in states):
                req.stats.done_at = max((h.done_at or time.monotonic() for h in req.handles),
                                        default=time.monotonic())
                self._finish(req, "done")
                events.append(TransferEvent("done", key, req.stats.peer))
                self._send_complete(req.stats.peer, key, events)

    def _send_complete(self, peer: str, key: str, events: list[TransferEvent]) -> None:
        unacked = self._unacked.setdefault(peer, {})
        waiting = self._waiting_complete.setdefault(peer, collections.deque())
        if key is not None:
            waiting.append(key)
        while waiting and len(unacked) < self.max_unacked:
            room = waiting.popleft()
            try:
                self.backend.send_notif(peer, encode_ctrl("C", room))
                unacked[room] = time.monotonic()
            except TransferError as e:  # data is local already; the peer frees KV by its own timeout
                logger.warning("COMPLETE of %s to %s not delivered: %s", room, peer, e)
                events.append(TransferEvent("ack_timeout", room, peer, detail=str(e)))

    def _on_notif(self, peer: str, msg: bytes, events: list[TransferEvent]) -> None:
        ctrl = decode_ctrl(msg)
        if ctrl is None:
            events.append(TransferEvent("notif", "", peer, msg=msg))
            return
        kind, room = ctrl
        if kind == "C":  # target side: ACK first, then let the owner release the KV
            try:
                self.backend.send_notif(peer, encode_ctrl("A", room))
            except TransferError as e:
                logger.warning("ACK of %s to %s not delivered: %s", room, peer, e)
            events.append(TransferEvent("complete", room, peer))
        elif kind == "A":
            if self._unacked.get(peer, {}).pop(room, None) is None:
                logger.warning("unexpected ACK of %s from %s", room, peer)
                return
            events.append(TransferEvent("acked", room, peer))
            self._send_complete(peer, None, events)
        else:
            events.append(TransferEvent("notif", room, peer, msg=msg))

    def _expire_acks(self, events: list[TransferEvent]) -> None:
        limit = self.backend.config.transfer_timeout_s
        now = time.monotonic()
        for peer, unacked in self._unacked.items():
            for room, sent in list(unacked.items()):
                if now - sent > limit:
                    del unacked[room]
                    events.append(TransferEvent("ack_timeout", room, peer, detail=f"no ACK in {limit}s"))
                    self._send_complete(peer, None, events)

    def _fail(self, req: _Req, reason: str, events: list[TransferEvent]) -> None:
        key = req.stats.room
        for dq in self._pending.values():
            kept = [e for e in dq if e[1] != key or e[0] == "C"]
            dq.clear()
            dq.extend(kept)
        self._finish(req, "failed", reason)
        events.append(TransferEvent("failed", key, req.stats.peer, detail=reason))

    def _finish(self, req: _Req, state: str, error: str = "") -> None:
        req.stats.state, req.stats.error = state, error
        if req.stats.done_at is None:
            req.stats.done_at = time.monotonic()
        self._reqs.pop(req.stats.room, None)
        self._done_stats[req.stats.room] = req.stats
        while len(self._done_stats) > _MAX_FINISHED:  # callers pop_stats; bound what they forget
            self._done_stats.pop(next(iter(self._done_stats)))


def checksum_ranges(ranges) -> int:
    """CRC32 of host memory ``[(addr, nbytes), ...]`` in order (``--disaggregation-verify``: the decode side
    over the local ranges of its ops, the prefill side over the remote ranges of the same plan).
    Host memory only: GPU ranges must be copied to the host first."""
    crc = 0
    for addr, n in ranges:
        crc = zlib.crc32(ctypes.string_at(int(addr), int(n)), crc)
    return crc
