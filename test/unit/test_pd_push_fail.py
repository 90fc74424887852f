"""Push mode fails a room closed when one of its WRITEs fails: the room's other WRITEs are cancelled
(a cancelled one that had not started never lands on the decode side), the prefill KV stays held until no WRITE of the
room is still in the transport, and only then is ``RoomFailed`` sent (the decode side frees its slots and errors the
request) and the prefill request failed (its KV freed). Real in-process fake transfer agents move the bytes; the k-th
WRITE is made to fail."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch

from sglang.srt.disaggregation.connector import FinishRequest
from sglang.srt.disaggregation.layerwise import LayerwisePush, LayerwisePushListener
from sglang.srt.disaggregation.messages import RoomFailed, RoomRequest
from sglang.srt.disaggregation.prefill import PrefillConnector, PrefillRoom
from sglang.srt.disaggregation.push_room import DrainConfirms, PushDrain
from sglang.srt.disaggregation.transfer.base import MemRegion, TransferConfig, TransferError, TransferState, \
    as_op_array
from sglang.srt.disaggregation.transfer.fake_backend import FakeTransferBackend
from sglang.srt.disaggregation.transfer.fault_hook import HeldTransferBackend

LAYERS, LAYER_BYTES, K = 8, 4096, 3  # the 3rd WRITE (layer 2) fails


class FailKth:
    """Passes every call to ``inner`` except the ``k``-th WRITE: ``raise`` (cannot be posted), ``failed`` (comes back
    FAILED) or ``manual`` (PENDING, never posted; the test fails it)."""

    def __init__(self, inner, k: int, how: str):
        self.inner, self.k, self.how, self.n, self.kth = inner, k, how, 0, None

    def write(self, peer, ops, notif=None):
        self.n += 1
        if self.n != self.k:
            return self.inner.write(peer, ops, notif)
        if self.how == "raise":
            raise TransferError("injected: the decode peer is unreachable")
        self.kth = self.inner._new_handle(peer, "WRITE", as_op_array(ops))
        if self.how == "failed":
            self.kth.finish(TransferState.FAILED, "injected: WRITE failed")
        return self.kth

    def __getattr__(self, attr):
        return getattr(self.inner, attr)


class GatedDecode(FakeTransferBackend):
    """A decode agent that stalls every incoming WRITE (after it arrived, before its bytes land) until ``gate``."""

    def __init__(self, *a):
        super().__init__(*a)
        self.gate, self.entered = threading.Event(), threading.Event()

    def _remote_ok(self, ops):
        self.entered.set()
        self.gate.wait(30)
        return super()._remote_ok(ops)


@pytest.fixture
def agents():
    cfg = TransferConfig(transfer_timeout_s=30.0)
    src = torch.randint(1, 255, (LAYERS * LAYER_BYTES,), dtype=torch.uint8)  # no zero byte: a landed WRITE shows
    dst = torch.zeros(LAYERS * LAYER_BYTES, dtype=torch.uint8)
    pre, dec = FakeTransferBackend("prefill", cfg), GatedDecode("decode", cfg)
    pre.register([MemRegion(src.data_ptr(), src.numel(), "cpu")])
    dec.register([MemRegion(dst.data_ptr(), dst.numel(), "cpu")])
    pre.connect("decode", dec.local_metadata())
    plan = [("decode", [torch.tensor([[dst.data_ptr() + i * LAYER_BYTES, src.data_ptr() + i * LAYER_BYTES,
                                       LAYER_BYTES]]).numpy() for i in range(LAYERS)])]
    yield SimpleNamespace(src=src, dst=dst, pre=pre, dec=dec, plan=plan)
    dec.close()  # closed before the gate opens: a WRITE stalled at the gate is dropped, never lands in freed memory
    dec.gate.set()
    pre.close()


def _held(agents) -> HeldTransferBackend:
    """The prefill agent behind the fault hook: every WRITE waits 0.3 s in the hook before the transport sees it."""
    held = HeldTransferBackend(agents.pre, 0.3)
    held.register(list(agents.pre.regions))  # the hook checks local ranges and peers against its own records
    held.connect("decode", agents.dec.local_metadata())
    return held


def _connector(backend, plan) -> PrefillConnector:
    """A push-mode prefill connector (one rank) over ``backend`` whose planned WRITEs are ``plan``."""
    c = PrefillConnector.__new__(PrefillConnector)  # no scheduler: the room's push and failure paths only
    c.rooms, c._decided, c.transfer_mode, c.listener, c.push_waiting, c.failed_rooms = {}, [], "push", None, {}, {}
    c.rid_room = {}
    c.stats = dict(rooms_done=0, rooms_failed=0, transfer_bytes=0, transfer_reads=0, push_layerwise=0,
                   push_after_forward=0)
    c.sent = []
    c.agent = SimpleNamespace(backend=backend, agree=list, tp_size=1, is_leader=False, recv=list,
                              queue=SimpleNamespace(progress=list), send=lambda ep, m: c.sent.append((ep, m)))
    c.drain = PushDrain(backend, c._backend_lock, 10.0)
    c.confirms = DrainConfirms(backend, c._backend_lock, 10.0)
    c._plan_push = lambda req, peer: plan
    c._send_ready = lambda r, **kw: c.sent.append(("ready", r.room))
    return c


def _room(c, room=7) -> PrefillRoom:
    req = SimpleNamespace(rid=f"r{room}", disagg_info={}, finished_reason=None)
    r = PrefillRoom(room, req=req, peer=RoomRequest(room, "tcp://decode:1", "push"))
    c.rooms[room] = r
    return r


def _assert_failed_closed(c, r, decisions, match: str):
    assert decisions == [FinishRequest(r.req)] and r.req.finished_reason["status_code"] == 500
    assert match in r.req.finished_reason["message"], r.req.finished_reason
    failed = [m for ep, m in c.sent if isinstance(m, RoomFailed)]
    assert [(m.room, ep) for ep, m in c.sent if isinstance(m, RoomFailed)] == [(r.room, "tcp://decode:1")]
    assert match in failed[0].reason and not any(m == ("ready", r.room) for m in c.sent)
    assert c.num_open() == 0 and not c.has_work() and c.stats["rooms_failed"] == 1 and not c.drain.rooms


@pytest.mark.parametrize("how,match", [("failed", "injected: WRITE failed"),
                                       ("raise", "injected: the decode peer is unreachable")])
def test_kth_write_fails_cancels_the_rooms_other_writes(agents, how, match):
    """Every WRITE is held in the transport's queue (fault hook) when the 3rd fails: the others are cancelled at once,
    the room fails in the same step, and none of them lands on the decode side afterwards."""
    held = _held(agents)
    backend = FailKth(held, K, how)
    c = _connector(backend, agents.plan)
    r = _room(c)
    decisions = c.poll()  # posts the room's WRITEs, sees the failure, cancels and drains, fails the room
    _assert_failed_closed(c, r, decisions, match)
    posted = LAYERS - 1 if how == "failed" else K - 1  # "raise": the push stopped at the failing WRITE
    assert c.drain.cancelled == posted and len(r.handles) == posted + (how == "failed")
    assert all(h.state is TransferState.FAILED for h in r.handles)
    time.sleep(0.5)  # past the hold: a WRITE not cancelled would now be handed to the transport
    assert held.snapshot()["released"] == 0 and c.poll() == []
    time.sleep(0.2)
    assert int(agents.dst.count_nonzero()) == 0, "a WRITE of the failed room landed on the decode side"


def test_write_in_the_transport_holds_the_kv_until_it_is_done(agents):
    """WRITE 1 is already at the decode agent (stalled before its bytes land) when WRITE 3 fails: the room's KV stays
    held and the decode side is not told (it would free slots WRITE 1 still writes into) until WRITE 1 is done; the
    queued WRITEs behind it are cancelled and never land."""
    backend = FailKth(agents.pre, K, "manual")
    c = _connector(backend, agents.plan)
    r = _room(c)
    assert c.poll() == [] and r.state == "pushing"
    assert agents.dec.entered.wait(10)  # WRITE 1 reached the decode agent
    backend.kth.finish(TransferState.FAILED, "injected: WRITE failed")
    for _ in range(3):
        assert c.poll() == [] and not c.sent and c.num_open() == 1 and c.has_work()
        assert list(c.drain.rooms) == [r.room] and c.drain.rids() == [r.req.rid] and r.req.rid in c.open_rids()
        time.sleep(0.05)
    assert all(h.state is TransferState.FAILED for h in r.handles)  # cancelled (WRITE 1 included) or failed
    agents.dec.gate.set()
    deadline = time.monotonic() + 10
    decisions = []
    while not decisions and time.monotonic() < deadline:
        decisions = c.poll()
        time.sleep(0.01)
    _assert_failed_closed(c, r, decisions, "injected: WRITE failed")
    # WRITE 1 was in flight and landed before RoomFailed went out; nothing after it did
    assert torch.equal(agents.dst[:LAYER_BYTES], agents.src[:LAYER_BYTES])
    assert int(agents.dst[LAYER_BYTES:].count_nonzero()) == 0


def test_drain_deadline_frees_a_room_whose_write_never_settles(agents):
    """A WRITE stuck in the transport past the drain deadline: the room fails anyway (never a hang)."""
    backend = FailKth(agents.pre, K, "manual")
    c = _connector(backend, agents.plan)
    c.drain = PushDrain(backend, c._backend_lock, 0.3)
    r = _room(c)
    c.poll()
    assert agents.dec.entered.wait(10)
    backend.kth.finish(TransferState.FAILED, "injected: WRITE failed")
    assert c.poll() == []
    time.sleep(0.4)
    _assert_failed_closed(c, r, c.poll(), "injected: WRITE failed")


def test_layerwise_failure_cancels_the_layers_already_posted(agents):
    """Layerwise push: the WRITE of layer 2 cannot be posted during the forward; the WRITEs of layers 0 and 1 (held
    in the transport) are cancelled when the room fails, later layers are never posted, nothing lands."""
    held = _held(agents)
    backend = FailKth(held, K, "raise")
    c = _connector(backend, agents.plan)
    c.listener = LayerwisePushListener(backend)
    r = _room(c)
    job = r.layerwise = LayerwisePush(r.room, agents.plan, LAYERS, started=True)
    for layer in range(LAYERS):  # the forward's per-layer calls (CPU: posted directly)
        c.listener._post(layer, [job])
    c.listener._finish([job])
    assert len(job.handles) == K - 1 and "layer 2" in job.error
    decisions = c.poll()
    _assert_failed_closed(c, r, decisions, "layer 2")
    assert c.drain.cancelled == K - 1 and all(h.state is TransferState.FAILED for h in job.handles)
    c.listener._post(LAYERS - 1, [job])  # a late layer call posts nothing for the failed room
    assert len(job.handles) == K - 1
    time.sleep(0.5)
    assert held.snapshot()["released"] == 0 and int(agents.dst.count_nonzero()) == 0


def test_room_failed_by_the_decode_side_cancels_its_writes(agents):
    """The decode side fails the room (``RoomFailed``) while its WRITEs are held in the transport: they are cancelled,
    none lands, the prefill request fails with the decode side's reason, and no ``RoomFailed`` is echoed back."""
    held = _held(agents)
    c = _connector(held, agents.plan)
    r = _room(c)
    assert c.poll() == [] and r.state == "pushing" and len(r.handles) == LAYERS
    c.agent.recv = lambda: [RoomFailed(r.room, "decode side: aborted by the client")]
    decisions = c.poll()
    assert decisions == [FinishRequest(r.req)] and "aborted by the client" in r.req.finished_reason["message"]
    assert not c.sent and c.drain.cancelled == LAYERS and c.num_open() == 0 and not c.has_work()
    time.sleep(0.5)
    assert held.snapshot()["released"] == 0 and int(agents.dst.count_nonzero()) == 0


def test_drain_deadline_validated():
    with pytest.raises(ValueError, match="deadline_s"):
        PushDrain(None, None, 0)
