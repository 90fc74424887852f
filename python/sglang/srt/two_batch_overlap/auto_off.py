"""When two-batch overlap turns itself off: the smallest batch (new tokens on this rank) it splits, per GPU model and
expert-parallel size, and where each value came from.

Splitting a batch in two costs the same work in more, smaller kernels (every GEMM's M halves, every weight is read
twice in decode), and it can only win back the communication it hides. SGLang measured both sides of this on
DeepSeek-V3 (LMSYS blog, 2025): +27-35% prefill throughput at EP32, but -27% in decode at 32 tokens per GPU. So
below a threshold a batch runs unsplit, on the sequential path (and its decode CUDA graphs).

:data:`AUTO_MIN_TOKENS` is the table. A row says whether it was measured; the rows for EP > 1 are NOT measured yet:
they are provisional values, chosen conservatively (on one NVLink node the all-to-all is a small share of a step:
0.054 ms for 1024 x 7168 bf16 at world 4 on H200 with the Triton-distributed kernel), and
``benchmark/moe/bench_moe_overlap.py`` prints the candidate threshold per (GPU, EP size) that replaces them once it
has run on that many GPUs. ``--tbo-min-tokens`` overrides the table (2 forces the overlap on for every batch that
can be split: tests, benchmarks).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

TBO_OFF = 1 << 30  # larger than any forward: never split
FORCED_MIN_TOKENS = 2  # the smallest batch that can be split


@dataclass(frozen=True)
class Threshold:
    """One row of :data:`AUTO_MIN_TOKENS`: ``min_tokens`` (batches with fewer new tokens on this rank run unsplit;
    :data:`TBO_OFF`: never split), ``measured`` (False: a provisional value) and ``source`` (where it came from)."""

    min_tokens: int
    measured: bool
    source: str

    def describe(self) -> str:
        """``"off (...)"``, ``"4096 tokens (unmeasured: ...)"`` or ``"2 tokens (set by --tbo-min-tokens)"`` for logs."""
        value = "off" if self.min_tokens >= TBO_OFF else f"{self.min_tokens} tokens"
        if self.source.startswith("--"):
            return f"{value} (set by {self.source})"
        return f"{value} ({'measured' if self.measured else 'unmeasured'}: {self.source})"


_PROVISIONAL = ("provisional, not measured yet; run benchmark/moe/bench_moe_overlap.py on this many GPUs for the "
                "measured candidate")
_NOTHING_TO_HIDE = "one expert-parallel rank has no dispatch/combine to hide, only the split's cost (by construction)"

# (GPU model substring, EP size) -> Threshold. "*" matches any GPU. EP sizes not listed use the row of the nearest
# smaller listed size of the same GPU. The provisional rows share one value on purpose: nothing measured here tells
# them apart yet.
AUTO_MIN_TOKENS: dict[tuple[str, int], Threshold] = {
    ("*", 1): Threshold(TBO_OFF, False, _NOTHING_TO_HIDE),
    ("H100", 2): Threshold(4096, False, _PROVISIONAL),
    ("H100", 4): Threshold(4096, False, _PROVISIONAL),
    ("H100", 8): Threshold(4096, False, _PROVISIONAL),
    ("H200", 2): Threshold(4096, False, _PROVISIONAL),
    ("H200", 4): Threshold(4096, False, _PROVISIONAL),
    ("H200", 8): Threshold(4096, False, _PROVISIONAL),
}
_NO_STREAMS = Threshold(TBO_OFF, False, "no GPU: the micro-batches run one after the other on one stream, so nothing "
                                        "overlaps (by construction)")


def auto_threshold(ep_size: int, gpu_name: str = "", device_type: str = "cuda") -> Threshold:
    """The :data:`AUTO_MIN_TOKENS` row for ``ep_size`` on ``gpu_name`` (e.g. ``"NVIDIA H100 80GB HBM3"``; the GPU
    model is matched as a substring; an unknown GPU uses the H100 rows). Off on a non-CUDA ``device_type``.

    Raises:
        ValueError: ``ep_size < 1``.
    """
    if ep_size < 1:
        raise ValueError(f"ep_size={ep_size} must be >= 1")
    if device_type != "cuda":
        return _NO_STREAMS
    if ep_size == 1:
        return AUTO_MIN_TOKENS[("*", 1)]
    gpu = next((g for g, _ in AUTO_MIN_TOKENS if g != "*" and g in gpu_name), "H100")
    sizes = sorted(ep for g, ep in AUTO_MIN_TOKENS if g == gpu and ep <= ep_size)
    return AUTO_MIN_TOKENS[(gpu, sizes[-1])]


def resolve_threshold(requested: Optional[int], ep_size: int, gpu_name: str = "",
                      device_type: str = "cuda") -> Threshold:
    """``--tbo-min-tokens`` when given (a :class:`Threshold` whose source says so), else :func:`auto_threshold`.

    Raises:
        ValueError: ``requested < 2`` or ``ep_size < 1``.
    """
    if requested is not None:
        if requested < FORCED_MIN_TOKENS:
            raise ValueError(f"--tbo-min-tokens={requested} is invalid: use >= {FORCED_MIN_TOKENS} (a split needs "
                             "two tokens)")
        return Threshold(int(requested), False, "--tbo-min-tokens")
    return auto_threshold(ep_size, gpu_name, device_type)
