"""Host-side helpers of ``benchmark/tokenweave/bench_layer.py`` layer mode: where the host time of one forward goes
(``--host-profile``: cProfile of rank 0) and the same forward captured as one CUDA graph (``--cuda-graph``).

Why graphs: a prefill of a fixed token count T issues the same kernels every time, so it can be captured once per T
and replayed with one launch; the replay's time is the forward's GPU time with no Python launch cost, which is what
an eager forward below ~4K tokens is bound by on our hosts (4 x H200: every variant host-bound at
T <= 2048). Every variant is graphed the same way (the sequential executor's ``model(...)`` for the baselines,
TokenWeave's ``run_subs`` of splits planned before the capture, streams and events captured as graph edges), so the
graphed table compares the GPU schedules only. The planning (host-to-device copies of the splits' metadata) runs
before the capture; the attention metadata of an extend batch is host-only, so it is captured as nothing.
"""

from __future__ import annotations

import cProfile
import io
import pstats
import time
from typing import Optional


def _forward_batch(runner, mwb, dev):
    from sglang.srt.forward_batch_info import ForwardBatch

    return ForwardBatch.init_new(mwb, dev, runner.req_to_token_pool, runner.token_to_kv_pool, runner.attn_backend)


def host_profile(runner, mwb, dev, rank: int, top: int = 25) -> str:
    """One forward of ``mwb`` on every rank (collective), rank 0 under :mod:`cProfile`; rank 0 returns the host ms
    (``perf_counter`` until the forward returned, under the profiler), the number of Python function calls, and the
    ``top`` functions by cumulative time, then the 15 by own time, as text (other ranks return "")."""
    import torch

    fb = _forward_batch(runner, mwb, dev)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    prof = cProfile.Profile() if rank == 0 else None
    with torch.inference_mode():
        t0 = time.perf_counter()
        if prof is not None:
            prof.enable()
        runner.executor.run(runner.model, fb)
        if prof is not None:
            prof.disable()
        host = (time.perf_counter() - t0) * 1e3
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
    if prof is None:
        return ""
    buf = io.StringIO()
    stats = pstats.Stats(prof, stream=buf).strip_dirs()
    buf.write(f"host {host:.2f} ms under cProfile, {stats.total_calls} Python calls "
              f"({stats.prim_calls} primitive)\n")
    stats.sort_stats("cumulative").print_stats(top)
    stats.sort_stats("tottime").print_stats(15)
    lines = [ln for ln in buf.getvalue().splitlines() if ln.strip() and not ln.startswith(("   Ordered by",
                                                                                           "   List reduced"))]
    return "\n".join(lines)


def _body(runner, fb):
    """The forward of ``fb`` as a closure that issues no host-to-device copy and no host sync (capturable): the
    TokenWeave executor's ``run_subs`` of its planned splits, or the executor's ``run`` (sequential: the extend
    metadata is host-only)."""
    ex = runner.executor
    if hasattr(ex, "run_subs"):
        subs = ex.plan(fb)  # host-to-device copies of the splits' metadata: before the capture
        return lambda: ex.run_subs(runner.model, fb, subs)
    return lambda: ex.run(runner.model, fb)


def eager_logits(runner, mwb, dev):
    """Next-token logits ``[bs, vocab]`` fp32 of one eager forward of ``mwb`` (collective), on the CPU."""
    import torch

    with torch.inference_mode():
        return runner.executor.run(runner.model, _forward_batch(runner, mwb, dev)).next_token_logits.float().cpu()


def time_graphed(runner, mwb, dev, ps, warmup: int, iters: int, ref,
                 timeline: Optional[str] = None) -> tuple[list[tuple[float, float]], float, Optional[dict]]:
    """The forward of ``mwb`` captured in one CUDA graph on every rank (collective), replayed ``warmup`` times, then
    ``iters`` timed replays (ranks aligned by a barrier before each): ([(GPU ms, host ms of the replay call)], the
    largest |graphed - eager| of the next-token logits against ``ref`` (:func:`eager_logits` of the same batch), a
    check that the graph computes what the eager forward does, and with ``timeline`` not None the overlap stats of
    one more, profiled replay (:func:`benchmark.tokenweave.layer_profile.profile_replay`; ``timeline`` the CSV path, "" for none:
    every rank must pass a str, the replay is collective), else None). Raises whatever the capture raises."""
    import torch
    import torch.distributed as dist

    fb = _forward_batch(runner, mwb, dev)
    with torch.inference_mode():
        body = _body(runner, fb)
        body()  # eager warm-up of this batch's splits
        torch.cuda.synchronize(dev)
        dist.barrier(group=ps.cpu_group)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            out = body()
        for _ in range(max(warmup, 1)):
            graph.replay()
        torch.cuda.synchronize(dev)
        diff = float((out.next_token_logits.float().cpu() - ref).abs().max())
        times = []
        for _ in range(iters):
            torch.cuda.synchronize(dev)
            dist.barrier(group=ps.cpu_group)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            start.record()
            graph.replay()
            end.record()
            host = (time.perf_counter() - t0) * 1e3
            end.synchronize()
            times.append((start.elapsed_time(end), host))
        stats = None
        if timeline is not None:
            from benchmark.tokenweave.layer_profile import profile_replay

            dist.barrier(group=ps.cpu_group)
            stats = profile_replay(graph, dev, timeline)
    del graph, out
    return times, diff, stats


def graph_table(cases: list[tuple[str, int, dict]], tokens: list[int], variants: list[str]) -> list[str]:
    """Markdown rows of the graphed forwards: per (model, TP, T) every variant's graph-replay ms, TokenWeave's ratio
    to each baseline, and the largest |graphed - eager| logit difference over the variants (a sanity check)."""
    bases = [b for b in ("nccl", "nccl_symm", "nocomm", "split_nocomm", "tokenweave_oldcomm", "tokenweave_oldsplit",
                         "tokenweave_selcarve") if b in variants and "tokenweave" in variants]
    lines = ["| model | TP | tokens | " + " | ".join(f"{v} graph ms" for v in variants) + " | "
             + " | ".join(f"tokenweave / {b}" for b in bases) + " | max abs(graph - eager) |",
             "|---|---:|---:|" + "---:|" * (len(variants) + len(bases) + 1)]
    for model, tp, res in cases:
        for t in tokens:
            ms = {v: res.get(f"graph|{v}|{t}") for v in variants}
            tw = ms.get("tokenweave")
            diffs = [res[f"graphdiff|{v}|{t}"] for v in variants if f"graphdiff|{v}|{t}" in res]
            check = f"{max(diffs):.3g}" if diffs else "n/a"
            lines.append(f"| {model} | {tp} | {t} | " + " | ".join(f"{ms[v]:.3f}" if ms[v] else "n/a" for v in variants)
                         + " | " + " | ".join(f"{tw / ms[b]:.3f}" if tw and ms[b] else "n/a" for b in bases)
                         + f" | {check} |")
    return lines


def graph_and_profile(runner, mwb, dev, ps, variant: str, t: int, opts: dict, out: dict, notes: set,
                      host_profiles: list) -> None:
    """The extra measurements of one (variant, T) after its eager timing (collective: every rank calls it):
    the eager next-token logits' largest difference to the ``nccl`` variant's of the same batch (same seeded dummy
    weights; ``opts["refs"]``, a dict kept across calls, holds nccl's per T) under ``("vsnccl", variant, t)`` and
    nccl's largest |logit| under ``("refmax", "nccl", t)``;
    with ``opts["cuda_graph"]`` (CUDA only) the graphed forward's median GPU / host ms and its logit difference to
    eager into ``out`` under ``("graph"|"graphhost"|"graphdiff", variant, t)`` (a capture error goes to ``notes``),
    and at a T in ``opts["graph_timeline"]`` ({T: CSV path, "" on ranks that write none}) one profiled replay's
    overlap stats appended to the list ``opts["graph_overlap"]`` as ``("<variant> (graph replay)", t, stats)``;
    at ``opts["host_profile"] == t`` rank 0's cProfile text into ``host_profiles`` as ``(variant, t, text)``."""
    import statistics

    ref = eager_logits(runner, mwb, dev)
    refs = opts.get("refs")
    if refs is not None:
        if variant == "nccl":
            refs[t] = ref
            out[("refmax", "nccl", t)] = float(ref.abs().max())
        if t in refs and variant != "nocomm":
            out[("vsnccl", variant, t)] = float((ref - refs[t]).abs().max())
    if opts.get("cuda_graph") and dev.type == "cuda":
        try:
            tl = opts.get("graph_timeline", {}).get(t)  # this T's replay timeline CSV ("" on other ranks)
            timed, diff, ov = time_graphed(runner, mwb, dev, ps, opts.get("warmup", 3), opts.get("iters", 5), ref, tl)
            if ov is not None and opts.get("graph_overlap") is not None:
                opts["graph_overlap"].append((f"{variant} (graph replay)", t, ov))
            out[("graph", variant, t)] = statistics.median(g for g, _ in timed)
            out[("graphhost", variant, t)] = statistics.median(h for _, h in timed)
            out[("graphdiff", variant, t)] = diff
        except Exception as e:  # a capture this build cannot do: the row says n/a, the note says why
            notes.add(f"cuda graph of {variant} at T={t} failed: {type(e).__name__}: {str(e)[:200]}")
    if opts.get("host_profile") == t:
        text = host_profile(runner, mwb, dev, ps.tp_rank)
        if text:
            host_profiles.append((variant, t, text))


def report_sections(cases: list[tuple[str, int, dict]], tokens: list[int], variants: list[str],
                    host_profiles: list, graphed: bool) -> list[str]:
    """Markdown sections of the graphed table (with each variant's replay host ms) and of rank 0's host
    profiles (empty when neither was asked)."""
    lines: list[str] = []
    check = [(t, f"{v} {res[f'vsnccl|{v}|{t}']:.3g}") for _, _, res in cases for t in tokens for v in variants
             if v != "nccl" and f"vsnccl|{v}|{t}" in res]
    if check:
        big = max((res.get(f"refmax|nccl|{t}", 0.0) for _, _, res in cases for t in tokens), default=0.0)
        lines += ["", "## correctness: eager next-token logits vs the nccl variant's (same seeded dummy weights)", "",
                  f"max |difference| over ranks and requests (nccl's largest |logit|: {big:.3g}):", ""]
        lines += [f"- T={t}: " + ", ".join(c for tt, c in check if tt == t) for t in tokens
                  if any(tt == t for tt, _ in check)]
    if graphed:
        lines += ["", "## CUDA graph: one graph per (variant, T), replay time (same run, same batches)", "",
                  "Every variant graphed the same way (the splits planned before the capture); the replay has no "
                  "Python launch cost, so this is the GPU schedule alone. Eager numbers above.", "",
                  *graph_table(cases, tokens, variants), ""]
        host = [f"{v} {res[f'graphhost|{v}|{t}']:.3f}" for _, _, res in cases for t in tokens[:1] for v in variants
                if f"graphhost|{v}|{t}" in res]
        if host:
            lines.append(f"- replay host ms at T={tokens[0]} (graph launch only): " + ", ".join(host))
    for variant, t, text in host_profiles:
        lines += ["", f"## host profile: {variant}, T={t} (rank 0, cProfile of one eager forward)", "", "```",
                  text, "```"]
    return lines
