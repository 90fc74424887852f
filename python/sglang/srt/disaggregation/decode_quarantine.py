"""Decode-side slot quarantine: KV slots of a failed room that a transfer may still write into are not freed until it
cannot.

Push mode: the decode side allocates a room's KV slots when the request arrives and the prefill side WRITEs into
them. When the decode side gives the room up itself (client abort, its own bootstrap/heartbeat timeout, a bad
``RoomReady``) before the KV arrived, WRITEs posted by the prefill side may still be in the transport; freeing the
slots at once would let another request get them and a late WRITE overwrite its KV (HTTP 200 with wrong tokens). So
the room's slots (and request row) stay allocated here (they count as used for admission, ``/get_server_info``:
``disagg_slots_quarantined``) while the decode side sends ``RoomAbort``; they are freed when

* the prefill side answers ``RoomDrained`` (it stopped posting, cancelled its PENDING WRITEs and saw the in-flight ones
  settle, ``push_room.py``), or a ``RoomFailed`` of its own (sent only after that drain), or
* the prefill server is known gone (silent past ``--disaggregation-heartbeat-timeout``: its agents are disconnected), or
* the deadline passes (the transfer timeout + margin; logged as an error naming the room).

Pull mode: the decode side posts the READs itself; a failed room's PENDING READs are cancelled, and its slots wait
here only while one of its READs is still ``in_flight`` on this rank (same deadline).

Every decode rank frees a room at the same step (agreed, min over the ranks). The fail-closed ordering is ours; the
push transfer itself follows KVDirect (Chen et al. 2024, sec. 4.3).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

logger = logging.getLogger(__name__)


@dataclass
class QuarantinedRoom:
    """KV held for a failed room. ``row``: request row; ``loc``: int64 slot tensor on the pool device (``n`` slots);
    ``server``: (bootstrap host, port) of its prefill server; ``handles``: this rank's READs (pull) that may still be
    in flight (``stage``: the staging chunk they may write into); ``awaiting_prefill``: push, until the prefill side
    confirms its drain; ``since`` / ``deadline``: ``time.monotonic()`` seconds."""

    room: int
    row: int
    loc: Any
    n: int
    server: tuple[str, int]
    awaiting_prefill: bool
    since: float
    deadline: float
    reason: str = ""
    handles: list = field(default_factory=list)
    stage: Any = None  # pull, heterogeneous TP: the room's staging chunk (READs land there), freed with the slots


class SlotQuarantine:
    """The quarantined rooms of one decode rank (module doc).

    Args:
        deadline_s: most seconds a room stays quarantined (> 0; the transfer timeout + margin).
    Raises:
        ValueError: ``deadline_s`` <= 0.
    """

    def __init__(self, deadline_s: float):
        if not deadline_s > 0:
            raise ValueError(f"SlotQuarantine deadline_s={deadline_s} must be > 0")
        self.deadline_s = float(deadline_s)
        self.rooms: dict[int, QuarantinedRoom] = {}
        self.expired = 0  # rooms freed by the deadline (``/get_server_info``: disagg_quarantine_expired)

    def add(self, room: int, row: int, loc: Any, n: int, server: tuple[str, int], awaiting_prefill: bool,
            reason: str, handles: list = (), stage: Any = None) -> None:
        """Hold ``room``'s request row and ``n`` KV slots ``loc`` (see :class:`QuarantinedRoom`)."""
        t = time.monotonic()
        self.rooms[room] = QuarantinedRoom(room, row, loc, n, server, awaiting_prefill, t, t + self.deadline_s,
                                           reason, list(handles), stage)

    def confirm(self, room: int) -> None:
        """The prefill side reported ``room`` drained (``RoomDrained``, or its own ``RoomFailed``)."""
        q = self.rooms.get(room)
        if q is not None:
            q.awaiting_prefill = False

    def prefill_gone(self, server: tuple[str, int]) -> None:
        """The prefill server ``server`` is gone (forgotten as silent, its agents disconnected): none of its WRITEs
        can still be posted, so its rooms no longer wait for a confirmation."""
        for q in self.rooms.values():
            if q.server == server and q.awaiting_prefill:
                logger.warning("room %d: prefill server %s:%d gone; its quarantined slots are freed", q.room, *server)
                q.awaiting_prefill = False

    def poll(self, in_flight: Callable[[Any], bool], agree: Callable[[list[int]], list[int]]) -> list[QuarantinedRoom]:
        """The rooms to free now on every rank (``in_flight``: the backend's check of a handle; ``agree``:
        element-wise min over the TP ranks), removed from here. The caller frees their slots and rows. A room still
        busy past its deadline is freed with an error in the log."""
        rooms = sorted(self.rooms)
        t = time.monotonic()
        busy = [self.rooms[room].awaiting_prefill or any(in_flight(h) for h in self.rooms[room].handles)
                for room in rooms]
        codes = agree([2 if not b or t > self.rooms[room].deadline else 1 for room, b in zip(rooms, busy)])
        out = []
        for room, b, code in zip(rooms, busy, codes):
            if code != 2:
                continue
            q = self.rooms.pop(room)
            if b:
                self.expired += 1
                logger.error("room %d: %s %.1f s after the room failed (%s); freeing its %d quarantined KV slots "
                             "anyway", room, "no RoomDrained from the prefill side" if q.awaiting_prefill
                             else "READs still in flight", t - q.since, q.reason, q.n)
            out.append(q)
        return out

    def num_slots(self) -> int:
        """KV slots held here (``/get_server_info``: disagg_slots_quarantined)."""
        return sum(q.n for q in self.rooms.values())
