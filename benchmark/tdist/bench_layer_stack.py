"""``--enable-tdist-overlap`` on a decoder-layer stack: TP prefill with and without the flag, timed and compared.

The layer-stack target: a Llama-3.3-70B layer stack at TP 4, prefill of T >= 4096 tokens, faster with
``--enable-tdist-overlap`` than without, outputs equal. Every rank (one per GPU) builds the model once from a real
``config.json`` cut to ``--layers`` decoder layers (:func:`benchmark.tokenweave.bench_layer._shrunk_config`, dummy bf16 weights) as a
server worker with the flag does (``ModelRunner`` with ``enable_tdist_overlap=True``: the ``tdist_sp`` executor of
the executor registry, :class:`~sglang.srt.distributed.tdist_overlap.TdistSequenceParallelOps` with the built-in
calibration table of the GPU model, no symmetric-memory group, as in the server). On the same weights it runs:

* ``off``     the executor a worker without the flag gets (``worker_template(args).executor``: sequential; the
              model's all-reduce communicator, ``--comm-backend auto``);
* ``tdist``   the flag's ops with the layout forced for every T (sequence-parallel residual; AG-GEMM / GEMM-RS
              through ``AutoAgGemm`` / ``AutoGemmRs``: decomposition, or NCCL + cuBLAS below the table's break-even
              M; Zheng et al., "Triton-distributed", 2025, sec. 3.2-3.3). The flag's own executor runs ``off``'s
              path below its ``min_tokens`` (the auto selection, reported per T);
* ``sp_nccl`` the flag's layout with torch collectives (NCCL all-gather, all-reduce + slice; cuBLAS): its time
              separates the layout change from the overlap;
* ``ref32``   (checked, not timed) the flag's layout whose row-parallel sums are taken in fp32 and rounded to bf16
              once: the same bf16 partial products as every other variant, reduced without intermediate rounding.

Correctness (before warm-up and again after timing, one forward per variant): the final hidden states ``[T, H]``
(input of the LM head, all-gathered) of ``tdist``, ``sp_nccl`` and ``ref32`` against ``off``: relative L2 error and
max abs error over max |off|; greedy tokens (argmax of the full-vocabulary logits) at ``--check-positions`` evenly
spaced positions including the last. ``rel_l2(ref32, off)`` is the rounding error the baseline itself carries from
its bf16 reductions; a path as accurate as ``off`` lies within that distance of ``ref32``, so within twice of ``off``
(triangle inequality). Pass: ``rel_l2(tdist, off) <= 2 * max(rel_l2(ref32, off), rel_l2(sp_nccl, off), 2**-9)``
(2**-9: the bf16 unit roundoff, a floor where ``off`` happens to be exact) and greedy agreement >= the smaller of
``sp_nccl``'s and ``ref32``'s minus one position. ``tdist``'s own distance from ``ref32`` is listed too.

Timing: ``--warmup`` untimed rounds (after the first check, whose wall time is reported as the first forward), then
``--iters`` rounds; each round runs every variant once, the order alternating (forward, reversed); each forward
between CUDA events after a device sync and a barrier; per rank the median, reported as the slowest rank's. The paths the tdist ops took per shape are
listed. All variants share one process, so ``CUDA_DEVICE_MAX_CONNECTIONS=32`` (what the server gives flag workers,
:func:`sgl_kernel.tdist.layout.stream_queue_env`) holds for ``off`` too. NVLink multicast stays off.

Example::

    python benchmark/tdist/bench_layer_stack.py --model-path ../shared/data/configs/meta-llama--Llama-3.3-70B-Instruct \\
        --tp 4 --layers 4 --tokens 4096 8192
    python benchmark/tdist/bench_layer_stack.py --smoke          # CPU, gloo, TP 2, tiny dims (tests use this)

``--record-dir DIR`` also writes the project's JSON record + markdown (:func:`stack_record`) under ``DIR/tdist/``:
headline ``off`` / ``tdist`` at the largest T.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "python"), str(ROOT / "sgl-kernel" / "python"), str(ROOT)]
from sglang.srt.distributed.sequence_parallel import TorchSequenceParallelOps, _check_rows  # noqa: E402
from sglang.srt.utils.nvls_env import NVLS_OFF_ENV  # noqa: E402  (pure Python)

os.environ.update(NVLS_OFF_ENV)
VARIANTS = ("off", "tdist", "sp_nccl")  # timed
CHECKED = VARIANTS + ("ref32",)  # compared
BF16_U = 2.0 ** -9  # bf16 unit roundoff (8 stored mantissa bits, round to nearest)


class Fp32ReduceOps(TorchSequenceParallelOps):
    """Torch sequence-parallel ops whose GEMM-RS sums the per-rank partial products (``[T, N]``, rounded to the
    input dtype as in every variant) in fp32 with one all-reduce and rounds this rank's rows once: the reduction of
    the ``ref32`` reference. Same contract as :class:`TorchSequenceParallelOps`."""

    name = "torch_fp32_reduce"

    def linear_rs(self, x, weight, bias, rows):
        """See :class:`SequenceParallelOps` (fp32 sum, one rounding)."""
        import torch.distributed as dist
        import torch.nn.functional as F

        rows = _check_rows(rows, self.world_size)
        y = F.linear(x, weight).float()
        dist.all_reduce(y, group=self.group)
        start = sum(rows[: self.rank])
        y = y[start: start + rows[self.rank]].to(x.dtype)
        return y + bias if bias is not None else y.contiguous()


def _build(ps, path: str, tokens: list, device: str):
    """The rank's runner (built as a ``--enable-tdist-overlap`` worker) and its four executors by variant name.
    Raises RuntimeError if the runner did not get the sequence-parallel executor."""
    import torch

    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.deployment.compose import worker_template
    from sglang.srt.model_executor.executors import ExecutorContext, build_executor
    from sglang.srt.model_executor.executors.sequence_parallel import SequenceParallelExecutor
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.server_args import ServerArgs

    dev = ps.torch_device() if device == "cuda" else torch.device("cpu")
    mc = ModelConfig.from_path(path, None, "bfloat16" if device == "cuda" else "float32", device)
    kw = dict(model_path=path, load_format="dummy", device=device, max_total_tokens=max(tokens) + 64,
              max_running_requests=4, disable_cuda_graph=True)
    on_args, off_args = ServerArgs(enable_tdist_overlap=True, **kw), ServerArgs(**kw)
    runner = ModelRunner(mc, on_args, str(dev), tp_rank=ps.tp_rank, tp_size=ps.tp_size, parallel_state=ps)
    if not isinstance(runner.executor, SequenceParallelExecutor):
        raise RuntimeError(f"--enable-tdist-overlap gave executor {runner.executor.name!r}, not sequence_parallel")
    off = build_executor(worker_template(off_args).executor, ExecutorContext(
        model=runner.model, model_config=mc, device=dev, tp_size=ps.tp_size, parallel_state=ps, args=off_args))
    sp_nccl = SequenceParallelExecutor(TorchSequenceParallelOps(ps.device_group, ps.tp_rank, ps.tp_size))
    ref32 = SequenceParallelExecutor(Fp32ReduceOps(ps.device_group, ps.tp_rank, ps.tp_size))
    # the flag's ops with the layout forced for every T (the flag's own executor runs off's path below its
    # min_tokens: runner.executor.min_tokens is reported as the auto selection)
    tdist = SequenceParallelExecutor(runner.executor.sp_ops)
    return runner, dev, mc, {"off": off, "tdist": tdist, "sp_nccl": sp_nccl, "ref32": ref32}


def _prepare(runner, ex, mwb, dev):
    """The ForwardBatch of ``mwb`` for a forward through executor ``ex`` (host work kept out of the timed window).
    A sequence-parallel executor's layout is (re)installed on the model's modules: two such executors share it."""
    from sglang.srt.forward_batch_info import ForwardBatch
    from sglang.srt.model_executor.executors.sequence_parallel import install_sequence_parallel_layout

    if hasattr(ex, "layout"):
        install_sequence_parallel_layout(runner.model, ex.layout)
    return ForwardBatch.init_new(mwb, dev, runner.req_to_token_pool, runner.token_to_kv_pool, runner.attn_backend)


def _forward(runner, ex, mwb, dev):
    """One prefill forward of ``mwb`` through executor ``ex``; the LogitsProcessorOutput."""
    return ex.run(runner.model, _prepare(runner, ex, mwb, dev))


def _outputs(runner, ex, mwb, dev, positions):
    """(final hidden states ``[T, H]`` float32 on the device, greedy tokens at ``positions`` as a list, the
    full-vocabulary logits there ``[len(positions), V]``) of one forward through ``ex``."""
    import torch

    model, seen = runner.model, []
    # the LM head's input: model.forward and the staged executors' compute_logits both call logits_processor
    hook = model.logits_processor.register_forward_pre_hook(lambda mod, args: seen.append(args[0]))
    try:
        with torch.inference_mode():
            _forward(runner, ex, mwb, dev)
            hidden = seen[0]
            logits = model.logits_processor._project(hidden[positions], model.lm_head.weight)
    finally:
        hook.remove()
    return hidden.float(), logits.argmax(-1).tolist(), logits


def _compare(outs: dict, variant: str) -> dict:
    """Distances of ``variant``'s outputs from ``off``'s: rel_l2, max_abs_rel (max |diff| / max |off|), greedy
    agreement (count of equal positions) and the smallest top-1/top-2 logit margin of ``off`` at the positions
    where the greedy tokens differ (a small margin = a near-tie)."""
    ref, ref_tok, ref_logits = outs["off"]
    h, tok, _ = outs[variant]
    diff = (h - ref)
    scale = float(ref.abs().max()) or 1.0
    top2 = ref_logits.topk(2, dim=-1).values
    margins = [float(top2[i, 0] - top2[i, 1]) for i, (a, b) in enumerate(zip(ref_tok, tok)) if a != b]
    return {"rel_l2": float(diff.norm() / (ref.norm() or 1.0)), "max_abs_rel": float(diff.abs().max()) / scale,
            "greedy_equal": sum(a == b for a, b in zip(ref_tok, tok)), "greedy_n": len(tok),
            "flip_margin": min(margins) if margins else None}


def _check(runner, exs: dict, mwb, dev, t: int, n_pos: int) -> dict:
    """One forward per variant and the comparison of each against ``off`` (see _compare), plus ``tdist_vs_ref32``;
    ``paths``: the path every tdist op call took, as ``"kind K=.. N=.. M=..: path"`` strings."""
    import torch

    positions = torch.linspace(0, t - 1, min(n_pos, t), device=dev).round().long().unique()
    ops, paths = exs["tdist"].sp_ops, set()
    orig_op = getattr(ops, "_op", None)
    if orig_op is not None:  # TdistSequenceParallelOps: log the path of every fused op call of this forward
        def logged(kind, k, n, dtype):
            op = orig_op(kind, k, n, dtype)

            def call(a, b, rows, *rest, **kw):
                out = op(a, b, rows, *rest, **kw)
                paths.add(f"{kind} K={k} N={n} M={sum(rows)}: {getattr(op, 'last_path', '') or ops.producer}")
                return out
            return call
        ops._op = logged
    calls = {}
    for v in CHECKED[1:]:  # count the row-parallel calls: proof that the sequence-parallel path ran
        sp, orig_rs = exs[v].sp_ops, exs[v].sp_ops.linear_rs
        sp.linear_rs = lambda *a, _f=orig_rs, _v=v, **kw: (calls.__setitem__(_v, calls.get(_v, 0) + 1), _f(*a, **kw))[1]
    outs, wall = {}, {}
    try:
        for v in CHECKED:  # wall ms of each (the first check: the first forward, incl. op build and cuBLAS setup)
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            t0 = time.perf_counter()
            outs[v] = _outputs(runner, exs[v], mwb, dev, positions)
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            wall[v] = (time.perf_counter() - t0) * 1e3
    finally:
        for v in CHECKED[1:]:
            del exs[v].sp_ops.linear_rs
        if orig_op is not None:
            del ops._op
    res = {v: _compare(outs, v) for v in CHECKED[1:]}
    res["tdist_vs_ref32"] = float((outs["tdist"][0] - outs["ref32"][0]).norm() / (outs["ref32"][0].norm() or 1.0))
    res["paths"] = sorted(paths) or [f"sp ops: {ops.name} (no fused ops on this rank)"]
    res["paths"] += [f"{v}: {calls.get(v, 0)} linear_rs calls per forward" for v in CHECKED[1:]]
    res["wall_ms"] = wall
    return res


def _timed(runner, exs: dict, mwb, dev, ps, warmup: int, iters: int) -> dict:
    """Per variant: the GPU ms (CUDA events) / host ms (until ``run`` returned) of ``iters`` forwards after
    ``warmup`` untimed rounds, the variant order alternating per round. CPU: perf_counter for both."""
    import torch
    import torch.distributed as dist

    cuda = dev.type == "cuda"
    res = {v: {"gpu": [], "host": []} for v in VARIANTS}

    def one(v):
        fb = _prepare(runner, exs[v], mwb, dev)
        if cuda:
            torch.cuda.synchronize(dev)
        dist.barrier(group=ps.cpu_group)
        t0 = time.perf_counter()
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        exs[v].run(runner.model, fb)
        host = (time.perf_counter() - t0) * 1e3
        if cuda:
            end.record()
            end.synchronize()
            return start.elapsed_time(end), host
        return (time.perf_counter() - t0) * 1e3, host

    with torch.inference_mode():
        for i in range(warmup + iters):
            for v in (VARIANTS if i % 2 == 0 else VARIANTS[::-1]):
                g, h = one(v)
                if i >= warmup:
                    res[v]["gpu"].append(g)
                    res[v]["host"].append(h)
    return {v: {"gpu": statistics.median(r["gpu"]), "host": statistics.median(r["host"])} for v, r in res.items()}


def _rank_body(ps, path: str, tokens: list, warmup: int, iters: int, n_pos: int, device: str) -> dict:
    """Per rank: build once, then per T: check, time, check again. Returns ``{T: {"check": [before, after],
    "time": ...}}`` (JSON-safe) and progress lines on stderr (rank 0) so a cut run shows what it measured."""
    from sglang.srt.forward_batch_info import ForwardMode, ModelWorkerBatch

    runner, dev, mc, exs = _build(ps, path, tokens, device)
    out = {"sp_ops": type(exs["tdist"].sp_ops).__name__, "off_executor": exs["off"].name,
           "auto_min_tokens": runner.executor.min_tokens}
    for t in tokens:
        row = runner.kv_cache.alloc_req_slot()
        loc = runner.kv_cache.alloc_extend([row], [0], [t], [-1])
        mwb = ModelWorkerBatch(forward_mode=ForwardMode.EXTEND, input_ids=[(7 * i) % mc.vocab_size for i in range(t)],
                               positions=list(range(t)), out_cache_loc=loc, req_pool_indices=[row], prefix_lens=[0],
                               extend_lens=[t], seq_lens=[t], sample=[True])
        before = _check(runner, exs, mwb, dev, t, n_pos)
        if ps.tp_rank == 0:
            print(f"[partial] rank 0 T={t} first check: rel_l2 vs off: " + ", ".join(
                f"{v} {before[v]['rel_l2']:.2e}" for v in CHECKED[1:]) + "; " + "; ".join(before["paths"]),
                file=sys.stderr, flush=True)
        timing = _timed(runner, exs, mwb, dev, ps, warmup, iters)
        after = _check(runner, exs, mwb, dev, t, n_pos)
        out[str(t)] = {"check": [before, after], "time": timing}
        if ps.tp_rank == 0:
            print(f"[partial] rank 0 T={t}: " + ", ".join(f"{v} {timing[v]['gpu']:.3f} ms" for v in VARIANTS)
                  + "; rel_l2 vs off: " + ", ".join(f"{v} {after[v]['rel_l2']:.2e}" for v in CHECKED[1:]),
                  file=sys.stderr, flush=True)
        runner.kv_cache.free_slots(loc)
        runner.kv_cache.free_req_slot(row)
    return out


def _worst(per_rank: list, t: int) -> dict:
    """Over ranks: the largest distances, the fewest greedy matches, the slowest medians of T ``t``."""
    rows = [r[str(t)] for r in per_rank]
    chk = {"tdist_vs_ref32": max(c["tdist_vs_ref32"] for r in rows for c in r["check"])}
    for v in CHECKED[1:]:
        cs = [c[v] for r in rows for c in r["check"]]
        margins = [c["flip_margin"] for c in cs if c["flip_margin"] is not None]
        chk[v] = {"rel_l2": max(c["rel_l2"] for c in cs), "max_abs_rel": max(c["max_abs_rel"] for c in cs),
                  "greedy_equal": min(c["greedy_equal"] for c in cs), "greedy_n": cs[0]["greedy_n"],
                  "flip_margin": min(margins) if margins else None}
    tol = 2 * max(chk["ref32"]["rel_l2"], chk["sp_nccl"]["rel_l2"], BF16_U)
    chk["tol"] = tol
    chk["pass"] = (chk["tdist"]["rel_l2"] <= tol and chk["tdist"]["greedy_equal"]
                   >= min(chk["sp_nccl"]["greedy_equal"], chk["ref32"]["greedy_equal"]) - 1)
    tm = {v: {k: max(r["time"][v][k] for r in rows) for k in ("gpu", "host")} for v in VARIANTS}
    for v in VARIANTS:  # the first forward: the first check's wall time
        tm[v]["first"] = max(r["check"][0]["wall_ms"][v] for r in rows)
    paths = sorted({p for r in rows for c in r["check"] for p in c["paths"]})
    return {"check": chk, "time": tm, "paths": paths}


def _tables(per_rank: list, tokens: list, model: str, tp: int) -> list:
    """Markdown: the timing table, the output comparison table, the tdist op paths per T."""
    res = {t: _worst(per_rank, t) for t in tokens if str(t) in per_rank[0]}
    lines = ["| model | TP | T | off ms | tdist ms | sp_nccl ms | off / tdist | sp_nccl / tdist | host ms off / tdist "
             "| first forward wall ms off / tdist |", "|---|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    for t, r in res.items():
        m = r["time"]
        lines.append(f"| {model} | {tp} | {t} | {m['off']['gpu']:.3f} | {m['tdist']['gpu']:.3f} | "
                     f"{m['sp_nccl']['gpu']:.3f} | **{m['off']['gpu'] / m['tdist']['gpu']:.3f}x** | "
                     f"{m['sp_nccl']['gpu'] / m['tdist']['gpu']:.3f}x | {m['off']['host']:.2f} / "
                     f"{m['tdist']['host']:.2f} | {m['off']['first']:.1f} / {m['tdist']['first']:.1f} |")
    lines += ["", "| T | variant | rel L2 vs off | max abs / max abs(off) | greedy equal | smallest off top-2 margin "
              "at a flip | tolerance (rel L2) | pass |", "|---:|---|---:|---:|---:|---:|---:|---|"]
    for t, r in res.items():
        c = r["check"]
        for v in CHECKED[1:]:
            x = c[v]
            fm = "-" if x["flip_margin"] is None else f"{x['flip_margin']:.2e}"
            verdict = (f"{c['tol']:.3e} | {'yes' if c['pass'] else 'NO'} (rel L2 vs ref32: {c['tdist_vs_ref32']:.3e})"
                       if v == "tdist" else "| ")
            lines.append(f"| {t} | {v} | {x['rel_l2']:.3e} | {x['max_abs_rel']:.3e} | {x['greedy_equal']}/"
                         f"{x['greedy_n']} | {fm} | {verdict} |")
    lines += ["", "tdist op paths per call (kind, K, N, total M: path; AutoAgGemm / AutoGemmRs with the built-in "
              "table of the GPU model):", ""]
    lines += [f"- T={t}: " + "; ".join(r["paths"]) for t, r in res.items()]
    return lines


def stack_record(per_rank: list, a, env: Optional[dict] = None, command: Optional[str] = None) -> dict:
    """``--record-dir``: the timing and output tables as a :mod:`benchmark.common.records` record (``what`` =
    ``tdist_stack``): per T the slowest rank's GPU / host / first-forward ms of ``off`` (the same-run baseline),
    ``tdist`` and ``sp_nccl``, the ratios ``off_over_tdist`` / ``sp_nccl_over_tdist`` (> 1: tdist faster) and the
    output check (tdist's rel L2 vs off, its tolerance, greedy matches, pass). Headline: off / tdist at the largest T."""
    from benchmark.common import records

    model, rows = Path(a.model_path).name or "synthetic", []
    for t in [t for t in a.tokens if str(t) in per_rank[0]]:
        w = _worst(per_rank, t)
        m, c = w["time"], w["check"]
        rows.append({"model": model, "tp": a.tp, "tokens": t, **{f"{v}_ms": m[v]["gpu"] for v in VARIANTS},
                     **{f"{v}_host_ms": m[v]["host"] for v in ("off", "tdist")},
                     **{f"{v}_first_ms": m[v]["first"] for v in ("off", "tdist")},
                     "tdist_rel_l2": c["tdist"]["rel_l2"], "tol_rel_l2": c["tol"],
                     "greedy_equal": c["tdist"]["greedy_equal"], "greedy_n": c["tdist"]["greedy_n"],
                     "pass": c["pass"]})
    rows = records.add_ratio(records.add_ratio(rows, "off_over_tdist", "off_ms", "tdist_ms"),
                             "sp_nccl_over_tdist", "sp_nccl_ms", "tdist_ms")
    headline = [{"label": f"--enable-tdist-overlap layer stack, {model} {a.layers} layers TP{a.tp}, T={r['tokens']}"
                          f" (outputs {'pass' if r['pass'] else 'FAIL'})", "value": r["tdist_ms"], "unit": "ms",
                 "baseline": r["off_ms"], "ratio": r["off_over_tdist"]} for r in rows[-1:]]
    return records.make_record(
        subject="tdist", benchmark="benchmark.tdist.bench_layer_stack", mode="smoke" if a.smoke else "stack",
        what="tdist_stack_smoke" if a.smoke else "tdist_stack", rows=rows,
        params={k: getattr(a, k) for k in ("layers", "tp", "tokens", "warmup", "iters", "check_positions")},
        baselines=["off_ms", "sp_nccl_ms"] if rows else [],
        units={k: "ms" for r in rows[:1] for k in r if k.endswith("_ms")}, headline=headline,
        gpu_count=0 if a.smoke else a.tp, env=env, command=command)


def _auto_line(min_tokens: int, tokens: list) -> str:
    """What ``--enable-tdist-overlap`` runs per T without ``--tdist-overlap-min-tokens``: off's path (sequential)
    below its min_tokens, tdist's (the sequence-parallel layout) from there."""
    from sglang.srt.model_executor.executors.sequence_parallel_select import NEVER_TOKENS

    mt = "never" if min_tokens >= NEVER_TOKENS else str(min_tokens)
    return f"layout from T >= {mt}; " + ", ".join(
        f"T={t}: {'tdist' if t >= min_tokens else 'off'}" for t in tokens)


def _hardware(device: str) -> str:
    if device == "cuda":
        import torch

        return f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    import platform

    return f"CPU {platform.machine()} ({os.cpu_count()} cores)"


def run(a) -> Path:
    """Spawn the ranks, write ``<results-dir>/<date>_tdist_stack[_smoke].md``; returns its path. Raises
    RuntimeError (spawn_ranks) if a rank fails or the run exceeds ``--timeout``."""
    from benchmark.tokenweave.bench_layer import _shrunk_config

    from sglang.test.spawn_ranks import spawn_ranks

    device = "cpu" if a.smoke else "cuda"
    if device == "cuda":
        from sgl_kernel.tdist.layout import stream_queue_env

        os.environ.update(stream_queue_env(os.environ))  # what the server gives --enable-tdist-overlap workers
    path = _shrunk_config(a.model_path, a.layers, a.smoke)
    per_rank = spawn_ranks(_rank_body, a.tp, path, a.tokens, a.warmup, a.iters, a.check_positions, device,
                           timeout=a.timeout, device=device)
    model = Path(a.model_path).name or "synthetic"
    lines = [f"# --enable-tdist-overlap layer stack ({'smoke, ' if a.smoke else ''}{device})", "",
             f"- date: {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}",
             f"- hardware: {_hardware(device)}; CUDA_DEVICE_MAX_CONNECTIONS="
             f"{os.environ.get('CUDA_DEVICE_MAX_CONNECTIONS', 'unset')}",
             f"- command: `{' '.join([sys.executable] + sys.argv)}`",
             f"- model: {model} cut to {a.layers} layers, dummy weights, TP {a.tp}, one request of T tokens; "
             f"executors: off = {per_rank[0]['off_executor']}, tdist = sequence_parallel on "
             f"{per_rank[0]['sp_ops']}, sp_nccl = sequence_parallel on TorchSequenceParallelOps, ref32 = "
             "sequence_parallel on Fp32ReduceOps (checked, not timed)",
             f"- auto selection (the flag's default executor): {_auto_line(per_rank[0]['auto_min_tokens'], a.tokens)}",
             f"- timing: first forward (the first output check, wall time incl. op build) apart, {a.warmup} warm-up rounds, median of {a.iters} rounds (variant order "
             "alternating per round), CUDA events per forward, slowest rank; ratios > 1: tdist faster",
             f"- outputs: final hidden states [T, H] and greedy tokens at {a.check_positions} positions, before warm-up "
             "and after timing, worst over ranks and both checks; pass: rel L2 <= 2 x max(ref32's, sp_nccl's, 2^-9) "
             "and greedy matches >= min(sp_nccl's, ref32's) - 1 (ref32: row-parallel sums in fp32, rounded once)", "", *_tables(per_rank, a.tokens, model, a.tp)]
    print("\n".join(lines))
    d = Path(a.results_dir)
    d.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d_%H%M")
    out = d / f"{stamp}_tdist_stack{'_smoke' if a.smoke else ''}.md"
    out.write_text("\n".join(lines) + "\n")
    (d / out.name.replace(".md", ".json")).write_text(json.dumps(per_rank))
    if a.record_dir:  # the parent holds every rank's results: one writer
        from benchmark.common.records import write_record

        print(f"record: {write_record(stack_record(per_rank, a), Path(a.record_dir))[0]}")
    return out


def parse_args(argv=None):
    """The flags (module docstring); argparse errors name the bad value."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-path", default="", help="folder with a real config.json (weights are dummy)")
    p.add_argument("--tp", type=int, default=None, help="TP size (default 4; --smoke: 2)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--tokens", type=int, nargs="+", default=[4096, 8192])
    p.add_argument("--warmup", type=int, default=10, help="untimed rounds (every variant once) before timing")
    p.add_argument("--iters", type=int, default=15, help="timed rounds (every variant once per round)")
    p.add_argument("--check-positions", type=int, default=128, help="positions whose greedy tokens are compared")
    p.add_argument("--smoke", action="store_true", help="CPU gloo, TP 2, tiny shapes (checks the harness only)")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--results-dir", default=str(ROOT / "benchmark" / "results" / "tdist"))
    from benchmark.common.records import add_record_dir_argument
    add_record_dir_argument(p, "tdist")
    a = p.parse_args(argv)
    a.tp = a.tp or (2 if a.smoke else 4)
    if a.smoke:
        a.warmup, a.iters = 1, 2
        a.tokens = [t for t in a.tokens if t <= 256] or [64, 130]
    if a.tp < 2 or a.layers < 1 or a.iters < 1 or a.warmup < 0 or a.check_positions < 1 or min(a.tokens) < 2:
        p.error(f"--tp={a.tp} must be >= 2, --layers / --iters / --check-positions >= 1, --warmup >= 0, "
                f"every --tokens >= 2 (got {a.tokens})")
    if not a.smoke and not a.model_path:
        p.error("--model-path is required (a folder with config.json), or use --smoke")
    return a


def main(argv=None) -> Path:
    """Run the benchmark (see the module docstring); returns the results file."""
    return run(parse_args(argv))


if __name__ == "__main__":
    main()
