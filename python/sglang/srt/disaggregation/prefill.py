"""The prefill role's connector: run the prompt, sample the first token, hold the KV until the decode
side has it (KVDirect sec. 4.3), then free it through the prefix cache (so later prompts hit it).

Room life cycle on the prefill side (all ranks change state at the same step; see ``agent.py``)::

    request arrives  ->  prefill runs like aggregated (max one new token)  ->  hold(req): KV kept
    RoomRequest from the decode leader (may come before or after the prefill)
    pull: send RoomReady(slots, first token, ...)           push: WRITE layer by layer, then RoomReady
    (push, RoomRequest before the forward of the request's last chunk: each layer's WRITEs are posted while the
    forward runs, see ``layerwise.py``; RoomRequest after it: every layer's WRITEs are posted at once)
    pull: every decode rank that reads from this rank sends a COMPLETE (backend notification, through the
          TransferQueue, KVDirect sec. 4.2); the queue ACKs it, and once every prefill rank got all of its
          COMPLETEs (agreed) -> release: KV to the prefix cache, the request finishes with its one token
    push: RoomAck (ZMQ) from the decode leader -> release
    RoomFailed, no RoomRequest within the bootstrap timeout, or a silent decode peer past the heartbeat
    timeout -> the request fails (its KV is freed)
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from sglang.srt.disaggregation.agent import now
from sglang.srt.disaggregation.bootstrap import BootstrapServer
from sglang.srt.disaggregation.connector import BaseConnector, Decision, FinishRequest, QueueRequest, \
    bootstrap_fields_error, reject
from sglang.srt.disaggregation.layerwise import LayerwisePush, LayerwisePushListener
from sglang.srt.disaggregation.messages import Heartbeat, HeartbeatAck, RoomAbort, RoomAck, RoomFailed, RoomReady, \
    RoomRequest
from sglang.srt.disaggregation.push_room import DrainConfirms, PushDrain, plan_push
from sglang.srt.disaggregation.slot_plan import readers_of
from sglang.srt.mem_cache.kv_descriptor import check_peer_ranks

logger = logging.getLogger(__name__)


@dataclass
class PrefillRoom:
    """One room on the prefill side: the held request and/or the decode side's request for it."""

    room: int
    req: Any = None  # the finished-prefill Req whose KV is held (None until hold())
    peer: Optional[RoomRequest] = None  # the decode side's RoomRequest (None until it arrives)
    state: str = "wait"  # wait | pushing | wait_ack
    created: float = field(default_factory=now)
    handles: list = field(default_factory=list)
    push_start: float = 0.0
    push_bytes: int = 0
    push_reads: int = 0
    fail_reason: str = ""
    expiring: bool = False  # the leader injected its failure already
    expect: set = field(default_factory=set)  # pull: decode agents whose COMPLETE this rank waits for
    completes: set = field(default_factory=set)  # pull: decode agents whose COMPLETE arrived (and was ACKed)
    layerwise: Optional[LayerwisePush] = None  # push planned before the forward (posted layer by layer)


class PrefillConnector(BaseConnector):
    """Prefill role (see the module doc). The leader rank also runs the bootstrap server."""

    TRANSFER_STATE = "pushing"  # push mode: WRITEs posted, not all done (pull: never; the decode side reads)

    def __init__(self, scheduler):
        super().__init__(scheduler)
        self.rooms: dict[int, PrefillRoom] = {}
        self.peer_seen: dict[str, float] = {}
        self.failed_rooms: dict[int, str] = {}  # rooms that failed before the decode side asked for them
        self.rid_room: dict[str, int] = {}  # requests not finished yet -> their room
        self.bootstrap = None
        if self.agent.is_leader:
            route = {"endpoint": self.agent.endpoint, "tp_size": self.agent.tp_size, "ranks": self.agent.ranks,
                     "total_kv_heads": self.agent.total_kv_heads, "page_size": self.args.page_size,
                     "transfer_mode": self.transfer_mode, "backend": self.args.disaggregation_transfer_backend}
            self.bootstrap = BootstrapServer(self.args.host, self.args.disaggregation_bootstrap_port, route)
        self.stats.update(push_layerwise=0, push_after_forward=0)
        # push mode: requests waiting for their RoomRequest before they prefill, room -> (req, since), arrival order
        self.push_waiting: dict[int, tuple[Any, float]] = {}
        self.listener: Optional[LayerwisePushListener] = None
        # failed push rooms hold their KV until no WRITE of theirs can still move bytes (push_room.py)
        self.drain = PushDrain(self.agent.backend, self._backend_lock,
                               self.agent.backend.config.transfer_timeout_s + 5.0)
        self.confirms = DrainConfirms(self.agent.backend, self._backend_lock, self.drain.deadline_s)  # RoomAbort
        executor = getattr(scheduler.runner, "executor", None)
        if self.transfer_mode == "push" and executor is not None:
            if executor.supports_kv_layer_listener:
                self.listener = LayerwisePushListener(self.agent.backend)
                executor.set_kv_layer_listener(self.listener)
            else:
                logger.info("push mode: the %s executor reports no KV layers; every push is posted after the "
                            "forward", executor.name)

    # ---- scheduler hooks -----------------------------------------------------------------------------
    def intercept(self, req, msg) -> list[Decision]:
        """Record the room of a new request; it then prefills like an aggregated request with one new token
        (``[QueueRequest]``). Push mode may keep it until its RoomRequest arrives (``[]``); unusable bootstrap
        fields finish it with a 400 (``[FinishRequest]``)."""
        req.bootstrap_room = msg.bootstrap_room
        err = bootstrap_fields_error(req)
        if err:
            return [reject(req, err)]
        if (req.bootstrap_room in self.rooms and self.rooms[req.bootstrap_room].req is not None) \
                or req.bootstrap_room in self.drain.rooms:  # a failed room still draining its WRITEs
            return [reject(req, f"bootstrap_room {req.bootstrap_room} is already in use")]
        self.rid_room[req.rid] = req.bootstrap_room
        req.max_new_tokens_cap = 1  # the first token is sampled here, the rest on the decode side
        req.disagg_info = {"bootstrap_room": req.bootstrap_room}
        r = self.rooms.get(req.bootstrap_room)
        if self.listener is not None and self.args.disaggregation_push_wait_timeout > 0 \
                and (r is None or r.peer is None):
            self.push_waiting[req.bootstrap_room] = (req, now())  # released by _poll_push_waiting
            return []
        return [QueueRequest(req)]

    def hold(self, req) -> bool:
        """Called when ``req`` finished; keep its KV for the decode side unless it was aborted (True: kept; the
        scheduler drops it from ``running``, and a later decision finishes it)."""
        room = req.bootstrap_room
        if room is None or req.finished_reason is None or req.finished_reason.get("type") == "abort":
            if room is not None:
                self.rid_room.pop(req.rid, None)
                self._forget(room, "the prefill request was aborted")
            return False
        self.rid_room.pop(req.rid, None)
        r = self.rooms.setdefault(room, PrefillRoom(room))
        r.req, r.created = req, now()
        req.disagg_info["prefill_queue_s"] = (req.admit_time - req.arrival_time) if req.admit_time else 0.0
        return True

    def abort(self, rid: str) -> list[Decision]:
        """The client went away: drop the held KV of its room (the decode side gets RoomFailed)."""
        for room, (req, _) in list(self.push_waiting.items()):
            if req.rid == rid:  # still waiting for its RoomRequest: it holds no KV
                del self.push_waiting[room]
                req.finished_reason = {"type": "abort", "message": "aborted by the client", "status_code": 499}
                self.decide(FinishRequest(req))
        for r in list(self.rooms.values()):
            if r.req is not None and r.req.rid == rid:
                self._finish(r, "aborted by the client", notify=True, status_code=499)
        room = self.rid_room.pop(rid, None)
        if room is not None:  # aborted before its prefill finished (the scheduler freed its KV)
            self._forget(room, "the prefill request was aborted by the client")
        return self.take_decisions()

    def open_rids(self) -> list[str]:
        """Requests with an open room."""
        return [r.req.rid for r in self.rooms.values() if r.req is not None] + list(self.rid_room) + self.drain.rids()

    def has_work(self) -> bool:
        """Rooms whose KV is held or being pushed, requests waiting for their RoomRequest, and drains the decode side
        waits for keep the loop spinning (heartbeats, timeouts)."""
        return bool(self.push_waiting or self.drain.rooms or self.confirms.rooms) or \
            any(r.req is not None for r in self.rooms.values())

    def num_open(self) -> int:
        return sum(1 for r in self.rooms.values() if r.req is not None) + len(self.drain.rooms)

    def internal_state(self) -> dict[str, Any]:
        """Counters for ``/get_server_info`` (plus rooms the decode side asked for whose prefill has not finished)."""
        return {**super().internal_state(),
                "disagg_rooms_awaiting_prefill": sum(1 for r in self.rooms.values() if r.req is None and r.peer),
                "disagg_push_waiting": len(self.push_waiting), "disagg_rooms_draining": len(self.drain.rooms),
                "disagg_push_writes_cancelled": self.drain.cancelled}

    def before_forward(self, batch, mwb) -> None:
        """Push mode: plan the layerwise WRITEs of every request whose last chunk runs in ``batch`` and whose
        decode side already sent its RoomRequest (with ``dst_slots``), and arm the listener with them. The last
        chunk's WRITEs cover every prompt position (earlier chunks and prefix hits were stored before), so
        chunked requests take the layerwise path too. A request whose plan fails here falls back to the
        after-the-fact push, which fails its room closed with the same error."""
        if self.listener is None:
            return
        self.listener.disarm()
        jobs = []
        layers = self.agent.desc.size("layer")
        for req in batch.reqs:
            room = self.rid_room.get(req.rid)
            r = self.rooms.get(room) if room is not None else None
            if r is None or r.peer is None or r.req is not None or r.layerwise is not None \
                    or r.peer.mode != "push" or r.expiring:
                continue
            if req.kv_len + req.extend_len < len(req.origin_input_ids):
                continue  # not its last chunk
            try:
                with self.listener.lock:  # connect() may run while the posting thread posts earlier layers
                    plan = self._plan_push(req, r.peer)
                r.layerwise = LayerwisePush(room, plan, layers)
            except Exception as e:  # noqa: BLE001 - the after-the-fact push reports it (fail closed there)
                logger.info("room %d: no layerwise push (%s); pushing after the forward", room, e)
                continue
            jobs.append(r.layerwise)
        if jobs:
            self.listener.arm(list(mwb.req_pool_indices), jobs)

    # ---- one poll per scheduler step ----------------------------------------------------------------
    def poll(self) -> list[Decision]:
        """Handle control messages, advance pushes, send RoomReady, expire rooms (see the module doc); returns the
        requests to queue (push mode) and the rooms finished (hand-off done, or failed)."""
        if self.listener is not None:
            self.listener.disarm()  # jobs armed for a forward that did not report layers fall back
        if self.agent.is_leader:
            self._check_timeouts()
        for msg in self.agent.recv():
            self._on_message(msg)
        if self.push_waiting:
            self._poll_push_waiting()
        for r in list(self.rooms.values()):
            if r.state == "wait" and r.req is not None and r.peer is not None:
                self._start(r)
        self._poll_pushes()
        for d in self.drain.poll(self.agent.agree):  # failed push rooms none of whose WRITEs can still move bytes
            self._close_now(d.room, d.reason, d.notify, d.status_code)
        for c in self.confirms.poll(self.agent.agree):  # RoomDrained / RoomFailed once drained on every rank
            self.agent.send(c.endpoint, c.msg)
        self._poll_completes()
        return self.take_decisions()

    def _poll_push_waiting(self) -> None:
        """Push mode: hand requests to the scheduler once their RoomRequest arrived (their forward then writes each
        layer's KV to the decode side as it goes) or after ``--disaggregation-push-wait-timeout`` (written after the
        forward). Like SGLang's prefill bootstrap queue, but bounded. Every rank releases the same requests at the
        same step (the arrival of a RoomRequest is seen by all ranks at once; expiry is agreed, min over ranks)."""
        t, wait = now(), self.args.disaggregation_push_wait_timeout
        rooms = list(self.push_waiting)
        ready = [1 if (room in self.rooms and self.rooms[room].peer is not None)
                 or t - self.push_waiting[room][1] > wait else 0 for room in rooms]
        for room, ok in zip(rooms, self.agent.agree(ready)):
            if ok:
                req, since = self.push_waiting.pop(room)
                req.disagg_info["push_wait_s"] = t - since
                self.decide(QueueRequest(req))

    def _on_message(self, msg) -> None:
        if isinstance(msg, RoomRequest):
            self.peer_seen[msg.endpoint] = now()
            if msg.room in self.failed_rooms:
                self.agent.send(msg.endpoint, RoomFailed(msg.room, self.failed_rooms.pop(msg.room)))
                return
            r = self.rooms.setdefault(msg.room, PrefillRoom(msg.room))
            r.peer = msg
        elif isinstance(msg, RoomAck):  # push mode only; pull releases on the queue's COMPLETE (_poll_completes)
            r = self.rooms.get(msg.room)
            if r is not None and r.state == "wait_ack" and self.transfer_mode == "push":
                self._finish(r, None)
        elif isinstance(msg, RoomFailed):
            r = self.rooms.get(msg.room)
            if r is not None:
                self._finish(r, msg.reason, notify=msg.local)
        elif isinstance(msg, RoomAbort):  # the decode side holds the slots until RoomDrained (push_room.py)
            r = self.rooms.get(msg.room)
            if r is not None:
                self._finish(r, msg.reason)
            self.confirms.add(msg.room, msg.endpoint, r, self.drain.rooms.get(msg.room))
        elif isinstance(msg, Heartbeat):
            self.peer_seen[msg.endpoint] = now()
            self.agent.send(msg.endpoint, HeartbeatAck(self.agent.endpoint))

    def _start(self, r: PrefillRoom) -> None:
        req, peer = r.req, r.peer
        if peer.mode != self.transfer_mode:
            self._finish(r, f"transfer mode mismatch: prefill runs --disaggregation-transfer-mode "
                            f"{self.transfer_mode}, decode {peer.mode}")
            return
        try:  # KV bytes move unconverted: the decode side must store the same format (dtype, FP8 scales)
            if peer.decode_ranks:
                check_peer_ranks(self.agent.desc, peer.decode_ranks, "prefill", "decode")
        except ValueError as e:  # same on every rank (same RoomRequest)
            self._finish(r, f"refusing the decode server: {e}", notify=True)
            return
        if self.transfer_mode == "pull":
            try:
                if not peer.decode_ranks:
                    raise ValueError("the decode side's RoomRequest lists no decode ranks")
                r.expect = self._completers(peer)
            except ValueError as e:  # same on every rank (same RoomRequest, same route)
                self._finish(r, f"bad RoomRequest: {e}", notify=True)
                return
            self._send_ready(r)
            return
        job = r.layerwise
        if job is not None and job.started:  # posted layer by layer during the forward (layerwise.py)
            r.push_start, r.push_bytes, r.push_reads = job.start, job.nbytes, job.num_ops
            r.handles = job.handles  # complete once job.done (_poll_pushes waits for that)
            req.disagg_info["push_layerwise"] = True
            self.stats["push_layerwise"] += 1
            r.state = "pushing"
            return
        r.layerwise = None  # armed for a forward that never reported its layers
        req.disagg_info["push_layerwise"] = False
        self.stats["push_after_forward"] += 1
        # push after the forward: WRITE this rank's heads into every decode rank that holds some of them, layer
        # by layer (all posted now)
        try:
            r.push_start = time.monotonic()
            with self._backend_lock():
                for name, layers in self._plan_push(req, peer):
                    for rows in layers:
                        if len(rows):
                            r.handles.append(self.agent.backend.write(name, rows))
                            r.push_bytes += int(rows[:, 2].sum())
                            r.push_reads += len(rows)
            r.state = "pushing"
        except Exception as e:  # noqa: BLE001 - any local failure fails this room only (agreed in _poll_pushes)
            logger.warning("room %d: push failed to start: %s", r.room, e)
            r.fail_reason = f"push failed to start on the prefill side: {e}"
            r.state = "pushing"

    def _backend_lock(self):
        """The lock shared with the layerwise posting thread (a no-op context without a listener)."""
        return self.listener.lock if self.listener is not None else contextlib.nullcontext()

    def _plan_push(self, req, peer: RoomRequest) -> list[tuple[str, list]]:
        """This rank's WRITEs of ``req``'s prompt KV into ``peer.dst_slots`` (:func:`~.push_room.plan_push`)."""
        return plan_push(self.agent, self._slots(req), peer)

    def _poll_pushes(self) -> None:
        from sglang.srt.disaggregation.transfer.base import TransferState

        pushing = sorted(r.room for r in self.rooms.values() if r.state == "pushing")
        codes = []
        for room in pushing:
            r = self.rooms[room]
            job = r.layerwise  # layerwise: r.handles is job.handles, appended by the posting thread under the lock
            with self._backend_lock():
                bad = [h.error for h in r.handles if self.agent.backend.poll(h) is TransferState.FAILED]
                pending = any(h.state is TransferState.PENDING for h in r.handles)
            r.fail_reason = r.fail_reason or (job.error if job is not None else "") or \
                (f"a KV WRITE to the decode side failed: {bad[0] or 'transfer failed'}" if bad else "")
            # one failed WRITE fails the room at once, even while later layers still wait to be posted
            codes.append(0 if r.fail_reason else (1 if pending or (job is not None and not job.done) else 2))
        for room, code in zip(pushing, self.agent.agree(codes)):
            r = self.rooms[room]
            if code == 0:  # its other WRITEs are cancelled and drained before the decode side hears of it
                self._finish(r, r.fail_reason or "a KV WRITE to the decode side failed on another rank", notify=True)
            elif code == 2:
                t = time.monotonic()  # layerwise: the tail after the last layer was posted (the forward's end)
                end = r.layerwise.end if r.layerwise is not None and r.layerwise.end else r.push_start
                self._send_ready(r, push_time=t - r.push_start, layerwise=r.layerwise is not None,
                                 push_tail=max(t - end, 0.0))

    def _completers(self, peer: RoomRequest) -> set[str]:
        """Pull mode: the decode agents that read heads from this rank (as decode's ``assign_sources`` picks
        them), each of which sends one COMPLETE for the room. Connects to them so the ACK can be sent (NIXL
        addresses notifications by loaded metadata); a failed connect only loses the ACK (logged)."""
        out = set()
        for info in readers_of(self.agent.tp_rank, self.agent.ranks, peer.decode_ranks):
            out.add(info["agent"])
            try:
                self.agent.ensure_connected(info)
            except Exception as e:  # noqa: BLE001 - the decode side then sees an ACK timeout, nothing else
                logger.warning("cannot connect to decode agent %s for ACKs: %s", info["agent"], e)
        return out

    def _poll_completes(self) -> None:
        """Pull mode: ACK the COMPLETEs that arrived (this rank's TransferQueue, KVDirect sec. 4.2), then release
        the rooms for which every prefill rank has all of its COMPLETEs (min-agreed: all ranks release together)."""
        for ev in self.agent.queue.progress():
            if ev.kind != "complete":
                if ev.kind != "notif":
                    logger.debug("transfer queue event %s of %s from %s", ev.kind, ev.room, ev.peer)
                continue
            try:
                room = int(ev.room.split(":", 1)[0])
            except ValueError:
                logger.warning("COMPLETE with a malformed room %r from %s", ev.room, ev.peer)
                continue
            r = self.rooms.get(room)
            if r is not None:
                r.completes.add(ev.peer)
            else:
                logger.debug("COMPLETE of room %d from %s after the room closed", room, ev.peer)
        if self.transfer_mode != "pull":
            return
        waiting = sorted(r.room for r in self.rooms.values() if r.state == "wait_ack")
        codes = [2 if self.rooms[room].completes >= self.rooms[room].expect else 1 for room in waiting]
        for room, code in zip(waiting, self.agent.agree(codes)):
            if code == 2:
                self._finish(self.rooms[room], None)

    def _send_ready(self, r: PrefillRoom, push_time: float = 0.0, layerwise: bool = False,
                    push_tail: float = 0.0) -> None:
        req = r.req
        slots = self._slots(req)
        checksums: list[int] = []
        if self.args.disaggregation_verify:
            checksums = self._global_checksums(slots)
        lp = top = None
        if req.return_logprob and req.output_token_logprobs:
            lp = tuple(req.output_token_logprobs[0])
            if req.top_logprobs_num and req.output_top_logprobs:
                top = [tuple(x) for x in req.output_top_logprobs[0]]
        per_rank = self.agent.gather_concat([r.push_bytes, r.push_reads])  # push: every rank wrote its heads
        bytes_, reads = sum(per_rank[0::2]), sum(per_rank[1::2])
        self.agent.send(r.peer.endpoint, RoomReady(
            room=r.room, slots=slots, first_token=req.output_ids[0], cached_tokens=req.cached_tokens,
            output_logprob=lp, output_top_logprobs=top,
            input_token_logprobs=[tuple(x) for x in req.input_token_logprobs] if req.wants_input_logprobs() else None,
            input_top_logprobs=([[tuple(y) for y in x] for x in req.input_top_logprobs]
                                if req.wants_input_logprobs() and req.top_logprobs_num else None),
            checksums=checksums, prefill_queue_s=req.disagg_info.get("prefill_queue_s", 0.0),
            push_bytes=bytes_, push_reads=reads, push_time_s=push_time, push_layerwise=layerwise,
            push_tail_s=push_tail))
        req.disagg_info.update(transfer_bytes=bytes_, transfer_reads=reads, transfer_time_s=push_time)
        r.state = "wait_ack"
        r.created = now()

    def _global_checksums(self, slots: list[int]) -> list[int]:
        """crc32 per (layer, K/V, global head), layer-major: every rank's heads, gathered (collective)."""
        mine = self.agent.checksums(slots)
        allc = self.agent.gather_concat(mine)
        layers = self.agent.desc.size("layer")
        total = self.agent.total_kv_heads
        out = [0] * (layers * 2 * total)
        per_rank = len(mine)
        for info in self.agent.ranks:
            part = allc[info["rank"] * per_rank:(info["rank"] + 1) * per_rank]
            nh = info["head_hi"] - info["head_lo"]
            for i, c in enumerate(part):
                layer, rest = divmod(i, 2 * nh)
                kv, h = divmod(rest, nh)
                out[(layer * 2 + kv) * total + info["head_lo"] + h] = c
        return out

    def _slots(self, req) -> list[int]:
        return self.kv.slots_of(req.req_pool_idx, 0, len(req.origin_input_ids)).tolist()

    # ---- endings -------------------------------------------------------------------------------------
    def _finish(self, r: PrefillRoom, error: Optional[str], notify: bool = False, status_code: int = 500) -> None:
        """Close a room: success (``error`` None) finishes the request with its token; else it fails: a push room's
        WRITEs are stopped and cancelled, and one holding KV drains first (``push_room.py``, then
        :meth:`_close_now`)."""
        self.rooms.pop(r.room, None)
        # every push room holding KV drains (the same choice on every rank; one without WRITEs in flight drains at the
        # next drain poll, in this step when called from poll)
        if error is not None and self.transfer_mode == "push" and self.drain.begin(
                r, error, notify, status_code, hold_kv=r.req is not None):
            return
        self._close_now(r, error, notify, status_code)

    def _close_now(self, r: PrefillRoom, error: Optional[str], notify: bool = False, status_code: int = 500) -> None:
        """Tell the decode side (``notify``) and finish ``r``'s request now (``error`` None: success, else failed)."""
        if notify and r.peer is not None:
            self.agent.send(r.peer.endpoint, RoomFailed(r.room, error or "failed"))
        req = r.req
        if req is None:
            if error:
                self._remember_failed(r.room, error)
            return
        if error is None:
            self.stats["rooms_done"] += 1
            self.stats["transfer_bytes"] += req.disagg_info.get("transfer_bytes", 0)
            self.decide(FinishRequest(req))  # its KV goes to the prefix cache, it finishes with its one token
        else:
            logger.warning("room %d (request %s) failed: %s", r.room, req.rid, error)
            self.fail_request(req, f"KV transfer failed: {error}", status_code)

    def _forget(self, room: int, reason: str) -> None:
        r = self.rooms.pop(room, None)
        if r is not None and r.peer is not None:  # push: WRITEs posted during the forward may still be in flight:
            self.drain.begin(r, reason, False, 499, hold_kv=False)  # stopped/cancelled; the decode side frees its
            self.confirms.add(room, r.peer.endpoint, r, msg=RoomFailed(room, reason))  # slots once they settled
        else:
            self._remember_failed(room, reason)

    def _remember_failed(self, room: int, reason: str) -> None:
        self.failed_rooms[room] = reason
        while len(self.failed_rooms) > 10000:
            self.failed_rooms.pop(next(iter(self.failed_rooms)))

    def _check_timeouts(self) -> None:
        """Leader: rooms whose decode side never asked, or went silent, fail (injected for every rank)."""
        t = now()
        hb = self.args.disaggregation_heartbeat_timeout
        queued = set(self.rid_room.values())  # rooms whose prefill request is queued or running here
        for r in list(self.rooms.values()):
            reason = None
            if r.req is not None and r.peer is None and t - r.created > self.args.disaggregation_bootstrap_timeout:
                reason = (f"no decode server asked for bootstrap_room {r.room} within "
                          f"--disaggregation-bootstrap-timeout={self.args.disaggregation_bootstrap_timeout}s")
            elif r.req is None and r.peer is not None and r.room not in queued \
                    and t - r.created > self.args.disaggregation_bootstrap_timeout:
                reason = f"the prefill request of bootstrap_room {r.room} never arrived"
            elif r.peer is not None and r.state == "wait_ack" and t - self.peer_seen.get(r.peer.endpoint, t) > hb:
                reason = (f"the decode server {r.peer.endpoint} went silent (no heartbeat for "
                          f"{hb}s, --disaggregation-heartbeat-timeout)")
            if reason is not None and not r.expiring:
                r.expiring = True
                self.agent.inject(RoomFailed(r.room, reason, local=True))

    def close(self) -> None:
        """Stop the layerwise posting thread and the bootstrap server, then the agent (base class)."""
        if self.listener is not None:
            self.listener.close()
        if self.bootstrap is not None:
            self.bootstrap.close()
        super().close()
