"""Which GEMMs of a TokenWeave split forward run while the other split's AllReduce is in flight.

TokenWeave (Gond et al. 2025, sec. 3.2) caps the GEMMs to ``num_sms - carveout`` SMs so the fused AllReduce +
RMSNorm kernel of the other split finds free SMs (:mod:`.carveout`). A GEMM that runs with no communication kernel
beside it pays the cap for nothing (profiled at 4K tokens on 4 x H200: GEMM sum 10.3 ms capped vs 9.4 ms uncapped
per 4-layer forward; each half's down projection ran with no comm in flight). This module derives, from the
executor's schedule alone, which GEMMs overlap a communication stage, so the executor can cap only those
(``TokenWeaveConfig.carveout_scope="overlap"``).

The schedule (:class:`~sglang.srt.model_executor.executors.split.SubBatchExecutor`): per layer, stage by stage,
split by split, e.g. for a dense layer and splits A, B::

    input_norm(A) input_norm(B) attention(A) attention(B) post_attention_norm(A) post_attention_norm(B) mlp(A) mlp(B)

Norm stages (after the first layer's input norm, which has no residual yet) run on the communication stream, the
others on the compute stream, each waiting only for its own split's previous stage; each stream runs in issue
order. A communication stage ``c`` of split ``s`` becomes ready when ``s``'s previous (compute) stage ``p`` ends, so
it runs beside the compute items issued after ``p`` up to the first one that must wait for ``c`` -- the next compute
stage of ``s``, or of any split whose communication is queued behind ``c`` on the communication stream. That list
of compute items is ``c``'s *window*. Dense steady state: norm(B) beside attention(A), post-attention norm(A) beside
attention(B), post-attention norm(B) beside mlp(A), next input norm(A) beside mlp(B). MoE layers (route, dispatch,
experts, combine are separate stages) get short windows: post-attention norm(B) only has moe_route(A) beside it.

Inside a window the communication kernel starts together with the window's first GEMM; how far it reaches depends
on durations this module does not model. ``head`` (default 1) is how many leading GEMMs of each window count as
overlapped: the profile above (4K tokens, balanced halves) had each half's AllReduce (190-330 us) end before the
attention stage's output projection (after QKV ~160 us plus the attention kernel) and during the MLP's gate/up
projection (~600 us), so the output and down projections run alone. ``head=None``: every GEMM of every window.

GEMMs per stage come from :data:`STAGE_GEMMS` (the stage contract of :mod:`sglang.srt.layers.stages`, keyed by
stage, not by model): submodule paths inside a decoder layer, in call order; paths a layer lacks are skipped.
Pure Python over stage names: no tensors, no device.
"""

from __future__ import annotations

from typing import Optional, Sequence

from sglang.srt.layers.stages import NORM_STAGES

# cuBLAS GEMMs (LinearBase modules) each compute stage calls, in call order, as paths inside a decoder layer. The
# fused-MoE experts are Triton kernels (the carveout does not apply) and dispatch is communication-free locally.
STAGE_GEMMS: dict[str, tuple[str, ...]] = {
    "attention": ("self_attn.qkv_proj", "self_attn.o_proj"),
    "mlp": ("mlp.gate_up_proj", "mlp.down_proj"),
    "moe_route": ("mlp.gate",),
    "moe_dispatch": (),
    "moe_experts": (),
    "moe_combine": ("mlp.shared_expert_gate", "mlp.shared_expert.gate_up_proj", "mlp.shared_expert.down_proj"),
}

# the planner's GEMM widths (planner.layer_gemm_widths: QKV, O, gate+up, down) as (stage, GEMM) of a dense layer
WIDTH_GEMMS: tuple[tuple[str, str], ...] = (("attention", "self_attn.qkv_proj"), ("attention", "self_attn.o_proj"),
                                            ("mlp", "mlp.gate_up_proj"), ("mlp", "mlp.down_proj"))

Item = tuple[int, str, int]  # (layer, stage, split) in issue order


def forward_schedule(layer_stages: Sequence[Sequence[str]], num_splits: int = 2) -> list[Item]:
    """The split forward's issue order: ``(layer, stage, split)`` per layer, stage by stage, split by split.

    Raises:
        ValueError: no layers, or ``num_splits < 1``.
    """
    if not layer_stages or num_splits < 1:
        raise ValueError(f"forward_schedule: need layers and num_splits >= 1 (got {len(layer_stages)} layers, "
                         f"num_splits={num_splits})")
    return [(i, stage, s) for i, stages in enumerate(layer_stages) for stage in stages for s in range(num_splits)]


def _is_comm(item: Item) -> bool:
    """A communication-stream stage: a norm stage, except the first layer's input norm (no residual yet)."""
    layer, stage, _ = item
    return stage in NORM_STAGES and not (layer == 0 and stage == "input_norm")


def comm_windows(schedule: Sequence[Item]) -> list[tuple[Item, list[Item]]]:
    """Per communication stage of ``schedule`` (:func:`forward_schedule`), its window: the compute items that run
    beside it (see the module docstring), in issue order."""
    compute = [it for it in schedule if not _is_comm(it)]
    comms = [it for it in schedule if _is_comm(it)]
    pos = {it: k for k, it in enumerate(schedule)}
    out = []
    for ci, c in enumerate(comms):
        split = c[2]
        prev = [it for it in schedule[:pos[c]] if it[2] == split]
        if not prev or _is_comm(prev[-1]):
            out.append((c, []))  # ready after another comm stage of its split: nothing known to run beside it
            continue
        # splits whose comm is c or queued behind c: their next compute stage after that comm must wait
        blocked_after = {}
        for later in comms[ci:]:
            blocked_after.setdefault(later[2], pos[later])
        window = []
        for it in compute:
            if pos[it] <= pos[prev[-1]]:
                continue
            if it[2] in blocked_after and pos[it] > blocked_after[it[2]]:
                break
            window.append(it)
        out.append((c, window))
    return out


def overlapped_gemms(schedule: Sequence[Item], stage_gemms: Optional[dict[str, Sequence[str]]] = None,
                     head: Optional[int] = 1) -> frozenset[tuple[int, int, str, str]]:
    """``(layer, split, stage, gemm)`` of every GEMM that runs beside a communication stage: the first ``head``
    GEMMs of each window (:func:`comm_windows`; ``head=None``: all of them). ``stage_gemms``: GEMM paths per stage
    (:data:`STAGE_GEMMS`).

    Raises:
        ValueError: ``head < 1``.
    """
    if head is not None and head < 1:
        raise ValueError(f"overlapped_gemms: head={head} must be >= 1 (or None: every GEMM of a window)")
    gemms_of = STAGE_GEMMS if stage_gemms is None else stage_gemms
    out = set()
    for _, window in comm_windows(schedule):
        gemms = [(layer, split, stage, g) for layer, stage, split in window for g in gemms_of.get(stage, ())]
        out.update(gemms if head is None else gemms[:head])
    return frozenset(out)


def layer_overlap(stages: Sequence[str], stage_gemms: Optional[dict[str, Sequence[str]]] = None,
                  head: Optional[int] = 1, num_splits: int = 2) -> frozenset[tuple[int, str, str]]:
    """The steady-state answer for one layer: ``(split, stage, gemm)`` overlapped in a layer with stages
    ``stages`` that has identical layers before and after it (the middle one of three; a model's first layer,
    whose input norm is no communication, has its first split's first GEMM capped needlessly).

    Example (dense, 2 splits, head 1): ``{(0, "attention", "self_attn.qkv_proj"), (1, "attention",
    "self_attn.qkv_proj"), (0, "mlp", "mlp.gate_up_proj"), (1, "mlp", "mlp.gate_up_proj")}``."""
    sched = forward_schedule([stages] * 3, num_splits)
    return frozenset((s, st, g) for layer, s, st, g in overlapped_gemms(sched, stage_gemms, head) if layer == 1)


def width_sms(overlap: frozenset[tuple[int, str, str]], num_sms: int, carveout: int) -> tuple[int, ...]:
    """SMs per planner GEMM width (:data:`WIDTH_GEMMS` order): ``num_sms - carveout`` for a GEMM capped in some
    split of ``overlap`` (:func:`layer_overlap` of a dense layer), ``num_sms`` for one that always runs at full
    width (the planner's wave model, TokenWeave sec. 3.1.1, per GEMM)."""
    capped = {(st, g) for _, st, g in overlap}
    return tuple(num_sms - carveout if sg in capped else num_sms for sg in WIDTH_GEMMS)
