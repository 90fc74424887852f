"""Profiling helpers of ``benchmark/tokenweave/bench_layer.py`` layer mode: launch counts, a top-ops summary, and the overlap
check (does tw-comm's communication kernel of one split run *while* the other split computes?).

The overlap check profiles one forward with the torch profiler (CUPTI kernel timestamps), classifies every kernel
as communication (tw-comm's fused kernels, NCCL) or compute (everything else), and reports, per variant:
the forward's GPU span, the communication kernels' busy time (union of their intervals), the part of it during
which a compute kernel ran at the same time (``overlap``: the time TokenWeave hides), the compute busy time, and
the summed GEMM kernel time (a GEMM slowed by the communication kernel's SMs shows up here against
``split_nocomm``). Times are microseconds of one rank (rank 0).
"""

from __future__ import annotations

import re
from pathlib import Path

from benchmark.common.profile_intervals import intersect, length, trace_events, union

COMM_KERNEL = re.compile(r"twoshot|oneshot|lamport|copy_engine|nccl|allreduce|all_reduce", re.I)
GEMM_KERNEL = re.compile(r"gemm|nvjet|xmma|cutlass|sm90_|cublas", re.I)


def launch_count(prof) -> tuple[int, int]:
    """(kernel launches (runtime + driver launch calls), tensor allocations (aten::empty*)) recorded by a torch
    profiler run."""
    names = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC",
             "cudaLaunchCooperativeKernel")
    ka = prof.key_averages()
    return (sum(e.count for e in ka if e.key in names),
            sum(e.count for e in ka if e.key in ("aten::empty", "aten::empty_strided")))


def _one_forward(runner, mwb, dev):
    """A torch-profiler run of one forward of ``mwb`` (synchronized); returns the profiler."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from sglang.srt.forward_batch_info import ForwardBatch

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with torch.inference_mode():
        fb = ForwardBatch.init_new(mwb, dev, runner.req_to_token_pool, runner.token_to_kv_pool, runner.attn_backend)
        with profile(activities=acts) as prof:
            runner.executor.run(runner.model, fb)
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
    return prof


def profile_forward(runner, mwb, dev, path: str) -> tuple[int, int]:
    """One forward under the torch profiler (collective: every rank calls it); writes the top ops by CUDA time
    and by host time to ``path`` (nothing when empty); returns the forward's (kernel launches, allocations)."""
    prof = _one_forward(runner, mwb, dev)
    launches = launch_count(prof)
    if not path:
        return launches
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    ka = prof.key_averages()
    by_dev = "self_cuda_time_total" if dev.type == "cuda" else "self_cpu_time_total"
    Path(path).write_text(f"## top ops by {by_dev}\n" + ka.table(sort_by=by_dev, row_limit=25, max_name_column_width=60)
                          + "\n## top ops by self_cpu_time_total (host)\n"
                          + ka.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))
    return launches


def _ctas(kernel: dict) -> int:
    """Thread blocks of a chrome-trace kernel event (``args.grid``; 0 when absent)."""
    grid = kernel.get("args", {}).get("grid") or []
    n = 1
    for g in grid:
        n *= int(g)
    return n if grid else 0


def overlap_stats(kernels: list[dict]) -> dict:
    """Overlap of communication and compute kernels in one forward. ``kernels``: chrome-trace kernel events
    (``name``, ``ts`` and ``dur`` in us, ``args.stream``). Returns a dict of us values (span, comm, compute,
    overlap, gemm), ``overlap_frac`` (overlap / comm, 0 without communication), the largest GEMM grid in CTAs (a
    persistent GEMM's grid is its SM target: <= SMs - carveout when the carveout took effect), kernel counts and
    the streams used by communication and compute kernels."""
    comm = [k for k in kernels if COMM_KERNEL.search(k["name"])]
    comp = [k for k in kernels if not COMM_KERNEL.search(k["name"])]
    iv = lambda ks: union([(float(k["ts"]), float(k["ts"]) + float(k["dur"])) for k in ks])  # noqa: E731
    ci, pi = iv(comm), iv(comp)
    allv = iv(kernels)
    c_len, ov = length(ci), intersect(ci, pi)
    return {"span_us": (allv[-1][1] - allv[0][0]) if allv else 0.0, "comm_us": c_len, "compute_us": length(pi),
            "overlap_us": ov, "overlap_frac": ov / c_len if c_len else 0.0,
            "gemm_us": sum(float(k["dur"]) for k in comp if GEMM_KERNEL.search(k["name"])),
            "gemm_max_ctas": max((_ctas(k) for k in comp if GEMM_KERNEL.search(k["name"])), default=0),
            "comm_kernels": len(comm), "kernels": len(kernels),
            "comm_streams": sorted({k.get("args", {}).get("stream", -1) for k in comm}),
            "compute_streams": sorted({k.get("args", {}).get("stream", -1) for k in comp})}


def profile_overlap(runner, mwb, dev, csv_path: str = "") -> dict:
    """Profile one forward (collective: every rank calls it) and return :func:`overlap_stats` of its kernels;
    with ``csv_path`` also write every kernel as ``stream,start_us,dur_us,comm,name`` (start relative to the
    first kernel), the raw evidence of which kernels ran concurrently."""
    prof = _one_forward(runner, mwb, dev)
    kernels = [e for e in trace_events(prof) if e.get("cat") == "kernel" and "dur" in e]
    stats = overlap_stats(kernels)
    if csv_path and kernels:
        write_timeline(kernels, csv_path)
    return stats


def write_timeline(kernels: list[dict], csv_path: str) -> None:
    """Write chrome-trace kernel events as the timeline CSV ``stream,start_us,dur_us,comm,name`` (start relative to
    the first kernel, us; read by ``benchmark/tokenweave/overlap_timeline.py``). No-op without kernels."""
    if not kernels:
        return
    t0 = min(float(k["ts"]) for k in kernels)
    rows = ["stream,start_us,dur_us,comm,name"] + [
        f"{k.get('args', {}).get('stream', -1)},{float(k['ts']) - t0:.1f},{float(k['dur']):.1f},"
        f"{int(bool(COMM_KERNEL.search(k['name'])))},{k['name'][:90].replace(',', ';')}"
        for k in sorted(kernels, key=lambda k: float(k["ts"]))]
    Path(csv_path).parent.mkdir(parents=True, exist_ok=True)
    Path(csv_path).write_text("\n".join(rows) + "\n")


def profile_replay(graph, dev, csv_path: str = "") -> dict:
    """One replay of a captured CUDA graph under the torch profiler (collective when the graph holds collectives:
    every rank calls it): :func:`overlap_stats` of its kernels, and with ``csv_path`` the timeline CSV
    (:func:`write_timeline`). The graphed forward has no host launch gaps, so this is the GPU schedule alone (the
    eager profile of the sharded variant was host-bound)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize(dev)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize(dev)
    kernels = [e for e in trace_events(prof) if e.get("cat") == "kernel" and "dur" in e]
    if csv_path:
        write_timeline(kernels, csv_path)
    return overlap_stats(kernels)


def overlap_table(rows: list[tuple[str, int, dict]]) -> list[str]:
    """Markdown rows of :func:`overlap_stats` per (variant, T): us and the overlapped fraction."""
    lines = ["| variant | tokens | span us | comm busy us | comm overlapped by compute us | overlapped fraction | "
             "compute busy us | GEMM sum us | largest GEMM grid | comm kernels | comm / compute streams |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for v, t, s in rows:
        lines.append(f"| {v} | {t} | {s['span_us']:.0f} | {s['comm_us']:.0f} | {s['overlap_us']:.0f} | "
                     f"{s['overlap_frac']:.2f} | {s['compute_us']:.0f} | {s['gemm_us']:.0f} | {s['gemm_max_ctas']} | "
                     f"{s['comm_kernels']} | "
                     f"{s['comm_streams']} / {s['compute_streams']} |")
    return lines
