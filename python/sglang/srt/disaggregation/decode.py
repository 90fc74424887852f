"""The decode role's connector: take requests into a transfer queue, get their prompt KV from the prefill
server named by ``bootstrap_host:bootstrap_port``, then let them decode as if they had prefilled here.

Pull mode (default, KVDirect sec. 4.3): KV is allocated only once the prefill side reports the prompt
done (``RoomReady``) *and* the pool has room, so decode KV lifetime excludes prefill queuing. Each decode
rank then submits, per prefill rank it reads from, the per-(layer, K/V, token) READs of the KV heads it
holds (whole rows into a staging chunk when the head ranges differ, staging.py) plus a COMPLETE to its
:class:`~sglang.srt.disaggregation.transfer.queue.TransferQueue` (KVDirect sec. 4.2: popped up to the first
COMPLETE, coalesced where both sides are contiguous; the COMPLETE goes over the transfer backend's notification
channel once that rank's reads are done, one unacknowledged COMPLETE per peer pair). The prefill ranks ACK it and
release the KV on it (prefill.py). A room is activated here only when every decode rank's reads are done (agreed;
and verified with ``--disaggregation-verify``).
Push mode: KV is allocated when the request arrives; the slots travel in ``RoomRequest`` and the
prefill ranks write into them; ``RoomReady`` then means written, and ``RoomAck`` (ZMQ) releases the
prefill KV once the request is activated here.

Faults fail closed: an unreachable bootstrap server or no ``RoomReady`` within
``--disaggregation-bootstrap-timeout``, a failed/timed-out transfer, a checksum mismatch or a prefill
leader silent past ``--disaggregation-heartbeat-timeout`` finish the request with an error and free
its KV; other requests continue.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import msgspec

from sglang.srt.disaggregation.agent import now
from sglang.srt.disaggregation.bootstrap import fetch_route
from sglang.srt.disaggregation.connector import BaseConnector, Decision, StartDecode, bootstrap_fields_error, reject
from sglang.srt.disaggregation.decode_quarantine import SlotQuarantine
from sglang.srt.disaggregation.decode_room import DecodeRoom, PrefillServer, resume_request, room_of
from sglang.srt.disaggregation.messages import (
    BootstrapRoute,
    Heartbeat,
    HeartbeatAck,
    RoomAbort,
    RoomAck,
    RoomDrained,
    RoomFailed,
    RoomReady,
    RoomRequest,
)
from sglang.srt.disaggregation.slot_plan import assign_sources
from sglang.srt.disaggregation.staging import Stager
from sglang.srt.mem_cache.kv_descriptor import check_peer_ranks

logger = logging.getLogger(__name__)

ROUTE_RETRY_S = 0.5
SPIN_SLEEP_S = 50e-6  # poll period of in-flight READs while the GPU runs a forward (see during_forward)
SPIN_MAX_S = 0.1  # never spin longer than this per forward, whatever the probe says
QUARANTINE_MARGIN_S = 10.0  # a failed room's slots are freed at the latest this long after the transfer timeout


class DecodeConnector(BaseConnector):
    """Decode role (see the module doc)."""

    TRANSFER_STATE = "transfer"  # READs posted (pull) / pushed KV being handed over, not activated yet

    def __init__(self, scheduler):
        super().__init__(scheduler)
        self.rooms: dict[int, DecodeRoom] = {}
        self.servers: dict[tuple[str, int], PrefillServer] = {}
        self.last_route_try: dict[tuple[str, int], float] = {}
        self.stats["transfer_ops_planned"] = 0
        self.stager = Stager(self.agent.backend, self.agent.desc, self.agent.heads, self.agent.ranks)
        # failed rooms' KV that a transfer may still write into (decode_quarantine.py)
        self.quarantine = SlotQuarantine(self.agent.backend.config.transfer_timeout_s + QUARANTINE_MARGIN_S)

    # ---- scheduler hooks -----------------------------------------------------------------------------
    def intercept(self, req, msg) -> list[Decision]:
        """Take every valid request into the transfer queue (``[]``: the scheduler must not queue it); a request
        with unusable bootstrap fields finishes with a 400 (``[FinishRequest]``)."""
        req.bootstrap_room = msg.bootstrap_room
        err = bootstrap_fields_error(req)
        if err is None and (not msg.bootstrap_host or not msg.bootstrap_port):
            err = "bootstrap_host and bootstrap_port are required on a decode server (use the mini_lb router)"
        if err is None and (msg.bootstrap_room in self.rooms or msg.bootstrap_room in self.quarantine.rooms):
            err = f"bootstrap_room {msg.bootstrap_room} is already in use"
        if err:
            return [reject(req, err)]
        req.disagg_info = {"bootstrap_room": req.bootstrap_room}
        self.rooms[req.bootstrap_room] = DecodeRoom(req.bootstrap_room, req, (msg.bootstrap_host, msg.bootstrap_port))
        return []

    def hold(self, req) -> bool:
        """Decode requests finish normally."""
        return False

    def abort(self, rid: str) -> list[Decision]:
        """Drop a waiting request (its KV, if allocated, is freed; the prefill side is told)."""
        for r in list(self.rooms.values()):
            if r.req.rid == rid:
                self._fail(r, "aborted by the client", notify=True, status_code=499)
        return self.take_decisions()

    def open_rids(self) -> list[str]:
        """Requests waiting for their KV."""
        return [r.req.rid for r in self.rooms.values()]

    def has_work(self) -> bool:
        """Open rooms, or COMPLETEs still waiting for a completion slot / an ACK (they must keep flowing)."""
        return bool(self.rooms) or bool(self.quarantine.rooms) or self.agent.queue.has_pending()

    def num_open(self) -> int:
        """Rooms (requests) this decode connector holds, for ``/get_server_info``."""
        return len(self.rooms)

    def internal_state(self) -> dict:
        """The base counters plus the quarantine (KV slots of failed rooms a transfer may still write into)."""
        return {**super().internal_state(), "disagg_slots_quarantined": self.quarantine.num_slots(),
                "disagg_rooms_quarantined": len(self.quarantine.rooms),
                "disagg_quarantine_expired": self.quarantine.expired}

    # ---- one poll per scheduler step ----------------------------------------------------------------
    def poll(self) -> list[Decision]:
        """Control messages, CONNECT, allocation + READs, completion, heartbeats and timeouts; returns the requests
        whose KV arrived (:class:`StartDecode`) and those that failed (:class:`FinishRequest`)."""
        if self.agent.is_leader:
            self._leader_duties()
        for msg in self.agent.recv():
            self._on_message(msg)
        for q in self.quarantine.poll(self.agent.backend.in_flight, self.agent.agree):
            self._free_kv(q.row, q.loc, q.stage)
        self._connect()
        self._start_ready()
        self._progress_queue()
        self._poll_transfers()
        return self.take_decisions()

    def during_forward(self, forward_done: Callable[[], bool]) -> None:
        """Between launching a batch and waiting for its result (the CPU only waits for the GPU then): take control
        messages, allocate and post the READs of ready rooms, and poll the posted READs every ``SPIN_SLEEP_S`` until
        ``forward_done()`` (at most ``SPIN_MAX_S``). With TP 1 the control socket is read on every round too, so a
        ``RoomReady`` arriving during the forward has its READs posted at once and usually done when the forward
        ends: the room decodes from the next step. Before, it waited for the next step's :meth:`poll` to be posted
        and for the one after to be seen done (two steps). With TP > 1 messages are read once here (``recv`` is a
        broadcast every rank must make at the same point); the spin stops when no READ is in flight (TP 1: and no room
        awaits its ``RoomReady``, so the host goes on to overlap scheduling's work). The DONE
        time of the READs is stamped within about ``SPIN_SLEEP_S`` (the pure transfer time in ``meta_info``).
        Activation stays at the step boundary (:meth:`poll`, agreed over the ranks).

        Args:
            forward_done: non-blocking probe of the launched forward (e.g. a CUDA event's ``query``; CPU: the
                forward already ran, so one pass).
        """
        local = self.agent.tp_size <= 1
        end = time.monotonic() + SPIN_MAX_S
        first = True
        while True:
            if first or local:
                for msg in self.agent.recv():
                    self._on_message(msg)
                self._start_ready()
            self._progress_queue()
            first = False
            idle = not self.agent.queue.busy_rooms() and not (
                local and any(r.state in ("connect", "wait_ready") for r in self.rooms.values()))
            if forward_done() or time.monotonic() >= end or idle:
                return
            time.sleep(SPIN_SLEEP_S)

    def _start_ready(self) -> None:
        for room in sorted(self.rooms):
            r = self.rooms.get(room)
            if r is not None and r.state == "wait_ready" and r.ready is not None:
                self._start_transfer(r)

    def _progress_queue(self) -> None:
        """Post queued READs, poll them, send COMPLETEs and take ACKs (this rank's TransferQueue); record which
        of each room's per-prefill-rank requests are done or failed."""
        for ev in self.agent.queue.progress():
            room = room_of(ev.room)
            r = self.rooms.get(room) if room is not None else None
            if ev.kind in ("done", "failed"):
                st = self.agent.queue.pop_stats(ev.room)
                if r is None or ev.room not in r.keys:
                    continue
                if st is not None:
                    r.reads += st.reads_posted
                    r.ops += st.ops_planned
                    r.nbytes += st.bytes
                    r.queue_s = max(r.queue_s, st.queue_time_s)
                    r.t_done = max(r.t_done, st.done_at or 0.0)
                    if st.first_post_at is not None:
                        r.t_post = min(r.t_post or st.first_post_at, st.first_post_at)
                if ev.kind == "done":
                    r.done_keys.add(ev.room)
                elif not r.fail_reason:
                    r.fail_reason = f"KV transfer failed: {ev.detail or 'backend error'}"
            elif ev.kind == "ack_timeout":  # the data is here already; the prefill side frees by its own timeout
                logger.warning("prefill agent %s did not ACK the COMPLETE of %s: %s", ev.peer, ev.room, ev.detail)
            elif ev.kind == "notif":
                logger.debug("ignoring notification %r from %s", ev.msg, ev.peer)

    def _on_message(self, msg) -> None:
        if isinstance(msg, RoomReady):
            r = self.rooms.get(msg.room)
            if r is not None and r.state == "wait_ready":
                r.ready, r.t_ready = msg, now()
                srv = self.servers.get(r.server)
                if srv is not None:
                    srv.last_seen = now()
        elif isinstance(msg, RoomFailed):
            r = self.rooms.get(msg.room)
            if r is not None:  # from the prefill side (not local): sent after its WRITEs drained (push_room.py)
                self._fail(r, msg.reason, notify=msg.local, drained=not msg.local)
            elif not msg.local:
                self.quarantine.confirm(msg.room)
        elif isinstance(msg, RoomDrained):
            self.quarantine.confirm(msg.room)
        elif isinstance(msg, HeartbeatAck):
            for srv in self.servers.values():
                if srv.endpoint == msg.endpoint:
                    srv.last_seen = now()
        elif isinstance(msg, BootstrapRoute):
            self._on_route(msg)
        elif isinstance(msg, Heartbeat):
            self.agent.send(msg.endpoint, HeartbeatAck(self.agent.endpoint))

    # ---- CONNECT -------------------------------------------------------------------------------------
    def _leader_duties(self) -> None:
        t = now()
        a = self.args
        wanted = {r.server for r in self.rooms.values() if r.state == "connect"} - set(self.servers)
        for key in wanted:  # lazy CONNECT: fetch the route once per prefill server, share it with every rank
            if t - self.last_route_try.get(key, 0.0) < ROUTE_RETRY_S:
                continue
            self.last_route_try[key] = t
            try:
                route = fetch_route(key[0], key[1], timeout_s=min(2.0, a.disaggregation_bootstrap_timeout))
                self.agent.inject(BootstrapRoute(key[0], key[1], msgspec.json.encode(route)))
            except ConnectionError as e:
                logger.warning("%s", e)
        for r in self.rooms.values():
            reason = None
            if r.state in ("connect", "wait_ready") and r.ready is None \
                    and t - r.created > a.disaggregation_bootstrap_timeout:
                reason = (f"the prefill server {r.server[0]}:{r.server[1]} did not hand over bootstrap_room {r.room} "
                          f"within --disaggregation-bootstrap-timeout={a.disaggregation_bootstrap_timeout}s")
            srv = self.servers.get(r.server)
            if reason is None and srv is not None and r.state != "connect" \
                    and t - srv.last_seen > a.disaggregation_heartbeat_timeout:
                reason = (f"the prefill server {r.server[0]}:{r.server[1]} went silent (no heartbeat answer for "
                          f"{a.disaggregation_heartbeat_timeout}s, --disaggregation-heartbeat-timeout)")
            if reason is not None and not r.expiring:
                r.expiring = True
                self.agent.inject(RoomFailed(r.room, reason, local=True))
        # servers whose confirmation quarantined slots wait for are pinged too: forgotten when silent (slots freed)
        waiting = {q.server for q in self.quarantine.rooms.values() if q.awaiting_prefill}
        for key, srv in self.servers.items():  # a silent prefill server is forgotten: the next request naming
            if t - srv.last_seen > a.disaggregation_heartbeat_timeout and not srv.forgetting:  # it CONNECTs anew
                busy_rooms = [r for r in self.rooms.values() if r.server == key and r.state != "connect"]
                if busy_rooms or key in waiting or t - srv.last_seen > 10 * a.disaggregation_heartbeat_timeout:
                    srv.forgetting = True
                    self.agent.inject(BootstrapRoute(key[0], key[1], b""))
        busy = {r.server for r in self.rooms.values() if r.state != "connect"} | waiting
        for key in busy:
            srv = self.servers.get(key)
            if srv is not None and t - srv.last_ping > a.disaggregation_heartbeat_interval:
                srv.last_ping = t
                self.agent.send(srv.endpoint, Heartbeat(self.agent.endpoint))

    def _on_route(self, msg: BootstrapRoute) -> None:
        key = (msg.host, msg.port)
        if not msg.route:  # forget a dead prefill server (see _leader_duties)
            srv = self.servers.pop(key, None)
            if srv is not None:
                for info in srv.route["ranks"]:
                    self.agent.drop_peer(info["agent"])
                self.agent.forget(srv.endpoint)
                self.quarantine.prefill_gone(key)
                logger.warning("forgot prefill server %s:%d (silent)", *key)
            return
        route = msgspec.json.decode(msg.route)
        self.servers[key] = PrefillServer(route=route, endpoint=route["endpoint"])
        logger.info("connected to prefill server %s:%d (tp %d, control %s)", msg.host, msg.port,
                    route["tp_size"], route["endpoint"])

    def _connect(self) -> None:
        for room in sorted(self.rooms):
            r = self.rooms.get(room)
            if r is None or r.state != "connect" or r.server not in self.servers:
                continue
            srv = self.servers[r.server]
            try:  # KV bytes move unconverted: the prefill side must store the same format (dtype, FP8 scales)
                check_peer_ranks(self.agent.desc, srv.route["ranks"], "decode", "prefill")
            except ValueError as e:
                self._fail(r, f"refusing the prefill server {r.server[0]}:{r.server[1]}: {e}", notify=True)
                continue
            try:
                for info, _ in self._sources(srv):
                    self.agent.ensure_connected(info)
            except Exception as e:  # noqa: BLE001 - bad metadata fails this request only
                self._fail(r, f"cannot connect to the prefill ranks of {r.server[0]}:{r.server[1]}: {e}")
                continue
            dst_slots = None
            if self.transfer_mode == "push":
                if not self._alloc(r):
                    continue  # no room yet: retry next step
                dst_slots = r.slots
            mine = [{k: i[k] for k in ("rank", "agent", "metadata", "kv", "head_lo", "head_hi")}
                    for i in self.agent.ranks]
            self.agent.send(srv.endpoint, RoomRequest(room=r.room, endpoint=self.agent.endpoint,
                                                      mode=self.transfer_mode, decode_ranks=mine, dst_slots=dst_slots))
            srv.last_seen = max(srv.last_seen, now())
            r.state = "wait_ready"

    def _sources(self, srv: PrefillServer) -> list[tuple[dict, tuple[int, int]]]:
        """The prefill ranks this rank reads and the global heads from each (a replicated head is read once)."""
        return assign_sources(srv.route["ranks"], self.agent.heads)

    # ---- KV ------------------------------------------------------------------------------------------
    def _alloc(self, r: DecodeRoom) -> bool:
        """Allocate a request row and KV slots for the prompt; False (nothing taken) when the pool is full."""
        n = len(r.req.origin_input_ids)
        row = self.kv.alloc_req_slot()
        if row is None:
            return False
        got = self.kv.alloc_extend_with_host([row], [0], [n], [-1])
        if got is None:
            self.kv.free_req_slot(row)
            return False
        # the slots as a host list now: reading them back from the GPU (loc.tolist()) would wait for the forward
        # running on the stream (RoomReady is mostly handled in during_forward), ~the forward's time per room
        r.row, (r.loc, host), r.t_alloc = row, got, time.monotonic()
        r.slots = host.tolist()
        return True

    def _start_transfer(self, r: DecodeRoom) -> None:
        ready = r.ready
        if len(ready.slots) != len(r.req.origin_input_ids):
            self._fail(r, f"prefill sent {len(ready.slots)} slots for a {len(r.req.origin_input_ids)}-token prompt "
                          "(the prefill and decode servers tokenized the prompt differently?)", notify=True)
            return
        if self.transfer_mode == "push":
            r.state = "transfer"  # written already: completion is immediate
            r.nbytes, r.reads = ready.push_bytes, ready.push_reads
            return
        if r.loc is None and not self._alloc(r):
            return  # pull mode: allocate only when the pool has room; stays queued
        srv = self.servers[r.server]
        if r.stage is None:  # heterogeneous TP: whole source rows into a staging chunk (staging.py)
            ok, r.stage = self.stager.reserve(r.room, srv.route["ranks"], len(ready.slots))
            if not ok:
                return  # staging full now: stays queued (every rank decides alike)
        dst_slots = r.slots
        try:
            plans = []
            for info, heads in self._sources(srv):  # plan every source first: a bad plan posts nothing
                plans.append((info, self.stager.plan(r.stage, r.staged, info, heads, ready.slots, dst_slots)))
            for info, copies in plans:
                # rows (prefill address, decode address, nbytes) = (remote, local, nbytes); the queue coalesces
                # them and sends COMPLETE once they are done (also for an empty plan: the prefill rank waits for it)
                key = f"{r.room}:{info['rank']}"
                self.agent.queue.submit(info["agent"], key, copies)
                r.keys.append(key)
        except Exception as e:  # noqa: BLE001 - agreed below; fails this room only
            logger.warning("room %d: posting reads failed: %s", r.room, e)
            r.fail_reason = f"posting KV reads failed: {e}"
        r.state = "transfer"

    def _poll_transfers(self) -> None:
        """Agree over the decode ranks which rooms' transfers are failed (0), pending (1) or done (2) on every
        rank; verify and activate the done ones, fail the failed ones (every rank at the same step)."""
        active = sorted(room for room, r in self.rooms.items() if r.state == "transfer")
        codes = []
        for room in active:
            r = self.rooms[room]
            codes.append(0 if r.fail_reason else (2 if r.done_keys.issuperset(r.keys) else 1))
        agreed = self.agent.agree(codes)
        done = [room for room, c in zip(active, agreed) if c == 2]
        if done and self.transfer_mode == "pull":  # per-request stats summed over the decode ranks
            per_rank = self.agent.gather_concat([v for room in done for v in (self.rooms[room].reads,
                                                                                 self.rooms[room].ops,
                                                                                 self.rooms[room].nbytes)])
            width = 3 * len(done)
            for i, room in enumerate(done):
                r = self.rooms[room]
                r.reads, r.ops, r.nbytes = (sum(per_rank[k * width + 3 * i + j] for k in range(len(per_rank) // width))
                                            for j in range(3))
        for room in done:  # staged rows -> KV slots (heterogeneous TP), before verification and decoding
            r = self.rooms[room]
            self.stager.unstage(self.kv.token_to_kv_pool.kv_layer_view, r.stage, r.staged, r.loc)
            r.stage = None
        if done and self.args.disaggregation_verify:
            oks = self.agent.agree([1 if self._verify(self.rooms[room]) else 0 for room in done])
            for room, ok in zip(done, oks):
                if not ok:
                    self._fail(self.rooms[room], "KV checksum mismatch after the transfer (--disaggregation-verify)",
                               notify=True)
            done = [room for room, ok in zip(done, oks) if ok]
        for room, code in zip(active, agreed):
            if code == 0:
                r = self.rooms[room]
                self._fail(r, r.fail_reason or "KV transfer failed on another decode rank", notify=True)
        for room in done:
            self._activate(self.rooms.pop(room))

    def _verify(self, r: DecodeRoom) -> bool:
        want = r.ready.checksums
        if not want:
            return False
        got = self.agent.checksums(r.slots)
        total, (lo, hi) = self.agent.total_kv_heads, self.agent.heads
        nh = hi - lo
        for i, c in enumerate(got):
            layer, rest = divmod(i, 2 * nh)
            kv, h = divmod(rest, nh)
            if want[(layer * 2 + kv) * total + lo + h] != c:
                logger.error("room %d: checksum mismatch at layer %d kv %d head %d", r.room, layer, kv, lo + h)
                return False
        return True

    def _activate(self, r: DecodeRoom) -> None:
        """The KV is here: the request continues as if it had prefilled locally, with the prefill's first token
        (:class:`StartDecode`: the scheduler takes it from here)."""
        req, ready = r.req, r.ready
        srv = self.servers.get(r.server)
        if srv is not None and self.transfer_mode == "push":  # pull: the prefill side releases on COMPLETE/ACK
            self.agent.send(srv.endpoint, RoomAck(r.room))
        n = resume_request(r, self.transfer_mode == "pull")
        self.stats["rooms_done"] += 1
        self.stats["transfer_bytes"] += r.nbytes
        self.stats["transfer_reads"] += r.reads
        self.stats["transfer_ops_planned"] += r.ops
        self.decide(StartDecode(req, prompt_tokens=n, cached_tokens=ready.cached_tokens))

    def _fail(self, r: DecodeRoom, reason: str, notify: bool = False, status_code: int = 500,
              drained: bool = False) -> None:
        """Fail one room: tell the prefill side when ``notify``, report the error, and free its KV (if allocated), or
        quarantine it while a transfer may still write into it (``decode_quarantine.py``): push, a room whose
        ``RoomReady`` has not come (the prefill side gets ``RoomAbort`` and answers ``RoomDrained``; ``drained``:
        the prefill side failed the room itself, after its drain); pull, a room whose READs were posted (freed once
        none is in flight). The same choice on every rank (room state and messages are)."""
        self.rooms.pop(r.room, None)
        handles = []
        for key in r.keys:  # drop its queued READs (no COMPLETE is sent for a failed request)
            handles += self.agent.queue.handles(key)
            self.agent.queue.abort(key, reason)
            self.agent.queue.pop_stats(key)
        srv = self.servers.get(r.server)
        push_live = (self.transfer_mode == "push" and r.row is not None and r.ready is None
                     and r.state == "wait_ready" and not drained and srv is not None)
        if push_live:
            self.agent.send(srv.endpoint, RoomAbort(r.room, reason, self.agent.endpoint))
        elif notify and srv is not None:
            self.agent.send(srv.endpoint, RoomFailed(r.room, reason))
        req = r.req
        if r.row is not None and (push_live or (self.transfer_mode == "pull" and r.state == "transfer")):
            self.quarantine.add(r.room, r.row, r.loc, len(r.slots or ()), r.server, push_live, reason, handles,
                                stage=r.stage)
        elif r.row is not None:
            self._free_kv(r.row, r.loc, r.stage)
        else:
            self.stager.free(r.stage)
        r.stage = None
        if r.row is not None:
            req.kv_len = 0  # its KV is freed or quarantined here, never by the scheduler
        req.req_pool_idx = None
        logger.warning("request %s (room %d) failed: %s", req.rid, r.room, reason)
        self.fail_request(req, reason, status_code)

    def _free_kv(self, row: int, loc, stage) -> None:
        """Give a failed room's request row, KV slots and staging chunk back."""
        self.stager.free(stage)
        self.kv.free_slots(loc)
        self.kv.free_req_slot(row)
