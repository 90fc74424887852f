"""Triton-distributed kernels under TRITON_INTERPRET=1 with simulated ranks (one process, CPU): every case runs the
real kernels rank by rank (all producers, then all consumers) against the torch references. Prints one JSON line
{case: error-or-""}; run by test_tdist_interpret.py in a subprocess (the interpreter flag is process-wide)."""

from __future__ import annotations

import json
import os
import sys
import traceback

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

import torch  # noqa: E402

from sgl_kernel.tdist import litmus as L  # noqa: E402
from sgl_kernel.tdist.ag_gemm import AgGemm  # noqa: E402
from sgl_kernel.tdist.all_to_all import AllToAll  # noqa: E402
from sgl_kernel.tdist.gemm_rs import GemmRs  # noqa: E402
from sgl_kernel.tdist.heap import simulate_group  # noqa: E402
from sgl_kernel.tdist.layout import HeapConfig  # noqa: E402
from sgl_kernel.tdist.reference import ag_gemm_ref, all_to_all_ref, gemm_rs_ref  # noqa: E402

CFG = HeapConfig(data_bytes=1 << 20, signal_slots=256)


def case_message_passing():
    hs = simulate_group(2, CFG)
    data = [h.tensor("data", (777,), torch.float32) for h in hs]
    sig = [h.signals("mp", 1) for h in hs]
    for epoch in (1, 2, 3):  # the same signal slot reused with growing epochs, never reset
        src = torch.randn(777)
        L.mp_producer_kernel[(1,)](hs[0].meta, data[0], src, sig[0], 777, epoch, 1, BLOCK=256)
        assert int(sig[1][0]) == epoch and int(sig[0][0]) == 0, (sig[0], sig[1])
        out = torch.full((777,), float("nan"))
        L.mp_consumer_kernel[(1,)](hs[1].meta, data[1], out, sig[1], 777, epoch, BLOCK=256)
        assert torch.equal(out, src)
        assert data[0].abs().sum() == 0, "the put wrote into the wrong rank"


def case_atomics_put_get_barrier():
    hs = simulate_group(3, CFG)
    cnt = [h.signals("cnt", 4) for h in hs]
    old = torch.zeros(5, dtype=torch.int64)
    cas = torch.zeros(5, dtype=torch.int64)
    L.counter_kernel[(5,)](hs[0].meta, cnt[0], old, cas, 2, 0, 9)
    assert cnt[2][:3].tolist() == [5, 9, 5], cnt[2]
    assert sorted(old.tolist()) == [0, 1, 2, 3, 4] and sorted(cas.tolist()) == [0, 9, 9, 9, 9]
    assert cnt[0].abs().sum() == 0 and cnt[1].abs().sum() == 0
    src = torch.randint(-2**40, 2**40, (300,))
    dst = [h.tensor("buf", (300,), torch.int64) for h in hs]
    L.put_kernel[(1,)](hs[1].meta, dst[1], src, 300, 0, BLOCK=128)
    assert torch.equal(dst[0], src)
    got = torch.zeros(300, dtype=torch.int64)
    L.get_kernel[(1,)](hs[2].meta, got, dst[2], 300, 0, BLOCK=128)  # rank 2's address of the buffer
    assert torch.equal(got, src)
    bsig = [h.signals("bar", 3) for h in hs]
    outs = [torch.zeros(2, dtype=torch.int64) for _ in hs]
    # a barrier blocks until all ranks arrived; in one process only the last arriver can run it to completion,
    # so pre-arrive ranks 0 and 1 by their release stores (what their barrier_all does first) then run rank 2.
    for r in (0, 1):
        for p in range(3):
            bsig[p][r] = 1
    L.barrier_kernel[(1,)](hs[2].meta, bsig[2], 1, outs[2])
    assert outs[2].tolist() == [2, 3] and all(int(bsig[p][2]) == 1 for p in range(3))


def _ag(world, rows_list, k, n, producer_chunks=2):
    hs = simulate_group(world, CFG)
    ops = [AgGemm(h, 64, k, torch.float32, bm=16, bn=16, bk=16, chunks=producer_chunks) for h in hs]
    for rows in rows_list:
        shards = [torch.randn(r, k) for r in rows]
        b = torch.randn(n, k).t()  # a weight's transpose: non-contiguous B
        plans = [op.prepare(s, b, rows) for op, s in zip(ops, shards)]
        for op, p in zip(ops, plans):
            p["out"].fill_(float("nan"))
            op.produce(p)
        for op, p in zip(ops, plans):
            op.consume(p)
            op.release(p)
        ref = ag_gemm_ref(shards, b)
        for r, p in enumerate(plans):
            torch.testing.assert_close(p["out"], ref, rtol=1e-4, atol=1e-4, msg=lambda m: f"rank {r} rows {rows}: {m}")
    _no_wait_errors(hs)


def _no_wait_errors(hs):
    for h in hs:
        h.check()  # a wait the simulation order could not satisfy would be recorded (and raise here)


def case_ag_gemm_world1():
    _ag(1, [[37]], 24, 40)


def case_ag_gemm_uneven():
    _ag(3, [[7, 7, 6], [5, 0, 17], [1, 2, 3]], 40, 24)


def _rs(world, rows_list, n):
    hs = simulate_group(world, CFG)
    ops = [GemmRs(h, 32, n, torch.float32, bm=16, bn=16, bk=16) for h in hs]
    for i, rows in enumerate(rows_list):
        m, k = sum(rows), 19 + i
        a = [torch.randn(m, k) for _ in hs]
        b = [torch.randn(n, k).t() for _ in hs]
        plans = [op.prepare(x, y, rows) for op, x, y in zip(ops, a, b)]
        for op, p in zip(ops, plans):
            op.gemm(p)
        for op, p in zip(ops, plans):
            op.reduce(p)
            op.release(p)
        for r, (p, ref) in enumerate(zip(plans, gemm_rs_ref(a, b, rows))):
            torch.testing.assert_close(p["out"], ref, rtol=1e-4, atol=1e-4, msg=lambda m: f"rank {r} rows {rows}: {m}")
    _no_wait_errors(hs)


def case_gemm_rs_uneven():
    _rs(3, [[7, 7, 6], [5, 0, 17], [16, 16, 16]], 24)


def case_gemm_rs_world1():
    _rs(1, [[21]], 40)


def _a2a_lockstep(ops, plans):
    """One all-to-all call of every simulated rank: each phase (AllToAll.stages) on every rank before the next."""
    stages = [op.stages(p) for op, p in zip(ops, plans)]
    for i in range(len(stages[0])):
        for st in stages:
            st[i][1]()


def case_all_to_all():
    world, h, cap = 3, 8, 10
    hs = simulate_group(world, CFG)
    ops = [AllToAll(x, cap, h, torch.float32, chunks=2) for x in hs]
    backs = [AllToAll(x, cap, h, torch.float32, chunks=3, name="a2a.back") for x in hs]
    g = torch.Generator().manual_seed(0)
    for it in range(4):
        sc = torch.randint(0, cap + 1, (world, world), generator=g).tolist()
        if it == 1:
            sc[0] = [0, 0, 0]
        xs = [torch.randn(sum(c), h) for c in sc]
        plans = [op.prepare(x, torch.tensor(c, dtype=torch.int32)) for op, x, c in zip(ops, xs, sc)]
        _a2a_lockstep(ops, plans)
        ref, rc = all_to_all_ref(xs, sc)
        for d, p in enumerate(plans):
            assert p["recv_counts"].tolist() == rc[d], (p["recv_counts"], rc[d])
            assert torch.equal(p["out"][: ref[d].shape[0]], ref[d]), f"rank {d} iteration {it}"
        # combine: send the received rows back with the received counts -> original rows in original order (its
        # own object: the input lies in the dispatch object's receive buffer)
        back = [op.prepare(p["out"][: ref[d].shape[0]].clone(), p["recv_counts"]) for d, (op, p)
                in enumerate(zip(backs, plans))]
        _a2a_lockstep(backs, back)
        for r, p in enumerate(back):
            assert torch.equal(p["out"][: xs[r].shape[0]], xs[r]), f"combine rank {r}"
    _no_wait_errors(hs)


def case_all_to_all_peer_one_call_ahead():
    """Rank 0 finishes call 1 and announces call 2 (new counts) before rank 1 finishes call 1: rank 1 must still
    report call 1's counts and rows (the count matrix is double-buffered by epoch parity; a single buffer fails
    here), and call 2 must complete with its own."""
    hs = simulate_group(2, CFG)
    ops = [AllToAll(x, 6, 8, torch.float32, chunks=2) for x in hs]
    calls = [[[1, 2], [3, 4]], [[5, 6], [0, 1]]]
    xs = [[torch.randn(sum(c), 8) for c in sc] for sc in calls]
    plans = [[op.prepare(x, torch.tensor(c, dtype=torch.int32)) for op, x, c in zip(ops, xs[i], sc)]
             for i, sc in enumerate(calls)]
    st = [[op.stages(p) for op, p in zip(ops, plans[i])] for i in range(2)]  # st[call][rank][phase]
    for i, r, ph in ((0, 0, 0), (0, 1, 0), (0, 0, 1), (0, 1, 1), (0, 0, 2), (0, 0, 3), (1, 0, 0)):
        st[i][r][ph][1]()
    got0 = plans[0][0]["out"][:4].clone()
    st[0][1][2][1]()  # rank 1 finishes call 1 only now
    ref, rc = all_to_all_ref(xs[0], calls[0])
    assert plans[0][1]["recv_counts"].tolist() == rc[1], (plans[0][1]["recv_counts"], rc[1])
    assert torch.equal(plans[0][1]["out"][:6], ref[1]) and torch.equal(got0, ref[0])
    st[0][1][3][1]()
    st[1][1][0][1]()  # rank 1 announces call 2; then both ranks run call 2's remaining phases in lockstep
    for ph in (1, 2, 3):
        for r in (0, 1):
            st[1][r][ph][1]()
    ref, rc = all_to_all_ref(xs[1], calls[1])
    for d in (0, 1):
        assert plans[1][d]["recv_counts"].tolist() == rc[d], (d, plans[1][d]["recv_counts"], rc[d])
        assert torch.equal(plans[1][d]["out"][: ref[d].shape[0]], ref[d]), f"call 2 rank {d}"
    _no_wait_errors(hs)


def case_all_to_all_overflow_fails_closed():
    hs = simulate_group(2, CFG)
    ops = [AllToAll(x, 4, 8, torch.float32, chunks=1) for x in hs]
    sc = [[5, 1], [1, 1]]  # rank 0 sends 5 rows to itself: above capacity 4
    xs = [torch.randn(sum(c), 8) for c in sc]
    plans = [op.prepare(x, torch.tensor(c, dtype=torch.int32)) for op, x, c in zip(ops, xs, sc)]
    _a2a_lockstep(ops, plans)
    assert plans[1]["recv_counts"].tolist() == [1, 1]
    assert torch.equal(plans[1]["out"][:2], torch.cat([xs[0][5:6], xs[1][1:2]]))  # refused rows count 0 in offsets
    assert plans[0]["recv_counts"].tolist() == [-1, 1]
    try:
        ops[0].check(plans[0])
    except ValueError as e:
        assert "capacity" in str(e)
    else:
        raise AssertionError("overflow was not reported")


if __name__ == "__main__":
    names = sys.argv[1:] or [n for n in dict(globals()) if n.startswith("case_")]
    res = {}
    for n in names:
        try:
            globals()[n]()
            res[n] = ""
        except Exception:
            res[n] = traceback.format_exc()[-3000:]
    print(json.dumps(res))
