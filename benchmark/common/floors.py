"""Pure helpers of ``benchmark/serving/bench_gpu_targets.py``: parameter statistics, floor formulas, FLOP counting, the ratio table,
and parsing of the attention/serving benchmarks' outputs. No torch import and no device work here."""

from __future__ import annotations

import dataclasses
from typing import Iterable, Optional

__all__ = [
    "ParamStats", "param_stats", "model_param_stats", "kv_bytes", "mean_decode_context", "memory_floor_s",
    "copy_bandwidth", "matmul_flops", "attention_flops", "prefill_flops", "TargetRow", "format_table", "si",
    "parse_attention_rows", "SERVING_KEYS", "summarize_serving",
]

@dataclasses.dataclass(frozen=True)
class ParamStats:
    """Parameter counts/bytes of a causal LM (from ``named_parameters()``, shared tensors counted once)."""

    total_bytes: int
    embed_bytes: int
    layer_matmul_params: int  # >= 2-D parameters outside the embedding and the LM head
    lm_head_params: int  # the LM head's (the embedding's when tied)
    tied: bool

    @property
    def decode_weight_bytes(self) -> int:
        """Weight bytes a decode step reads: all but the embedding table (only B rows gathered) unless tied."""
        return self.total_bytes - (0 if self.tied else self.embed_bytes)


def param_stats(params: Iterable[tuple[str, tuple[int, ...], int]]) -> ParamStats:
    """``params``: (name, shape, itemsize in bytes) per parameter. Raises ValueError without an embedding."""
    total = embed_bytes = embed_n = layer = head = 0
    has_head = False
    for name, shape, itemsize in params:
        n = 1
        for s in shape:
            n *= int(s)
        total += n * itemsize
        if "embed_tokens" in name:
            embed_bytes += n * itemsize
            embed_n += n
        elif "lm_head" in name:
            head += n
            has_head = True
        elif len(shape) >= 2:
            layer += n
    if embed_n == 0:
        raise ValueError("no 'embed_tokens' parameter found: param_stats expects a Llama-style causal LM")
    return ParamStats(total, embed_bytes, layer, head if has_head else embed_n, not has_head)


def model_param_stats(model) -> ParamStats:
    """:func:`param_stats` of a torch module."""
    return param_stats((n, tuple(p.shape), p.element_size()) for n, p in model.named_parameters())


def kv_bytes(tokens: float, layers: int, kv_heads: int, head_dim: int, itemsize: int) -> float:
    """Bytes of K and V for ``tokens`` cached tokens over all layers."""
    return tokens * 2 * layers * kv_heads * head_dim * itemsize


def mean_decode_context(context: int, steps: int) -> float:
    """Mean tokens attended per request over ``steps`` decode steps after a ``context``-token prefill
    (step j attends context + j + 1 tokens)."""
    return context + 1 + (steps - 1) / 2


def memory_floor_s(weight_bytes: float, kv_read_bytes: float, bandwidth: float) -> float:
    """Seconds to stream weights + KV once at ``bandwidth`` bytes/s."""
    if bandwidth <= 0:
        raise ValueError(f"bandwidth={bandwidth} must be positive")
    return (weight_bytes + kv_read_bytes) / bandwidth


def copy_bandwidth(nbytes: int, seconds: float) -> float:
    """Bytes/s of a copy of ``nbytes`` (each byte read once and written once)."""
    return 2 * nbytes / seconds


def matmul_flops(n: int) -> float:
    """FLOPs of an n x n x n matmul."""
    return 2.0 * n ** 3


def attention_flops(tokens: int, layers: int, heads: int, head_dim: int) -> float:
    """Causal self-attention FLOPs of one T-token prefill: 4 * L * H * d per visible (query, key) pair."""
    return 4.0 * layers * heads * head_dim * tokens * (tokens + 1) / 2


def prefill_flops(tokens: int, stats: ParamStats, layers: int, heads: int, head_dim: int,
                  logit_rows: int = 1) -> float:
    """FLOPs of one prefill (see the module docstring)."""
    return (2.0 * tokens * stats.layer_matmul_params + 2.0 * logit_rows * stats.lm_head_params
            + attention_flops(tokens, layers, heads, head_dim))


@dataclasses.dataclass(frozen=True)
class TargetRow:
    """One line of the ratio table; ``ratio`` None when the floor or measurement is missing."""

    metric: str
    floor: str
    measured: str
    ratio: Optional[float]
    op: str  # "<=", ">=" or "" (report only)
    target: Optional[float]

    @property
    def met(self) -> Optional[bool]:
        """Whether ``ratio`` meets ``target`` under ``op``; None when there is no ratio or the row is report-only."""
        if self.ratio is None or not self.op:
            return None
        return self.ratio <= self.target if self.op == "<=" else self.ratio >= self.target


def format_table(rows: list[TargetRow]) -> str:
    """Markdown table: metric | floor / baseline | measured | ratio | target | met?"""
    out = ["| metric | floor / baseline | measured | ratio | target | met? |", "|---|---|---|---:|---|---|"]
    for r in rows:
        ratio = "" if r.ratio is None else f"{r.ratio:.2f}"
        target = f"{r.op} {r.target:.2f}" if r.op else "report"
        met = {None: "n/a", True: "yes", False: "NO"}[r.met]
        out.append(f"| {r.metric} | {r.floor} | {r.measured} | {ratio} | {target} | {met} |")
    return "\n".join(out)


def si(value: float, unit: str) -> str:
    """``value`` with a T/G/M/k prefix, e.g. ``si(4.1e12, "B/s") == "4.10 TB/s"``."""
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            return f"{value / scale:.2f} {prefix}{unit}"
    return f"{value:.2f} {unit}"


def parse_attention_rows(lines: list[str]) -> list[dict]:
    """Rows of ``bench_triton_attention.bench_decode``'s table -> [{name, time_us}] (header lines skipped)."""
    out = []
    for line in lines:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 2:
            continue
        try:
            out.append({"name": cells[0], "time_us": float(cells[1])})
        except ValueError:
            continue
    return out


SERVING_KEYS = ("completed", "failed", "duration", "output_throughput", "total_throughput", "request_throughput",
                "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_itl_ms", "median_itl_ms", "p99_itl_ms",
                "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms")


def summarize_serving(record: dict) -> dict:
    """The keys this report uses from one ``bench_serving --output-file`` JSON line. Raises KeyError if absent."""
    return {k: record[k] for k in SERVING_KEYS}
