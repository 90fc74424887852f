"""Timeline summary of one call of a tdist op (``benchmark/tdist/bench_kernels.py --variants ... profile``): torch profiler (CUPTI)
kernel / memcpy intervals of one call on each rank, reduced to GEMM time, copy-engine time, their overlap and the
GPU idle time inside the call, plus the host time to enqueue the call. Explains a row: a call whose host enqueue
time is close to its GPU span is host-bound (the GPU waits for launches); copy time not covered by GEMM time is
exposed communication; idle time is waiting (signals, dependencies, launches).

Kept importable without CUDA (the interval arithmetic is unit-tested on CPU).
"""

from __future__ import annotations

import time
from typing import Callable, Dict, List, Optional

from benchmark.common.profile_intervals import intersect, length, trace_events, union

GEMM_MARKERS = ("gemm", "nvjet", "cutlass", "sm90_xmma", "ampere_", "sm80_xmma")  # cuBLAS / cuBLASLt kernel names


def summarize(events: List[dict]) -> Dict[str, float]:
    """Chrome-trace ``X`` events (``cat`` kernel / gpu_memcpy / gpu_memset, ``ts``/``dur`` in us) -> ms figures:
    span (first GPU start to last GPU end), gemm (union of cuBLAS kernels), copy (union of memcpys), overlap (GEMM
    and copy at once), idle (no GPU activity inside the span), other (union of other kernels), counts, and the
    copies' GB/s over their busy time when the trace gives bytes."""
    gemm, copy, other, nbytes = [], [], [], 0
    for e in events:
        if e.get("ph") != "X" or "dur" not in e:
            continue
        iv = (float(e["ts"]), float(e["ts"]) + float(e["dur"]))
        cat, name = e.get("cat", ""), e.get("name", "").lower()
        if cat == "gpu_memcpy":
            copy.append(iv)
            nbytes += int((e.get("args") or {}).get("bytes", 0) or 0)
        elif cat == "kernel":
            (gemm if any(m in name for m in GEMM_MARKERS) else other).append(iv)
        elif cat == "gpu_memset":
            other.append(iv)
    every = gemm + copy + other
    if not every:
        return {"span_ms": 0.0}
    span = max(e for _, e in every) - min(s for s, _ in every)
    ug, uc = union(gemm), union(copy)
    busy_c = length(uc)
    res = {"span_ms": span / 1e3, "gemm_ms": length(ug) / 1e3, "copy_ms": busy_c / 1e3,
           "overlap_ms": intersect(ug, uc) / 1e3, "other_ms": length(union(other)) / 1e3,
           "idle_ms": (span - length(union(every))) / 1e3, "n_gemm": len(gemm), "n_copy": len(copy),
           "n_other": len(other)}
    if nbytes and busy_c > 0:
        res["copy_gbps"] = nbytes / (busy_c * 1e-6) / 1e9
    return res


def profile_call(barrier: Callable[[], None], fn: Callable[[], object], enqueue_calls: int = 5,
                 host_barrier: Optional[Callable[[], None]] = None) -> Dict[str, float]:
    """Collective (every rank calls it with its own ``fn``, already warm): the host enqueue time of ``fn`` (median
    of ``enqueue_calls`` calls, ms, no sync inside), then one call under the torch profiler (CUDA activities),
    summarized by :func:`summarize`. ``barrier``: a host barrier of the ranks (may touch the device);
    ``host_barrier``: one that does no device work (default ``barrier``), run inside the profiled region right
    before the call so every rank's profiler is already running when any rank's call starts: a rank whose call
    starts while a peer is still starting its profiler waits for that peer's signals, and the wait showed up as
    GPU idle time (world 4, 2026-11-27: a 1087 ms span for a 0.6 ms call, the first profiler start initializing
    CUPTI; 2-3 ms idle in GEMM-RS spans). The profiled sequence runs twice and the second is kept (the first one
    pays the profiler's start-up). Raises whatever the profiler raises (the caller reports it)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    host_barrier = host_barrier or barrier
    barrier()
    host = []
    for _ in range(enqueue_calls):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        host.append((time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize()
    for _ in range(2):
        barrier()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            torch.cuda.synchronize()
            host_barrier()
            fn()
            torch.cuda.synchronize()
    res = summarize(trace_events(prof))
    res["host_enqueue_ms"] = sorted(host)[len(host) // 2]
    barrier()
    return res


def row_tail(heap, note, res, variants, iters, seq, op_d, call, largest, try_fn) -> None:
    """After a row's jobs (and ``auto``): with ``auto``, NCCL + cuBLAS timed again (``torch_seq_again``, notes: the
    two NCCL times of a row show its run-to-run spread, the auto op's nccl path ran between them); with ``profile``
    at the largest M, :func:`profile_call` of one planned decomposition call (``profile``). ``try_fn``: the
    bench's timer (``benchmark.tdist.kernels_lib._try``); collective like every timed job."""
    if "auto" in variants and seq is not None:
        res["torch_seq_again"], _ = try_fn(heap, note, "NCCL + cuBLAS again", seq, iters)
    if "profile" in variants and largest:
        try:
            import torch.distributed as dist

            res["profile"] = profile_call(heap.barrier, call, host_barrier=dist.barrier)  # default group: gloo
        except Exception as ex:  # reported, never fatal
            note(f"profile failed: {type(ex).__name__}: {ex}")
            res["profile"] = {"error": f"{type(ex).__name__}: {str(ex)[:100]}"}
            heap.barrier()
        res["profile"]["what"] = f"{res.get('plan')} pc, {op_d.hs.schedule}"


def profile_lines(rows: List[dict]) -> List[str]:
    """Markdown section from rows carrying ``profile`` (rank 0's summary of one decomposition call)."""
    keys = ("host_enqueue_ms", "span_ms", "gemm_ms", "copy_ms", "overlap_ms", "idle_ms", "other_ms")
    out = ["| op | shape | M | pieces / schedule | host enqueue ms | GPU span ms | GEMM ms | copy ms | overlap ms "
           "| idle ms | other kernels ms | #GEMM / #copy | copy GB/s |", "|---|---|---|---|" + "---|" * 9]
    for r in rows:
        p = r.get("profile")
        if not p:
            continue
        if "error" in p:
            out.append(f"| {r['op']} | {r['shape']} | {r['M']} | - | profile failed: {p['error']} |")
            continue
        cells = " | ".join(f"{p.get(k, 0.0):.3f}" for k in keys)
        gbps = f"{p['copy_gbps']:.0f}" if "copy_gbps" in p else "-"
        out.append(f"| {r['op']} | {r['shape']} | {r['M']} | {p.get('what', '-')} | {cells} | "
                   f"{p.get('n_gemm', 0)} / {p.get('n_copy', 0)} | {gbps} |")
    return out
