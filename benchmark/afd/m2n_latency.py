"""M2N latency part of ``benchmark/afd/bench.py`` (``--mode m2n``; MegaScale-Infer sec. 5, Fig. 12): two spawned
ranks, rank 0 sends each size to rank 1, which echoes it; one-way latency = round trip / 2, M2N transports against
``torch.distributed`` send/recv of the same bytes in the same run (eager and, on GPU, CUDA-graph rows). With a
``cuda_push_ll`` transport on GPU, also the raw LL floor of ``benchmark/afd/m2n_floor.py`` (one store kernel + one spin
kernel per hop, no M2N bookkeeping), graphed like the others. See benchmark/afd/bench.py's module docstring for the method;
:func:`run_m2n` returns the markdown table lines and the rows :func:`m2n_record` makes a benchmark record of.
"""

from __future__ import annotations

import tempfile
import time
import traceback

import numpy as np
import torch


def _m2n_rank(rank: int, a, addrs, init: str, q) -> None:
    """One rank of the latency benchmark; any error goes to ``q`` with its full traceback (never a silent hang)."""
    try:
        _m2n_rank_body(rank, a, addrs, init, q)
    except Exception as e:
        q.put({"error": f"rank {rank}: {type(e).__name__}: {e}\n--- rank {rank} traceback ---\n"
                        f"{traceback.format_exc()}"})


def _m2n_rank_body(rank: int, a, addrs, init: str, q) -> None:
    import torch.distributed as dist

    from sgl_kernel.m2n import M2NConfig, M2NEndpoint, RowLayout

    from sglang.srt.afd.protocol import create_afd_transport

    dev = f"cuda:{rank if torch.cuda.device_count() > 1 else 0}" if a.device == "cuda" else "cpu"
    if a.device == "cuda":
        torch.cuda.set_device(torch.device(dev))
    dist.init_process_group("nccl" if a.device == "cuda" else "gloo", init_method=init, rank=rank, world_size=2)
    res = {}
    for i, kb in enumerate(a.sizes_kb):
        rows = max(1, kb * 1024 // 4 // 256)
        x = torch.randn(rows, 256, device=dev)
        buf = torch.empty(rows * 256, device=dev)
        names = list(a.transports) + ["p2p"]
        for name in (names if i % 2 == 0 else names[::-1]):  # A/B order alternated across sizes
            ep = None
            if name != "p2p":
                ep = M2NEndpoint(M2NConfig(rank, tuple(f"{x_}-{kb}-{name}" for x_ in addrs), rows, device=dev),
                                 RowLayout(((torch.float32, 256),)),
                                 transport=create_afd_transport(name.removesuffix("-dev")))
            res[(name, kb)] = _m2n_time(a, rank, name, ep, x, buf)
            if a.graph_k and a.device == "cuda" and (name == "p2p" or name.endswith("-dev")):
                res[(name + "@graph", kb)] = _m2n_graph_time(a, rank, name, ep, x, buf)
            dist.barrier()
            if ep is not None:
                ep.check()
                ep.close()
        if a.graph_k and a.device == "cuda" and any(t.startswith("cuda_push_ll") for t in a.transports):
            res[("rawll@graph", kb)] = _raw_ll_time(a, rank, kb, addrs, x, buf)
        if rank == 0 and a.device == "cuda" and torch.cuda.device_count() > 1:
            res[("floor", kb)] = _copy_floor(x)
        if rank == 0:  # each size as soon as it is measured: a run cut short still reports the sizes it finished
            q.put({f"{k[0]}|{k[1]}": v for k, v in res.items() if k[1] == kb})
    if rank == 0:
        q.put({"done": True})
    dist.destroy_process_group()


def _raw_ll_time(a, rank: int, kb: int, addrs, x, buf):
    """Graphed one-way latency (s, per replay) of the raw LL floor (``benchmark.afd.m2n_floor.RawLLFloor``) for ``x``'s bytes,
    on a fresh ``cuda_push_ll`` endpoint of its own (no M2N message shares its ring)."""
    import torch.distributed as dist
    from benchmark.afd.m2n_floor import RawLLFloor

    from sgl_kernel.m2n import M2NConfig, M2NEndpoint, RowLayout, create_transport
    from sgl_kernel.m2n.ll_kernels import ll_grid

    ep = M2NEndpoint(M2NConfig(rank, tuple(f"{x_}-{kb}-rawll" for x_ in addrs), x.shape[0], device=str(x.device),
                               timeout_s=5.0), RowLayout(((torch.float32, x.shape[1]),)),
                     transport=create_transport("cuda_push_ll"))
    try:  # a floor failure is reported in its row; the M2N rows of this and later sizes still come
        fl = RawLLFloor(ep, 1 - rank, x.numel() * 4, ll_grid(ep.transport.cap))
        for _ in range(3):  # compile and warm up eagerly, outside the capture
            _m2n_round_trip(rank, "rawll", fl, x, buf)
        torch.cuda.synchronize()
        lat = _m2n_graph_time(a, rank, "rawll", fl, x, buf)
        torch.cuda.synchronize()
        ep.check()
        return lat
    except Exception as e:
        return f"floor failed on rank {rank}: {type(e).__name__}: {str(e)[:160]}"
    finally:
        dist.barrier()
        ep.close()


def _copy_floor(x, k: int = 20, reps: int = 5) -> float:
    """Physical reference (s): one copy-engine peer copy of ``x`` from this GPU to cuda:1, the median over ``reps``
    of ``k`` back-to-back copies / k (bandwidth plus per-copy cost; no signalling, no receive)."""
    y = torch.empty_like(x, device="cuda:1")
    y.copy_(x)
    out = []
    for _ in range(reps):
        torch.cuda.synchronize()
        ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        ev0.record()
        for _ in range(k):
            y.copy_(x, non_blocking=True)
        ev1.record()
        torch.cuda.synchronize()
        out.append(ev0.elapsed_time(ev1) * 1e-3 / k)
    return float(np.median(out))


def _m2n_round_trip(rank: int, name: str, ep, x, buf) -> None:
    """One echo: rank 0 sends ``x`` and receives it back; rank 1 echoes. ``*-dev``: device-driven (no host message)."""
    import torch.distributed as dist

    if name == "rawll":  # ep: a benchmark.afd.m2n_floor.RawLLFloor
        if rank == 0:
            ep.put(x)
            ep.wait()
        else:
            ep.wait()
            ep.put(x)
    elif name == "p2p":
        if rank == 0:
            dist.send(x.view(-1), 1)
            dist.recv(buf, 1)
        else:
            dist.recv(buf, 0)
            dist.send(buf, 0)
    elif name.endswith("-dev"):
        if rank == 0:
            ep.send(1, [x], host_header=False)
            ep.recv_device(1)
        else:
            ep.send(0, [ep.recv_device(0).tensors[0]], host_header=False)
    elif rank == 0:
        ep.send(1, [x])
        ep.recv()
    else:
        ep.send(0, ep.recv().tensors)


def _m2n_time(a, rank: int, name: str, ep, x, buf) -> list:
    """One-way latencies (s) of ``a.iters`` echoes after ``a.warmup``: CUDA events on GPU (the stream's view, incl.
    waits for the peer's data), wall clock on CPU."""
    lat, cuda = [], a.device == "cuda"
    for it in range(a.iters + a.warmup):
        if cuda:
            torch.cuda.synchronize()
            ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            ev0.record()
        t0 = time.perf_counter()
        _m2n_round_trip(rank, name, ep, x, buf)
        if cuda:
            ev1.record()
            torch.cuda.synchronize()
        if it >= a.warmup:
            lat.append((ev0.elapsed_time(ev1) * 1e-3 if cuda else time.perf_counter() - t0) / 2)
    return lat


def _m2n_graph_time(a, rank: int, name: str, ep, x, buf):
    """One-way latencies (s) with ``a.graph_k`` echoes captured in one CUDA graph on each rank (M2N device path or
    NCCL send/recv), replayed in lockstep after a barrier: replay time / (2 K), one value per replay (after 2 warm-up
    replays). Returns a list, or an error string when either rank failed to capture (both then skip the replays)."""
    import torch.distributed as dist

    torch.cuda.synchronize()
    g, err = torch.cuda.CUDAGraph(), ""
    try:  # thread_local: the NCCL watchdog thread's event queries must not invalidate the capture
        with torch.cuda.graph(g, capture_error_mode="thread_local"):
            for _ in range(a.graph_k):
                _m2n_round_trip(rank, name, ep, x, buf)
    except Exception as e:  # reported in the table; the peer learns it below and skips too
        err = f"capture failed on rank {rank}: {type(e).__name__}: {str(e)[:160]}"
    ok = torch.tensor([0 if err else 1], device=x.device)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    if not int(ok):
        return err or "capture failed on the peer"
    lat = []
    for it in range(a.graph_replays + 2):
        dist.barrier()
        torch.cuda.synchronize()
        ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        ev0.record()
        g.replay()
        ev1.record()
        torch.cuda.synchronize()
        if it >= 2:
            lat.append(ev0.elapsed_time(ev1) * 1e-3 / (2 * a.graph_k))
    return lat


def _m2n_data(res, name: str, base: str, kb: int) -> dict:
    """One measured case as a flat dict: ``name`` vs ``base`` at ``kb`` -- median and p99 one-way microseconds of
    both, ``baseline_fallback`` (the graph-capture error of a graphed baseline, replaced by the eager one) and
    ``error`` (a capture error string, or "not measured") instead of numbers."""
    m, p = res.get(f"{name}|{kb}"), res.get(f"{base}|{kb}")
    out = {"kb": kb, "transport": name, "baseline": base, "baseline_fallback": None, "error": None}
    if isinstance(p, str) and base.endswith("@graph") and not isinstance(m, str) and m is not None:
        out.update(baseline=base.removesuffix("@graph"), baseline_fallback=p)
        p = res.get(f"{base.removesuffix('@graph')}|{kb}")
    if isinstance(m, str) or isinstance(p, str) or m is None or p is None:
        out["error"] = m if isinstance(m, str) else p if isinstance(p, str) else "not measured"
        return out
    m, p = np.array(m) * 1e6, np.array(p) * 1e6
    out.update(median_us=float(np.median(m)), p99_us=float(np.percentile(m, 99)),
               baseline_median_us=float(np.median(p)), baseline_p99_us=float(np.percentile(p, 99)))
    return out


def _m2n_rows(res, name: str, base: str, kb: int, label: str) -> str:
    """One table row: ``name`` vs ``base`` at ``kb`` (:func:`_m2n_data`). A capture error string is shown instead of
    ``name``'s numbers; a baseline whose graph failed falls back to the eager baseline, named in the row."""
    d = _m2n_data(res, name, base, kb)
    if d["baseline_fallback"] is not None:
        label += f"; vs EAGER baseline ({d['baseline_fallback'][:120]})"
    if d["error"] is not None:
        return f"| {kb} | {label} | {d['error']} | | | | | |"
    r = d["median_us"] / d["baseline_median_us"]
    target = "n/a (baseline not graphed)" if d["baseline_fallback"] is not None else "met" if r <= 0.5 else "not met"
    return (f"| {kb} | {label} | {d['median_us']:.1f} | {d['p99_us']:.1f} | {d['baseline_median_us']:.1f} | "
            f"{d['baseline_p99_us']:.1f} | {r:.2f}x | {target} |")


def _collect_sizes(q, deadline: float) -> tuple[dict, str]:
    """Rank 0's per-size results from ``q`` until its ``done`` message, an error or ``deadline`` (time.monotonic);
    returns (merged results, error text or "")."""
    res: dict = {}
    while True:
        try:
            msg = q.get(timeout=max(0.1, deadline - time.monotonic()))
        except Exception:
            return res, f"no complete result within the time limit ({len(res)} values measured)"
        if "error" in msg:
            return res, msg["error"]
        if msg.get("done"):
            return res, ""
        res.update(msg)


def run_m2n(a) -> tuple[list[str], list[dict]]:
    """Spawn two ranks, time M2N vs p2p per size; :func:`m2n_table` of their results (markdown lines, rows)."""
    import torch.multiprocessing as mp

    from sglang.srt.utils.common import free_tcp_ports

    d = tempfile.mkdtemp(prefix="bench-m2n-")
    addrs = (f"ipc://{d}/0", f"ipc://{d}/1")
    init = f"tcp://127.0.0.1:{free_tcp_ports(1)[0]}"
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_m2n_rank, args=(r, a, addrs, init, q)) for r in range(2)]
    for p in procs:
        p.start()
    res, err = _collect_sizes(q, time.monotonic() + a.timeout)
    for p in procs:  # a failed rank's peer may block in NCCL: do not wait long for it
        p.join(2 if err else 60)
        if p.is_alive():
            p.kill()
    if err and not res:
        raise RuntimeError(f"m2n: {err}")
    return m2n_table(a, res, err)


def m2n_table(a, res: dict, err: str = "") -> tuple[list[str], list[dict]]:
    """The markdown table lines of rank 0's results ``res`` (``"<name>|<kb>"`` -> latencies in s, or an error
    string) and the same cases as flat dicts for :func:`m2n_record` (:func:`_m2n_data` plus ``timing`` eager / graph,
    ``graph_k`` and the copy-engine ``copy_floor_us`` of the size when measured); ``err``: why the run stopped early."""
    base = "NCCL send/recv" if a.device == "cuda" else "gloo send/recv"
    lines = [f"| KB per pair | M2N transport | median us | p99 us | {base} median us | p99 us | ratio | "
             "<= 0.5x target |", "|---|---|---|---|---|---|---|---|"]
    rows: list[dict] = []

    def add(name: str, base_key: str, kb: int, label: str) -> None:
        lines.append(_m2n_rows(res, name, base_key, kb, label))
        d = _m2n_data(res, name, base_key, kb)
        graph = name.endswith("@graph")
        floor = res.get(f"floor|{kb}")
        rows.append({"kb": kb, "transport": "raw LL floor" if name == "rawll@graph" else name.removesuffix("@graph"),
                     "timing": "graph" if graph else "eager", "graph_k": a.graph_k if graph else None,
                     **{k: d.get(k) for k in ("median_us", "p99_us")},
                     "baseline": base + (" (graph)" if d["baseline"].endswith("@graph") else " (eager)"),
                     **{k: d.get(k) for k in ("baseline_median_us", "baseline_p99_us")},
                     "copy_floor_us": None if floor is None else floor * 1e6,
                     "baseline_fallback": d["baseline_fallback"], "error": d["error"]})

    for kb in a.sizes_kb:
        for name in a.transports:
            add(name, "p2p", kb, f"{name} (eager)")
            if f"{name}@graph|{kb}" in res:
                add(f"{name}@graph", "p2p@graph", kb, f"{name} (CUDA graph, K={a.graph_k}; baseline graphed too)")
        if f"rawll@graph|{kb}" in res:
            add("rawll@graph", "p2p@graph", kb,
                f"floor: raw LL store + spin, no M2N bookkeeping (CUDA graph, K={a.graph_k})")
    if err:  # the sizes measured before the error / time limit are above
        lines += ["", f"[partial] not every size was measured: {err.splitlines()[0][:300]}", "", "```",
                  err[-3000:], "```"]
    floors = [f"{kb} KB {res[f'floor|{kb}'] * 1e6:.1f} us" for kb in a.sizes_kb if f"floor|{kb}" in res]
    if floors:
        lines += ["", "Physical reference (one copy-engine peer copy cuda:0 -> cuda:1, back-to-back, no signalling): "
                  + ", ".join(floors) + "."]
    return lines, rows


def m2n_record(a, rows: list[dict], gpu_count: int | None = None, env: dict | None = None,
               command: str | None = None) -> dict:
    """``--record-dir``: the M2N rows of :func:`m2n_table` as a :mod:`benchmark.common.records` record (``mode``
    m2n, ``what`` = ``afd_m2n``): per size and transport (eager / graphed) the median and p99 one-way microseconds,
    the same-run send/recv baseline's, ``vs_baseline`` = median / baseline median (the target is <= 0.5) and the
    copy-engine peer copy (the physical reference, 2 GPUs only). Headline: at the smallest and the largest measured
    size, the M2N row with the lowest ratio (a graphed one when the size has any; the raw LL floor and rows whose
    graphed baseline fell back to the eager one excluded).
    ``gpu_count`` defaults to 0 on CPU, 2 on GPU."""
    from benchmark.common import records

    rows = records.add_ratio(rows, "vs_baseline", "median_us", "baseline_median_us")
    ok = [r for r in rows if r["vs_baseline"] is not None and r["transport"] != "raw LL floor"
          and not r.get("baseline_fallback")]
    headline = []
    sizes = sorted({r["kb"] for r in ok})
    for kb in dict.fromkeys(sizes[:1] + sizes[-1:]):  # the smallest and the largest (once when they are one)
        at = [r for r in ok if r["kb"] == kb]
        r = min([r for r in at if r["timing"] == "graph"] or at, key=lambda r: r["vs_baseline"])
        headline.append({"label": f"M2N one-way latency, {kb} KB, {r['transport']} ({r['timing']}) vs {r['baseline']}",
                         "value": round(r["median_us"], 2), "unit": "us", "baseline": round(r["baseline_median_us"], 2),
                         "ratio": r["vs_baseline"]})
    floor = ({"column": "copy_floor_us", "what": "one copy-engine peer copy cuda:0 -> cuda:1 of the same bytes, "
                                                 "back-to-back, no signalling"}
             if any(r.get("copy_floor_us") is not None for r in rows) else None)
    notes = ["vs_baseline = M2N median / same-run send/recv median (lower is faster; target <= 0.5)."]
    if any(r["error"] for r in rows):
        notes.append("Rows with an error were not measured (capture failure or a run cut short).")
    return records.make_record(
        subject="afd", benchmark="benchmark.afd.bench", mode="m2n", what="afd_m2n_smoke" if a.smoke else "afd_m2n",
        rows=rows, params={k: getattr(a, k) for k in ("device", "transports", "sizes_kb", "iters", "warmup",
                                                      "graph_k", "graph_replays")},
        baselines=["baseline_median_us"] if any("baseline_median_us" in r for r in rows) else [],
        units={k: "us" for k in ("median_us", "p99_us", "baseline_median_us", "baseline_p99_us", "copy_floor_us")},
        floor=floor, headline=headline, notes=notes,
        gpu_count=gpu_count if gpu_count is not None else (2 if a.device == "cuda" else 0), env=env, command=command)
