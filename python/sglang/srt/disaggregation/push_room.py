"""Push mode on the prefill side: planning a room's WRITEs, and failing a room closed when one of them fails.

A push-mode room posts many WRITEs (one per layer and decode rank; layerwise, they are posted while the forward still
runs, ``layerwise.py``). When one fails (or the room fails for any other reason while they are posted), the others
may still be queued in the transport or moving bytes: a WRITE that is still reading the prefill KV after those slots
were freed (and reused by another request) would carry that request's KV, and one that lands after the decode side
freed its preallocated slots (on ``RoomFailed``) would overwrite KV the decode side gave to another request, which
then answers HTTP 200 with wrong tokens. So a failing room is drained before anything is freed
(:class:`PushDrain`):

1. the layerwise job is stopped (no later layer is posted; checked under the posting lock), and every WRITE of the
   room that is still PENDING is cancelled (``TransferBackend.cancel``: one not started yet never moves a byte);
2. the room waits, holding its prefill KV, until no WRITE of it is ``in_flight`` on this rank (cancelled ones that
   were already in the transport finish or fail there), agreed over the TP ranks (min: all ranks free at one step);
   at the latest ``deadline_s`` after it began (the transport's own ``transfer_timeout_s`` plus slack), then it is
   freed anyway with an error in the log;
3. only then is ``RoomFailed`` sent to the decode side (which frees its slots and fails the request: an error, never a
   hang) and the prefill request failed (its KV goes back through the scheduler's ``FinishRequest``).

When the *decode* side gives a room up (``RoomAbort``: client abort, its own timeout), it keeps the room's slots
quarantined (``decode_quarantine.py``) until this side answers ``RoomDrained``: the room fails here as above (posting
stopped, PENDING WRITEs cancelled) and :class:`DrainConfirms` sends ``RoomDrained`` once none of the room's WRITEs is
``in_flight`` on any TP rank (agreed). Past ``deadline_s`` it gives up without confirming (logged; the decode side
then frees by its own, later deadline). Likewise a prefill request aborted by its client after layerwise WRITEs were
posted during its forward: they are stopped/cancelled and its ``RoomFailed`` waits until they settled.

KVDirect (Chen et al. 2024, sec. 4.3) describes the push alternative; the fail-closed ordering here is ours.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Sequence

from sglang.srt.disaggregation.messages import RoomDrained
from sglang.srt.disaggregation.slot_plan import assign_sources, copies_by_layer, plan_slot_copies
from sglang.srt.disaggregation.transfer.base import TransferState
from sglang.srt.mem_cache.kv_descriptor import KVRegionDescriptor

logger = logging.getLogger(__name__)


def plan_push(agent, slots: Sequence[int], peer) -> list[tuple[str, list]]:
    """This rank's WRITEs of a request's prompt KV (prefill ``slots``) into the decode side's ``peer.dst_slots``.

    Args:
        agent: the rank's :class:`~sglang.srt.disaggregation.agent.DisaggAgent` (``desc``, ``heads``, ``ranks``,
            ``tp_rank``, ``ensure_connected``).
        slots: the request's prefill KV slots, one per prompt token.
        peer: the decode side's :class:`~sglang.srt.disaggregation.messages.RoomRequest`.
    Returns:
        ``[(decode agent name, [int64 [N, 3] rows (remote = decode address, local = prefill address, nbytes) per
        layer])]``, planned once (index x stride, coalesced; ``plan_slot_copies`` + ``copies_by_layer``). Connects
        to the decode ranks lazily.
    Raises:
        ValueError: a wrong number of decode slots, or unusable layouts.
    """
    if peer.dst_slots is None or len(peer.dst_slots) != len(slots):
        raise ValueError(f"push needs {len(slots)} decode slots, got "
                         f"{None if peer.dst_slots is None else len(peer.dst_slots)}")
    out = []
    for info in peer.decode_ranks:
        dst = KVRegionDescriptor.from_dict(info["kv"])
        mine = [h for src, h in assign_sources(agent.ranks, (info["head_lo"], info["head_hi"]))
                if src["rank"] == agent.tp_rank]  # heads this rank writes to that decode rank
        if not mine:
            continue
        copies = plan_slot_copies(agent.desc, agent.heads, list(slots), dst, (info["head_lo"], info["head_hi"]),
                                  peer.dst_slots, heads=mine[0])
        if not len(copies):
            continue
        name = agent.ensure_connected(info)
        out.append((name, [c[:, [1, 0, 2]] for c in copies_by_layer(copies, agent.desc, side=0)]))
    return out


@dataclass
class DrainingRoom:
    """A failed push room whose prefill KV stays held until none of its WRITEs can still move bytes.

    ``room``: the ``PrefillRoom`` (its ``req`` holds the KV); ``reason`` / ``status_code``: how the request fails;
    ``notify``: send ``RoomFailed`` to the decode side once drained; ``handles``: the room's WRITE handles on this
    rank; ``since`` / ``deadline``: ``time.monotonic()`` seconds.
    """

    room: Any
    reason: str
    notify: bool
    status_code: int
    handles: list
    since: float
    deadline: float


class _WriteWait:
    """What :class:`PushDrain` and :class:`DrainConfirms` share: a rank's backend, the lock serializing backend calls
    with the layerwise posting thread, a drain deadline in seconds (> 0), and the in-flight check of a room's WRITEs.

    Raises:
        ValueError: ``deadline_s`` <= 0.
    """

    def __init__(self, backend, lock: Callable[[], ContextManager], deadline_s: float):
        if not deadline_s > 0:
            raise ValueError(f"{type(self).__name__} deadline_s={deadline_s} must be > 0")
        self.backend, self.lock, self.deadline_s = backend, lock, float(deadline_s)

    def _in_flight(self, handles: list) -> list:
        """The WRITEs of ``handles`` that may still move bytes on this rank (``TransferBackend.in_flight``)."""
        with self.lock():
            return [h for h in handles if self.backend.in_flight(h)]


class PushDrain(_WriteWait):
    """The failed push rooms of one prefill rank that are draining (module doc).

    Args:
        backend: the rank's :class:`~sglang.srt.disaggregation.transfer.base.TransferBackend`.
        lock: ``() -> context manager`` serializing backend calls with the layerwise posting thread.
        deadline_s: most seconds a room drains before its KV is freed anyway (> 0).
    Raises:
        ValueError: ``deadline_s`` <= 0.
    """

    def __init__(self, backend, lock: Callable[[], ContextManager], deadline_s: float):
        super().__init__(backend, lock, deadline_s)
        self.rooms: dict[int, DrainingRoom] = {}
        self.cancelled = 0  # WRITEs cancelled by failing rooms (``/get_server_info``: disagg_push_writes_cancelled)

    def begin(self, r, reason: str, notify: bool, status_code: int, hold_kv: bool) -> bool:
        """Stop room ``r``'s layerwise posting and cancel its PENDING WRITEs. With ``hold_kv`` (the room holds
        prefill KV; must be the same on every rank) the room drains and True is returned: :meth:`poll` hands it back
        once drained. False: it holds no KV, the caller fails it now."""
        job = r.layerwise
        with self.lock():  # the posting thread re-checks job.error under this lock before each post
            if job is not None and not job.error:
                job.error = f"room closed: {reason}"
            handles = list({id(h): h for h in [*r.handles, *(job.handles if job is not None else [])]}.values())
            for h in handles:
                if h.state is TransferState.PENDING:
                    self.backend.cancel(h, f"room {r.room} failed: {reason}")
                    self.cancelled += 1
        if not hold_kv:
            return False
        t = time.monotonic()
        self.rooms[r.room] = DrainingRoom(r, reason, notify, status_code, handles, t, t + self.deadline_s)
        return True

    def _code(self, d: DrainingRoom, t: float) -> int:
        """2: no WRITE of the room can still move bytes on this rank (or its deadline passed); 1: wait."""
        busy = self._in_flight(d.handles)
        if busy and t > d.deadline:
            logger.error("room %d: %d WRITE(s) still in flight %.1f s after the room failed; freeing its KV anyway",
                         d.room.room, len(busy), t - d.since)
        return 1 if busy and t <= d.deadline else 2

    def poll(self, agree: Callable[[list[int]], list[int]]) -> list[DrainingRoom]:
        """The rooms every rank has drained (``agree``: element-wise min over the TP ranks), removed from here."""
        rooms = sorted(self.rooms)
        t = time.monotonic()
        codes = agree([self._code(self.rooms[room], t) for room in rooms])
        return [self.rooms.pop(room) for room, code in zip(rooms, codes) if code == 2]

    def rids(self) -> list[str]:
        """Requests whose KV is held by a draining room."""
        return [d.room.req.rid for d in self.rooms.values() if d.room.req is not None]


@dataclass
class PendingConfirm:
    """A message held until a room's WRITEs settled: ``endpoint`` (the decode leader's control socket) gets ``msg``
    (``RoomDrained(room)`` answering a ``RoomAbort``; ``RoomFailed`` for a room whose prefill request was aborted
    here) once none of ``handles`` (the room's WRITEs on this rank) is in flight; ``deadline``: ``time.monotonic()``
    seconds."""

    room: int
    endpoint: str
    handles: list
    deadline: float
    msg: Any


class DrainConfirms(_WriteWait):
    """Messages to the decode side that one prefill rank holds until the room's WRITEs drained: ``RoomDrained``
    answering a ``RoomAbort`` (module doc), ``RoomFailed`` of a room whose prefill request was aborted here while
    WRITEs posted during its forward may still land.

    Args:
        backend: the rank's :class:`~sglang.srt.disaggregation.transfer.base.TransferBackend`.
        lock: ``() -> context manager`` serializing backend calls with the layerwise posting thread.
        deadline_s: most seconds to wait for a drain before giving up without sending (> 0).
    Raises:
        ValueError: ``deadline_s`` <= 0.
    """

    def __init__(self, backend, lock: Callable[[], ContextManager], deadline_s: float):
        super().__init__(backend, lock, deadline_s)
        self.rooms: dict[int, PendingConfirm] = {}

    def add(self, room: int, endpoint: str, *holders, msg: Any = None) -> None:
        """Send ``msg`` (default ``RoomDrained(room)``) to ``endpoint`` once the WRITEs of ``holders``
        (``PrefillRoom`` / :class:`DrainingRoom` objects or None; call after the room's posting was stopped, so the
        lists are final) settled."""
        handles: dict[int, Any] = {}
        for x in (*holders, self.rooms.get(room)):  # an earlier pending message of the room: its WRITEs too
            job = getattr(x, "layerwise", None)
            for h in [*getattr(x, "handles", ()), *(job.handles if job is not None else ())]:
                handles[id(h)] = h
        self.rooms[room] = PendingConfirm(room, endpoint, list(handles.values()), time.monotonic() + self.deadline_s,
                                          msg if msg is not None else RoomDrained(room))

    def poll(self, agree: Callable[[list[int]], list[int]]) -> list[PendingConfirm]:
        """The confirmations to send now (drained on every rank; ``agree``: element-wise min over the TP ranks),
        removed from here; those past their deadline are dropped with an error in the log."""
        rooms = sorted(self.rooms)
        t = time.monotonic()
        codes = [1 if self._in_flight(self.rooms[room].handles) else 2 for room in rooms]
        codes = [0 if c == 1 and t > self.rooms[room].deadline else c for room, c in zip(rooms, codes)]
        out = []
        for room, code in zip(rooms, agree(codes)):
            if code == 0:
                c = self.rooms.pop(room)
                logger.error("room %d: its WRITEs are still in flight after %.1f s; %s not sent (the decode side frees "
                             "its slots by its own deadline)", room, self.deadline_s, type(c.msg).__name__)
            elif code == 2:
                out.append(self.rooms.pop(room))
        return out
