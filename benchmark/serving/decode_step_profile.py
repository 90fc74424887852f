"""Decode steps at the batch sizes and contexts a serving run reaches: graph vs eager, time vs memory floor, and the
GPU kernel time by category (attention share) from a short torch.profiler capture.

For each ``--cases BSxCTX[:var][:eager]`` the batch's KV context is allocated without a prefill (timing does not depend on
the KV values), then decode steps run through ``ModelRunner.forward`` exactly as the server's worker calls it: the
CUDA graph of that size (captured here for the listed sizes only) or, with ``:eager`` or above the largest graph,
the eager forward. Per case: median step time (CUDA events around ``forward``, synchronized steps), the floor
``(weight bytes + bs x ctx x KV bytes per token) / copy bandwidth`` (the copy bandwidth measured in the same process;
Williams et al., "Roofline", CACM 2009), and one profiled step's kernel time by category
(``benchmark/common/kernel_breakdown.py``: attention, gemm, norm, act, rope, copy, other). Prints a markdown table; writes
JSON with ``--json``. ``--policies balanced,wave`` times every case under each decode split policy of the Triton
backend (``SGLANG_DECODE_SPLIT_POLICY``: rows longest first with length-aware splits, or the rule before), each
with its own CUDA graphs, alternating which policy goes first from case to case, and prints the ratio. ``--device cpu`` runs the same flow on a tiny model (a dry run of the script; no graphs, no
profiler categories beyond what the CPU profiler reports).

``--record-dir DIR`` also writes a :mod:`benchmark.common.records` record (``what`` = ``decode_step_profile``) under
``DIR/serving/`` (:func:`decode_step_profile_record`).

Usage: python benchmark/serving/decode_step_profile.py --model-path ../shared/data/configs/meta-llama--Meta-Llama-3.1-8B \\
    --cases 160x2560 160x2560:var 200x2048:var 200x2048:var:eager --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(_HERE)))  # the repository root: benchmark.common.kernel_breakdown

from sglang.srt.utils.nvls_env import NVLS_OFF_ENV  # noqa: E402  (pure Python)

os.environ.update(NVLS_OFF_ENV)

import torch  # noqa: E402


def parse_case(spec: str) -> tuple[int, int, bool, bool]:
    """``BSxCTX[:var][:eager]`` -> (batch, mean context, variable contexts, eager). ``var``: the contexts are drawn
    uniformly from ``[1, 2 x CTX - 1]`` (mean CTX, as in a serving batch of random-length requests) instead of all
    CTX. Raises ValueError naming the bad spec."""
    body, *flags = spec.split(":")
    try:
        bs, ctx = (int(x) for x in body.lower().split("x"))
    except ValueError:
        raise ValueError(f"--cases {spec!r}: use BSxCTX[:var][:eager], e.g. 160x2560:var") from None
    if bs < 1 or ctx < 1 or any(f not in ("var", "eager") for f in flags):
        raise ValueError(f"--cases {spec!r}: batch and context must be >= 1, the suffixes ':var' / ':eager' or none")
    return bs, ctx, "var" in flags, "eager" in flags


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth in bytes/s ((read + write) / time), median of 10 after 2 warm-ups."""
    a = torch.empty(nbytes, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    times = []
    for _ in range(12):
        t0 = time.perf_counter()
        s, e = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) \
            if device.type == "cuda" else (None, None)
        if s is not None:
            s.record()
        b.copy_(a)
        if e is not None:
            e.record()
            e.synchronize()
            times.append(s.elapsed_time(e) * 1e-3)
        else:
            times.append(time.perf_counter() - t0)
    del a, b
    return 2 * nbytes / statistics.median(times[2:])


def case_contexts(bs: int, ctx: int, variable: bool) -> list[int]:
    """The contexts of a case (deterministic per case): all ``ctx``, or uniform in ``[1, 2 ctx - 1]``."""
    if not variable:
        return [ctx] * bs
    gen = torch.Generator().manual_seed(bs * 7919 + ctx)
    return torch.randint(1, 2 * ctx, (bs,), generator=gen).tolist()


class FakeContextBatch:
    """``bs`` requests of ``ctx`` tokens of KV each, or (``variable``) of uniform random lengths with mean ``ctx``
    (slots allocated, nothing computed), decoded one step at a time."""

    def __init__(self, runner, bs: int, ctx: int, variable: bool = False):
        self.runner = runner
        ctxs = case_contexts(bs, ctx, variable)
        gen = torch.Generator().manual_seed(bs * 7919 + ctx + 1)
        rows = runner.req_to_token_pool.alloc(bs)
        if rows is None:
            raise ValueError(f"batch {bs} exceeds the runner's request rows")
        self.rows = list(rows)
        self.slots = []
        locs = self._alloc(sum(ctxs))
        runner.req_to_token_pool.write_batch(self.rows, [0] * bs, ctxs, locs)
        self.seq = list(ctxs)
        self.ids = torch.randint(0, runner.model_config.vocab_size, (bs,), generator=gen).tolist()
        from sglang.srt.sampling.sampling_params import SamplingParams
        from sglang.srt.managers.schedule_batch import Req

        reqs = []
        for i in range(bs):
            p = SamplingParams(max_new_tokens=1 << 20, temperature=0.0, ignore_eos=True)
            p.normalize(None)
            reqs.append(Req(f"prof-{i}", [0], p))
        self.info = runner.make_sampling_info(reqs)

    def _alloc(self, n: int) -> torch.Tensor:
        locs = self.runner.allocator.alloc(n)
        if locs is None:
            raise ValueError(f"the KV pool cannot hold {n} more tokens: raise --max-total-tokens or lower the cases")
        self.slots.append(locs)
        return locs

    def batch(self):
        """The next decode step's ModelWorkerBatch (one new KV slot per request)."""
        from sglang.srt.forward_batch_info import ForwardMode, ModelWorkerBatch

        bs = len(self.rows)
        locs = self._alloc(bs)
        self.runner.req_to_token_pool.write_batch(self.rows, self.seq, [1] * bs, locs)
        b = ModelWorkerBatch(forward_mode=ForwardMode.DECODE, input_ids=list(self.ids), positions=list(self.seq),
                             out_cache_loc=locs, req_pool_indices=self.rows, prefix_lens=list(self.seq),
                             extend_lens=[1] * bs, seq_lens=[s + 1 for s in self.seq], sample=[True] * bs,
                             top_logprobs_nums=[0] * bs, sampling_info=self.info)
        self.seq = [s + 1 for s in self.seq]
        return b

    def free(self) -> None:
        """Give the rows and slots back."""
        self.runner.req_to_token_pool.free(self.rows)
        for s in self.slots:
            self.runner.allocator.free(s)
        self.slots = []


def time_steps(runner, fb: FakeContextBatch, steps: int, warmup: int) -> dict:
    """Median ms of ``steps`` synchronized decode steps: CUDA-event span around ``forward`` (device) and wall."""
    cuda = runner.device.type == "cuda"
    ev, wall = [], []
    for k in range(warmup + steps):
        b = fb.batch()
        if cuda:
            torch.cuda.synchronize(runner.device)
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
        t0 = time.perf_counter()
        runner.forward(b)
        if cuda:
            e.record()
            e.synchronize()
        w = (time.perf_counter() - t0) * 1e3
        if k >= warmup:
            wall.append(w)
            ev.append(s.elapsed_time(e) if cuda else w)
    return {"step_ms": statistics.median(ev), "wall_ms": statistics.median(wall)}


def profile_step(runner, fb: FakeContextBatch) -> dict:
    """Kernel time by category of one decode step (``kernel_breakdown``); CPU: the total of the profiled ops."""
    from benchmark.common import kernel_breakdown

    b = fb.batch()
    if runner.device.type == "cuda":
        return kernel_breakdown.kernel_breakdown(lambda: runner.forward(b), top=5)
    t0 = time.perf_counter()
    runner.forward(b)
    return {"total_ms": (time.perf_counter() - t0) * 1e3, "by_category": {}, "top": []}


def build_runner(a, cases, policies=()):
    """A dummy-weight ModelRunner sized for the cases, with CUDA graphs for the graph cases' sizes only: one set per
    decode split policy in ``policies`` (returned as ``{policy: CudaGraphRunner}``; the runner keeps the first), or
    one set under the backend's own policy when ``policies`` is empty."""
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_executor.cuda_graph_runner import CudaGraphRunner
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.server_args import ServerArgs

    max_ctx = max(2 * c for _, c, _, _ in cases) + a.steps + a.warmup + 16
    kv = max(sum(case_contexts(bs, ctx, var)) + bs * (a.steps + a.warmup + 8) for bs, ctx, var, _ in cases) + 4096
    sa = ServerArgs(model_path=a.model_path, load_format="dummy", dtype=a.dtype, device=a.device,
                    context_length=max_ctx, max_total_tokens=kv, max_running_requests=max(b for b, _, _, _ in cases) + 4,
                    disable_cuda_graph=True)
    runner = ModelRunner(ModelConfig.from_path(sa.model_path, sa.context_length, sa.dtype, a.device), sa, a.device)
    sizes = sorted({bs for bs, _, _, eager in cases if not eager})
    graphs = {}
    backend = runner.attn_backend
    own = getattr(backend, "split_policy", None)
    for pol in (policies or [own]):
        if pol is not None and hasattr(backend, "split_policy"):
            backend.split_policy = pol  # captured into this set of graphs (row order, split rule)
        if runner.device.type == "cuda" and sizes:
            graphs[pol] = CudaGraphRunner(runner, sizes[-1], runner.pad_req_idx, batch_sizes=sizes)
        else:
            graphs[pol] = None
    runner.cuda_graph_runner = next(iter(graphs.values()), None)
    return runner, graphs


def main(argv=None) -> int:
    """CLI entry (see the module docstring); returns 0."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-path", required=True)
    p.add_argument("--cases", nargs="+", default=["160x2560", "160x2560:var", "200x2048:var", "200x2048:var:eager"])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--json", default=None)
    p.add_argument("--policies", default="", help="comma list of decode split policies to compare, e.g. "
                   "balanced,wave (empty: the backend's default only)")
    from benchmark.common.records import add_record_dir_argument
    add_record_dir_argument(p, "serving")
    a = p.parse_args(argv)
    policies = [x for x in a.policies.split(",") if x]
    try:
        cases = [parse_case(c) for c in a.cases]
    except ValueError as e:
        p.error(str(e))
    t_start = time.perf_counter()
    runner, graph_sets = build_runner(a, cases, policies)
    dev = runner.device
    mc = runner.model_config
    pool = runner.token_to_kv_pool
    kv_per_token = pool.kv_size_bytes() / max(runner.max_total_tokens, 1) if hasattr(pool, "kv_size_bytes") else 0
    weight_bytes = sum(t.numel() * t.element_size() for t in runner.model.parameters())
    bw = copy_bandwidth(dev, 1 << 30 if dev.type == "cuda" else 1 << 24)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    print(f"device {name}; copy bandwidth {bw / 1e12:.3f} TB/s; weights {weight_bytes / 1e9:.2f} GB; KV "
          f"{kv_per_token:.0f} B/token; graphs {getattr(runner.cuda_graph_runner, 'batch_sizes', None)}; "
          f"setup {time.perf_counter() - t_start:.1f} s")
    rows = []
    pols = list(graph_sets)
    for k, (bs, ctx, var, eager) in enumerate(cases):
        for pol in (pols if k % 2 == 0 else pols[::-1]):  # A/B order alternates from case to case
            graphs = graph_sets[pol]
            if pol is not None and hasattr(runner.attn_backend, "split_policy"):
                runner.attn_backend.split_policy = pol  # eager steps read it at launch; graphs captured theirs
            runner.cuda_graph_runner = None if eager else graphs
            fb = FakeContextBatch(runner, bs, ctx, var)
            kv_tokens = sum(fb.seq)
            try:
                with torch.inference_mode():
                    t = time_steps(runner, fb, a.steps, a.warmup)
                    brk = profile_step(runner, fb)
            finally:
                fb.free()
            used_graph = not eager and graphs is not None and bs <= graphs.max_bs
            floor = (weight_bytes + kv_tokens * kv_per_token) / bw * 1e3
            cats = brk.get("by_category", {})
            tot = brk.get("total_ms") or 0.0
            rows.append({"case": k, "bs": bs, "ctx": ctx, "contexts": "uniform 1..2ctx" if var else "all ctx", "policy": pol,
                         "graph": used_graph, **t, "floor_ms": floor,
                         "ratio": t["step_ms"] / floor if floor else 0.0, "kernel_ms": tot,
                         "attention_ms": cats.get("attention", 0.0), "gemm_ms": cats.get("gemm", 0.0),
                         "attention_share": cats.get("attention", 0.0) / tot if tot else 0.0,
                         "top": brk.get("top", [])[:3], "error": brk.get("error")})
    runner.cuda_graph_runner = graph_sets[pols[0]]
    print("\n| bs | ctx (mean) | contexts | policy | graph | step ms | wall ms | floor ms | step / floor | kernels ms | "
          "attention ms (share) | gemm ms |\n|---:|---:|---|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['bs']} | {r['ctx']} | {r['contexts']} | {r['policy']} | {'yes' if r['graph'] else 'no'} | "
              f"{r['step_ms']:.2f} | {r['wall_ms']:.2f} | {r['floor_ms']:.2f} | {r['ratio']:.2f} | {r['kernel_ms']:.2f} | "
              f"{r['attention_ms']:.2f} ({r['attention_share']:.0%}) | {r['gemm_ms']:.2f} |")
    if len(pols) > 1:  # same case, first policy's step time / each other policy's
        print(f"\n| bs | ctx | contexts | graph | {pols[0]} step ms | " + " | ".join(f"{p} step ms | {p} / {pols[0]}"
                                                                                for p in pols[1:]) + " |")
        print("|---:|---:|---|---|---:|" + "---:|---:|" * (len(pols) - 1))
        for k, (bs, ctx, var, eager) in enumerate(cases):
            sel = {r["policy"]: r for r in rows if r["case"] == k}
            b = sel[pols[0]]
            print(f"| {bs} | {ctx} | {b['contexts']} | {'yes' if b['graph'] else 'no'} | {b['step_ms']:.2f} | " + " | ".join(
                f"{sel[p]['step_ms']:.2f} | {sel[p]['step_ms'] / b['step_ms']:.3f}" for p in pols[1:] if p in sel) + " |")
    for r in rows:
        if r["top"]:
            print(f"top kernels bs {r['bs']} ctx {r['ctx']}: " + "; ".join(f"{n[:60]} {ms:.2f} ms x{c}"
                                                                          for n, ms, c in r["top"]))
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump({"device": name, "copy_bw": bw, "weight_bytes": weight_bytes, "kv_bytes_per_token": kv_per_token,
                       "rows": rows, "seconds": time.perf_counter() - t_start}, f, indent=1)
    if a.record_dir:
        from benchmark.common import records

        rec = decode_step_profile_record(rows, pols, a, name, bw, weight_bytes, kv_per_token)
        js, _ = records.write_record(rec, a.record_dir)
        print(f"record: {js}")
    return 0


def decode_step_profile_record(rows: list, pols: list, a, device_name: str, bw: float, weight_bytes: int,
                               kv_per_token: float, env=None) -> dict:
    """The ``rows`` :func:`main` measured as a :mod:`benchmark.common.records` record: per case (and policy) the step
    time, the memory floor ``floor_ms`` and ``step_over_floor`` (step / floor), the kernel time by category. With
    several ``pols`` (``--policies``) the first policy's step time of the same case is the same-run baseline
    ``base_step_ms`` and ``of_base`` = step / base (below 1 = faster than the first policy). Headline: the first
    case's step time against its floor, and with policies the second policy against the first on that case."""
    from benchmark.common import records

    base = {r["case"]: r["step_ms"] for r in rows if r["policy"] == pols[0]} if len(pols) > 1 else {}
    out = []
    for r in rows:
        row = {k: v for k, v in r.items() if k not in ("top", "ratio", "error")}
        row["policy"] = r["policy"] if r["policy"] is None else str(r["policy"])
        if base:
            row["base_step_ms"] = base.get(r["case"])
        if r.get("error"):
            row["profile_error"] = str(r["error"])
        out.append(row)
    out = records.add_ratio(out, "step_over_floor", "step_ms", "floor_ms")
    if base:
        out = records.add_ratio(out, "of_base", "step_ms", "base_step_ms")
    headline = []
    first = next((r for r in out if r["case"] == 0 and (not base or r["policy"] == str(pols[0]))), None)
    if first is not None:
        headline.append({"label": f"decode step, batch {first['bs']} x context {first['ctx']} ({first['contexts']}), "
                                  f"{'CUDA graph' if first['graph'] else 'eager'}, vs the weight + KV bytes floor",
                         "value": round(first["step_ms"], 3), "unit": "ms", "baseline": round(first["floor_ms"], 3),
                         "ratio": first["step_over_floor"]})
    if base:
        other = next((r for r in out if r["case"] == 0 and r["policy"] == str(pols[1])), None)
        if other is not None:
            headline.append({"label": f"decode split policy {pols[1]} vs {pols[0]}, batch {other['bs']} x context "
                                      f"{other['ctx']} ({other['contexts']})", "value": round(other["step_ms"], 3),
                             "unit": "ms", "baseline": round(other["base_step_ms"], 3), "ratio": other["of_base"]})
    return records.make_record(
        subject="serving", benchmark="benchmark.serving.decode_step_profile",
        mode="policies" if base else "profile", what="decode_step_profile", rows=out, env=env,
        params={"model_path": a.model_path, "cases": list(a.cases), "steps": a.steps, "warmup": a.warmup,
                "device": a.device, "device_name": device_name, "dtype": a.dtype,
                "policies": [str(p) for p in pols], "copy_bandwidth_gbps": round(bw / 1e9, 1),
                "weight_bytes": weight_bytes, "kv_bytes_per_token": kv_per_token},
        baselines=["base_step_ms"] if base else [],
        units={c: "ms" for c in ("step_ms", "wall_ms", "floor_ms", "kernel_ms", "attention_ms", "gemm_ms",
                                 "base_step_ms")},
        floor={"column": "floor_ms", "what": "(weight bytes + KV tokens x KV bytes per token) / device copy bandwidth "
                                             "measured in this process"},
        headline=headline, gpu_count=1 if a.device == "cuda" else 0)


if __name__ == "__main__":
    sys.exit(main())
