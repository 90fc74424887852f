"""Interval arithmetic and trace reading shared by the profiler summaries of the benches (``benchmark/tdist/call_profile.py``,
``benchmark/tokenweave/layer_profile.py``): GPU activity intervals of a torch profiler (CUPTI) chrome trace, as ``(start, end)``
pairs in microseconds, reduced to busy time (union) and concurrent time (intersection).

Kept importable without CUDA (unit-tested on CPU).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Iterable, List, Tuple


def union(iv: Iterable[Tuple[float, float]]) -> List[Tuple[float, float]]:
    """Sorted disjoint union of ``[start, end)`` intervals."""
    out: List[List[float]] = []
    for s, e in sorted(iv):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def length(iv: Iterable[Tuple[float, float]]) -> float:
    """Total length of disjoint intervals."""
    return sum(e - s for s, e in iv)


def intersect(a: List[Tuple[float, float]], b: List[Tuple[float, float]]) -> float:
    """Length of the intersection of two disjoint sorted interval lists (as :func:`union` returns them)."""
    i = j = 0
    tot = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        tot += max(0.0, hi - lo)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return tot


def trace_events(prof) -> list:
    """The chrome-trace ``traceEvents`` of a finished torch profiler run (``prof.export_chrome_trace`` into a
    temporary file, read back and removed). Raises whatever the export raises."""
    with tempfile.TemporaryDirectory() as d:
        trace = Path(d) / "trace.json"
        prof.export_chrome_trace(str(trace))
        return json.loads(trace.read_text()).get("traceEvents", [])
