"""Ta / Tf / Tc of device-driven AFD steps, also inside CUDA graphs (MegaScale-Infer, Zhu et al. 2025, sec. 4.1: the
ping-pong hides communication when ``m >= 2 (1 + Tc / Tf)``).

A graph replay runs no Python, so the host-path measurement (host time stamps and a Tf in every reply's header,
:meth:`AfdExecutor.pipeline_constraint`) has nothing to read there. A :class:`StepTimer` instead records *external*
timed CUDA events (``torch.cuda.Event(enable_timing=True, external=True)``: captured as event-record nodes, so a
replay re-records them) at fixed points of a step; after each replay (synchronized) :meth:`StepTimer.collect`
turns the pairs into per-(layer, micro-batch) milliseconds. Off CUDA the stamps are host ``perf_counter`` times (the
CPU simulation of the device path). Opt-in: the executor and the FFN worker record nothing unless a timer is set
(``AfdExecutor.step_timer``, ``FfnDeviceSteps.timer``; ``benchmark/afd/bench_step_graph.py`` sets both).

* attention worker: ``ta`` = attention stages of one (layer, micro-batch); ``rtt`` = from the end of those stages
  (dispatch next) to its results combined, on the attention worker's stream;
* FFN worker: ``tf`` = from a micro-batch's dispatch received to its experts computed (before the reply);
* :func:`pipeline_check`: ``Tc = (rtt - Tf) / 2`` (as the host path) and the bound ``2 (1 + Tc / Tf)``. With
  ``m > 1`` the attention stream runs the other micro-batches' attention between a dispatch and its combine, so
  ``rtt`` includes it and Tc is an upper bound (exact for ``m = 1``).
"""

from __future__ import annotations

import statistics
import time
from typing import Optional

import torch


class StepTimer:
    """Pairs of stamps per kind (``"ta"``, ``"rtt"``, ``"tf"``) of the step being recorded, and the per-step medians.

    Args:
        device: where the timed work runs; CUDA -> external timed events (valid inside a graph capture), else
            host ``perf_counter`` floats.
    Attributes:
        samples: kind -> list of per-step median milliseconds (one entry per :meth:`collect`).
    """

    def __init__(self, device: torch.device):
        self.cuda = torch.device(device).type == "cuda"
        self.pairs: dict[str, list[list]] = {}
        self.samples: dict[str, list[float]] = {}

    def begin(self) -> None:
        """Start recording a step (eager, or the one a graph captures): forget the previous step's stamps."""
        self.pairs = {}

    def stamp(self):
        """A stamp now on the current stream: an external timed CUDA event (recorded; captured as a node during a
        graph capture) or, off CUDA, ``time.perf_counter()``."""
        if not self.cuda:
            return time.perf_counter()
        ev = torch.cuda.Event(enable_timing=True, external=True)
        ev.record()
        return ev

    def open(self, kind: str) -> list:
        """Start a ``kind`` interval now; returns the pair to :meth:`close`."""
        pair = [self.stamp(), None]
        self.pairs.setdefault(kind, []).append(pair)
        return pair

    def close(self, pair: list) -> None:
        """End the interval ``pair`` (from :meth:`open`) now."""
        pair[1] = self.stamp()

    def collect(self) -> dict[str, float]:
        """After a step (or a replay of the captured one) has finished: the median milliseconds per kind of its
        closed pairs, also appended to :attr:`samples`. Synchronizes the device on CUDA."""
        if self.cuda:
            torch.cuda.synchronize()
        out = {}
        for kind, pairs in self.pairs.items():
            ms = [_elapsed_ms(a, b) for a, b in pairs if b is not None]
            if ms:
                out[kind] = statistics.median(ms)
                self.samples.setdefault(kind, []).append(out[kind])
        return out

    def medians(self) -> dict[str, float]:
        """Median over the collected steps, per kind (milliseconds); empty before any :meth:`collect`."""
        return {k: statistics.median(v) for k, v in self.samples.items() if v}

    def reset_samples(self) -> None:
        """Forget the collected medians (a benchmark starting a new configuration); the stamps stay."""
        self.samples = {}


def _elapsed_ms(a, b) -> float:
    if isinstance(a, float):
        return (b - a) * 1e3
    return a.elapsed_time(b)


def pipeline_check(ta_ms: float, tf_ms: float, rtt_ms: float, m: int) -> dict:
    """``{"ta_ms", "tf_ms", "tc_ms", "m_min", "m", "hidden"}``: ``Tc = max(0, (rtt - Tf) / 2)``, ``m_min =
    2 (1 + Tc / Tf)`` (sec. 4.1, eq. 3) and whether ``m >= m_min``.

    Raises:
        ValueError: a negative time, ``tf_ms <= 0`` or ``m < 1``.
    """
    if min(ta_ms, rtt_ms) < 0 or not tf_ms > 0 or m < 1:
        raise ValueError(f"pipeline_check needs times >= 0, Tf > 0 and m >= 1, got Ta={ta_ms} Tf={tf_ms} "
                         f"rtt={rtt_ms} m={m}")
    tc = max(0.0, (rtt_ms - tf_ms) / 2)
    m_min = 2 * (1 + tc / tf_ms)
    return {"ta_ms": ta_ms, "tf_ms": tf_ms, "tc_ms": tc, "m_min": m_min, "m": m, "hidden": m >= m_min}


def format_check(c: Optional[dict]) -> str:
    """``"Ta / Tf / Tc ms | m >= 2(1+Tc/Tf) = x: yes|NO"`` table cells of a :func:`pipeline_check` result (``"n/a"``
    cells when ``c`` is None)."""
    if c is None:
        return "n/a | n/a"
    return (f"{c['ta_ms']:.3f} / {c['tf_ms']:.3f} / {c['tc_ms']:.3f} | "
            f"m >= 2(1+Tc/Tf) = {c['m_min']:.2f}: {'yes' if c['hidden'] else 'NO'}")
