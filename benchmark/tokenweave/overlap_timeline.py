"""Where a TokenWeave forward's overlap goes: analysis of one kernel timeline CSV.

``benchmark/tokenweave/bench_layer.py --overlap-tokens T --profile-dir DIR`` writes, per TokenWeave variant, rank 0's kernels of
one profiled eager forward to ``DIR/tokenweave_timeline_<variant>_T<T>.csv`` (columns ``stream,start_us,dur_us,
comm,name``; times in microseconds from the first kernel; ``comm`` 1 for communication kernels). This script prints

* per stream: kernels, busy time (union of its kernels' intervals), communication kernels;
* the communication kernels' busy time, how much of it ran while a compute kernel ran (the overlap TokenWeave,
  Gond et al. 2025, sec. 3, is meant to create), and per communication kernel its overlapped fraction;
* the gaps of the compute stream (the stream with the most compute-kernel time) longer than ``--gap-us``, each with
  the kernels before and after it and its cause: ``wait-comm`` (a communication kernel ended at most ``--tol-us``
  before the gap ended: the compute stream waited on that split's AllReduce event), ``comm-running`` (a
  communication kernel ran during the gap but none ended just before it: not a dependency we can see, e.g. the host
  was late), ``idle`` (nothing ran: the host had not launched the next kernel yet);
* with ``--schedule FROM TO``, every kernel starting in ``[FROM, TO)`` us in time order with its stream, a short
  kind (GEMM, attention, comm, ...) and its overlap with the other stream, to draw one layer's schedule.

Usage::

    python3 benchmark/tokenweave/overlap_timeline.py DIR/tokenweave_timeline_tokenweave_T4096.csv [--schedule 13800 17700]

Pure Python (csv module): runs anywhere, no torch.
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
from dataclasses import dataclass
from typing import Optional, Sequence

if __package__ in (None, ""):  # run as a file: the repository root makes the benchmark package importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from benchmark.common.profile_intervals import intersect, length, union  # noqa: E402,F401 (re-exported for callers)

KINDS = (("twoshot", "comm"), ("nccl", "comm"), ("allreduce", "comm"), ("nvjet", "GEMM"), ("gemm", "GEMM"),
         ("cutlass", "GEMM"), ("_extend", "attention"), ("flash", "attention"), ("attn", "attention"),
         ("rope", "rope+kv"), ("silu", "act"), ("rmsnorm", "norm"))


@dataclass(frozen=True)
class Kernel:
    """One kernel of the timeline: ``stream`` id, ``start`` / ``dur`` in us, ``comm`` (a communication kernel)."""

    stream: int
    start: float
    dur: float
    comm: bool
    name: str

    @property
    def end(self) -> float:
        """End time in us."""
        return self.start + self.dur

    @property
    def kind(self) -> str:
        """A short label from the kernel name (``comm`` for every communication kernel)."""
        if self.comm:
            return "comm"
        low = self.name.lower()
        return next((k for key, k in KINDS if key in low), "other")


def load(path: str) -> list[Kernel]:
    """The kernels of a timeline CSV, sorted by start. Raises ValueError naming the file when a column is missing
    or a value does not parse."""
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    need = {"stream", "start_us", "dur_us", "comm", "name"}
    if rows and not need <= set(rows[0]):
        raise ValueError(f"{path}: columns {sorted(rows[0])} lack {sorted(need - set(rows[0]))}")
    try:
        ks = [Kernel(int(r["stream"]), float(r["start_us"]), float(r["dur_us"]), r["comm"].strip() == "1",
                     r["name"]) for r in rows]
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path}: a row does not parse ({e})") from e
    return sorted(ks, key=lambda k: (k.start, k.stream))


@dataclass(frozen=True)
class Gap:
    """An idle span of the compute stream: ``start``/``end`` us, the kernels around it, ``cause`` (module
    docstring) and ``comm`` (the communication kernel it waited for or that ran in it, else None)."""

    start: float
    end: float
    before: str
    after: str
    cause: str
    comm: Optional[Kernel]

    @property
    def dur(self) -> float:
        """Length in us."""
        return self.end - self.start


def compute_stream(ks: Sequence[Kernel]) -> int:
    """The stream with the most compute-kernel time. Raises ValueError when there is no compute kernel."""
    tot: dict[int, float] = {}
    for k in ks:
        if not k.comm:
            tot[k.stream] = tot.get(k.stream, 0.0) + k.dur
    if not tot:
        raise ValueError("the timeline has no compute kernel")
    return max(tot, key=tot.get)


def gaps(ks: Sequence[Kernel], gap_us: float = 20.0, tol_us: float = 10.0) -> list[Gap]:
    """The compute stream's gaps longer than ``gap_us``, each classified (module docstring) against the
    communication kernels of any stream (``tol_us``: how soon after a communication kernel's end the compute
    stream must resume for ``wait-comm``)."""
    cs = compute_stream(ks)
    own = [k for k in ks if k.stream == cs]
    comms = [k for k in ks if k.comm and k.stream != cs]
    out = []
    for prev, nxt in zip(own, own[1:]):
        a, b = prev.end, nxt.start
        if b - a <= gap_us:
            continue
        ended = [c for c in comms if a <= c.end <= b and b - c.end <= tol_us]
        running = [c for c in comms if c.start < b and c.end > a]
        if ended:
            cause, c = "wait-comm", max(ended, key=lambda c: c.end)
        elif running:
            cause, c = "comm-running", running[0]
        else:
            cause, c = "idle", None
        out.append(Gap(a, b, prev.name, nxt.name, cause, c))
    return out


def analyze(ks: Sequence[Kernel], gap_us: float = 20.0, tol_us: float = 10.0) -> dict:
    """Summary numbers of a timeline (all in us): ``span``, per-stream ``streams`` {id: (kernels, busy, comm
    kernels)}, ``comm_busy`` / ``compute_busy`` (unions over all streams), ``overlap`` (their intersection),
    ``overlap_frac``, ``per_comm`` [(kernel, overlapped us)], ``gaps`` (:func:`gaps`) and ``gap_by_cause``."""
    if not ks:
        raise ValueError("empty timeline")
    comm_iv = union((k.start, k.end) for k in ks if k.comm)
    comp_iv = union((k.start, k.end) for k in ks if not k.comm)
    streams = {}
    for s in sorted({k.stream for k in ks}):
        mine = [k for k in ks if k.stream == s]
        streams[s] = (len(mine), length(union((k.start, k.end) for k in mine)), sum(k.comm for k in mine))
    per_comm = [(k, intersect([(k.start, k.end)], comp_iv)) for k in ks if k.comm]
    gl = gaps(ks, gap_us, tol_us)
    by_cause: dict[str, float] = {}
    for g in gl:
        by_cause[g.cause] = by_cause.get(g.cause, 0.0) + g.dur
    cb = length(comm_iv)
    ov = intersect(comm_iv, comp_iv)
    return {"span": max(k.end for k in ks) - min(k.start for k in ks), "streams": streams, "comm_busy": cb,
            "compute_busy": length(comp_iv), "overlap": ov, "overlap_frac": ov / cb if cb else 0.0,
            "per_comm": per_comm, "gaps": gl, "gap_by_cause": by_cause, "compute_stream": compute_stream(ks)}


def report(st: dict, top: int = 12) -> list[str]:
    """Text lines of :func:`analyze`'s summary: streams, overlap, communication kernels, the ``top`` longest gaps."""
    lines = [f"span {st['span']:.1f} us; compute busy {st['compute_busy']:.1f} us; comm busy {st['comm_busy']:.1f} "
             f"us, of which overlapped by compute {st['overlap']:.1f} us ({st['overlap_frac']:.2f})",
             "stream | kernels | busy us | comm kernels"]
    lines += [f"{s} | {n} | {busy:.1f} | {nc}" for s, (n, busy, nc) in st["streams"].items()]
    lines.append("comm kernels: start us | dur us | overlapped us | fraction | stream")
    lines += [f"  {k.start:.1f} | {k.dur:.1f} | {ov:.1f} | {ov / k.dur if k.dur else 0:.2f} | {k.stream}"
              for k, ov in st["per_comm"]]
    causes = ", ".join(f"{c} {us:.1f} us" for c, us in sorted(st["gap_by_cause"].items()))
    lines.append(f"compute stream {st['compute_stream']} gaps: {len(st['gaps'])} ({causes or 'none'})")
    lines.append("  start us | gap us | cause | before -> after | comm kernel (start+dur)")
    for g in sorted(st["gaps"], key=lambda g: -g.dur)[:top]:
        c = f"{g.comm.start:.1f}+{g.comm.dur:.1f}" if g.comm else "-"
        lines.append(f"  {g.start:.1f} | {g.dur:.1f} | {g.cause} | {_short(g.before)} -> {_short(g.after)} | {c}")
    return lines


def schedule(ks: Sequence[Kernel], t0: float, t1: float) -> list[str]:
    """One line per kernel starting in ``[t0, t1)`` us: start, end, stream, kind, duration, the us it overlaps a
    kernel of another stream, and the short name; the layer's schedule drawn in text."""
    lines = ["start us | end us | stream | kind | dur us | overlap us | name"]
    for k in ks:
        if t0 <= k.start < t1:
            other = union((o.start, o.end) for o in ks if o.stream != k.stream)
            ov = intersect([(k.start, k.end)], other)
            lines.append(f"{k.start:.1f} | {k.end:.1f} | {k.stream} | {k.kind} | {k.dur:.1f} | {ov:.1f} | "
                         f"{_short(k.name)}")
    return lines


def _short(name: str, n: int = 40) -> str:
    """A kernel name cut to ``n`` characters (the ``void `` prefix dropped)."""
    return name.removeprefix("void ")[:n]


def main(argv: Optional[list[str]] = None) -> int:
    """CLI: print :func:`report` (and :func:`schedule` with ``--schedule``) for each CSV given."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("csv", nargs="+", help="timeline CSV(s) written by benchmark/tokenweave/bench_layer.py --overlap-tokens")
    p.add_argument("--gap-us", type=float, default=20.0, help="shortest compute-stream gap listed")
    p.add_argument("--tol-us", type=float, default=10.0, help="max us from a comm kernel's end to a wait-comm resume")
    p.add_argument("--top", type=int, default=12, help="longest gaps listed")
    p.add_argument("--schedule", type=float, nargs=2, metavar=("FROM", "TO"), help="list kernels in [FROM, TO) us")
    a = p.parse_args(argv)
    for path in a.csv:
        try:
            ks = load(path)
            lines = report(analyze(ks, a.gap_us, a.tol_us), a.top)
        except (OSError, ValueError) as e:
            print(f"{path}: {e}", file=sys.stderr)
            return 2
        print(f"== {path}")
        print("\n".join(lines))
        if a.schedule:
            print("\n".join(schedule(ks, *a.schedule)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
