"""Deployment-plan search for attention/FFN disaggregation (MegaScale-Infer sec. 4.2, Algorithm 1).

``python -m sglang.srt.afd.planner.plan --model-path CONFIG --attention-gpu H20 --ffn-gpu L40S --tpot-slo-ms 150``

Algorithm 1 enumerates the expert-node TP size ``tp_e`` and the attention-node TP size ``tp_a`` (both
within one node), balances the attention and expert times through the number of attention nodes ``n_a``
(eq. 1), picks the number of micro-batches ``m`` (eq. 3) and lets SIMULATE find the largest global batch
``B = n_a * m * b_a`` whose TPOT (eq. 4) meets the SLO, keeping the plan with the best throughput per cost.

Our reconstruction (documented in ``docs/afd_plan.md``):

* instead of solving BALANCE for one ``n_a`` we evaluate every ``n_a`` in ``[1, max_attention_nodes]``
  (vectorized), which finds the balanced point and anything the linear model prefers near it;
* we also enumerate ``g`` experts per expert node (``n_e = E / g``); ``g = 1`` is the paper's layout;
* throughput ``B / T_iter`` rises with ``b_a`` (``T_iter`` is affine in ``b_a``), so per (tp_a, tp_e, g,
  n_a, m) the best ``b_a`` is the largest one meeting the SLO and the KV memory: a vectorized bisection;
* a plan is feasible only if it meets eq. 2 (``T_c < T_f``) and eq. 3 (``m >= 2 (1 + T_c / T_f)``).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import asdict, dataclass
from typing import Optional, Sequence

import numpy as np

from sglang.srt.afd.planner.gpu_specs import gpu_kinds
from sglang.srt.afd.planner.model_spec import MoEModelSpec
from sglang.srt.afd.planner.perf_model import PerfModel, build_perf_model, load_profile
from sglang.srt.afd.planner.simulator import iteration_time, min_micro_batches, pipeline_summary, simulate_fleet

logger = logging.getLogger(__name__)


class PlanInfeasibleError(ValueError):
    """No deployment meets the constraints (SLO, memory, node size); the message says which and why."""


@dataclass(frozen=True)
class SearchLimits:
    """Bounds of the plan search (frozen, passed explicitly).

    Attributes:
        tpot_slo_s: time-per-output-token SLO, seconds.
        max_gpus_per_node: largest TP group (``tp_a``, ``tp_e`` are powers of two up to it).
        max_total_gpus: GPUs one deployment unit may use (attention + experts).
        max_attention_nodes: upper end of the ``n_a`` sweep.
        max_micro_batches: upper end of the ``m`` sweep.
        max_micro_batch_size: upper end of ``b_a`` (tokens per micro-batch per attention node).
        mem_fraction: usable fraction of device memory (the rest: activations, CUDA graphs, fragmentation).
        objective: ``"per-cost"`` (tokens/s per price unit, the paper's), ``"per-gpu"``, or ``"fleet"``
            (total tokens/s of as many units as fit in the fleet below).
        fleet_attention_gpus: fleet GPUs of the attention kind (a shared pool when both kinds are equal).
        fleet_ffn_gpus: fleet GPUs of the FFN kind (heterogeneous fleets).
        expert_imbalance: max/mean expert-node load (1.0 = uniform routing).
    """

    tpot_slo_s: float
    max_gpus_per_node: int = 8
    max_total_gpus: int = 4096
    max_attention_nodes: int = 512
    max_micro_batches: int = 16
    max_micro_batch_size: int = 1024
    mem_fraction: float = 0.9
    objective: str = "per-cost"
    expert_imbalance: float = 1.0
    fleet_attention_gpus: int = 0
    fleet_ffn_gpus: int = 0

    def __post_init__(self):
        if not self.tpot_slo_s > 0:
            raise ValueError(f"--tpot-slo-ms must be > 0, got {self.tpot_slo_s * 1e3:g}")
        if self.max_gpus_per_node < 1:
            raise ValueError(f"--max-gpus-per-node must be >= 1, got {self.max_gpus_per_node}")
        if self.objective not in ("per-cost", "per-gpu", "fleet"):
            raise ValueError(f"--objective must be per-cost, per-gpu or fleet, got {self.objective!r}")
        if self.objective == "fleet" and self.fleet_attention_gpus <= 0:
            raise ValueError("--objective fleet needs --fleet-gpus N (or A,F for attention,FFN pools)")
        if not 0 < self.mem_fraction <= 1:
            raise ValueError(f"--mem-fraction must be in (0, 1], got {self.mem_fraction}")
        if self.expert_imbalance < 1:
            raise ValueError(f"--expert-imbalance is max/mean load and must be >= 1, got {self.expert_imbalance}")


@dataclass(frozen=True)
class AfdPlan:
    """One deployment unit: ``n_a`` attention nodes of ``tp_a`` GPUs + ``n_e`` expert nodes of ``tp_e`` GPUs.

    Times are per micro-batch per MoE layer, in milliseconds; throughput in output tokens/s.
    """

    model: str
    attention_gpu: str
    ffn_gpu: str
    tp_a: int
    n_a: int
    tp_e: int
    n_e: int
    experts_per_node: int
    m: int
    micro_batch_size: int
    global_batch: int
    t_a_ms: float
    t_e_ms: float
    t_c_ms: float
    tpot_ms: float
    tokens_per_s: float
    attention_gpus: int
    ffn_gpus: int
    cost_per_hour: float
    tokens_per_s_per_gpu: float
    tokens_per_s_per_cost: float
    cost_model: str = ""

    @property
    def total_gpus(self) -> int:
        return self.attention_gpus + self.ffn_gpus

    def to_dict(self) -> dict:
        return asdict(self)

    def format(self) -> str:
        """Human-readable summary (what the CLI prints)."""
        return "\n".join([
            f"model {self.model}: attention on {self.attention_gpu}, experts on {self.ffn_gpu}",
            f"  tp_a={self.tp_a} n_a={self.n_a} | tp_e={self.tp_e} n_e={self.n_e} "
            f"(experts/node={self.experts_per_node}) | m={self.m} b_a={self.micro_batch_size} "
            f"global batch B={self.global_batch}",
            f"  per micro-batch per layer: T_a={self.t_a_ms:.3f} ms T_e={self.t_e_ms:.3f} ms "
            f"T_c={self.t_c_ms:.3f} ms; " + pipeline_summary(self.t_a_ms, self.t_e_ms, self.t_c_ms, self.m),
            f"  TPOT={self.tpot_ms:.1f} ms  throughput={self.tokens_per_s:,.0f} tok/s on {self.total_gpus} GPUs "
            f"({self.attention_gpus} {self.attention_gpu} + {self.ffn_gpus} {self.ffn_gpu}), "
            f"cost {self.cost_per_hour:.2f}/h",
            f"  per GPU {self.tokens_per_s_per_gpu:,.1f} tok/s   "
            f"per cost {self.tokens_per_s_per_cost:,.1f} tok/s per price unit/h",
            f"  cost model: {self.cost_model}",
        ])


def _pow2_upto(n: int, divides: int) -> list[int]:
    out, t = [], 1
    while t <= n:
        if divides % t == 0:
            out.append(t)
        t *= 2
    return out


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _evaluate(perf: PerfModel, lim: SearchLimits, tp_a, tp_e, g, n_a, m, b_a):
    """Times, TPOT and constraint mask for broadcast arrays of plan coordinates."""
    t_a, t_e, t_c = perf.micro_batch_times(tp_a, tp_e, g, n_a, b_a, lim.expert_imbalance)
    t_it = iteration_time(t_a, t_e, t_c, m, perf.model.num_layers)
    return t_a, t_e, t_c, t_it


def search_plans(perf: PerfModel, lim: SearchLimits, top: int = 1) -> list[AfdPlan]:
    """Algorithm 1: the best ``top`` plans under ``lim`` (best first).

    Raises:
        PlanInfeasibleError: nothing meets the SLO / memory / node-size constraints; the message gives the
            smallest achievable TPOT or the memory shortfall and how to fix it.
    """
    model = perf.model
    mem_a = perf.attn.gpu.memory_bytes * lim.mem_fraction
    mem_e = perf.expert.gpu.memory_bytes * lim.mem_fraction
    kv_req = perf.kv_bytes_per_request()
    n_a = np.arange(1, lim.max_attention_nodes + 1)[:, None]          # [Na, 1]
    m = np.arange(1, lim.max_micro_batches + 1)[None, :]              # [1, M]
    cands: list[tuple] = []
    best_tpot, mem_reason, fits = np.inf, [], False
    for tp_e in _pow2_upto(lim.max_gpus_per_node, model.moe_intermediate_size):
        for g in _divisors(model.num_experts):
            if float(perf.expert_weight_bytes(g)) > tp_e * mem_e:
                if g == 1:
                    mem_reason.append(f"one expert's weights need {float(perf.expert_weight_bytes(g)) / 1e9:.1f} GB"
                                      f" > {tp_e}x{perf.expert.gpu.name} ({tp_e * mem_e / 1e9:.1f} GB usable)")
                break  # more experts per node need even more
            n_e = model.num_experts // g
            for tp_a in _pow2_upto(lim.max_gpus_per_node, model.num_heads):
                free_a = tp_a * mem_a - perf.attention_weight_bytes()
                if free_a < kv_req:
                    mem_reason.append(f"attention weights + one request's KV exceed {tp_a}x{perf.attn.gpu.name}")
                    continue
                fits = True
                gpus = n_a * tp_a + n_e * tp_e + 0 * m
                ok_size = gpus <= lim.max_total_gpus
                b_mem = np.floor(free_a / (m * kv_req)).astype(np.int64) + 0 * n_a
                hi = np.minimum(b_mem, lim.max_micro_batch_size)
                lo = np.zeros_like(hi)                                  # largest b meeting the SLO so far
                t_a1, t_e1, t_c1, t1 = _evaluate(perf, lim, tp_a, tp_e, g, n_a, m, np.ones_like(hi))
                t_f1 = np.maximum(t_a1, t_e1)
                pipe_ok = (t_c1 < t_f1) & (m >= min_micro_batches(t_c1, t_f1))
                best_tpot = min(best_tpot, float(np.where(ok_size & pipe_ok, t1, np.inf).min()))
                lo = np.where((t1 <= lim.tpot_slo_s) & (hi >= 1) & ok_size, 1, 0)
                hi = np.where(lo == 1, hi, 0)
                while np.any(hi > lo):
                    mid = (lo + hi + 1) // 2
                    *_, t_mid = _evaluate(perf, lim, tp_a, tp_e, g, n_a, m, np.maximum(mid, 1))
                    good = t_mid <= lim.tpot_slo_s
                    lo = np.where((hi > lo) & good, mid, lo)
                    hi = np.where((hi > lo) & ~good, mid - 1, hi)
                b = lo
                t_a, t_e, t_c, t_it = _evaluate(perf, lim, tp_a, tp_e, g, n_a, m, np.maximum(b, 1))
                t_f = np.maximum(t_a, t_e)
                ok = (b >= 1) & (t_c < t_f) & (m >= min_micro_batches(t_c, t_f))
                tput = np.where(ok, n_a * m * b / t_it, 0.0)
                cost = n_a * tp_a * perf.attn.gpu.price_per_hour + n_e * tp_e * perf.expert.gpu.price_per_hour
                if lim.objective == "per-cost":
                    score = tput / cost
                elif lim.objective == "per-gpu":
                    score = tput / gpus
                else:  # fleet: units that fit x unit throughput (a shared pool when both kinds are equal)
                    score = tput * _fleet_units(perf, lim, n_a * tp_a, n_e * tp_e)
                shape = score.shape
                gpus, cost, b, t_a, t_e, t_c, t_it = (np.broadcast_to(v, shape)
                                                      for v in (gpus, cost, b, t_a, t_e, t_c, t_it))
                for flat in np.argsort(score, axis=None)[::-1][:top]:
                    i, j = np.unravel_index(flat, score.shape)
                    if score[i, j] <= 0:
                        break
                    cands.append((float(score[i, j]), -int(gpus[i, j]), tp_a, int(n_a[i, 0]), tp_e, n_e, g,
                                  int(m[0, j]), int(b[i, j]), float(t_a[i, j]), float(t_e[i, j]),
                                  float(t_c[i, j]), float(t_it[i, j]), float(tput[i, j]), int(gpus[i, j]),
                                  float(cost[i, j])))
    if not cands:
        raise PlanInfeasibleError(_infeasible_message(perf, lim, best_tpot, mem_reason, fits))
    cands.sort(key=lambda c: (c[0], c[1]), reverse=True)
    return [_to_plan(perf, c) for c in cands[:top]]


def _fleet_units(perf: PerfModel, lim: SearchLimits, attn_gpus, ffn_gpus):
    if not lim.fleet_ffn_gpus:  # N GPUs to split between the kinds (one pool when they are equal)
        return lim.fleet_attention_gpus // (attn_gpus + ffn_gpus)
    return np.minimum(lim.fleet_attention_gpus // attn_gpus, lim.fleet_ffn_gpus // ffn_gpus)


def _infeasible_message(perf: PerfModel, lim: SearchLimits, best_tpot: float, mem_reason: list[str],
                        fits: bool) -> str:
    where = f"{perf.model.name} on {perf.attn.gpu.name} attention / {perf.expert.gpu.name} experts"
    if fits and not np.isfinite(best_tpot):
        return (f"no deployment of {where} hides communication: every plan breaks T_c < T_f or needs more than "
                f"--max-micro-batches={lim.max_micro_batches} micro-batches (m >= 2(1+T_c/T_f)), or more than "
                f"--max-total-gpus={lim.max_total_gpus}; raise those limits or use GPUs with faster NICs")
    if not fits:
        why = "; ".join(dict.fromkeys(mem_reason)) or "no tensor-parallel size divides the model"
        return (f"no deployment of {where} fits in memory ({why}); raise --max-gpus-per-node, lower "
                f"--avg-seq-len, or pick GPUs with more memory")
    return (f"no deployment of {where} meets --tpot-slo-ms={lim.tpot_slo_s * 1e3:g}: even one token per "
            f"micro-batch needs TPOT >= {best_tpot * 1e3:.2f} ms with T_c < T_f and m >= 2(1+T_c/T_f); "
            f"raise the SLO above that, or use faster GPUs / larger --max-gpus-per-node")


def _to_plan(perf: PerfModel, c: tuple) -> AfdPlan:
    (_, _, tp_a, n_a, tp_e, n_e, g, m, b, t_a, t_e, t_c, t_it, tput, gpus, cost) = c
    return AfdPlan(
        model=perf.model.name, attention_gpu=perf.attn.gpu.name, ffn_gpu=perf.expert.gpu.name,
        tp_a=tp_a, n_a=n_a, tp_e=tp_e, n_e=n_e, experts_per_node=g, m=m, micro_batch_size=b,
        global_batch=n_a * m * b, t_a_ms=t_a * 1e3, t_e_ms=t_e * 1e3, t_c_ms=t_c * 1e3, tpot_ms=t_it * 1e3,
        tokens_per_s=tput, attention_gpus=n_a * tp_a, ffn_gpus=n_e * tp_e, cost_per_hour=cost,
        tokens_per_s_per_gpu=tput / gpus, tokens_per_s_per_cost=tput / cost,
        cost_model=f"attention {perf.attn.source}, experts {perf.expert.source}, seq_len={perf.seq_len}")


def best_afd_plan(model: MoEModelSpec, attention_gpu: str, ffn_gpu: str, limits: SearchLimits,
                  seq_len: int = 1024, profiles: Sequence[dict] = ()) -> AfdPlan:
    """Build the performance model and return the best plan (see :func:`search_plans`).

    Raises:
        ValueError: unknown GPU kind or bad profile; PlanInfeasibleError: nothing feasible.
    """
    tps = _pow2_upto(limits.max_gpus_per_node, 1 << 20)
    perf = build_perf_model(model, attention_gpu, ffn_gpu, seq_len, tps, profiles)
    return search_plans(perf, limits)[0]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m sglang.srt.afd.planner.plan", description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", required=True, help="HF checkpoint folder or config.json of an MoE model")
    p.add_argument("--attention-gpu", required=True, help=f"GPU kind of attention nodes: {', '.join(gpu_kinds())}")
    p.add_argument("--ffn-gpu", required=True, help="GPU kind of expert (FFN) nodes")
    p.add_argument("--tpot-slo-ms", type=float, required=True, help="time-per-output-token SLO, ms")
    p.add_argument("--max-gpus-per-node", type=int, default=8)
    p.add_argument("--profile", action="append", default=[],
                   help="profile JSON from python -m sglang.srt.afd.planner.profiler (repeat: one per GPU kind)")
    p.add_argument("--avg-seq-len", type=int, default=1024, help="mean context length of decoding requests")
    p.add_argument("--max-total-gpus", type=int, default=4096)
    p.add_argument("--max-attention-nodes", type=int, default=512)
    p.add_argument("--max-micro-batches", type=int, default=16)
    p.add_argument("--max-micro-batch-size", type=int, default=1024)
    p.add_argument("--mem-fraction", type=float, default=0.9)
    p.add_argument("--objective", choices=("per-cost", "per-gpu", "fleet"), default="per-cost",
                   help="per-cost (the paper's), per-gpu, or fleet: most tokens/s on --fleet-gpus")
    p.add_argument("--expert-imbalance", type=float, default=1.0, help="max/mean expert-node load (>= 1)")
    p.add_argument("--dtype-bytes", type=int, default=2)
    p.add_argument("--top", type=int, default=1, help="print the best N plans")
    p.add_argument("--compare-homogeneous", action="store_true",
                   help="also plan attention and experts both on each of the two GPU kinds")
    p.add_argument("--fleet-gpus", type=_fleet_arg, default=(0, 0),
                   help="a fleet: N GPUs (split between the kinds as the plan needs) or A,F (attention,FFN pools); "
                        "the plan is replicated over it")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.add_argument("--log-level", default="warning")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    """CLI entry point; returns the exit status (2 with a one-line error on bad input or no feasible plan)."""
    args = _parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    out = sys.stdout
    try:
        model = MoEModelSpec.from_path(args.model_path, dtype_bytes=args.dtype_bytes)
        limits = SearchLimits(tpot_slo_s=args.tpot_slo_ms / 1e3, max_gpus_per_node=args.max_gpus_per_node,
                              max_total_gpus=args.max_total_gpus, max_attention_nodes=args.max_attention_nodes,
                              max_micro_batches=args.max_micro_batches,
                              max_micro_batch_size=args.max_micro_batch_size, mem_fraction=args.mem_fraction,
                              objective=args.objective, expert_imbalance=args.expert_imbalance,
                              fleet_attention_gpus=args.fleet_gpus[0], fleet_ffn_gpus=args.fleet_gpus[1])
        profiles = [load_profile(p) for p in args.profile]
        tps = _pow2_upto(args.max_gpus_per_node, 1 << 20)
        pairs = [(args.attention_gpu, args.ffn_gpu)]
        if args.compare_homogeneous:
            pairs += [(args.attention_gpu, args.attention_gpu), (args.ffn_gpu, args.ffn_gpu)]
        results = []
        for a_gpu, f_gpu in dict.fromkeys(pairs):
            perf = build_perf_model(model, a_gpu, f_gpu, args.avg_seq_len, tps, profiles)
            try:
                results.append((a_gpu, f_gpu, search_plans(perf, limits, top=args.top), None))
            except PlanInfeasibleError as e:
                if (a_gpu, f_gpu) == pairs[0]:
                    raise
                results.append((a_gpu, f_gpu, [], str(e)))
    except ValueError as e:
        sys.stderr.write(f"error: {e}\n")
        return 2
    if args.json:
        out.write(json.dumps([{"attention_gpu": a, "ffn_gpu": f, "plans": [p.to_dict() for p in ps], "error": err}
                              for a, f, ps, err in results], indent=2) + "\n")
        return 0
    for a_gpu, f_gpu, plans, err in results:
        if err:
            out.write(f"[{a_gpu} attention / {f_gpu} experts] infeasible: {err}\n")
        for k, plan in enumerate(plans):
            out.write((f"#{k + 1} " if args.top > 1 else "") + plan.format() + "\n")
            if args.fleet_gpus[0]:
                fr = simulate_fleet(plan, *_fleet_pools(plan, *args.fleet_gpus))
                total = sum(args.fleet_gpus)
                out.write(f"  fleet of {total} GPUs: {fr.replicas} units, {fr.tokens_per_s:,.0f} tok/s, "
                          f"{fr.idle_gpus} idle, cost {fr.cost_per_hour:,.1f}/h\n")
    if len(results) > 1 and results[0][2]:
        base = results[0][2][0].tokens_per_s_per_cost
        for a_gpu, f_gpu, plans, _ in results[1:]:
            if plans:
                out.write(f"{args.attention_gpu}/{args.ffn_gpu} vs {a_gpu}/{f_gpu} per cost: "
                          f"{base / plans[0].tokens_per_s_per_cost:.2f}x\n")
    return 0


def _fleet_arg(text: str) -> tuple[int, int]:
    try:
        vals = [int(v) for v in text.split(",")]
    except ValueError:
        vals = []
    if len(vals) not in (1, 2) or min(vals) <= 0:
        raise argparse.ArgumentTypeError(f"--fleet-gpus takes N or A,F (positive integers), got {text!r}")
    return (vals[0], vals[1] if len(vals) == 2 else 0)


def _fleet_pools(plan: AfdPlan, total: int, ffn: int = 0) -> tuple[int, Optional[int]]:
    if ffn:
        return total, ffn
    if plan.attention_gpu == plan.ffn_gpu:
        return total, None
    units = total // plan.total_gpus
    rest = total - units * plan.total_gpus
    return units * plan.attention_gpus + rest, units * plan.ffn_gpus


if __name__ == "__main__":
    sys.exit(main())
