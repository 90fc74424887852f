"""MegaScale-Infer's performance model (Zhu et al. 2025, sec. 4.2, eq. 5-8).

Per micro-batch and MoE layer (all times in seconds, vectorized over numpy arrays):

* attention node (``tp_a`` GPUs, ``b_a`` decode tokens):  ``T_a = k1 * b_a + k2``         (eq. 5)
* tokens per expert:  ``b_e = b_a * n_a * K / E``  (uniform routing, eq. 6)
* expert node (``tp_e`` GPUs holding ``g`` experts): ``T_e = k3 * (g * b_e) + g * k4``  (eq. 7;
  ``g = 1`` is the paper's one-expert-per-node layout, ``g > 1`` our extension for fine-grained experts)
* M2N / N2M transfer (one direction):                                               (eq. 8)
  ``T_c = max(b_a*K*h*s / (W_a * Util(.)), g*b_e*h*s / (W_e * Util(.)))`` with ``W = tp * NIC``
  and ``Util(msg)`` the network utilization at the per-peer message size.

``k1..k4`` and ``Util`` come from a measured profile (``profiler.py``) or, without one, from an additive
roofline over the GPU datasheet (``gpu_specs.py``): weight bytes / bandwidth go into the intercepts, KV
bytes and GEMM FLOPs per token into the slopes (no overlap assumed: conservative near the ridge point).

A profile may give the expert side per *node* instead of per expert (``"expert_nodes"``: measured FFN-worker
times at several ``g`` and token counts, e.g. from ``benchmark/afd/bench.py``'s Tf tables); it is fitted to
``T_e = k3 * (g * b_e) + g * k4 + k0`` (our extension: ``k0`` is a per-node, per-layer-and-micro-batch time that
does not shrink with fewer experts, such as launch or host overhead; 0 for the datasheet and per-expert profiles).
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import numpy as np

from sglang.srt.afd.planner.gpu_specs import GpuSpec, get_gpu_spec
from sglang.srt.afd.planner.model_spec import MoEModelSpec

logger = logging.getLogger(__name__)

PROFILE_SCHEMA = "sglang-afd-profile/1"


@dataclass(frozen=True)
class LinearCost:
    """``T(x) = slope * x + intercept``: slope in s/token, intercept in s.

    ``fixed`` (s, expert side only): a per-node time added once per layer and micro-batch whatever the number
    of experts ``g`` on the node (``T_e = g * (slope * b_e + intercept) + fixed``); 0 unless fitted from
    ``expert_nodes`` points (:func:`fit_node_cost`).
    """

    slope: float
    intercept: float
    fixed: float = 0.0

    def __call__(self, tokens):
        return self.slope * np.asarray(tokens, dtype=np.float64) + self.intercept


def fit_linear(xs: Sequence[float], ys: Sequence[float]) -> LinearCost:
    """Least-squares line through measured ``(tokens, seconds)`` points (the paper fits k1..k4 this way).

    Negative coefficients (noise on flat curves) are clamped to 0 and the other one refit.

    Raises:
        ValueError: fewer than two distinct ``xs``.
    """
    x = np.asarray(xs, dtype=np.float64)
    y = np.asarray(ys, dtype=np.float64)
    if x.shape != y.shape or len(np.unique(x)) < 2:
        raise ValueError(f"need >= 2 distinct batch sizes to fit a linear cost, got {list(x)}")
    a = np.stack([x, np.ones_like(x)], axis=1)
    slope, icpt = np.linalg.lstsq(a, y, rcond=None)[0]
    if icpt < 0:
        slope, icpt = float(np.dot(x, y) / np.dot(x, x)), 0.0
    if slope < 0:
        slope, icpt = 0.0, float(y.mean())
    return LinearCost(float(slope), float(icpt))


def fit_node_cost(points: Sequence[Sequence[float]]) -> LinearCost:
    """Non-negative least squares of ``T_e = k3 * (g * b_e) + g * k4 + k0`` through measured expert-node points.

    Args:
        points: ``[g, b_e, seconds]`` rows: ``g`` experts on the node, ``b_e`` tokens per expert (token-expert
            pairs on the node / ``g``), the node's time for one layer and micro-batch (s).

    Returns:
        ``LinearCost(k3, k4, fixed=k0)``, every coefficient >= 0 (the best non-negative fit: each subset of the
        three terms is solved and the lowest-residual non-negative solution kept).

    Raises:
        ValueError: fewer than 2 points, a row not of 3 numbers, or a negative / zero ``g``.
    """
    pts = np.asarray(points, dtype=np.float64)
    if pts.ndim != 2 or pts.shape[1] != 3 or len(pts) < 2:
        raise ValueError(f"expert_nodes points must be >= 2 rows of [g, tokens_per_expert, seconds], got {points!r}")
    g, b_e, y = pts[:, 0], pts[:, 1], pts[:, 2]
    if np.any(g <= 0) or np.any(b_e < 0):
        raise ValueError(f"expert_nodes points need g > 0 and tokens_per_expert >= 0, got {points!r}")
    cols = np.stack([g * b_e, g, np.ones_like(g)], axis=1)
    best, best_res = np.zeros(3), float(np.sum(y * y))
    for mask in range(1, 8):
        idx = [i for i in range(3) if mask >> i & 1]
        coef = np.linalg.lstsq(cols[:, idx], y, rcond=None)[0]
        if np.any(coef < 0):
            continue
        full = np.zeros(3)
        full[idx] = coef
        res = float(np.sum((cols @ full - y) ** 2))
        if res < best_res - 1e-30:
            best, best_res = full, res
    return LinearCost(float(best[0]), float(best[1]), float(best[2]))


@dataclass(frozen=True)
class NetworkUtil:
    """``Util(message bytes)``: achieved / peak bandwidth of one node's NICs.

    Measured: piecewise-linear in log(bytes) through ``points`` ((bytes, util) pairs), clamped at the ends.
    Default: ``peak * s / (s + latency * bw)`` (a latency-bandwidth model; 5 us, 90% peak: our assumption).
    """

    points: tuple[tuple[float, float], ...] = ()
    latency_s: float = 5e-6
    peak: float = 0.9

    def __call__(self, msg_bytes, bw):
        s = np.maximum(np.asarray(msg_bytes, dtype=np.float64), 1.0)
        if self.points:
            xs = np.log([p[0] for p in self.points])
            return np.clip(np.interp(np.log(s), xs, [p[1] for p in self.points]), 1e-4, 1.0)
        return self.peak * s / (s + self.latency_s * np.asarray(bw, dtype=np.float64))


@dataclass(frozen=True)
class SideModel:
    """Cost model of one side (attention or experts) on one GPU kind.

    Attributes:
        gpu: the GPU kind.
        costs: ``(tp, LinearCost)`` pairs; attention: T_a(b_a) = (k1, k2); experts: per expert (k3, k4).
        util: the network utilization function of this side's NICs.
        source: ``"datasheet"`` or ``"profile:<file>"``.
    """

    gpu: GpuSpec
    costs: tuple[tuple[int, LinearCost], ...]
    util: NetworkUtil = field(default_factory=NetworkUtil)
    source: str = "datasheet"

    def cost(self, tp: int) -> LinearCost:
        """The linear cost at tensor-parallel size ``tp``.

        Raises:
            ValueError: ``tp`` was neither measured nor derived.
        """
        for t, c in self.costs:
            if t == tp:
                return c
        raise ValueError(f"no {self.gpu.name} cost for tp={tp} ({self.source}); known tp: {[t for t, _ in self.costs]}")

    @property
    def tps(self) -> tuple[int, ...]:
        return tuple(t for t, _ in self.costs)


def _allreduce_per_token(model: MoEModelSpec, gpu: GpuSpec, tp: int) -> float:
    """Ring all-reduce of one token's hidden state inside a node (s/token)."""
    if tp <= 1:
        return 0.0
    return 2.0 * (tp - 1) / tp * model.hidden_size * model.dtype_bytes / (gpu.intra_node_gbps * 1e9)


def datasheet_attention_cost(model: MoEModelSpec, gpu: GpuSpec, tp: int, seq_len: int) -> LinearCost:
    """(k1, k2) of one attention node of ``tp`` GPUs per MoE layer at mean context ``seq_len`` tokens.

    k1: KV bytes (read once per token; KV heads split over tp, replicated below one head per GPU) / BW
    + (projection + score/value) FLOPs / compute + the TP all-reduce; k2: attention-side weight bytes / BW
    + kernel overhead (+ 10 us all-reduce latency when tp > 1).
    """
    kv_heads_per_gpu = max(model.num_kv_heads / tp, 1.0)
    kv_bytes = 2 * kv_heads_per_gpu * model.head_dim * model.dtype_bytes * seq_len
    flops = (2 * model.attn_params_per_layer + 4 * model.num_heads * model.head_dim * seq_len) / tp
    k1 = kv_bytes / gpu.eff_mem_bw + flops / gpu.eff_flops + _allreduce_per_token(model, gpu, tp)
    k2 = model.attn_params_per_layer * model.dtype_bytes / tp / gpu.eff_mem_bw + gpu.kernel_overhead_us * 1e-6
    k2 += 10e-6 if tp > 1 else 0.0
    return LinearCost(k1, k2)


def datasheet_expert_cost(model: MoEModelSpec, gpu: GpuSpec, tp: int) -> LinearCost:
    """(k3, k4) of one routed expert on a node of ``tp`` GPUs per MoE layer.

    k3: SwiGLU FLOPs per token (6*h*I) / compute + the TP all-reduce; k4: expert weight bytes / BW +
    kernel overhead (+ 10 us all-reduce latency when tp > 1).
    """
    k3 = 2 * model.expert_params / tp / gpu.eff_flops + _allreduce_per_token(model, gpu, tp)
    k4 = model.expert_params * model.dtype_bytes / tp / gpu.eff_mem_bw + gpu.kernel_overhead_us * 1e-6
    k4 += 10e-6 if tp > 1 else 0.0
    return LinearCost(k3, k4)


def load_profile(path: str) -> dict[str, Any]:
    """Read and validate a profile JSON written by ``python -m sglang.srt.afd.planner.profiler``.

    Raises:
        ValueError: unreadable file, wrong schema, or no attention/expert points.
    """
    try:
        with open(path) as f:
            prof = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"--profile {path!r}: cannot read ({e})") from None
    if prof.get("schema") != PROFILE_SCHEMA:
        raise ValueError(f"--profile {path!r}: schema {prof.get('schema')!r} is not {PROFILE_SCHEMA!r}; "
                         "write it with python -m sglang.srt.afd.planner.profiler")
    if not prof.get("attention") and not prof.get("expert") and not prof.get("expert_nodes"):
        raise ValueError(f"--profile {path!r} holds neither attention nor expert (or expert_nodes) points")
    prof["_path"] = path
    return prof


def _check_profile_model(prof: dict[str, Any], model: MoEModelSpec) -> None:
    pm = prof.get("model") or {}
    for key in ("hidden_size", "num_heads", "num_kv_heads", "head_dim", "moe_intermediate_size"):
        if key in pm and int(pm[key]) != int(getattr(model, key)):
            raise ValueError(f"--profile {prof['_path']!r} was measured for {key}={pm[key]}, but the model has "
                             f"{key}={getattr(model, key)}; profile the same model (--model-path)")


def _costs_from_points(points: dict[str, list], tps: Sequence[int]) -> list[tuple[int, LinearCost]]:
    """Fit measured tps; derive unmeasured ones from the nearest measured tp, scaled by tp_meas / tp."""
    fitted = {int(t): fit_linear([p[0] for p in pts], [p[1] for p in pts]) for t, pts in points.items()}
    out = []
    for tp in tps:
        if tp in fitted:
            out.append((tp, fitted[tp]))
            continue
        near = min(fitted, key=lambda t: abs(math.log(t / tp)))
        c = fitted[near]
        out.append((tp, LinearCost(c.slope * near / tp, c.intercept * near / tp)))
    return out


def _node_costs_from_points(points: dict[str, list], tps: Sequence[int]) -> list[tuple[int, LinearCost]]:
    """:func:`fit_node_cost` per measured tp; unmeasured tps scale k3, k4 by tp_meas / tp from the nearest measured
    tp and keep k0 (a per-node overhead, not a per-GPU share of the work)."""
    fitted = {int(t): fit_node_cost(pts) for t, pts in points.items()}
    out = []
    for tp in tps:
        near = min(fitted, key=lambda t: abs(math.log(t / tp)))
        c = fitted[near]
        out.append((tp, c if near == tp else LinearCost(c.slope * near / tp, c.intercept * near / tp, c.fixed)))
    return out


def _util_from_profile(prof: dict[str, Any]) -> Optional[NetworkUtil]:
    net = prof.get("network") or {}
    pts = net.get("points") or []
    if not pts:
        return None
    bw = float(net["bandwidth_gbps"]) * 1e9
    return NetworkUtil(points=tuple(sorted((float(b), min(1.0, float(b) / (float(t) * bw))) for b, t in pts)))


def build_side(model: MoEModelSpec, gpu: GpuSpec, role: str, tps: Sequence[int], seq_len: int,
               profile: Optional[dict[str, Any]] = None) -> SideModel:
    """The attention (``role="attention"``) or expert (``role="expert"``) side on ``gpu``.

    A profile measured on this GPU kind replaces the datasheet coefficients (and Util if it has network
    points); otherwise the datasheet roofline is used. For the expert side, ``expert_nodes`` points (per node,
    :func:`fit_node_cost`) take precedence over per-expert ``expert`` points.

    Raises:
        ValueError: bad role, or a profile for another model.
    """
    if role not in ("attention", "expert"):
        raise ValueError(f"role must be 'attention' or 'expert', got {role!r}")
    if role == "expert" and profile is not None and profile.get("expert_nodes"):
        _check_profile_model(profile, model)
        util = _util_from_profile(profile) or NetworkUtil()
        return SideModel(gpu, tuple(_node_costs_from_points(profile["expert_nodes"], tps)), util,
                         f"profile:{profile['_path']}")
    if profile is not None and profile.get(role):
        _check_profile_model(profile, model)
        if role == "attention" and int(profile.get("seq_len", seq_len)) != seq_len:
            logger.warning("profile %s measured attention at seq_len=%s; planning at %s uses the profile's k1",
                           profile["_path"], profile.get("seq_len"), seq_len)
        util = _util_from_profile(profile) or NetworkUtil()
        return SideModel(gpu, tuple(_costs_from_points(profile[role], tps)), util, f"profile:{profile['_path']}")
    if role == "attention":
        costs = tuple((tp, datasheet_attention_cost(model, gpu, tp, seq_len)) for tp in tps)
    else:
        costs = tuple((tp, datasheet_expert_cost(model, gpu, tp)) for tp in tps)
    util = (_util_from_profile(profile) if profile else None) or NetworkUtil()
    return SideModel(gpu, costs, util, "datasheet")


@dataclass(frozen=True)
class PerfModel:
    """The whole model: MoE dims, both sides, and the mean decode context length.

    Attributes:
        model: MoE dimensions.
        attn: attention side (GPU kind, (k1, k2) per tp_a, Util).
        expert: expert side (GPU kind, (k3, k4) per tp_e, Util).
        seq_len: mean context length of decoding requests (tokens), sizes the KV cache.
    """

    model: MoEModelSpec
    attn: SideModel
    expert: SideModel
    seq_len: int

    def micro_batch_times(self, tp_a, tp_e, g, n_a, b_a, imbalance=1.0):
        """``(T_a, T_e, T_c)`` in seconds for one micro-batch in one MoE layer (eq. 5-8), vectorized.

        Args:
            tp_a, tp_e, g, n_a, b_a: broadcastable integer arrays (tp sizes must be in the sides' tps;
                ``g`` experts per expert node; ``n_a`` attention nodes; ``b_a`` tokens per micro-batch
                per attention node).
            imbalance: max/mean tokens over expert nodes (1.0 = uniform routing; see ``load_balance``).
        """
        m = self.model
        tp_a, tp_e, g, n_a, b_a = np.broadcast_arrays(*(np.asarray(v) for v in (tp_a, tp_e, g, n_a, b_a)))
        k1, k2, _ = self._coef(self.attn, tp_a)
        k3, k4, k0 = self._coef(self.expert, tp_e)
        b_a = b_a.astype(np.float64)
        b_e = b_a * n_a * m.top_k / m.num_experts * imbalance
        t_a = k1 * b_a + k2
        t_e = k3 * g * b_e + g * k4 + k0
        tok_bytes = m.hidden_size * m.dtype_bytes
        n_e = m.num_experts // g
        w_a = tp_a * self.attn.gpu.nic_gbps * 1e9
        w_e = tp_e * self.expert.gpu.nic_gbps * 1e9
        send_a = b_a * m.top_k * tok_bytes
        recv_e = g * b_e * tok_bytes
        t_c = np.maximum(send_a / (w_a * self.attn.util(send_a / n_e, w_a)),
                         recv_e / (w_e * self.expert.util(recv_e / n_a, w_e)))
        return t_a, t_e, t_c

    @staticmethod
    def _coef(side: SideModel, tp):
        tps = np.array(side.tps)
        slopes = np.array([c.slope for _, c in side.costs])
        icpts = np.array([c.intercept for _, c in side.costs])
        fixed = np.array([c.fixed for _, c in side.costs])
        idx = np.searchsorted(tps, tp)
        if np.any(idx >= len(tps)) or np.any(tps[np.minimum(idx, len(tps) - 1)] != tp):
            raise ValueError(f"tp values {np.unique(tp)} not all in the {side.gpu.name} model's tps {list(tps)}")
        return slopes[idx], icpts[idx], fixed[idx]

    # ---- memory (bytes) -------------------------------------------------------------------------
    def attention_weight_bytes(self) -> float:
        """Attention-side weights of the whole model (all layers + embeddings), bytes."""
        m = self.model
        return (m.attn_params_per_layer * m.num_layers + m.embedding_params) * m.dtype_bytes

    def kv_bytes_per_request(self) -> float:
        """KV cache of one request at ``seq_len`` tokens over all layers, bytes."""
        return self.model.kv_bytes_per_token_layer * self.model.num_layers * self.seq_len

    def expert_weight_bytes(self, g) -> np.ndarray:
        """Weights of ``g`` experts over all MoE layers, bytes."""
        m = self.model
        return np.asarray(g) * m.expert_params * m.num_moe_layers * m.dtype_bytes


def build_perf_model(model: MoEModelSpec, attention_gpu: str, ffn_gpu: str, seq_len: int,
                     tps: Sequence[int] = (1, 2, 4, 8), profiles: Sequence[dict[str, Any]] = ()) -> PerfModel:
    """A :class:`PerfModel` for ``attention_gpu`` attention nodes and ``ffn_gpu`` expert nodes.

    Each profile applies to the GPU kind it names (its ``"gpu"`` field); kinds without one use the datasheet.

    Raises:
        ValueError: unknown GPU kind, bad ``seq_len``, or a profile for another model.
    """
    if seq_len <= 0:
        raise ValueError(f"--avg-seq-len={seq_len} must be positive")
    by_gpu: dict[str, dict[str, Any]] = {}
    for prof in profiles:
        by_gpu[get_gpu_spec(prof.get("gpu", "")).name] = prof
    a_gpu, e_gpu = get_gpu_spec(attention_gpu), get_gpu_spec(ffn_gpu)
    attn = build_side(model, a_gpu, "attention", tps, seq_len, by_gpu.get(a_gpu.name))
    expert = build_side(model, e_gpu, "expert", tps, seq_len, by_gpu.get(e_gpu.name))
    logger.info("AFD perf model: attention on %s (%s), experts on %s (%s), seq_len=%d",
                a_gpu.name, attn.source, e_gpu.name, expert.source, seq_len)
    return PerfModel(model, attn, expert, seq_len)
