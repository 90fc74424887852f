"""TransferQueue (KVDirect sec. 4.2) over the fake backend: pull and push move the planned KV exactly; reads
are popped up to the first COMPLETE and coalesced per request; COMPLETE waits for the previous ACK (one
completion slot) while the next request's reads proceed; failures end as events, never hangs."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from sglang.srt.disaggregation.transfer import MemRegion, ReadOp, TransferConfig, make_transfer_backend
from sglang.srt.disaggregation.transfer.kv_plan import coalesce, plan_kv_reads
from sglang.srt.disaggregation.transfer.queue import (TransferQueue, checksum_ranges, decode_ctrl,
                                                      encode_ctrl)
from sglang.srt.mem_cache.kv_cache import KVCache


def _kv(seed: int, page_size: int = 4):
    kv = KVCache.create(max_total_tokens=64 * page_size, page_size=page_size, dtype=torch.float32, head_num=2,
                        head_dim=4, layer_num=2, req_rows=2, max_context_len=8, device="cpu")
    d = kv.token_to_kv_pool.kv_data
    d.copy_(torch.randn(d.shape, generator=torch.Generator().manual_seed(seed)))
    return kv, d


@pytest.fixture
def pair():
    cfg = TransferConfig(transfer_timeout_s=5.0, connect_timeout_s=2.0)
    pre, dec = make_transfer_backend("fake", "prefill", cfg), make_transfer_backend("fake", "decode", cfg)
    pkv, pt = _kv(1)
    dkv, dt = _kv(2)
    pre.register([MemRegion(pt.data_ptr(), pt.numel() * 4, "cpu")])
    dec.register([MemRegion(dt.data_ptr(), dt.numel() * 4, "cpu")])
    pre.connect("decode", dec.local_metadata())
    dec.connect("prefill", pre.local_metadata())
    yield pre, dec, pkv, pt, dkv, dt
    pre.close()
    dec.close()


def _drive(queues, until, timeout=10.0):
    events = {id(q): [] for q in queues}
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        for q in queues:
            events[id(q)] += q.progress()
        if until(events):
            return events
        time.sleep(0.002)
    raise AssertionError(f"timed out; events so far {events}")


def _kinds(evs, kind):
    return [e.room for e in evs if e.kind == kind]


def test_ctrl_messages_round_trip():
    assert decode_ctrl(encode_ctrl("C", 123)) == ("C", "123")
    assert decode_ctrl(b"heartbeat") is None


@pytest.mark.parametrize("mode", ["read", "write"])
def test_pull_and_push_move_planned_kv(pair, mode):
    pre, dec, pkv, pt, dkv, dt = pair
    rng = np.random.default_rng(0)
    src, dst = dkv.describe(), pkv.describe()
    if mode == "read":  # decode pulls prefill's KV
        init_b, tgt_b, remote_kv, local_kv, remote_t, local_t = dec, pre, pkv, dkv, pt, dt
    else:  # prefill pushes into decode's preallocated pages
        init_b, tgt_b, remote_kv, local_kv, remote_t, local_t = pre, dec, dkv, pkv, dt, pt
    initiator, target = TransferQueue(init_b, mode), TransferQueue(tgt_b, mode)
    peer = "prefill" if mode == "read" else "decode"
    want = remote_t.clone() if mode == "write" else local_t.clone()
    plans = {}
    rperm, lperm = rng.permutation(np.arange(1, 64)).tolist(), rng.permutation(np.arange(1, 64)).tolist()
    for i, room in enumerate((11, 12, 13)):  # disjoint pages per request, random order
        rp, lp = rperm[5 * i:5 * i + 5], lperm[5 * i:5 * i + 5]
        if mode == "read":  # ops: remote = prefill pages, local = decode pages
            ops = plan_kv_reads(pkv.describe(), dkv.describe(), rp, lp, num_tokens=18)
        else:  # ops: remote = decode pages (destination), local = prefill pages (source)
            ops = plan_kv_reads(dkv.describe(), pkv.describe(), rp, lp, num_tokens=18)
        plans[room] = (ops, rp, lp)
        initiator.submit(peer, room, ops)
    ev = _drive([initiator, target], lambda e: len(_kinds(e[id(target)], "complete")) == 3
                and len(_kinds(e[id(initiator)], "acked")) == 3)
    assert _kinds(ev[id(initiator)], "done") == ["11", "12", "13"]
    assert _kinds(ev[id(target)], "complete") == ["11", "12", "13"]  # COMPLETEs in order, each ACKed
    for room, (ops, rp, lp) in plans.items():
        st = initiator.pop_stats(room)
        assert st.state == "done" and st.reads_posted == len(coalesce(ops)) and st.transfers_posted == 1
        assert st.bytes == sum(o.nbytes for o in ops) and st.transfer_time_s > 0
        assert checksum_ranges((o.local_addr, o.nbytes) for o in ops) == \
            checksum_ranges((o.remote_addr, o.nbytes) for o in ops)  # the --disaggregation-verify check
        for o in ops:  # expected result: each range copied
            if mode == "read":
                _copy(want, local_t, o.local_addr, remote_t, o.remote_addr, o.nbytes)
            else:
                _copy(want, remote_t, o.remote_addr, local_t, o.local_addr, o.nbytes)
    assert torch.equal(local_t if mode == "read" else remote_t, want)


def _copy(want, dst_t, dst_addr, src_t, src_addr, n):
    di, si = (dst_addr - dst_t.data_ptr()) // 4, (src_addr - src_t.data_ptr()) // 4
    want.view(-1)[di:di + n // 4] = src_t.view(-1)[si:si + n // 4]


def test_pop_until_complete_and_ack_slot(pair):
    pre, dec, pkv, pt, dkv, dt = pair
    q, target = TransferQueue(dec, "read"), TransferQueue(pre, "read")
    R, L = pkv.describe(), dkv.describe()
    a = plan_kv_reads(R, L, [1, 2], [1, 2])
    q.enqueue("prefill", 1, a[: len(a) // 2])
    q.enqueue("prefill", 1, a[len(a) // 2:])  # two enqueues before COMPLETE: merged into one post
    q.complete("prefill", 1)
    page = 4 * 2 * 4 * 4  # bytes of one page of one (layer, K/V)
    b = [ReadOp(pt.data_ptr() + 9 * page, dt.data_ptr() + 9 * page, page)]
    c = [ReadOp(pt.data_ptr() + 10 * page, dt.data_ptr() + 10 * page, page)]  # contiguous with b on both sides
    q.submit("prefill", 2, b)
    q.submit("prefill", 3, c)
    ev = _drive([q], lambda e: len(_kinds(e[id(q)], "done")) == 3)  # target does NOT progress: no ACK yet
    s1, s2, s3 = q.stats(1), q.stats(2), q.stats(3)
    assert s1.transfers_posted == 1 and s1.reads_posted == len(coalesce(a)) == 2 * 2  # (layer, K/V) runs
    assert s1.ops_planned == len(a) == 2 * 2 * 2  # one per page before coalescing
    assert len(coalesce(b + c)) == 1  # merging across a COMPLETE would post one read ...
    assert s2.reads_posted == s3.reads_posted == 1  # ... but reads are popped up to the first COMPLETE only
    time.sleep(0.1)
    got = pre.get_notifs()  # only COMPLETE(1) went out; COMPLETE(2) waits for ACK(1) ...
    assert [decode_ctrl(m) for m in got["decode"]] == [("C", "1")]
    assert _kinds(ev[id(q)], "done") == ["1", "2", "3"]  # ... although later requests' reads finished meanwhile
    ev = target.progress(got)  # the target ACKs and only then reports complete
    assert _kinds(ev, "complete") == ["1"]
    ev = _drive([q], lambda e: _kinds(e[id(q)], "acked") == ["1"])
    time.sleep(0.1)
    assert [decode_ctrl(m) for m in pre.get_notifs()["decode"]] == [("C", "2")]  # slot reused after ACK(1)
    assert torch.equal(dt[:, :, 4:12], pt[:, :, 4:12])  # request 1: pages 1-2, all layers, K and V
    assert torch.equal(dt[0, 0, 36:44], pt[0, 0, 36:44]) and not torch.equal(dt[0, 0, 44:48], pt[0, 0, 44:48])


def test_failed_peer_gives_failed_event(pair):
    pre, dec, pkv, pt, dkv, dt = pair
    q = TransferQueue(dec, "read")
    ops = plan_kv_reads(pkv.describe(), dkv.describe(), [1], [1])
    pre.close()  # the prefill agent is gone
    q.submit("prefill", 7, ops)
    ev = _drive([q], lambda e: _kinds(e[id(q)], "failed") == ["7"])
    assert not _kinds(ev[id(q)], "done") and q.stats(7).state == "failed" and not q.busy_rooms()
    with pytest.raises(ValueError, match="already finished"):
        q.enqueue("prefill", 7, ops)


def test_abort_cancels_posted_reads_no_late_bytes(pair):
    """An aborted request's READ that the peer answers later never lands (the decode side frees and reuses that
    KV right after the abort); has_pending() tracks queued work, in-flight requests and unACKed COMPLETEs."""
    import socket
    import threading

    from sglang.srt.disaggregation.transfer.fake_backend import _enc, _recv_frame, _send_frame

    dec, dt = pair[1], pair[5]
    lst = socket.create_server(("127.0.0.1", 0))
    got_req, answer = threading.Event(), threading.Event()

    def slow_peer():  # answers the read only after the test aborted it
        conn, _ = lst.accept()
        hdr, _ = _recv_frame(conn)
        got_req.set()
        answer.wait(10)
        _send_frame(conn, {"t": "ok"}, b"\xab" * sum(n for _, n in hdr["ops"]))
        time.sleep(0.5)
        conn.close()

    threading.Thread(target=slow_peer, daemon=True).start()
    dec.connect("slow", _enc.encode({"backend": "fake", "name": "slow", "host": "127.0.0.1",
                                     "port": lst.getsockname()[1]}))
    q = TransferQueue(dec, "read")
    assert not q.has_pending()
    before = dt.clone()
    q.submit("slow", 5, [ReadOp(0x1000, dt.data_ptr() + 64, 256)])  # remote address: the peer's business
    assert q.has_pending()
    q.progress()
    assert got_req.wait(5) and q.busy_rooms() == {"5"}
    q.abort(5, "client went away")
    assert q.stats(5).state == "aborted" and not q.has_pending() and not q.busy_rooms()
    answer.set()
    time.sleep(0.3)
    assert not [e for e in q.progress() if e.kind in ("done", "complete")]
    assert torch.equal(dt, before)  # the late answer was dropped, not copied
    lst.close()


def test_bad_arguments(pair):
    dec = pair[1]
    with pytest.raises(ValueError, match="mode"):
        TransferQueue(dec, "copy")
    with pytest.raises(ValueError, match="max_unacked"):
        TransferQueue(dec, "read", max_unacked_completes=0)


def test_transfer_package_never_imports_nixl_or_cuda_modules():
    """The plain server path (contract, fake backend, planner, queue) imports neither nixl nor torch."""
    import subprocess
    import sys

    code = ("import sys; import sglang.srt.disaggregation.transfer as t, sglang.srt.disaggregation.transfer.queue, "
            "sglang.srt.disaggregation.transfer.kv_plan, sglang.srt.disaggregation.transfer.fake_backend; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('nixl', 'nixl_cu13', 'nixl_cu12', 'torch', "
            "'triton')]; print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
