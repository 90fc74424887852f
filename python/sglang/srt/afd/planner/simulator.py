"""Ping-pong pipeline timing (MegaScale-Infer sec. 4.1-4.2, eq. 1-4) and a fleet simulator.

Within one MoE layer a micro-batch runs attention (``T_a``), is dispatched to the experts (``T_c``),
runs the experts (``T_e``) and is combined back (``T_c``).  With ``T_f = max(T_a, T_e)`` the paper's
pipeline constraints are

* eq. 1  ``T_a ~= T_e``            (balanced; the planner's objective takes care of it)
* eq. 2  ``T_c < T_f``             (communication hidden behind compute)
* eq. 3  ``m * T_f >= 2 * (T_f + T_c)``, i.e. ``m >= 2 * (1 + T_c / T_f)``: so ``m >= 3`` whenever
  ``0 < T_c <= T_f / 2`` (and never fewer than 3 once there is any communication),

and a decode iteration over ``L`` layers takes (eq. 4)
``T_iter = T_a + T_e + 2 T_c + T_f (m L - 1)``.  Below the eq. 3 bound the pipeline has bubbles; we then
use ``(L - 1) max(m T_f, C) + C + (m - 1) T_f`` with ``C = T_a + T_e + 2 T_c`` (one micro-batch's round
trip), which equals eq. 4 when eq. 3 holds.  :func:`simulate_pipeline` replays the schedule event by
event (vectorized over plans) and is what the closed forms are tested against.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import numpy as np


def min_micro_batches(t_c, t_f) -> np.ndarray:
    """Smallest integer ``m`` with ``m * T_f >= 2 (T_f + T_c)`` (eq. 3); vectorized, >= 2."""
    t_c = np.asarray(t_c, dtype=np.float64)
    t_f = np.asarray(t_f, dtype=np.float64)
    return np.maximum(np.ceil(2.0 * (1.0 + t_c / t_f) - 1e-9), 2).astype(np.int64)


def iteration_time(t_a, t_e, t_c, m, num_layers):
    """Seconds of one decode iteration (every request gains one token): eq. 4, with bubbles below eq. 3.

    All arguments broadcast; ``t_*`` in seconds per micro-batch per layer.
    """
    t_a, t_e, t_c, m = (np.asarray(v, dtype=np.float64) for v in (t_a, t_e, t_c, m))
    t_f = np.maximum(t_a, t_e)
    cycle = t_a + t_e + 2.0 * t_c
    return (num_layers - 1) * np.maximum(m * t_f, cycle) + cycle + (m - 1.0) * t_f


def simulate_pipeline(t_a, t_e, t_c, m: int, num_layers: int) -> np.ndarray:
    """Event-level replay of the ping-pong schedule; returns the iteration time (vectorized over plans).

    Attention serves (layer, micro-batch) in order (l, 0..m-1), (l+1, 0..m-1), ...; so do the experts.
    ``A[l,i] = max(A[l,i-1], E[l-1,i] + T_c) + T_a`` and ``E[l,i] = max(E[l,i-1], A[l,i] + T_c) + T_e``;
    the iteration ends when the last micro-batch's output is back: ``E[L-1,m-1] + T_c``.
    """
    t_a, t_e, t_c = np.broadcast_arrays(*(np.asarray(v, dtype=np.float64) for v in (t_a, t_e, t_c)))
    a_free = np.zeros_like(t_a)
    e_free = np.zeros_like(t_a)
    back = [np.zeros_like(t_a) for _ in range(m)]  # when micro-batch i's previous-layer output is back
    for _layer in range(num_layers):
        for i in range(m):
            a_free = np.maximum(a_free, back[i]) + t_a
            e_free = np.maximum(e_free, a_free + t_c) + t_e
            back[i] = e_free + t_c
    return back[m - 1]


@dataclass(frozen=True)
class FleetResult:
    """A deployment unit replicated over a fleet.

    Attributes:
        replicas: copies of the unit that fit.
        attention_gpus_used / ffn_gpus_used: GPUs they occupy.
        idle_gpus: fleet GPUs left over.
        tokens_per_s: decode throughput of the fleet.
        cost_per_hour: price of the used GPUs.
        tokens_per_s_per_gpu_fleet: throughput over *all* fleet GPUs (idle ones included).
    """

    replicas: int
    attention_gpus_used: int
    ffn_gpus_used: int
    idle_gpus: int
    tokens_per_s: float
    cost_per_hour: float
    tokens_per_s_per_gpu_fleet: float


def simulate_fleet(plan, attention_gpus: int, ffn_gpus: Optional[int] = None) -> FleetResult:
    """Replicate ``plan`` (a :class:`~sglang.srt.afd.planner.plan.AfdPlan`) over a fleet.

    Args:
        plan: the deployment unit.
        attention_gpus: GPUs of the attention kind; with ``ffn_gpus=None`` a homogeneous pool shared by
            both roles (requires both roles on the same GPU kind).
        ffn_gpus: GPUs of the FFN kind (heterogeneous fleet).

    Raises:
        ValueError: a shared pool for a heterogeneous plan, or negative sizes.
    """
    if attention_gpus < 0 or (ffn_gpus is not None and ffn_gpus < 0):
        raise ValueError(f"fleet sizes must be >= 0, got attention={attention_gpus} ffn={ffn_gpus}")
    ua, ue = plan.attention_gpus, plan.ffn_gpus
    if ffn_gpus is None:
        if plan.attention_gpu != plan.ffn_gpu:
            raise ValueError(f"plan uses {plan.attention_gpu} attention and {plan.ffn_gpu} experts; "
                             "give the FFN pool size too (ffn_gpus=...)")
        replicas = attention_gpus // (ua + ue)
        total = attention_gpus
    else:
        replicas = min(attention_gpus // ua, ffn_gpus // ue)
        total = attention_gpus + ffn_gpus
    used = replicas * (ua + ue)
    tput = replicas * plan.tokens_per_s
    return FleetResult(replicas, replicas * ua, replicas * ue, total - used, tput,
                       replicas * plan.cost_per_hour, tput / total if total else 0.0)


def fleet_split(total_gpus: int, plan) -> tuple[int, int]:
    """How to split a budget of ``total_gpus`` new GPUs between the plan's two kinds (whole units)."""
    replicas = total_gpus // (plan.attention_gpus + plan.ffn_gpus)
    return replicas * plan.attention_gpus, replicas * plan.ffn_gpus


def pipeline_summary(t_a: float, t_e: float, t_c: float, m: int) -> str:
    """One log line: the eq. 3 bound and whether ``m`` meets it."""
    t_f = max(t_a, t_e)
    need = 2.0 * (1.0 + t_c / t_f) if t_f > 0 else math.inf
    state = "ok" if m >= need - 1e-9 else "BUBBLES"
    return f"m={m} vs 2(1+Tc/Tf)={need:.2f} ({state}); Tc/Tf={t_c / t_f:.2f}"
