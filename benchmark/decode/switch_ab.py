"""A/B of kernel-variant switches that are read when a kernel is launched (so a CUDA graph keeps the variant
it captured), in ONE process on one runner: ``SGLANG_DECODE_ATTN_SMALL_GRID_TILE`` (decode-attention tile for a
one-split grid that fits one wave, e.g. batch 32 on an H100) and ``SGLANG_DECODE_PDL`` (the decode-path Triton
kernels launched with programmatic dependent launch, early launch of the next kernel and the skinny GEMM's L2 weight
prefetch: the default on H100s; ``=0`` gives plain launches) and ``SGLANG_DECODE_FUSE_EPILOGUE``
(split-K reduce inside the next add + RMSNorm, SiLU-and-mul in the gate_up skinny GEMM; it changes the
GEMM table, so each (PDL, fuse) value pair tunes its own).

Each set is ``name:ENV=value,ENV=value`` (``default:`` = no variables set); one CUDA-graph set is captured per set
with its variables set; the first capture of each ``SGLANG_DECODE_PDL`` value runs the decode-GEMM autotune (default on)
and later captures of that value reuse its table, so sets of one launch mode differ only in the switched kernels.
Per batch size: the served step (the Scheduler's overlap loop with device futures, as the server runs on CUDA) and
the graph replay alone vs the memory floor, the order reversed on every other repetition, the host time inside
``graph.replay()`` and the graph's node count, and the per-class kernel breakdown of one replay per set
(:mod:`benchmark.decode.breakdown`) at the batches of ``cfg.switch_breakdown``. Called by
``benchmark/decode/step_ab.py --switch-ab SPEC``.
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from contextlib import contextmanager
from typing import Callable, Dict, List, Optional, Tuple

import torch

from benchmark.decode.breakdown import model_dims, render_role_table
from benchmark.decode.gemm_ab import _breakdown, staged_kv_tokens
from benchmark.common.floors import kv_bytes, memory_floor_s

logger = logging.getLogger("benchmark.decode.switch_ab")
Sets = List[Tuple[str, Dict[str, str]]]
SWITCHES = ("SGLANG_DECODE_ATTN_SMALL_GRID_TILE", "SGLANG_DECODE_PDL", "SGLANG_DECODE_FUSE_EPILOGUE")


def parse_sets(spec: str) -> Sets:
    """``"default:;nopdl:SGLANG_DECODE_PDL=0"`` -> ``[("default", {}), ("nopdl", {...: "0"})]``.

    Raises ValueError for fewer than two sets, a repeated or empty name, or a variable outside :data:`SWITCHES`.
    """
    sets: Sets = []
    for part in filter(None, (p.strip() for p in spec.split(";"))):
        name, _, env = part.partition(":")
        items = [e.strip() for e in env.split(",") if e.strip()]
        kv = dict(item.split("=", 1) for item in items if "=" in item)
        bad = [k for k in kv if k not in SWITCHES]
        if not name.strip() or bad or name.strip() in dict(sets) or len(kv) != len(items):
            raise ValueError(f"--switch-ab set {part!r}: want name:VAR=value,... with VAR in {SWITCHES}")
        sets.append((name.strip(), kv))
    if len(sets) < 2:
        raise ValueError(f"--switch-ab {spec!r}: need at least two sets separated by ';'")
    return sets


@contextmanager
def switched(env: Dict[str, str]):
    """Set exactly ``env`` among :data:`SWITCHES` (the others unset) for the block; restore afterwards."""
    saved = {k: os.environ.get(k) for k in SWITCHES}
    try:
        for k in SWITCHES:
            os.environ.pop(k, None)
        os.environ.update(env)
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _unset_pdl_mode() -> str:
    """``"2"`` where ``SGLANG_DECODE_PDL`` unset means on for the current CUDA device's model
    (``sgl_kernel.triton.common.PDL_DEFAULT_ON_MODELS``), else ``"0"`` (also without CUDA)."""
    import torch

    if not torch.cuda.is_available():
        return "0"
    from sgl_kernel.triton.common import _pdl_default_on

    return "2" if _pdl_default_on(torch.cuda.get_device_name(torch.cuda.current_device())) else "0"


def capture_sets(runner, sizes: List[int], capture: Callable, sets: Sets) -> Dict[str, object]:
    """One CUDA-graph set per entry of ``sets``. The decode-GEMM autotune runs at the first capture of each
    effective ``SGLANG_DECODE_PDL`` value, unset counting as this GPU model's default (:func:`_unset_pdl_mode`; the
    skinny kernel's launch mode changes its timings, e.g.
    its L2 weight prefetch, so each mode picks its own cuBLAS / skinny table) and later sets of that mode reuse it
    (``decode_gemm.maybe_autotune`` patched for those captures only). A later set whose capture raises is logged and
    left out (its name maps to the error text); the first set's error propagates."""
    from sglang.srt.layers import decode_gemm

    graphs: Dict[str, object] = {}
    tables: Dict[str, object] = {}
    orig = decode_gemm.maybe_autotune
    try:
        for i, (name, env) in enumerate(sets):
            t0 = time.monotonic()
            mode = (env.get("SGLANG_DECODE_PDL", "").strip() or _unset_pdl_mode(),
                    env.get("SGLANG_DECODE_FUSE_EPILOGUE", "").strip() or "0")
            decode_gemm.maybe_autotune = (lambda t: (lambda *a, **k: t))(tables[mode]) if mode in tables else orig
            try:
                with switched(env):
                    graphs[name] = capture(runner, sizes)
            except Exception as e:  # e.g. a Triton without launch_pdl: keep the other sets
                if i == 0:
                    raise
                graphs[name] = f"{type(e).__name__}: {e}"[:300]
                logger.error("graph set %s %s failed to capture: %s", name, env, graphs[name])
                torch.cuda.synchronize()
                continue
            tables.setdefault(mode, getattr(graphs[name], "decode_gemm_table", None))
            logger.info("graph set %s %s captured in %.1f s (GEMM table of SGLANG_DECODE_PDL=%s, fuse=%s)", name,
                        env, time.monotonic() - t0, *mode)
    finally:
        decode_gemm.maybe_autotune = orig
    return graphs


def _use(runner, graphs) -> None:
    from sglang.srt.layers import decode_gemm

    runner.cuda_graph_runner = graphs
    decode_gemm.install(runner.model, getattr(graphs, "decode_gemm_table", None))


def _replay_host_ms(graphs, bs: int) -> float:
    """Host milliseconds spent in ``graph.replay()`` of the padded-``bs`` graph (the launch, not the GPU time)."""
    graph = graphs.graphs[graphs.padded_size(bs)]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    graph.replay()
    host = time.perf_counter() - t0
    torch.cuda.synchronize()
    return host * 1e3


def _measure(runner, cfg, bs: int, sets: Sets, graphs: Dict[str, object], bw: float, weight_bytes: int,
             replay_ms: Callable) -> List[dict]:
    """Rows (one per set) of the served step and the replay vs the floor at batch ``bs``, order alternated."""
    from benchmark.decode.graphs import graph_node_counts
    from benchmark.decode.served_step import run_mode

    mc = runner.model_config
    gen = torch.Generator().manual_seed(cfg.seed + 1000 + bs)
    prompts = torch.randint(3, mc.vocab_size, (bs, cfg.context), generator=gen).tolist()
    acc = {n: {"step_s": [], "floor_s": [], "replay": [], "rfloor": [], "host": []} for n, _ in sets}
    for rep in range(cfg.serving_reps):
        for name, env in (sets if rep % 2 == 0 else sets[::-1]):
            _use(runner, graphs[name])
            with switched(env):
                got = run_mode(runner, "overlap", prompts, cfg.serving_warmup, cfg.serving_steps, bw, weight_bytes,
                               f"sw-{name}-{bs}-{rep}", cfg.model_path)
            acc[name]["step_s"] += got["step_s"]
            acc[name]["floor_s"] += got["floor_s"]
    for rep in range(2 * cfg.serving_reps):  # replay alone on the inputs the serving runs staged last
        for name, _ in (sets if rep % 2 == 0 else sets[::-1]):
            g = graphs[name]
            kv = kv_bytes(staged_kv_tokens(g, bs), mc.num_hidden_layers, runner.num_kv_heads, mc.head_dim,
                          mc.dtype.itemsize)
            acc[name]["replay"].append(replay_ms(g, bs))
            acc[name]["host"].append(_replay_host_ms(g, bs))
            acc[name]["rfloor"].append(memory_floor_s(weight_bytes, kv, bw) * 1e3)
    rows = []
    for name, env in sets:
        a = acc[name]
        step, floor = statistics.median(a["step_s"]), statistics.median(a["floor_s"])
        rep_ms, rfloor = statistics.median(a["replay"]), statistics.median(a["rfloor"])
        rows.append({"batch": bs, "set": name, "env": env, "step_ms": step * 1e3, "floor_ms": floor * 1e3,
                     "ratio": step / floor, "replay_ms": rep_ms, "replay_floor_ms": rfloor,
                     "replay_ratio": rep_ms / rfloor, "steps": len(a["step_s"]),
                     "host_replay_ms": statistics.median(a["host"]),
                     "nodes": graph_node_counts(graphs[name].graphs[graphs[name].padded_size(bs)])})
        logger.info("switch A/B bs %d %s: served %.3f ms (x%.3f), replay %.3f ms (x%.3f)", bs, name, step * 1e3,
                    step / floor, rep_ms, rep_ms / rfloor)
    return rows


def switch_ab(runner, cfg, bw: float, weight_bytes: int, capture: Callable, replay_ms: Callable, spec: str,
              progress: Optional[Callable[[dict], None]] = None) -> dict:
    """The A/B of the module docstring for the sets of ``spec`` (:func:`parse_sets`). Returns ``{"sets", "rows",
    "breakdown"}``; ``progress(res)`` gets the partial result after each batch size."""
    sets = parse_sets(spec)
    graphs = capture_sets(runner, sorted(set(cfg.batches)), capture, sets)
    failed = {n: g for n, g in graphs.items() if isinstance(g, str)}
    sets = [(n, e) for n, e in sets if n not in failed]
    dims = model_dims(runner.model_config, runner.num_kv_heads, runner.local_num_heads)
    res = {"sets": [[n, e] for n, e in sets], "failed": failed, "rows": [], "breakdown": []}
    try:
        for bs in cfg.batches:
            res["rows"] += _measure(runner, cfg, bs, sets, graphs, bw, weight_bytes, replay_ms)
            for name, _ in (sets if bs in getattr(cfg, "switch_breakdown", cfg.batches) else []):
                res["breakdown"].append(_breakdown(graphs[name], bs, name, dims, bw))
            runner.kv_cache.prefix_cache.reset()  # the next batch size starts from an empty cache
            if progress is not None:
                progress(res)
    finally:
        _use(runner, graphs[sets[0][0]])
    return res


def render_switch(res: dict, bw: float) -> List[str]:
    """Markdown lines: the A/B table (with each row's ratio to the first set) and the per-class breakdowns."""
    sets = ", ".join(f"`{n}` = {' '.join(f'{k}={v}' for k, v in e.items()) or '(none set)'}"
                     for n, e in res.get("sets", []))
    failed = "".join(f" Not captured: `{n}` ({err})." for n, err in res.get("failed", {}).items())
    out = ["## Kernel-variant switches A/B, one process, one GEMM table per SGLANG_DECODE_PDL value, order "
           "alternated", "", f"Sets: {sets}.{failed}", "",
           "| batch | set | served step (ms) | floor (ms) | served / floor | vs first set (ms) | replay (ms) | "
           "replay / floor | replay vs first set (ms) | host in replay() (ms) | graph nodes | steps |",
           "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|"]
    base: Dict[int, dict] = {}
    for r in res.get("rows", []):
        b = base.setdefault(r["batch"], r)
        nodes = r.get("nodes") or {}
        nd = f"{nodes.get('total', 'n/a')} ({nodes.get('kernel', '?')} kernels)" if nodes else "n/a"
        host = r.get("host_replay_ms")
        out.append(f"| {r['batch']} | {r['set']} | {r['step_ms']:.3f} | {r['floor_ms']:.3f} | {r['ratio']:.3f} | "
                   f"{r['step_ms'] - b['step_ms']:+.3f} | {r['replay_ms']:.3f} | {r['replay_ratio']:.3f} | "
                   f"{r['replay_ms'] - b['replay_ms']:+.3f} | {'n/a' if host is None else f'{host:.3f}'} | {nd} | "
                   f"{r['steps']} |")
    out += ["", "## Per-class breakdown of one graph replay per set (torch.profiler; min bytes per class)", ""]
    for b in res.get("breakdown", []):
        out += ([f"### {b['label']}: n/a ({b['error']})", ""] if "error" in b
                else render_role_table(b["label"], b["result"], bw))
    return out
