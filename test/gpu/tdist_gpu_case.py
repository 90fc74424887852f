"""Rank-side cases of the Triton-distributed GPU tests (run by test_tdist_gpu.py through sgl_kernel.tdist.spawn).

Every case takes (heap, note) and returns a list of failure strings (empty = pass); a case never raises on a wrong
result, so one failing case does not hide the others. Inputs are regenerated from seeds on every rank, so each rank
can build the torch reference of the whole group without communication.
"""

from __future__ import annotations

import time
import traceback

import torch

from sgl_kernel.tdist import litmus as L
from sgl_kernel.tdist.ag_gemm import AgGemm
from sgl_kernel.tdist.all_to_all import AllToAll
from sgl_kernel.tdist.gemm_rs import GemmRs
from sgl_kernel.tdist.reference import ag_gemm_ref, all_to_all_ref, compare, gemm_rs_ref


def _randn(seed, *shape, dtype=torch.float32, device="cuda"):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype).to(device)


def _close(got, ref, tag):
    # reference.compare handles a rank with no rows (the old helper's .max() on an empty reference raised on that
    # rank only: it left case_gemm_rs early and its peers waited forever for its tiles: the 2026-11-25 "stall")
    return compare(got, ref, tag)


def case_message_passing(heap, note):
    """100 rounds of put + st.release / ld.acquire + read between ring neighbours, 256K floats, signal slot reused."""
    me, w = heap.rank, heap.world
    n = 1 << 18
    data = heap.tensor("mp.data", (n,), torch.float32)
    sig = heap.signals("mp.sig", 1)
    out = torch.empty(n, device=heap.device)
    fails = []
    for epoch in range(1, 101):
        src = _randn(epoch * 31 + me, n, device=heap.device)
        L.mp_producer_kernel[(1,)](heap.meta, data, src, sig, n, epoch, (me + 1) % w, BLOCK=4096, num_warps=8)
        L.mp_consumer_kernel[(1,)](heap.meta, data, out, sig, n, epoch, BLOCK=4096, num_warps=8)
        exp = _randn(epoch * 31 + (me - 1) % w, n, device=heap.device)
        heap.barrier()
        if not torch.equal(out, exp):
            fails.append(f"round {epoch}: consumer read stale/garbled data ({int((out != exp).sum())} elements)")
            break
    return fails


def case_pingpong_10000(heap, note):
    """Signal reuse in one launch between ranks 0 and 1 (the others stay idle, so on a shared GPU only two contexts
    take turns): 10,000 rounds with 2 ranks, 2,000 with more; the data must never be stale."""
    me, w = heap.rank, heap.world
    sig = heap.signals("pp.sig", 1)
    data = heap.tensor("pp.data", (128,), torch.int64)
    log = torch.zeros(2, dtype=torch.int64, device=heap.device)
    if me > 1:
        return []
    rounds = 10_000 if w == 2 else 2_000
    t = time.time()
    L.pingpong_kernel[(1,)](heap.meta, sig, data, log, rounds, 0, me ^ 1, BLOCK=128, num_warps=4)
    torch.cuda.synchronize()
    note(f"pingpong {rounds} rounds in {time.time() - t:.1f} s")
    bad, last = log.tolist()
    fails = []
    if bad:
        fails.append(f"{bad} stale elements seen over {rounds} rounds")
    if last != rounds:
        fails.append(f"last epoch {last} != {rounds}")
    return fails


def case_pingpong_cta_10000(heap, note):
    """10,000 signal reuses between two concurrently running CTAs of one launch (each rank runs its own pair; real
    SM-to-SM concurrency, unlike the time-sliced cross-process run): 4096 int64 per message, never stale."""
    sig = torch.zeros(2, dtype=torch.int64, device=heap.device)
    data = torch.zeros(2 * 4096, dtype=torch.int64, device=heap.device)
    log = torch.full((2,), -1, dtype=torch.int64, device=heap.device)
    t = time.time()
    L.pingpong_cta_kernel[(2,)](heap.meta, sig, data, log, 10_000, BLOCK=4096, num_warps=4)
    torch.cuda.synchronize()
    note(f"pingpong_cta 10000 rounds in {time.time() - t:.2f} s")
    fails = []
    if log.tolist() != [0, 0]:
        fails.append(f"stale elements per CTA {log.tolist()} (expected [0, 0])")
    if sig.tolist() != [10_000, 10_000]:
        fails.append(f"final signals {sig.tolist()}")
    return fails


def case_atomics(heap, note):
    """8 CTAs per rank: atomic_add / CAS / red.release on rank 0's counters."""
    import torch.distributed as dist

    cnt = heap.signals("at.cnt", 4)
    old = torch.full((8,), -1, dtype=torch.int64, device=heap.device)
    cas = torch.full((8,), -1, dtype=torch.int64, device=heap.device)
    heap.barrier()
    L.counter_kernel[(8,)](heap.meta, cnt, old, cas, 0, 0, 9)
    heap.barrier()
    olds = [None] * heap.world
    cass = [None] * heap.world
    dist.all_gather_object(olds, old.tolist())
    dist.all_gather_object(cass, cas.tolist())
    fails = []
    flat = sorted(v for o in olds for v in o)
    if flat != list(range(8 * heap.world)):
        fails.append(f"atomic_add returned {flat}, expected each of 0..{8 * heap.world - 1} once")
    c = sorted(v for o in cass for v in o)
    if c.count(0) != 1 or c.count(9) != 8 * heap.world - 1:
        fails.append(f"CAS old values {c}: exactly one CTA must win")
    if heap.rank == 0 and cnt[:3].tolist() != [8 * heap.world, 9, 8 * heap.world]:
        fails.append(f"counters {cnt[:3].tolist()}")
    return fails


def case_put_get_barrier(heap, note):
    """putmem to the next rank, barrier_all (100 epochs), getmem from the next rank."""
    me, w = heap.rank, heap.world
    n = 12_345
    buf = heap.tensor("pg.buf", (n,), torch.int64)
    bsig = heap.signals("pg.bar", w)
    src = (torch.arange(n, device=heap.device) * 7 + me * 1_000_003)
    L.put_kernel[(1,)](heap.meta, buf, src, n, (me + 1) % w, BLOCK=1024)
    out = torch.zeros(2, dtype=torch.int64, device=heap.device)
    for e in range(1, 101):
        L.barrier_kernel[(1,)](heap.meta, bsig, e, out)
    torch.cuda.synchronize()
    fails = []
    if out.tolist() != [me, w]:
        fails.append(f"rank/num_ranks read {out.tolist()}")
    prev = (me - 1) % w
    if not torch.equal(buf, torch.arange(n, device=heap.device) * 7 + prev * 1_000_003):
        fails.append("put data missing after barrier_all")
    got = torch.zeros(n, dtype=torch.int64, device=heap.device)
    L.get_kernel[(1,)](heap.meta, got, buf, n, (me + 1) % w, BLOCK=1024)
    torch.cuda.synchronize()
    if not torch.equal(got, src):
        fails.append("getmem from the next rank returned wrong data")
    heap.barrier()
    return fails


def _row_sets(w):
    return [[64 * (r + 1) for r in range(w)], [1 + 37 * r for r in range(w)], [0] + [129] * (w - 1),
            [256] * w, [3] * (w - 1) + [0]]


def _case_ag(heap, producer):
    me, w = heap.rank, heap.world
    k, n = 512, 384
    op = AgGemm(heap, 1024, k, torch.bfloat16, name=f"ag.{producer}", producer=producer)
    fails = []
    for i, rows in enumerate(_row_sets(w)):
        shards = [_randn(1000 * i + r, rows[r], k, dtype=torch.bfloat16) for r in range(w)]
        wt = _randn(777 + i, n, k, dtype=torch.bfloat16)
        out = torch.full((sum(rows), n), float("nan"), dtype=torch.bfloat16, device=heap.device)
        op(shards[me], wt.t(), rows, out=out)
        torch.cuda.synchronize()
        fails += _close(out, ag_gemm_ref(shards, wt.t()), f"ag_gemm[{producer}] rows={rows}")
    # 100 back-to-back calls, no host sync: the buffer-release protocol must keep results right
    rows = [100 + 3 * r for r in range(w)]
    shards = [_randn(50 + r, rows[r], k, dtype=torch.bfloat16) for r in range(w)]
    wt = _randn(51, n, k, dtype=torch.bfloat16)
    ref = ag_gemm_ref(shards, wt.t())
    outs = [op(shards[me], wt.t(), rows) for _ in range(100)]
    torch.cuda.synchronize()
    for j in (0, 49, 99):
        fails += _close(outs[j], ref, f"ag_gemm[{producer}] back-to-back call {j}")
    heap.barrier()
    return fails


def case_ag_gemm_sm(heap, note):
    """AG-GEMM, SM producer: uneven/empty segments vs torch; 100 back-to-back calls."""
    return _case_ag(heap, "sm")


def case_ag_gemm_ce(heap, note):
    """AG-GEMM, copy-engine producer (stream memops)."""
    return _case_ag(heap, "ce")


def case_gemm_rs(heap, note):
    """GEMM-RS: uneven/empty segments vs torch; 100 back-to-back calls."""
    me, w = heap.rank, heap.world
    k, n = 320, 448
    op = GemmRs(heap, 512, n, torch.bfloat16)
    fails = []
    for i, rows in enumerate(_row_sets(w)):
        m = sum(rows)
        a = [_randn(2000 * i + r, m, k, dtype=torch.bfloat16) for r in range(w)]
        b = [_randn(3000 * i + r, n, k, dtype=torch.bfloat16).t() for r in range(w)]
        out = torch.full((rows[me], n), float("nan"), dtype=torch.bfloat16, device=heap.device)
        op(a[me], b[me], rows, out=out)
        torch.cuda.synchronize()
        fails += _close(out, gemm_rs_ref(a, b, rows)[me], f"gemm_rs rows={rows}")
    rows = [90 + 5 * r for r in range(w)]
    m = sum(rows)
    a = [_randn(70 + r, m, k, dtype=torch.bfloat16) for r in range(w)]
    b = [_randn(80 + r, n, k, dtype=torch.bfloat16).t() for r in range(w)]
    ref = gemm_rs_ref(a, b, rows)[me]
    outs = [op(a[me], b[me], rows) for _ in range(100)]
    torch.cuda.synchronize()
    for j in (0, 99):
        fails += _close(outs[j], ref, f"gemm_rs back-to-back call {j}")
    heap.barrier()
    return fails


def case_all_to_all(heap, note):
    """Dispatch + combine with random variable counts (zeros included), 50 rounds, vs all_to_all_single semantics."""
    me, w = heap.rank, heap.world
    h, cap = 1024, 96
    op = AllToAll(heap, cap, h, torch.bfloat16)
    back = AllToAll(heap, cap, h, torch.bfloat16, name="a2a.combine")
    fails = []
    for it in range(50):
        g = torch.Generator().manual_seed(4242 + it)
        sc = torch.randint(0, cap + 1, (w, w), generator=g)
        if it % 7 == 3:
            sc[it % w] = 0  # one source sends nothing (the same on every rank)
        sc = sc.tolist()
        xs = [_randn(9000 + it * 16 + r, sum(sc[r]), h, dtype=torch.bfloat16) for r in range(w)]
        out, rc = op(xs[me], torch.tensor(sc[me], dtype=torch.int32, device=heap.device))
        ref, rcr = all_to_all_ref(xs, sc)
        got_rc = rc.tolist()
        if got_rc != rcr[me]:
            fails.append(f"round {it}: recv_counts {got_rc} != {rcr[me]}")
            break
        total = sum(got_rc)
        if not torch.equal(out[:total], ref[me]):
            fails.append(f"round {it}: dispatched rows differ")
            break
        y, _ = back(out[:total].contiguous(), rc)
        if not torch.equal(y[: xs[me].shape[0]], xs[me]):
            fails.append(f"round {it}: combine did not return the original rows")
            break
    heap.barrier()
    return fails


def case_layers_sequence_parallel(heap, note):
    """ColumnParallelLinear.forward_gathered + RowParallelLinear.forward_scattered with the Triton-distributed ops
    (its own heap, copy-engine producer) equal the unsharded torch linears, uneven token splits, 3 calls each."""
    import torch.distributed as dist
    import torch.nn.functional as F

    from sglang.srt.distributed.sequence_parallel import split_rows
    from sglang.srt.distributed.tdist_overlap import TdistSequenceParallelOps
    from sglang.srt.layers.linear import ColumnParallelLinear, RowParallelLinear

    me, w = heap.rank, heap.world
    ops = TdistSequenceParallelOps(dist.group.WORLD, heap.device, me, w, max_tokens=1024, heap_bytes=64 << 20)
    h, inter = 256, 512
    fails = []
    with torch.device(heap.device):
        col = ColumnParallelLinear(h, inter, bias=True, params_dtype=torch.bfloat16, tp_rank=me, tp_size=w)
        row = RowParallelLinear(inter, h, bias=True, params_dtype=torch.bfloat16, tp_rank=me, tp_size=w)
    w1, b1 = _randn(1, inter, h, dtype=torch.bfloat16), _randn(2, inter, dtype=torch.bfloat16)
    w2, b2 = _randn(3, h, inter, dtype=torch.bfloat16), _randn(4, h, dtype=torch.bfloat16)
    col.weight_loader(col.weight, w1)
    col.weight_loader(col.bias, b1)
    row.weight_loader(row.weight, w2)
    row.weight_loader(row.bias, b2)
    for total in (1000, 77, 5):
        x = _randn(total, total, h, dtype=torch.bfloat16)
        rows = split_rows(total, w)
        s = sum(rows[:me])
        mid = col.forward_gathered(x[s: s + rows[me]], rows, ops)
        out = row.forward_scattered(mid, rows, ops)
        torch.cuda.synchronize()
        ref_mid = F.linear(x.float(), w1.float(), b1.float())
        n = inter // w
        fails += _close(mid, ref_mid[:, me * n:(me + 1) * n], f"forward_gathered T={total}")
        ref = F.linear(ref_mid.to(torch.bfloat16).float(), w2.float(), b2.float())[s: s + rows[me]]
        fails += _close(out, ref, f"forward_scattered T={total}")
    ops.heap.close()
    return fails


def case_wait_timeout_fails_closed(heap, note):
    """The bounded wait on real hardware: every rank waits (mp_consumer_kernel) for a signal nobody sets, with a
    0.2 s budget in a copy of meta. The launch must end (no hang), and every rank's error record must name the kernel
    and the signal (the first rank to time out aborts the others). The record is then cleared on every rank."""
    import torch.distributed as dist

    sig = heap.signals("wt.never", 1)
    data = heap.tensor("wt.data", (256,), torch.float32)
    out = torch.empty(256, device=heap.device)
    meta = heap.meta.clone()
    meta[-1] = 200_000_000  # 0.2 s
    dist.barrier()
    t = time.time()
    L.mp_consumer_kernel[(2,)](meta, data, out, sig, 256, 1, BLOCK=256, num_warps=4)
    torch.cuda.synchronize()
    waited = time.time() - t
    msg = heap.wait_error() or ""
    note(f"wait timeout case: {waited:.2f} s: {msg[:300]}")
    fails = []
    for part in ("mp_consumer_kernel", "wt.never[0]", f"rank {heap.rank} of {heap.world}", ">= 1, last value 0"):
        if part not in msg:
            fails.append(f"error record lacks {part!r}: {msg!r}")
    if waited > 20:
        fails.append(f"the bounded wait took {waited:.1f} s for a 0.2 s budget")
    dist.barrier()  # every rank's kernel (and its abort writes into peers) is finished
    heap.error.zero_()
    torch.cuda.synchronize()
    dist.barrier()
    heap.check()
    return fails


CASES = ["case_message_passing", "case_pingpong_10000", "case_pingpong_cta_10000", "case_atomics",
         "case_put_get_barrier", "case_ag_gemm_sm", "case_ag_gemm_ce", "case_gemm_rs", "case_all_to_all",
         "case_layers_sequence_parallel", "case_wait_timeout_fails_closed"]


def run_all(heap, note, nccl, names):
    """Run the named cases in order on this rank; returns {case: [failures]} plus per-case seconds under '_time'.

    Each case's outcome goes to the parent as soon as it is known (``note.result(case, {"fails", "seconds",
    "raised"})``), so a later hang or timeout does not lose it. After every case the device error record is checked
    (a bounded wait that gave up raises TdistWaitError naming kernel, rank and signal) and the ranks agree over a
    separate gloo group whether any of them raised: a raise leaves the ranks out of step (one left a collective the
    others are still in, or the heap is poisoned), so the group then stops and reports the rest as not run; the
    test driver continues with them in a fresh group."""
    import datetime

    import torch.distributed as dist

    # consensus only: never paired with a case's own collectives; outlives the world group's timeout, so a rank stuck
    # in a case's barrier (its peer raised and left) times out there first and still joins the consensus
    ctl = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=600))
    res, times = {}, {}
    for name in names:
        note(f"{name} start")
        t = time.time()
        raised = False
        try:
            fails = globals()[name](heap, note)
            torch.cuda.synchronize()
            heap.check()
        except Exception:
            fails, raised = [traceback.format_exc()[-3000:]], True
        times[name] = round(time.time() - t, 2)
        res[name] = fails
        note.result(name, {"fails": fails, "seconds": times[name], "raised": raised})
        note(f"{name} done in {times[name]} s")
        flags = [None] * heap.world
        dist.all_gather_object(flags, raised, group=ctl)
        if any(flags):
            bad = [r for r, f in enumerate(flags) if f]
            note(f"group stops after {name}: ranks {bad} raised")
            res["_stopped"] = {"after": name, "ranks": bad}
            break
    res["_time"] = times
    return res
