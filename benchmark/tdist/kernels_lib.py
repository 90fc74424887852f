"""Rank bodies and the ratio table of ``benchmark/tdist/bench_kernels.py`` (kept importable so spawned ranks can unpickle them)."""

from __future__ import annotations

import json
from typing import Dict, List, Optional

import torch
from benchmark.tdist.call_profile import row_tail

UNAVAILABLE_SHARED = "n/a: ranks share one GPU (NCCL refuses duplicate GPUs)"


def llama_shapes(config_path: str, tp: int) -> Dict[str, tuple]:
    """TP-sharded GEMM shapes of one Llama layer from a HF config.json: name -> (kind, K, N_per_rank).

    AG-GEMM (column-parallel, input all-gathered): qkv [H -> (heads + 2 kv) * d / tp], gate_up [H -> 2 I / tp].
    GEMM-RS (row-parallel, output reduce-scattered): o_proj [heads * d / tp -> H], down [I / tp -> H]."""
    with open(config_path) as f:
        c = json.load(f)
    h, i = c["hidden_size"], c["intermediate_size"]
    heads, kv = c["num_attention_heads"], c.get("num_key_value_heads", c["num_attention_heads"])
    d = c.get("head_dim") or h // heads
    return {"qkv": ("ag", h, (heads + 2 * kv) * d // tp), "gate_up": ("ag", h, 2 * i // tp),
            "o_proj": ("rs", heads * d // tp, h), "down": ("rs", i // tp, h)}


def _timer(heap, fn, iters: int, warmup: int = 20) -> tuple:
    """(median ms per call, first-call seconds) of ``fn``. The first call (compilation, autotuning, per-shape
    metadata upload) is timed apart on the host; then ``warmup`` calls; then ``iters`` calls back to back, each
    between its own pair of CUDA events on the current stream; the median of the per-call times is returned. All
    ranks start each phase together (host barrier)."""
    import time

    heap.barrier()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    first = time.perf_counter() - t0
    heap.barrier()
    for _ in range(warmup):
        fn()
    heap.barrier()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for s, e in ev:
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    times = sorted(s.elapsed_time(e) for s, e in ev)
    heap.barrier()
    return times[len(times) // 2], first


def _try(heap, note, label, fn, iters, res=None, key=None):
    """Time ``fn``; on success store the median in ``res[key]`` and the first-call seconds in ``res['compile']``."""
    try:
        ms, first = _timer(heap, fn, iters)
        if res is not None:
            res.setdefault("compile", {})[key] = first
        return ms, ""
    except Exception as ex:  # a baseline that cannot run is reported, never fatal
        note(f"{label} unavailable: {type(ex).__name__}: {ex}")
        heap.barrier()
        return None, f"{type(ex).__name__}: {str(ex)[:120]}"


def _symm_group(nccl, note):
    """The NCCL group's name with torch symmetric memory enabled (multicast stays off by environment), or None."""
    if nccl is None:
        return None
    try:
        import torch.distributed._symmetric_memory as symm_mem

        if hasattr(symm_mem, "enable_symm_mem_for_group"):
            symm_mem.enable_symm_mem_for_group(nccl.group_name)
        return nccl.group_name
    except Exception as ex:
        note(f"symmetric memory unavailable: {ex}")
        return None


def _ag_row(heap, note, nccl, symm, name, k, n, m, max_m, iters, variants, flip):
    """One AG-GEMM row: tdist SM (Triton), tdist decomposition (cuBLAS + copy engine), NCCL + cuBLAS, torch
    symm-mem fused, cuBLAS alone on the gathered M. ``flip`` reverses the order the variants run in (A/B order)."""
    import torch.distributed as dist

    from sgl_kernel.tdist.ag_gemm import AgGemm
    from sgl_kernel.tdist.decomp import DecompAgGemm, plan_chunks
    from sgl_kernel.tdist.layout import split_rows

    w, me, dev, dt = heap.world, heap.rank, heap.device, torch.bfloat16
    rows = split_rows(m, w)
    res = {"op": "AG-GEMM", "kind": "ag", "name": name, "k": k, "n": n, "world": w,
           "shape": f"{name} K={k} N={n}", "M": m}
    g = torch.Generator(device="cpu").manual_seed(m + me)
    a = torch.randn(rows[me], k, generator=g).to(dt).to(dev)
    wt = torch.randn(n, k, generator=g).to(dt).to(dev) / k ** 0.5
    full = torch.randn(m, k, generator=g).to(dt).to(dev)
    jobs = []
    if "sm" in variants:
        op_sm = AgGemm(heap, max_m, k, dt, name=f"b.{name}.sm", producer="sm")
        jobs.append(("tdist_sm", "tdist SM", lambda: op_sm(a, wt.t(), rows)))
    if "decomp" in variants:
        op_d = DecompAgGemm(heap, max_m, k, dt, name=f"b.{name}.decomp")
        out_d = torch.empty(m, n, dtype=dt, device=dev)
        jobs.append(("tdist_decomp", "tdist decomposition", lambda: op_d(a, wt.t(), rows, out_d)))
        jobs += _pieces_jobs(res, variants, lambda c: op_d(a, wt.t(), rows, out_d, chunks=c),
                             plan_chunks("ag", rows, k, n))
        if "pieces" in variants and w == 2:
            jobs.append(("decomp_bulk", "tdist decomposition, bulk",
                         lambda: op_d(a, wt.t(), rows, out_d, chunks=1, bulk=True)))
        jobs += _mode_jobs(variants, op_d, lambda: op_d(a, wt.t(), rows, out_d), w)
    jobs.append(("cublas_only", "cuBLAS", lambda: full @ wt.t()))
    if nccl is not None and len(set(rows)) == 1:
        gathered = torch.empty(m, k, dtype=dt, device=dev)

        def seq():
            dist.all_gather_into_tensor(gathered, a, group=nccl)
            return gathered @ wt.t()

        jobs.append(("torch_seq", "NCCL + cuBLAS", seq))
        if symm is not None:
            jobs.append(("symm_fused", "symm fused_all_gather_matmul",
                         lambda: torch.ops.symm_mem.fused_all_gather_matmul(a, [wt.t()], 0, symm)))
    else:
        seq = None
        res["torch_seq_note"] = UNAVAILABLE_SHARED if nccl is None else "uneven rows"
    _run_jobs(heap, note, res, jobs[::-1] if flip else jobs, iters)
    if "auto" in variants and "decomp" in variants and "torch_seq" in res:
        from sgl_kernel.tdist.auto import AutoAgGemm

        _auto_job(heap, note, res, nccl, iters,
                  lambda t: (lambda op=AutoAgGemm(op_d, nccl, t, symm): op(a, wt.t(), rows)))
    if "decomp" in variants:
        row_tail(heap, note, res, variants, iters, seq, op_d, lambda: op_d(a, wt.t(), rows, out_d), m == max_m,
                 _try)
    return res


def _rs_row(heap, note, nccl, symm, name, k, n, m, max_m, iters, variants, flip):
    """One GEMM-RS row (same variants as :func:`_ag_row`; cuBLAS alone is the full [M, K_local] GEMM)."""
    import torch.distributed as dist

    from sgl_kernel.tdist.decomp import DecompGemmRs, plan_chunks
    from sgl_kernel.tdist.gemm_rs import GemmRs
    from sgl_kernel.tdist.layout import split_rows

    w, me, dev, dt = heap.world, heap.rank, heap.device, torch.bfloat16
    rows = split_rows(m, w)
    max_rows = max(split_rows(max_m, w))
    res = {"op": "GEMM-RS", "kind": "rs", "name": name, "k": k, "n": n, "world": w,
           "shape": f"{name} K={k} N={n}", "M": m}
    g = torch.Generator(device="cpu").manual_seed(m + me)
    a = torch.randn(m, k, generator=g).to(dt).to(dev)
    wt = torch.randn(n, k, generator=g).to(dt).to(dev) / k ** 0.5
    jobs = []
    if "sm" in variants:
        op_sm = GemmRs(heap, max_rows, n, dt, name=f"b.{name}.sm")
        jobs.append(("tdist_sm", "tdist SM", lambda: op_sm(a, wt.t(), rows)))
    if "decomp" in variants:
        op_d = DecompGemmRs(heap, max_rows, n, dt, name=f"b.{name}.decomp")
        out_d = torch.empty(rows[me], n, dtype=dt, device=dev)
        jobs.append(("tdist_decomp", "tdist decomposition", lambda: op_d(a, wt.t(), rows, out_d)))
        jobs += _pieces_jobs(res, variants, lambda c: op_d(a, wt.t(), rows, out_d, chunks=c),
                             plan_chunks("rs", rows, k, n))
        jobs += _mode_jobs(variants, op_d, lambda: op_d(a, wt.t(), rows, out_d), w)
    jobs.append(("cublas_only", "cuBLAS", lambda: a @ wt.t()))
    if nccl is not None and m % w == 0:
        out = torch.empty(m // w, n, dtype=dt, device=dev)

        def seq():
            dist.reduce_scatter_tensor(out, a @ wt.t(), group=nccl)
            return out

        jobs.append(("torch_seq", "cuBLAS + NCCL", seq))
        if symm is not None:
            jobs.append(("symm_fused", "symm fused_matmul_reduce_scatter",
                         lambda: torch.ops.symm_mem.fused_matmul_reduce_scatter(a, wt.t(), "sum", 0, symm)))
    else:
        seq = None
        res["torch_seq_note"] = UNAVAILABLE_SHARED if nccl is None else "M not divisible by world"
    _run_jobs(heap, note, res, jobs[::-1] if flip else jobs, iters)
    if "auto" in variants and "decomp" in variants and "torch_seq" in res:
        from sgl_kernel.tdist.auto import AutoGemmRs

        _auto_job(heap, note, res, nccl, iters,
                  lambda t: (lambda op=AutoGemmRs(op_d, nccl, t, symm): op(a, wt.t(), rows)))
    if "decomp" in variants:
        row_tail(heap, note, res, variants, iters, seq, op_d, lambda: op_d(a, wt.t(), rows, out_d), m == max_m,
                 _try)
    return res


def _row_table(heap, nccl, res):
    """CalibrationTable from this row's own timings (max over ranks, so every rank picks the same path): the
    fastest piece count of the decomposition and the fastest of decomposition / NCCL + cuBLAS / torch symm-mem."""
    import torch.distributed as dist

    from sgl_kernel.tdist.auto import CalibrationTable

    cands = _decomp_candidates(res)
    keys = [k for k, _, _ in cands] + ["torch_seq", "symm_fused"]
    v = torch.tensor([-1.0 if res.get(k) is None else float(res[k]) for k in keys], dtype=torch.float64,
                     device=heap.device)
    dist.all_reduce(v, op=dist.ReduceOp.MAX, group=nccl)
    t = {k: x for k, x in zip(keys, v.tolist()) if x > 0}
    dec = [(t[k], c, sc) for k, c, sc in cands if k in t]
    shape = (res["kind"], res["k"], res["n"], res["world"], res["M"])
    row = dict(kind=shape[0], k=shape[1], n=shape[2], world=shape[3], m=shape[4],
               decomp_ms=min(dec)[0] if dec else None, nccl_ms=t.get("torch_seq"), symm_ms=t.get("symm_fused"))
    return CalibrationTable(pieces=((*shape, min(dec)[1]),) if dec else (), best=CalibrationTable._best_rows([row]),
                            schedules=((*shape, min(dec)[2]),) if dec else ())


def _decomp_candidates(res):
    """(result key, pieces, schedule) of every measured decomposition variant of a row that the auto op can take:
    the planned call, the other piece counts (default schedule) and the other schedule (planned pieces)."""
    from sgl_kernel.tdist.decomp import default_schedule

    sched = default_schedule(res["world"])
    other = "all" if sched == "ring" else "ring"
    out = [("tdist_decomp", res["plan"], sched)] + [(f"decomp_p{c}", c, sched) for c in PIECES
                                                    if f"decomp_p{c}" in res]
    return out + ([("decomp_sched", res["plan"], other)] if "decomp_sched" in res else [])


def _auto_job(heap, note, res, nccl, iters, make):
    """Variant ``auto``: AutoAgGemm / AutoGemmRs with the table calibrated on this row (:func:`_row_table`),
    timed after the other variants (key ``tdist_auto``; the path and piece count it took go in the notes)."""
    try:
        table = _row_table(heap, nccl, res)
    except Exception as ex:  # reported, never fatal
        note(f"auto table failed: {type(ex).__name__}: {ex}")
        return
    res["auto_path"] = table.best[0][5] if table.best else "?"
    res["auto_pieces"] = table.pieces[0][5] if table.pieces else None
    res["auto_sched"] = table.schedules[0][5] if table.schedules else None
    res["tdist_auto"], err = _try(heap, note, "tdist auto", make(table), iters, res, "tdist_auto")
    if err:
        res["tdist_auto_note"] = err


PIECES = (1, 2, 4)


def _with_hs(op, call, **attrs):
    """``call()`` with the decomposition's handshake attributes set for this call only, on the same op and buffers
    (the signal protocol is the same in every mode): ``bounded=True`` (waits as bounded Triton wait kernels,
    decomp bounded_waits), ``split=2`` (each push cut in 2 parts on 2 copy streams, decomp._Handshake._push),
    ``split_recv=False`` (receive waits on the push streams, decomp._Handshake.exchange)."""
    old = {k: getattr(op.hs, k) for k in attrs}
    for k, v in attrs.items():
        setattr(op.hs, k, v)
    try:
        return call()
    finally:
        for k, v in old.items():
            setattr(op.hs, k, v)


def _mode_jobs(variants, op_d, call, world=2):
    """With variant ``pieces``: the planned decomposition with bounded waits, with split pushes, with the receive
    waits on the push streams (``decomp_samestream``, the layout before 2026-11-27) and (world > 2) with the other
    per-peer stream schedule (``decomp_sched``); with variant ``graph``: the decomposition captured in a
    CUDA graph and replayed (``decomp_graph``: the GPU time without the host's enqueue time). All in the notes."""
    jobs = []
    if "graph" in variants:
        jobs.append(("decomp_graph", "tdist decomposition, CUDA graph replay", _lazy_graph(call)))
    if "pieces" not in variants:
        return jobs
    jobs += [("decomp_bounded", "tdist decomposition, bounded waits", lambda: _with_hs(op_d, call, bounded=True)),
             ("decomp_split2", "tdist decomposition, pushes split on 2 streams",
              lambda: _with_hs(op_d, call, split=2))]
    jobs.append(("decomp_samestream", "tdist decomposition, receive waits on the push streams",
                 lambda: _with_hs(op_d, call, split_recv=False)))
    if world > 2:
        other = "all" if op_d.hs.schedule == "ring" else "ring"
        jobs.append(("decomp_sched", f"tdist decomposition, schedule {other}",
                     lambda: _with_hs(op_d, call, schedule=other)))
    return jobs


def _lazy_graph(fn):
    """A callable that captures ``fn`` in a CUDA graph on its first call (collective: every rank's job list has it
    at the same place) and replays it afterwards."""
    state = {}

    def call():
        if "replay" not in state:
            state["replay"] = _graphed(fn)
        return state["replay"]()
    return call


def _pieces_jobs(res, variants, call, planned):
    """With variant ``pieces``: the decomposition at every other piece count of :data:`PIECES` (keys
    ``decomp_p<c>``, shown in the notes column) to check :func:`~sgl_kernel.tdist.decomp.plan_chunks`."""
    res["plan"] = planned
    if "pieces" not in variants:
        return []
    return [(f"decomp_p{c}", f"tdist decomposition, {c} pieces", (lambda c=c: call(c))) for c in PIECES
            if c != planned]


def _run_jobs(heap, note, res, jobs, iters):
    for key, label, fn in jobs:
        note(f"{res['shape']} M={res['M']}: {label}")
        res[key], err = _try(heap, note, label, fn, iters, res, key)
        if err:
            res[f"{key}_note"] = err


A2A_CTAS = (16, 32, 64)  # CTAs per peer tried (besides the default, which is one of them) with variant ``pieces``
A2A_BLOCKS = ((2048, 4), (8192, 8))  # (elements per loop step, warps) tried at the default CTA count, ``pieces``


def _a2a_row(heap, note, nccl, t, hidden, iters, variants=()):
    """One all-to-all row: tdist low-latency all-to-all vs NCCL all_to_all_single, random counts; with variant
    ``pieces`` also the all-to-all at :data:`A2A_CTAS` CTAs per peer (keys ``a2a_c<n>``, in the notes column)."""
    import torch.distributed as dist

    from sgl_kernel.tdist.all_to_all import AllToAll

    w, dev, dt = heap.world, heap.device, torch.bfloat16
    op = AllToAll(heap, t, hidden, dt, name=f"b.a2a.{t}")
    g = torch.Generator(device="cpu").manual_seed(t + 7)
    counts = torch.multinomial(torch.ones(w), t, replacement=True, generator=g).bincount(minlength=w)
    x = torch.randn(t, hidden).to(dt).to(dev)
    sc = counts.to(torch.int32).to(dev)
    res = {"op": "all-to-all", "kind": "a2a", "shape": f"H={hidden} random counts", "M": t}
    res["tdist_sm"], _ = _try(heap, note, "tdist a2a", lambda: op(x, sc), iters, res, "tdist_sm")
    res["ctas"] = op.chunks
    for ch in [c for c in A2A_CTAS if c != op.chunks] if "pieces" in variants else ():
        op_c = AllToAll(heap, t, hidden, dt, name=f"b.a2a.{t}.c{ch}", chunks=ch)
        res[f"a2a_c{ch}"], _ = _try(heap, note, f"tdist a2a {ch} CTAs/peer", lambda op_c=op_c: op_c(x, sc), iters,
                                    res, f"a2a_c{ch}")
    for blk, nw in A2A_BLOCKS if "pieces" in variants else ():
        op_b = AllToAll(heap, t, hidden, dt, name=f"b.a2a.{t}.b{blk}", chunks=op.chunks, block=blk, num_warps=nw)
        res[f"a2a_b{blk}w{nw}"], _ = _try(heap, note, f"tdist a2a block {blk} {nw} warps",
                                          lambda op_b=op_b: op_b(x, sc), iters, res, f"a2a_b{blk}w{nw}")
    if nccl is not None:
        recv = torch.zeros(w, dtype=torch.int64, device=dev)
        dist.all_to_all_single(recv, counts.to(dev), group=nccl)
        out = torch.empty(int(recv.sum()), hidden, dtype=dt, device=dev)
        in_s, out_s = counts.tolist(), recv.tolist()
        res["torch_seq"], res["torch_seq_note"] = _try(
            heap, note, "nccl all_to_all_single", lambda: dist.all_to_all_single(out, x, out_s, in_s, group=nccl),
            iters, res, "torch_seq")
        if "graph" in variants:
            _a2a_graphs(heap, note, res, iters, lambda: op(x, sc),
                        lambda: dist.all_to_all_single(out, x, out_s, in_s, group=nccl))
    else:
        res["torch_seq_note"] = UNAVAILABLE_SHARED
    return res


def _graphed(fn):
    """``fn`` captured in a CUDA graph (after one eager call on a side stream, as torch.cuda.graph requires);
    returns the replay callable. Collective: every rank captures the same calls."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    torch.cuda.synchronize()
    return g.replay


def _a2a_graphs(heap, note, res, iters, tdist_fn, nccl_fn):
    """With variant ``graph``: the tdist all-to-all and NCCL all_to_all_single each captured in a CUDA graph and
    timed as replays (keys ``a2a_graph`` / ``nccl_graph``, in the notes column): launch overhead out of both, as in
    decode CUDA graphs. A capture that fails is reported in the notes."""
    for key, label, fn in (("a2a_graph", "tdist a2a graph", tdist_fn), ("nccl_graph", "nccl a2a graph", nccl_fn)):
        try:
            replay = _graphed(fn)
        except Exception as ex:  # reported, never fatal
            note(f"{label} capture failed: {type(ex).__name__}: {ex}")
            res[f"{key}_note"] = f"{label} capture failed: {type(ex).__name__}"
            heap.barrier()
            continue
        res[key], _ = _try(heap, note, label, replay, iters, res, key)


def rank_body(heap, note, nccl, shapes: Dict[str, tuple], tokens: List[int], iters: int, a2a_hidden: int,
              a2a_tokens: List[int], variants=("sm", "decomp")) -> List[dict]:
    """Time every op on this rank; returns rows {op, shape, M, variant -> median ms or None, compile, notes}."""
    symm = _symm_group(nccl, note)
    max_m = max(tokens)
    rows_out = []
    i = 0
    for name, (kind, k, n) in shapes.items():
        for m in tokens:
            row = _ag_row if kind == "ag" else _rs_row
            rows_out.append(row(heap, note, nccl, symm, name, k, n, m, max_m, iters, variants, i % 2 == 1))
            _report(note, len(rows_out) - 1, rows_out[-1])
            i += 1
    for t in a2a_tokens:
        note(f"all-to-all T={t}")
        rows_out.append(_a2a_row(heap, note, nccl, t, a2a_hidden, iters, variants))
        _report(note, len(rows_out) - 1, rows_out[-1])
    return rows_out


def _report(note, i, row):
    """Send a finished row to the parent at once (kept if a later row hangs or the run times out)."""
    if hasattr(note, "result"):
        note.result(f"row{i:03d}", row)


def partial_rows(got: Dict[int, Dict[str, dict]], world: int) -> List[List[dict]]:
    """Per-rank row lists from the rows every rank reported (``got[rank][key] = row``), in order."""
    keys = sorted(set.intersection(*[set(got.get(r, {})) for r in range(world)])) if got else []
    return [[got[r][k] for k in keys] for r in range(world)]


def _fmt(v: Optional[float]) -> str:
    return "-" if v is None else f"{v:.3f}"


def _mx(per_rank, i, key):
    vals = [r[i].get(key) for r in per_rank if r and len(r) > i]
    return None if not vals or any(v is None for v in vals) else max(vals)


def table(per_rank: List[List[dict]]) -> List[str]:
    """Markdown table; times are medians per rank, then the max over ranks (a collective ends when its slowest rank
    does). Ratio columns: baseline ms / tdist ms (> 1 means tdist is faster), where tdist is the auto op (the path
    the library takes, variant ``auto``) when measured, else the best of SM and decomposition. First-call seconds
    (compile, autotune, metadata upload) are reported apart and never enter the times."""
    lines = ["| op | shape | M | tdist SM ms | tdist decomp/CE ms | tdist auto ms (path) | NCCL+cuBLAS ms "
             "| symm-mem fused ms | cuBLAS only ms | NCCL/tdist | symm/tdist | first call s (SM / decomp) | notes |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for i, row in enumerate(per_rank[0]):
        sm, dc, au = (_mx(per_rank, i, k) for k in ("tdist_sm", "tdist_decomp", "tdist_auto"))
        best = au if au is not None else min([v for v in (sm, dc) if v is not None], default=None)
        ts, sf = _mx(per_rank, i, "torch_seq"), _mx(per_rank, i, "symm_fused")
        r1 = f"{ts / best:.2f}x" if ts and best else "-"
        r2 = f"{sf / best:.2f}x" if sf and best else "-"
        comp = [max((r[i].get("compile", {}).get(k) or 0.0) for r in per_rank)
                for k in ("tdist_sm", "tdist_decomp")]
        auto = f"{_fmt(au)} ({row.get('auto_path', '-')}" + (
            f", {row['auto_pieces']} pc" if row.get("auto_path") == "decomp" and row.get("auto_pieces") else "") + (
            f", {row['auto_sched']}" if row.get("auto_path") == "decomp" and row.get("auto_sched") else "") + ")"
        lines.append(f"| {row['op']} | {row['shape']} | {row['M']} | {_fmt(sm)} | {_fmt(dc)} | "
                     f"{auto if au is not None else '-'} | {_fmt(ts)} | {_fmt(sf)} | "
                     f"{_fmt(_mx(per_rank, i, 'cublas_only'))} | {r1} | {r2} | "
                     f"{comp[0]:.1f} / {comp[1]:.1f} | {_notes(per_rank, i, row)} |")
    return lines


def _notes(per_rank, i, row) -> str:
    """Notes column: errors, the other piece counts, the other all-to-all CTA counts, CUDA-graph times."""
    notes = [str(v) for key, v in row.items() if key.endswith("_note") and v]
    if row.get("plan"):
        notes.append(f"{row['plan']} pieces" + "".join(
            f", {c}: {_fmt(_mx(per_rank, i, f'decomp_p{c}'))}" for c in PIECES if f"decomp_p{c}" in row)
            + (f", bulk: {_fmt(_mx(per_rank, i, 'decomp_bulk'))}" if "decomp_bulk" in row else "")
            + (f"; bounded waits: {_fmt(_mx(per_rank, i, 'decomp_bounded'))}" if "decomp_bounded" in row else "")
            + (f"; split pushes: {_fmt(_mx(per_rank, i, 'decomp_split2'))}" if "decomp_split2" in row else "")
            + (f"; other schedule: {_fmt(_mx(per_rank, i, 'decomp_sched'))}" if "decomp_sched" in row else "")
            + (f"; waits on push streams: {_fmt(_mx(per_rank, i, 'decomp_samestream'))}"
               if "decomp_samestream" in row else "")
            + (f"; graph replay: {_fmt(_mx(per_rank, i, 'decomp_graph'))}" if "decomp_graph" in row else ""))
    if "torch_seq_again" in row:
        notes.append(f"NCCL+cuBLAS again after auto: {_fmt(_mx(per_rank, i, 'torch_seq_again'))}")
    if row.get("ctas"):
        notes.append(f"{row['ctas']} CTAs/peer" + "".join(
            f", {c}: {_fmt(_mx(per_rank, i, f'a2a_c{c}'))}" for c in A2A_CTAS if f"a2a_c{c}" in row)
            + "".join(f"; block {b}/{w} warps: {_fmt(_mx(per_rank, i, f'a2a_b{b}w{w}'))}" for b, w in A2A_BLOCKS
                      if f"a2a_b{b}w{w}" in row))
    if "a2a_graph" in row or "nccl_graph" in row:
        notes.append(f"CUDA graph: tdist {_fmt(_mx(per_rank, i, 'a2a_graph'))}, "
                     f"NCCL {_fmt(_mx(per_rank, i, 'nccl_graph'))}")
    return "; ".join(notes).replace("\n", " ").replace("|", "/")


def calibration(per_rank: List[List[dict]]):
    """CalibrationTable (sgl_kernel.tdist.auto) from the measured times: break-even M of the decomposition (at its
    best measured piece count) vs NCCL + cuBLAS, the best piece count, and the fastest path (with torch symm-mem)."""
    from sgl_kernel.tdist.auto import CalibrationTable

    pts, pieces, scheds = [], [], []
    for i, row in enumerate(per_rank[0]):
        if row.get("kind") in ("ag", "rs"):
            dec = [(t, c, sc) for k, c, sc in (_decomp_candidates(row) if row.get("plan") else [])
                   for t in [_mx(per_rank, i, k)] if t is not None]
            shape = (row["kind"], row["k"], row["n"], row["world"], row["M"])
            if dec:
                pieces.append((*shape, min(dec)[1]))
                scheds.append((*shape, min(dec)[2]))
            pts.append(dict(kind=shape[0], k=shape[1], n=shape[2], world=shape[3], m=shape[4],
                            decomp_ms=min(dec)[0] if dec else None, nccl_ms=_mx(per_rank, i, "torch_seq"),
                            symm_ms=_mx(per_rank, i, "symm_fused")))
    t = CalibrationTable.from_timings(pts)
    return CalibrationTable(t.entries, t.default_min_m, tuple(pieces), t.best, tuple(scheds))
