"""Wave-aware token splitting (TokenWeave, Gond et al. 2025, sec. 3.1.1 "smart splitting").

A GEMM over ``T`` tokens launches ``ceil(T / tile_m) * ceil(N / tile_n)`` thread blocks (CTAs), which
run in ``waves = ceil(CTAs / num_sms)`` waves. Cutting the batch in two halves naively can add a
wave to each half (two partly empty tails instead of one), so the two splits together take longer
than the unsplit GEMM and the overlap gains are eaten. The planner picks the cut ``T1`` (prefix split)
and ``T2 = T - T1`` (suffix split) that

1. stays within ``max_skew * T`` tokens of the half (:data:`DEFAULT_MAX_SKEW`), then
2. minimizes the extra waves ``sum_g waves_g(T1) + waves_g(T2) - waves_g(T)`` over the layer's GEMMs g
   (ideally 0: the splits together do no more GEMM work than the unsplit batch), then
3. balances the halves (``|T1 - T/2|`` smallest), preferring cuts on tile boundaries and, at equal balance, the
   larger prefix.

Why balance comes first (4 x H200 TP4, Llama-3.3-70B, ``benchmark/tokenweave/overlap_timeline.py`` over the
profiled forward at T=4096): with the GEMMs capped to 116 SMs the unbounded wave search cut 4096 tokens 384 + 3712
(0 extra waves; the half cut has 1). The suffix split's AllReduce (500-660 us) then had only the 384-token prefix's
compute (~100 us attention, ~340 us MLP) to hide behind, so the compute stream stood still ~0.8 ms per layer waiting
for it; one extra wave of the layer's GEMMs costs ~40 us. Why the larger prefix: the tightest overlap window of a
layer is the suffix's post-MLP AllReduce behind the prefix's next attention, and in a causal prefill the prefix's
attention is the lighter one. ``max_skew=None`` is the unbounded search with ties to the smaller prefix (the
behaviour before that measurement, kept for A/B benchmarks).

Pure Python: no torch, no device. Per-model defaults come from the model's shapes
(:func:`layer_gemm_widths`), not from a hand-written table per model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

DEFAULT_TILE_M = 128
DEFAULT_TILE_N = 128
DEFAULT_NUM_SMS = 132  # H100 / H200 SXM
DEFAULT_MAX_SKEW = 0.125  # the cut stays in [3/8, 5/8] of the batch


@dataclass(frozen=True)
class GemmShape:
    """The wave model of a device's GEMMs: tile height ``tile_m`` (tokens), tile width ``tile_n`` (output
    columns), ``num_sms`` CTAs per wave (one CTA per SM). Raises ValueError for non-positive values."""

    tile_m: int = DEFAULT_TILE_M
    tile_n: int = DEFAULT_TILE_N
    num_sms: int = DEFAULT_NUM_SMS

    def __post_init__(self) -> None:
        if min(self.tile_m, self.tile_n, self.num_sms) <= 0:
            raise ValueError(f"GemmShape: tile_m={self.tile_m}, tile_n={self.tile_n}, num_sms={self.num_sms} "
                             "must be positive")

    def waves(self, tokens: int, width: int, num_sms: Optional[int] = None) -> int:
        """Waves of a ``[tokens, K] x [K, width]`` GEMM (0 for no tokens) on ``num_sms`` SMs (None: ``self.num_sms``;
        a GEMM run outside the SM carveout has more SMs than a capped one)."""
        if tokens <= 0:
            return 0
        ctas = -(-tokens // self.tile_m) * -(-width // self.tile_n)
        return -(-ctas // (self.num_sms if num_sms is None else num_sms))


@dataclass(frozen=True)
class SplitPlan:
    """A cut: ``prefix`` tokens then ``suffix`` tokens; ``extra_waves`` over the unsplit batch (>= 0 is the
    cost the overlap must hide; 0 is the paper's goal); ``unsplit_waves`` for logging."""

    tokens: int
    prefix: int
    suffix: int
    extra_waves: int
    unsplit_waves: int


def layer_gemm_widths(hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, intermediate_size: int,
                      tp_size: int = 1) -> tuple[int, ...]:
    """Output widths of one decoder layer's GEMMs on one TP rank: QKV, O, gate+up, down (MoE layers: pass
    the per-expert intermediate times top-k as a dense approximation).

    Raises:
        ValueError: a non-positive size.
    """
    if min(hidden_size, num_heads, num_kv_heads, head_dim, intermediate_size, tp_size) <= 0:
        raise ValueError("layer_gemm_widths: every size must be positive")
    qkv = (num_heads + 2 * num_kv_heads) * head_dim // tp_size
    return (max(qkv, 1), hidden_size, max(2 * intermediate_size // tp_size, 1), hidden_size)


def total_waves(shape: GemmShape, tokens: int, widths: Sequence[int], sms: Optional[Sequence[int]] = None) -> int:
    """Sum of the waves of every GEMM in ``widths`` at ``tokens`` tokens (``sms``: each GEMM's SM count, None:
    ``shape.num_sms`` for all)."""
    if sms is None:
        return sum(shape.waves(tokens, w) for w in widths)
    return sum(shape.waves(tokens, w, n) for w, n in zip(widths, sms))


def plan_split(tokens: int, widths: Sequence[int], shape: GemmShape = GemmShape(),
               max_skew: Optional[float] = DEFAULT_MAX_SKEW, sms: Optional[Sequence[int]] = None) -> SplitPlan:
    """The best cut of a ``tokens``-token batch (see the module docstring).

    Candidates are every tile boundary and the exact half (and their neighbours), those farther than
    ``floor(max_skew * tokens)`` tokens from ``tokens / 2`` dropped (the exact half always stays): wave counts only
    change at tile boundaries, so no other cut can have fewer extra waves with a better balance than these.
    ``max_skew=None``: no bound, ties to the smaller prefix (the legacy planner). ``sms``: per GEMM of ``widths``
    the SMs it runs on (TokenWeave's selective carveout caps only the GEMMs beside a comm; None: ``shape.num_sms``).

    Raises:
        ValueError: ``tokens < 2`` (nothing to split), no GEMM widths, ``max_skew`` outside ``[0, 0.5]``, or ``sms``
            not one positive count per width.
    """
    if sms is not None and (len(sms) != len(widths) or min(sms, default=1) <= 0):
        raise ValueError(f"plan_split: sms={tuple(sms)} must give one positive SM count per GEMM width "
                         f"({len(widths)} widths)")
    if tokens < 2:
        raise ValueError(f"plan_split: {tokens} tokens cannot be split in two non-empty parts")
    if not widths:
        raise ValueError("plan_split: no GEMM widths given")
    if max_skew is not None and not 0.0 <= max_skew <= 0.5:
        raise ValueError(f"plan_split: max_skew={max_skew} must be in [0, 0.5] (fraction of the batch the cut may "
                         "be from its half; None: unbounded)")
    whole = total_waves(shape, tokens, widths, sms)
    window = tokens if max_skew is None else int(max_skew * tokens)
    cands = set(range(shape.tile_m, tokens, shape.tile_m)) | {tokens // 2}
    cands |= {c - 1 for c in list(cands) if c > 1} | {c + 1 for c in list(cands) if c + 1 < tokens}
    best = None
    for t1 in sorted(cands):
        skew = abs(2 * t1 - tokens)
        if not 1 <= t1 <= tokens - 1 or (skew > 2 * window and t1 != tokens // 2):
            continue
        extra = total_waves(shape, t1, widths, sms) + total_waves(shape, tokens - t1, widths, sms) - whole
        key = (extra, skew, t1 % shape.tile_m != 0, t1 if max_skew is None else -t1)
        if best is None or key < best[0]:
            best = (key, t1, extra)
    _, t1, extra = best
    return SplitPlan(tokens, t1, tokens - t1, extra, whole)
