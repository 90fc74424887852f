"""The decode side gives a room up while the other side's transfer may still write into its KV slots: the slots stay
allocated (quarantined, counted as used, ``disagg_slots_quarantined``) and are not handed to another request until
no transfer of the room can land: push, the prefill side confirms its drain (``RoomAbort`` -> ``RoomDrained``), the
prefill server is forgotten as gone, or the deadline passes; pull, the decode side's own READs are no longer in flight.
Real in-process fake transfer agents move the bytes; a real ``KVCache`` allocates the decode slots."""

from __future__ import annotations

import logging
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from test_pd_push_fail import LAYER_BYTES, LAYERS, GatedDecode, _connector, _room, agents  # noqa: F401 - fixture

from sglang.srt.disaggregation.connector import FinishRequest
from sglang.srt.disaggregation.decode import DecodeConnector
from sglang.srt.disaggregation.decode_quarantine import SlotQuarantine
from sglang.srt.disaggregation.decode_room import DecodeRoom, PrefillServer
from sglang.srt.disaggregation.layerwise import LayerwisePush, LayerwisePushListener
from sglang.srt.disaggregation.messages import BootstrapRoute, RoomAbort, RoomDrained, RoomFailed, RoomRequest
from sglang.srt.disaggregation.prefill import PrefillRoom
from sglang.srt.disaggregation.transfer.base import MemRegion, TransferConfig
from sglang.srt.disaggregation.transfer.fake_backend import FakeTransferBackend
from sglang.srt.disaggregation.transfer.queue import TransferQueue
from sglang.srt.mem_cache.kv_cache import KVCache

PROMPT = 10
SERVER = ("prefill-host", 1)


def _decode(transfer_mode="push", deadline_s=10.0, backend=None, queue=None) -> DecodeConnector:
    """A one-rank decode connector (no scheduler) over a small real KVCache; ``d.inbox``: its next control messages,
    ``d.sent``: what it sent."""
    d = DecodeConnector.__new__(DecodeConnector)
    d.rooms, d._decided, d.transfer_mode, d.mode = {}, [], transfer_mode, "decode"
    d.kv = KVCache.create(max_total_tokens=64, page_size=1, dtype=torch.float32, head_num=1, head_dim=2, layer_num=1,
                          req_rows=4, max_context_len=32, device="cpu")
    d.stats = dict(rooms_done=0, rooms_failed=0, transfer_bytes=0, transfer_reads=0, transfer_ops_planned=0)
    d.sent, d.inbox, d.dropped = [], [], []

    def recv():
        out, d.inbox[:] = list(d.inbox), []
        return out

    d.agent = SimpleNamespace(
        backend=backend or SimpleNamespace(in_flight=lambda h: False), agree=list, tp_size=1, is_leader=False,
        recv=recv, endpoint="tcp://decode:1", send=lambda ep, m: d.sent.append((ep, m)),
        queue=queue or SimpleNamespace(progress=list, handles=lambda k: [], abort=lambda *a: None,
                                       pop_stats=lambda k: None, has_pending=lambda: False),
        drop_peer=d.dropped.append, forget=lambda ep: None)
    d.stager = SimpleNamespace(free=lambda stage: None)
    d.quarantine = SlotQuarantine(deadline_s)
    d.servers = {SERVER: PrefillServer(route={"ranks": [{"agent": "prefill"}]}, endpoint="tcp://prefill:1")}
    return d


def _decode_room(d, room=7, state="wait_ready") -> DecodeRoom:
    req = SimpleNamespace(rid=f"r{room}", origin_input_ids=list(range(PROMPT)), finished_reason=None,
                          req_pool_idx=None, kv_len=0)
    r = DecodeRoom(room, req, SERVER, state=state)
    assert d._alloc(r)
    d.rooms[room] = r
    return r


def _quarantined(d) -> int:
    return d.internal_state()["disagg_slots_quarantined"]


def test_aborted_push_room_keeps_its_slots_until_the_prefill_confirms(agents):
    """The client aborts a push room on the decode side while the prefill side's WRITE 1 is at the decode agent: the
    slots stay allocated (another request gets other slots) until ``RoomDrained``, which comes only after WRITE 1
    landed; the queued WRITEs are cancelled and never land. Main freed the slots at once (this test fails there)."""
    d = _decode()
    free0 = d.kv.available_size()
    r = _decode_room(d)
    slots = set(r.slots)
    c = _connector(agents.pre, agents.plan)
    pr = _room(c, r.room)
    assert c.poll() == [] and pr.state == "pushing" and agents.dec.entered.wait(10)  # WRITE 1 is in the transport
    decisions = d.abort(r.req.rid)
    assert decisions == [FinishRequest(r.req)] and r.req.finished_reason["status_code"] == 499
    assert d.kv.available_size() == free0 - PROMPT, "the slots were freed while a prefill WRITE may still land"
    assert _quarantined(d) == PROMPT and d.internal_state()["disagg_rooms_quarantined"] == 1 and d.has_work()
    [(ep, abort)] = d.sent
    assert ep == "tcp://prefill:1" and isinstance(abort, RoomAbort) and abort.endpoint == "tcp://decode:1"
    other = _decode_room(d, room=8)
    assert not slots & set(other.slots)  # quarantined slots are not handed out
    c.agent.recv = lambda: [abort]
    decisions = c.poll()  # the prefill room fails and drains (WRITE 1 in flight): no RoomDrained, no RoomFailed yet
    c.agent.recv = list
    for _ in range(3):
        assert decisions == [] and not c.sent and c.has_work() and list(c.confirms.rooms) == [r.room]
        assert d.poll() == [] and _quarantined(d) == PROMPT
        time.sleep(0.05)
        decisions = c.poll()
    agents.dec.gate.set()
    deadline = time.monotonic() + 10
    while not c.sent and time.monotonic() < deadline:
        decisions += c.poll()
        time.sleep(0.01)
    assert c.sent == [("tcp://decode:1", RoomDrained(r.room))] and not c.has_work()
    assert decisions == [FinishRequest(pr.req)] and "aborted by the client" in pr.req.finished_reason["message"]
    assert torch.equal(agents.dst[:LAYER_BYTES], agents.src[:LAYER_BYTES])
    assert int(agents.dst[LAYER_BYTES:].count_nonzero()) == 0  # only WRITE 1 landed
    d.inbox.append(RoomDrained(r.room))
    d.poll()
    assert _quarantined(d) == 0 and not d.quarantine.rooms
    assert d.kv.available_size() == free0 - PROMPT  # only room 8 holds slots now


@pytest.mark.parametrize("how", ["prefill_gone", "prefill_room_failed"])
def test_quarantine_ends_when_the_prefill_is_gone_or_failed_the_room(how):
    """The decode side's own timeout fails a push room (``RoomFailed`` injected locally): the prefill side gets
    ``RoomAbort`` (not ``RoomFailed``) and the slots wait; they are freed once the prefill server is forgotten as
    silent (its agents dropped) or it reports the room failed itself (sent only after its drain)."""
    d = _decode()
    free0 = d.kv.available_size()
    r = _decode_room(d)
    d.inbox.append(RoomFailed(r.room, "no RoomReady within the bootstrap timeout", local=True))
    assert d.poll() == [FinishRequest(r.req)] and r.req.finished_reason["status_code"] == 500
    assert [type(m) for _, m in d.sent] == [RoomAbort] and _quarantined(d) == PROMPT
    assert d.poll() == [] and _quarantined(d) == PROMPT
    if how == "prefill_gone":
        d.inbox.append(BootstrapRoute(*SERVER, b""))
    else:
        d.inbox.append(RoomFailed(r.room, "prefill: room failed"))
    d.poll()
    assert _quarantined(d) == 0 and d.kv.available_size() == free0 and not d.has_work()
    assert d.dropped == (["prefill"] if how == "prefill_gone" else [])


def test_quarantine_deadline_frees_the_slots_with_an_error(caplog):
    """No confirmation ever comes: the slots are freed at the deadline, with an error naming the room (never held
    forever)."""
    d = _decode(deadline_s=0.2)
    free0 = d.kv.available_size()
    r = _decode_room(d, room=1234)
    d.abort(r.req.rid)
    assert d.poll() == [] and _quarantined(d) == PROMPT
    time.sleep(0.3)
    with caplog.at_level(logging.ERROR):
        d.poll()
    assert _quarantined(d) == 0 and d.kv.available_size() == free0
    assert d.internal_state()["disagg_quarantine_expired"] == 1
    assert any("room 1234" in rec.getMessage() and rec.levelno == logging.ERROR for rec in caplog.records)


def test_room_that_got_its_kv_or_never_allocated_is_freed_at_once():
    """Nothing can land: a push room whose ``RoomReady`` came (every WRITE done) and a room still connecting (no
    slots) are freed at once; the prefill side hears ``RoomFailed``."""
    d = _decode()
    free0 = d.kv.available_size()
    r = _decode_room(d)
    r.ready, r.state = SimpleNamespace(checksums=[]), "transfer"
    d._fail(r, "KV checksum mismatch", notify=True)
    req = SimpleNamespace(rid="r9", origin_input_ids=[1], finished_reason=None, req_pool_idx=None, kv_len=0)
    d.rooms[9] = DecodeRoom(9, req, SERVER)
    d.abort("r9")
    assert _quarantined(d) == 0 and d.kv.available_size() == free0
    assert [type(m) for _, m in d.sent] == [RoomFailed, RoomFailed]


def test_failed_pull_room_waits_for_its_reads_in_flight():
    """Pull: a READ of the room is being served by the prefill agent when the room fails: its slots stay quarantined
    until the READ is no longer in flight, then they are freed (no prefill confirmation involved)."""
    cfg = TransferConfig(transfer_timeout_s=30.0)
    src = torch.randint(1, 255, (4096,), dtype=torch.uint8)
    dst = torch.zeros(4096, dtype=torch.uint8)
    pre, dec = GatedDecode("prefill", cfg), FakeTransferBackend("decode", cfg)  # the prefill agent stalls READs
    try:
        pre.register([MemRegion(src.data_ptr(), src.numel(), "cpu")])
        dec.register([MemRegion(dst.data_ptr(), dst.numel(), "cpu")])
        dec.connect("prefill", pre.local_metadata())
        queue = TransferQueue(dec, "read")
        d = _decode("pull", backend=dec, queue=queue)
        free0 = d.kv.available_size()
        r = _decode_room(d, state="transfer")
        r.keys = ["7:0"]
        queue.submit("prefill", "7:0", np.array([[src.data_ptr(), dst.data_ptr(), 4096]], dtype=np.int64))
        queue.progress()
        assert pre.entered.wait(10)
        d._fail(r, "KV transfer failed: injected", notify=True)
        assert [type(m) for _, m in d.sent] == [RoomFailed]
        for _ in range(3):
            d.poll()
            assert _quarantined(d) == PROMPT and d.kv.available_size() == free0 - PROMPT
        pre.gate.set()
        deadline = time.monotonic() + 10
        while d.quarantine.rooms and time.monotonic() < deadline:
            d.poll()
            time.sleep(0.01)
        assert _quarantined(d) == 0 and d.kv.available_size() == free0
    finally:
        pre.gate.set()
        pre.close()
        dec.close()


def test_quarantine_deadline_validated():
    with pytest.raises(ValueError, match="deadline_s"):
        SlotQuarantine(0)


def test_prefill_abort_holds_room_failed_until_its_layerwise_writes_settled(agents):
    """The prefill request is aborted by its client after its forward posted layerwise WRITEs (WRITE 1 at the decode
    agent): posting stops, the queued WRITEs are cancelled, and ``RoomFailed`` (on which the decode side frees its
    slots at once) goes out only once WRITE 1 settled."""
    c = _connector(agents.pre, agents.plan)
    c.listener = LayerwisePushListener(agents.pre)
    pr = PrefillRoom(7, peer=RoomRequest(7, "tcp://decode:1", "push"))
    c.rooms[7] = pr
    job = pr.layerwise = LayerwisePush(7, agents.plan, LAYERS, started=True)
    for layer in range(3):
        c.listener._post(layer, [job])
    assert agents.dec.entered.wait(10) and len(job.handles) == 3
    req = SimpleNamespace(rid="r7", bootstrap_room=7, finished_reason={"type": "abort", "message": "client"})
    assert c.hold(req) is False and job.error and c.drain.cancelled == 3  # WRITE 1 too (still in flight)
    c.listener._post(3, [job])  # a later layer posts nothing for the aborted room
    for _ in range(3):
        assert c.poll() == [] and not c.sent and c.has_work()
        time.sleep(0.05)
    agents.dec.gate.set()
    deadline = time.monotonic() + 10
    while not c.sent and time.monotonic() < deadline:
        c.poll()
        time.sleep(0.01)
    assert [(ep, type(m)) for ep, m in c.sent] == [("tcp://decode:1", RoomFailed)] and not c.has_work()
    assert len(job.handles) == 3 and int(agents.dst[LAYER_BYTES:].count_nonzero()) == 0
