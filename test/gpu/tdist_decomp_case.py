"""Rank body of test_tdist_decomp_gpu.py (run by sgl_kernel.tdist.spawn.run_ranks, one rank per GPU, NCCL group).

Checks, against torch references on fresh random bf16 inputs (every rank regenerates every rank's inputs from seeds,
so it can build the whole group's reference without communication): the decomposition AG-GEMM and GEMM-RS
(tdist/decomp.py) with even, uneven and empty segments; 30 back-to-back calls with new inputs (signal and buffer
reuse without host barriers); CUDA-graph capture of one call of each op and 5 replays with new inputs copied into
the static tensors; the Auto* ops on both sides of the break-even M (NCCL fallback and decomposition); the Triton SM
AG-GEMM / GEMM-RS (tdist/ag_gemm.py, gemm_rs.py) with cached device metadata, eager and captured in a CUDA graph
(their epochs live in device memory); the low-latency all-to-all (tdist_gpu_case.case_all_to_all); both per-peer
stream schedules of the decomposition ("ring" / "all", case "schedules"), eager and graphed.
Returns a list of failure strings (empty = pass); never raises on a wrong result.
"""

from __future__ import annotations

import traceback

import torch

from sgl_kernel.tdist.auto import AutoAgGemm, AutoGemmRs, CalibrationTable
from sgl_kernel.tdist.decomp import DecompAgGemm, DecompGemmRs
from sgl_kernel.tdist.reference import ag_gemm_ref, compare, gemm_rs_ref

DT = torch.bfloat16


def _randn(seed, *shape, device="cuda"):
    """Seeded bf16 normal values, equal on every rank: drawn on the GPU (Philox; the ranks' GPUs are one model) so
    that rebuilding the whole group's inputs costs no host time. Drawn on the host (fp32, then moved) they made
    every call cost ~0.2 s at world 4 (4 ranks' inputs per call, 2026-11-27 on 4 x H200), the main part of the
    test's ~110 s."""
    dev = torch.device(device)
    if dev.type == "cuda":
        g = torch.Generator(device=dev).manual_seed(seed)
        return torch.randn(*shape, generator=g, device=dev, dtype=torch.float32).to(DT)
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(DT).to(device)


def _ag_inputs(seed, rows, k, n, dev):
    shards = [_randn(seed * 100 + r, rows[r], k, device=dev) for r in range(len(rows))]
    wt = _randn(seed * 100 + 99, n, k, device=dev) / k ** 0.5
    return shards, wt


def _rs_inputs(seed, rows, k, n, dev, world):
    m = sum(rows)
    a = [_randn(seed * 100 + r, m, k, device=dev) for r in range(world)]
    wt = [_randn(seed * 100 + 50 + r, n, k, device=dev) / k ** 0.5 for r in range(world)]
    return a, wt


def _check_ag(op, heap, rows, k, n, seeds, tag):
    fails = []
    for seed in seeds:
        shards, wt = _ag_inputs(seed, rows, k, n, heap.device)
        got = op(shards[heap.rank], wt.t(), rows)
        fails += compare(got, ag_gemm_ref(shards, wt.t()), f"{tag} seed {seed}")
    return fails


def _check_rs(op, heap, rows, k, n, seeds, tag):
    fails = []
    for seed in seeds:
        a, wt = _rs_inputs(seed, rows, k, n, heap.device, heap.world)
        got = op(a[heap.rank], wt[heap.rank].t(), rows)
        ref = gemm_rs_ref(a, [w.t() for w in wt], rows)[heap.rank]
        fails += compare(got, ref, f"{tag} seed {seed}")
    return fails


def _graph_ag(op, heap, rows, k, n, tag, note=lambda what: None):
    """Capture one call with static inputs, replay with new inputs copied in (``note``: progress per phase)."""
    shards, wt = _ag_inputs(1000, rows, k, n, heap.device)
    a_s, b_s = shards[heap.rank].clone(), wt.clone()
    out = torch.empty(sum(rows), n, dtype=DT, device=heap.device)
    op(a_s, b_s.t(), rows, out)  # warm-up outside capture (uploads any per-shape metadata)
    torch.cuda.synchronize()
    heap.barrier()
    note(f"{tag} graph: capture")
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        op(a_s, b_s.t(), rows, out)
    fails = []
    for seed in range(1001, 1006):
        note(f"{tag} graph: replay {seed - 1000}")
        shards, wt = _ag_inputs(seed, rows, k, n, heap.device)
        a_s.copy_(shards[heap.rank])
        b_s.copy_(wt)
        g.replay()
        fails += compare(out, ag_gemm_ref(shards, wt.t()), f"{tag} graph replay seed {seed}")
    torch.cuda.synchronize()
    return fails


def _graph_rs(op, heap, rows, k, n, tag, note=lambda what: None):
    """As :func:`_graph_ag`, for GEMM-RS."""
    a, wt = _rs_inputs(2000, rows, k, n, heap.device, heap.world)
    a_s, b_s = a[heap.rank].clone(), wt[heap.rank].clone()
    out = torch.empty(rows[heap.rank], n, dtype=DT, device=heap.device)
    op(a_s, b_s.t(), rows, out)
    torch.cuda.synchronize()
    heap.barrier()
    note(f"{tag} graph: capture")
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        op(a_s, b_s.t(), rows, out)
    fails = []
    for seed in range(2001, 2006):
        note(f"{tag} graph: replay {seed - 2000}")
        a, wt = _rs_inputs(seed, rows, k, n, heap.device, heap.world)
        a_s.copy_(a[heap.rank])
        b_s.copy_(wt[heap.rank])
        g.replay()
        ref = gemm_rs_ref(a, [w.t() for w in wt], rows)[heap.rank]
        fails += compare(out, ref, f"{tag} graph replay seed {seed}")
    torch.cuda.synchronize()
    return fails


def _guard(fn, *args):
    try:
        return fn(*args)
    except Exception:
        return [f"{getattr(fn, '__name__', fn)} raised: {traceback.format_exc()[-1500:]}"]


def run(heap, note, nccl, cases):
    """Every case named in ``cases`` ("decomp", "schedules", "graph", "auto", "a2a", "sm_cached", "sm_graph",
    "bounded", "deadpeer") in that order;
    returns {case: failures}. Each case's failures also go to the parent as soon as the case ends
    (``note.result``), so a later hang or timeout keeps them."""
    torch.set_num_threads(1)  # one rank per GPU on a shared host: the host work here is small, oversubscription not
    res = {}
    for case in cases:
        if case in ("bounded", "deadpeer"):
            note(case)
            res[case] = _guard(_bounded_case if case == "bounded" else _deadpeer_case, heap, nccl)
        else:
            res.update(_run_cases(heap, note, nccl, (case,)))
        note.result(case, res.get(case, [f"{case}: not a known case"]))
    return res


def _run_cases(heap, note, nccl, cases):
    """The named cases (see :func:`run`); returns {case: failures}."""
    w = heap.world
    k, n = 512, 384
    even = [256] * w
    uneven = [200 + 64 * r for r in range(w)]
    uneven[-1] = 0
    res = {}
    if "decomp" in cases:
        note("decomp")
        ag = DecompAgGemm(heap, 2048, k, DT, name="t.dag")
        rs = DecompGemmRs(heap, 512, n, DT, name="t.drs")
        f = []
        for rows in (even, uneven):
            f += _guard(_check_ag, ag, heap, rows, k, n, range(3), f"decomp AG rows={rows}")
            f += _guard(_check_rs, rs, heap, rows, k, n, range(3), f"decomp RS rows={rows}")
        f += _guard(_check_ag, ag, heap, even, k, n, range(10, 40), "decomp AG back-to-back")
        f += _guard(_check_rs, rs, heap, even, k, n, range(10, 40), "decomp RS back-to-back")
        ag3 = DecompAgGemm(heap, 2048, k, DT, name="t.dag3", chunks=3)  # pieces (uneven, some empty)
        rs4 = DecompGemmRs(heap, 512, n, DT, name="t.drs4", chunks=4)
        for rows in (even, uneven):
            f += _guard(_check_ag, ag3, heap, rows, k, n, range(50, 60), f"decomp AG 3 pieces rows={rows}")
            f += _guard(_check_rs, rs4, heap, rows, k, n, range(50, 60), f"decomp RS 4 pieces rows={rows}")
        if w == 2:  # bulk: head GEMM + one GEMM over the rest (wide N so the head is 256 of 512 rows)
            agb = DecompAgGemm(heap, 1024, k, DT, name="t.dagb", chunks=1)
            bulk = lambda a_, b_, rows_: agb(a_, b_, rows_, bulk=True)  # noqa: E731
            f += _guard(_check_ag, bulk, heap, [512, 512], k, 8192, range(60, 65), "decomp AG bulk")
        res["decomp"] = f
    if "schedules" in cases:
        note("schedules")
        res["schedules"] = _schedules_case(heap, k, n, even, uneven, note)
    if "graph" in cases:
        note("graph")
        ag = DecompAgGemm(heap, 2048, k, DT, name="t.gdag", chunks=2)
        rs = DecompGemmRs(heap, 512, n, DT, name="t.gdrs", chunks=3)
        res["graph"] = (_guard(_graph_ag, ag, heap, even, k, n, "decomp AG")
                        + _guard(_graph_rs, rs, heap, uneven, k, n, "decomp RS"))
    if "auto" in cases:
        note("auto")
        brk = 512 * w  # break-even M between the two cases below at any world size (M = per * w)
        table = CalibrationTable((("ag", k, n, w, brk), ("rs", k, n, w, brk)))
        ag = AutoAgGemm(DecompAgGemm(heap, 4096, k, DT, name="t.aag"), nccl, table)
        rs = AutoGemmRs(DecompGemmRs(heap, 1024, n, DT, name="t.ars"), nccl, table)
        f = []
        for per, want in ((256, "nccl"), (1024, "decomp")):
            rows = [per] * w
            f += _guard(_check_ag, ag, heap, rows, k, n, range(2), f"auto AG M={per * w}")
            if ag.last_path != want:
                f.append(f"auto AG M={per * w}: path {ag.last_path}, expected {want}")
            f += _guard(_check_rs, rs, heap, rows, k, n, range(2), f"auto RS M={per * w}")
            if rs.last_path != want:
                f.append(f"auto RS M={per * w}: path {rs.last_path}, expected {want}")
        res["auto"] = f
    if "a2a" in cases:  # the low-latency all-to-all (its copy loops changed with the 16-byte chunking)
        note("a2a")
        import tdist_gpu_case as G

        res["a2a"] = _guard(G.case_all_to_all, heap, note)
    if "sm_cached" in cases:
        note("sm_cached")
        res["sm_cached"] = _sm_cases(heap, k, n, even, uneven)
    if "sm_graph" in cases:  # the SM kernels read their epochs from device memory: capturable as well
        note("sm_graph")
        from sgl_kernel.tdist.ag_gemm import AgGemm
        from sgl_kernel.tdist.gemm_rs import GemmRs

        ag = AgGemm(heap, 2048, k, DT, name="t.gsmag")
        rs = GemmRs(heap, 512, n, DT, name="t.gsmrs")
        res["sm_graph"] = (_guard(_graph_ag, ag, heap, uneven, k, n, "SM AG")
                           + _guard(_graph_rs, rs, heap, even, k, n, "SM RS"))
    heap.barrier()
    return res


def _schedules_case(heap, k, n, even, uneven, note=lambda what: None):
    """Both per-peer stream schedules of the decomposition ("ring": staggered steps; "all"), 1 and 3 pieces, even and
    uneven rows, 4 back-to-back calls each (case "decomp" makes 30); the receive waits on the push streams
    (``split_recv=False``, the layout before 2026-11-27) for the 3-piece ops; then calls with split pushes (helper copy streams outside the
    later capture: the bench order whose capture was invalidated, 2026-11-27 on 4 x H200) and one CUDA-graph
    capture of the 3-piece ops replayed on new inputs. ``note(what)`` reports each sub-step (op and layout) as
    progress before it starts, so a rank that stops is named with the call it stopped in."""
    f = []

    def step(label, fn, *args):
        note(f"schedules {label}")
        return _guard(fn, *args)

    def noted(what):
        note(f"schedules {what}")

    for sched in ("ring", "all"):
        for c in (1, 3):
            ag = DecompAgGemm(heap, 2048, k, DT, name=f"t.sag.{sched}{c}", chunks=c, schedule=sched)
            rs = DecompGemmRs(heap, 512, n, DT, name=f"t.srs.{sched}{c}", chunks=c, schedule=sched)
            for rows in (even, uneven):
                tag = f"{sched} {c} pc rows={rows}"
                f += step(f"AG {tag}", _check_ag, ag, heap, rows, k, n, range(70, 74), f"AG {tag}")
                f += step(f"RS {tag}", _check_rs, rs, heap, rows, k, n, range(70, 74), f"RS {tag}")
        for op in (ag, rs):
            op.hs.split_recv = False
        tag = f"{sched} 3 pc waits on push streams"
        f += step(f"AG {tag}", _check_ag, ag, heap, uneven, k, n, range(80, 83), f"AG {tag}")
        f += step(f"RS {tag}", _check_rs, rs, heap, uneven, k, n, range(80, 83), f"RS {tag}")
        for op in (ag, rs):
            op.hs.split_recv, op.hs.split, op.hs.split_min_bytes = True, 2, 0
        tag = f"{sched} 3 pc split pushes"
        f += step(f"AG {tag}", _check_ag, ag, heap, even, k, n, range(83, 86), f"AG {tag}")
        f += step(f"RS {tag}", _check_rs, rs, heap, uneven, k, n, range(83, 86), f"RS {tag}")
        for op in (ag, rs):
            op.hs.split = 1
        f += step(f"AG {sched} 3 pc graph: warm-up", _graph_ag, ag, heap, even, k, n, f"AG {sched} 3 pc", noted)
        f += step(f"RS {sched} 3 pc graph: warm-up", _graph_rs, rs, heap, uneven, k, n, f"RS {sched} 3 pc", noted)
    return f


def _sm_cases(heap, k, n, even, uneven):
    """The Triton SM kernels with cached metadata: eager on uneven rows, then 3 eager calls after a warm-up must do
    no host-to-device upload (the metadata cache does not grow)."""
    from sgl_kernel.tdist.ag_gemm import AgGemm
    from sgl_kernel.tdist.gemm_rs import GemmRs

    ag = AgGemm(heap, 2048, k, DT, name="t.smag")
    rs = GemmRs(heap, 512, n, DT, name="t.smrs")
    f = _guard(_check_ag, ag, heap, uneven, k, n, range(2), "SM AG uneven")
    f += _guard(_check_rs, rs, heap, uneven, k, n, range(2), "SM RS uneven")
    sizes = (len(ag._dev_meta), len(rs._dev_meta))
    f += _guard(_check_ag, ag, heap, uneven, k, n, range(5, 8), "SM AG repeat")
    f += _guard(_check_rs, rs, heap, uneven, k, n, range(5, 8), "SM RS repeat")
    if (len(ag._dev_meta), len(rs._dev_meta)) != sizes:
        f.append(f"SM metadata cache grew on repeated shapes: {sizes} -> {(len(ag._dev_meta), len(rs._dev_meta))}")
    return f


def _bounded_case(heap, nccl):
    """The decomposition with bounded waits (Triton wait kernels instead of cuStreamWaitValue64): AG 2 pieces and
    RS 3 pieces on even and uneven rows, 10 back-to-back calls, and a CUDA-graph capture of each."""
    k, n, w = 512, 384, heap.world
    even, uneven = [256] * w, [200 + 64 * r for r in range(w)]
    ag = DecompAgGemm(heap, 2048, k, DT, name="t.bag", chunks=2, bounded_waits=True)
    rs = DecompGemmRs(heap, 512, n, DT, name="t.brs", chunks=3, bounded_waits=True)
    f = []
    for rows in (even, uneven):
        f += _check_ag(ag, heap, rows, k, n, range(70, 75), f"bounded AG rows={rows}")
        f += _check_rs(rs, heap, rows, k, n, range(70, 75), f"bounded RS rows={rows}")
    f += _graph_ag(ag, heap, even, k, n, "bounded AG") + _graph_rs(rs, heap, uneven, k, n, "bounded RS")
    heap.barrier()  # raises TdistWaitError if any bounded wait gave up
    return f


def _deadpeer_case(heap, nccl):
    """Fail closed: on a separate heap with a 1 s wait budget, rank 0 calls a bounded-wait AG-GEMM that rank 1 never
    joins; rank 0's wait must give up (call returns, heap.check() raises TdistWaitError naming the wait kernel)
    within 10 s instead of hanging."""
    import time

    from sgl_kernel.tdist.heap import SymmetricHeap, TdistWaitError
    from sgl_kernel.tdist.layout import HeapConfig

    h2 = SymmetricHeap.create(nccl, heap.device, HeapConfig(data_bytes=8 << 20, signal_slots=256,
                                                            wait_timeout_s=1.0))
    f = []
    try:
        op = DecompAgGemm(h2, 1024, 256, DT, name="t.dead", chunks=1, bounded_waits=True)
        if h2.rank == 0:
            t0 = time.monotonic()
            op(_randn(1, 128, 256, device=heap.device), _randn(2, 256, 64, device=heap.device), [128] * h2.world)
            torch.cuda.synchronize()
            dt = time.monotonic() - t0
            try:
                h2.check()
                f.append("dead peer: no TdistWaitError after the call")
            except TdistWaitError as e:
                if "wait_reset_kernel" not in str(e):
                    f.append(f"dead peer: error does not name the wait kernel: {e}")
            if dt > 10:
                f.append(f"dead peer: the call took {dt:.1f} s (budget 1 s)")
    finally:
        h2.close()  # synchronizes, host barrier (unchecked: the heap is poisoned by design), unmap and free
    return f
