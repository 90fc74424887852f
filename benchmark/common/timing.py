"""Timing every benchmark shares: warm-ups, per-sample CUDA-event timings summarised by their median, A/B order
alternation between the variants of one run, and a host timer (``time.perf_counter_ns``) where there is no GPU.

A *sample* is the time of ``inner`` back-to-back calls divided by ``inner`` (milliseconds). CUDA samples are taken
with a pair of ``torch.cuda.Event(enable_timing=True)`` recorded on the current stream around the calls, so they
measure device time including launch gaps but not host time before the first launch; host samples wrap the calls in
``perf_counter_ns`` and call ``sync`` (e.g. ``torch.cuda.synchronize``) before the stop stamp when one is given.

Same-run comparisons go through :func:`compare`: every arm is warmed up first, then the arms are timed in rounds
whose order alternates (forward on even rounds, reversed on odd ones: A B, B A, A B, ...), so a drift of clocks or
temperature during the run does not favour the arm that always runs first.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Callable, Mapping, Optional, Sequence

__all__ = ["Timing", "median", "percentile", "ratio", "ab_order", "time_cpu", "time_cuda_events", "time_fn",
           "compare", "CUDA_EVENT", "HOST_CLOCK"]

CUDA_EVENT = "cuda_event"
HOST_CLOCK = "perf_counter"


def median(xs: Sequence[float]) -> float:
    """Median of a non-empty sequence (mean of the two middle values for an even count). ValueError when empty."""
    if not xs:
        raise ValueError("median of no samples: time at least one iteration (iters >= 1)")
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


def percentile(xs: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) with linear interpolation between closest ranks, as ``numpy.percentile``'s
    default. ValueError when empty or ``q`` is outside [0, 100]."""
    if not xs:
        raise ValueError("percentile of no samples: time at least one iteration (iters >= 1)")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q={q} is outside [0, 100]")
    s = sorted(xs)
    pos = (len(s) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def ratio(num: Optional[float], den: Optional[float]) -> Optional[float]:
    """``num / den``, or None when either is missing or ``den`` is 0 (a ratio column never raises)."""
    if num is None or den is None or den == 0:
        return None
    return num / den


@dataclasses.dataclass(frozen=True)
class Timing:
    """Samples of one timed function. ``samples_ms``: per-sample milliseconds (each already divided by ``inner``);
    ``timer``: :data:`CUDA_EVENT` or :data:`HOST_CLOCK`; ``inner``: calls per sample."""

    samples_ms: tuple[float, ...]
    timer: str
    inner: int = 1

    @property
    def n(self) -> int:
        return len(self.samples_ms)

    @property
    def median_ms(self) -> float:
        return median(self.samples_ms)

    @property
    def p10_ms(self) -> float:
        return percentile(self.samples_ms, 10)

    @property
    def p90_ms(self) -> float:
        return percentile(self.samples_ms, 90)

    @property
    def min_ms(self) -> float:
        return min(self.samples_ms)

    @property
    def median_us(self) -> float:
        return self.median_ms * 1e3

    def summary(self, prefix: str = "") -> dict:
        """Row fields ``{prefix}median_ms``, ``{prefix}p10_ms``, ``{prefix}p90_ms``, ``{prefix}n``, ``{prefix}timer``
        for a record row."""
        return {f"{prefix}median_ms": self.median_ms, f"{prefix}p10_ms": self.p10_ms,
                f"{prefix}p90_ms": self.p90_ms, f"{prefix}n": self.n, f"{prefix}timer": self.timer}


def _check_counts(iters: int, warmup: int, inner: int) -> None:
    if iters < 1:
        raise ValueError(f"iters={iters}: time at least one sample (iters >= 1)")
    if warmup < 0:
        raise ValueError(f"warmup={warmup}: use 0 or more warm-up calls")
    if inner < 1:
        raise ValueError(f"inner={inner}: each sample needs at least one call (inner >= 1)")


def time_cpu(fn: Callable[[], object], *, iters: int = 20, warmup: int = 3, inner: int = 1,
             sync: Optional[Callable[[], object]] = None,
             clock: Callable[[], int] = time.perf_counter_ns) -> Timing:
    """Host-clock timing: ``warmup`` calls, then ``iters`` samples of ``inner`` calls each. ``sync`` (if given) runs
    after the warm-up and before every stop stamp (pass ``torch.cuda.synchronize`` to time GPU work end to end from
    the host). ``clock`` returns nanoseconds (injectable for tests). ValueError on non-positive counts."""
    _check_counts(iters, warmup, inner)
    for _ in range(warmup):
        fn()
    if sync is not None:
        sync()
    samples = []
    for _ in range(iters):
        t0 = clock()
        for _ in range(inner):
            fn()
        if sync is not None:
            sync()
        samples.append((clock() - t0) / 1e6 / inner)
    return Timing(tuple(samples), HOST_CLOCK, inner)


def time_cuda_events(fn: Callable[[], object], *, iters: int = 20, warmup: int = 3, inner: int = 1) -> Timing:
    """CUDA-event timing on the current device and stream: ``warmup`` calls and a synchronize, then ``iters`` samples,
    each an event pair around ``inner`` calls (``elapsed_time / inner``, ms). Raises RuntimeError without CUDA
    (use :func:`time_fn` to fall back to the host clock)."""
    _check_counts(iters, warmup, inner)
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("time_cuda_events needs a CUDA device; time_fn(..., device='cpu') uses the host clock")
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    pairs = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        pairs.append((start, end))
    torch.cuda.synchronize()
    return Timing(tuple(s.elapsed_time(e) / inner for s, e in pairs), CUDA_EVENT, inner)


def _is_cuda(device) -> bool:
    if device is None:
        return False
    kind = getattr(device, "type", None) or str(device).split(":")[0]
    if kind != "cuda":
        return False
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def time_fn(fn: Callable[[], object], *, device=None, iters: int = 20, warmup: int = 3, inner: int = 1,
            sync: Optional[Callable[[], object]] = None) -> Timing:
    """CUDA-event timing when ``device`` is a CUDA device (``"cuda"``, ``"cuda:1"``, a ``torch.device``) and CUDA is
    available, else the host clock (:func:`time_cpu` with ``sync``). The returned ``Timing.timer`` says which."""
    if _is_cuda(device):
        return time_cuda_events(fn, iters=iters, warmup=warmup, inner=inner)
    return time_cpu(fn, iters=iters, warmup=warmup, inner=inner, sync=sync)


def ab_order(arms: Sequence[str], rounds: int) -> list[list[str]]:
    """The order of the arms in each round: as given on even rounds, reversed on odd ones, so every arm has the same
    mean position over an even number of rounds. ValueError on duplicate names or ``rounds < 1``."""
    arms = list(arms)
    if len(set(arms)) != len(arms):
        raise ValueError(f"arm names repeat: {arms}")
    if rounds < 1:
        raise ValueError(f"rounds={rounds}: alternate over at least one round")
    return [arms if r % 2 == 0 else arms[::-1] for r in range(rounds)]


def compare(arms: Mapping[str, Callable[[], object]], *, device=None, rounds: int = 4, iters: int = 10,
            warmup: int = 3, inner: int = 1, sync: Optional[Callable[[], object]] = None,
            timer: Optional[Callable[..., Timing]] = None) -> dict[str, Timing]:
    """Time the arms of one same-run comparison (e.g. ``{"nccl": ..., "tw_comm": ...}``): each arm gets ``warmup``
    calls first, then ``rounds`` rounds in :func:`ab_order` order, ``iters`` samples per arm per round (no extra
    warm-up between rounds). Returns ``{arm: Timing}`` with ``rounds * iters`` samples each, in the arms' order.
    ``timer`` replaces :func:`time_fn` (same keywords; for tests)."""
    if not arms:
        raise ValueError("compare needs at least one arm")
    _check_counts(iters, warmup, inner)
    order = ab_order(list(arms), rounds)
    timer = timer or (lambda f, **kw: time_fn(f, device=device, sync=sync, **kw))
    for name in arms:
        timer(arms[name], iters=1, warmup=warmup, inner=1)
    samples: dict[str, list[float]] = {name: [] for name in arms}
    kinds: dict[str, str] = {}
    for names in order:
        for name in names:
            t = timer(arms[name], iters=iters, warmup=0, inner=inner)
            samples[name].extend(t.samples_ms)
            kinds[name] = t.timer
    return {name: Timing(tuple(samples[name]), kinds[name], inner) for name in arms}
