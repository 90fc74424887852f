"""Calibrated backend choice of tw-comm's fused AllReduce + RMSNorm, per (GPU model, world size).

``benchmark/comm/bench_allreduce_rmsnorm.py --calibrate`` times every candidate (variant, SM count) per token
count in one run and writes the fastest into a JSON table (default: ``tw_comm_crossovers.json`` next to this
module; ``$TW_COMM_CROSSOVERS`` points elsewhere). :class:`~sglang.srt.distributed.tw_comm.TwCommWorkspace`
loads the table of its GPU model and world size into its frozen config; ``select_backend`` then picks by payload
bytes (T x H x element size), and a GPU/world without a table keeps the built-in rules. Two tables per key:
``plain`` (non-overlapped calls: backend and SM count) and ``overlap`` (TokenWeave's calls on its SM budget:
backend only). File format::

    {"version": 1, "tables": {"NVIDIA H200|4": {"plain": [[max_bytes, backend, sms], ...],
                                               "overlap": [[max_bytes, backend, sms], ...],
                                               "source": "<date, command>"}}}

Entries are sorted by ``max_bytes`` (inclusive upper bound); the last one covers every larger payload.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterable, Mapping, Optional, Sequence, Tuple

DEFAULT_TABLE_PATH = Path(__file__).with_name("tw_comm_crossovers.json")
# backends a table may name (TwBackend values of the kernels that need no fallback)
TABLE_BACKENDS = ("p2p_oneshot", "p2p_lamport", "p2p_twoshot", "p2p_twoshot_pipe", "p2p_twoshot_bulk")
UNBOUNDED = 1 << 62

Entry = Tuple[int, str, int]  # (max_bytes, backend value, sms)


@dataclass(frozen=True)
class Crossovers:
    """Calibrated picks for one (GPU model, world): ``plain`` and ``overlap`` entry tuples, sorted by max_bytes."""

    plain: Tuple[Entry, ...] = ()
    overlap: Tuple[Entry, ...] = ()

    def pick(self, nbytes: int, overlap: bool = False) -> Optional[Entry]:
        """The entry covering a payload of ``nbytes`` (None when the table is empty)."""
        entries = self.overlap if overlap else self.plain
        for e in entries:
            if nbytes <= e[0]:
                return e
        return entries[-1] if entries else None


def table_key(gpu_name: str, world: int) -> str:
    """Key of one table: ``"<torch.cuda.get_device_name()>|<world>"``."""
    return f"{gpu_name}|{world}"


def _entries(raw: object, where: str) -> Tuple[Entry, ...]:
    if not isinstance(raw, list):
        raise ValueError(f"{where} must be a list of [max_bytes, backend, sms]")
    out = []
    for item in raw:
        if not (isinstance(item, list) and len(item) == 3):
            raise ValueError(f"{where}: entry {item!r} must be [max_bytes, backend, sms]")
        mb, backend, sms = item
        if not isinstance(mb, int) or mb <= 0 or backend not in TABLE_BACKENDS or not isinstance(sms, int) \
                or not 1 <= sms <= 256:
            raise ValueError(f"{where}: entry {item!r} needs max_bytes > 0, backend in {TABLE_BACKENDS}, "
                             "sms in [1, 256]; re-run the benchmark with --calibrate")
        out.append((mb, backend, sms))
    if [e[0] for e in out] != sorted(e[0] for e in out):
        raise ValueError(f"{where}: entries must be sorted by max_bytes")
    return tuple(out)


def load_crossovers(gpu_name: str, world: int, path: Optional[os.PathLike] = None) -> Crossovers:
    """The calibrated table of (gpu_name, world) from ``path`` (default ``$TW_COMM_CROSSOVERS`` or the packaged
    file); an empty :class:`Crossovers` when the file or the key is absent. Raises ValueError on a malformed file
    (naming the file and the entry)."""
    p = Path(path or os.environ.get("TW_COMM_CROSSOVERS") or DEFAULT_TABLE_PATH)
    if not p.exists():
        return Crossovers()
    try:
        data = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"tw-comm crossover table {p} is not valid JSON: {e}") from e
    table = data.get("tables", {}).get(table_key(gpu_name, world)) if isinstance(data, dict) else None
    if table is None:
        return Crossovers()
    where = f"{p} [{table_key(gpu_name, world)}]"
    return Crossovers(plain=_entries(table.get("plain", []), where + ".plain"),
                      overlap=_entries(table.get("overlap", []), where + ".overlap"))


def entries_from_timings(timings: Mapping[int, Mapping[Tuple[str, int], float]]) -> Tuple[Entry, ...]:
    """Collapse measured times into table entries.

    timings: {payload bytes: {(backend value, sms): microseconds}} for a set of token counts of one (GPU, world).
    The fastest candidate per size wins; a boundary between two sizes with different winners sits at their
    geometric mean; the last entry is unbounded. Raises ValueError when a size has no candidate.
    """
    sizes = sorted(timings)
    best = []
    for s in sizes:
        if not timings[s]:
            raise ValueError(f"no candidate timed at {s} bytes")
        best.append(min(timings[s], key=timings[s].get))
    out = []
    for k, (s, b) in enumerate(zip(sizes, best)):
        if k + 1 < len(sizes) and best[k + 1] == b:
            continue
        bound = UNBOUNDED if k + 1 == len(sizes) else int(math.sqrt(s * sizes[k + 1]))
        out.append((bound, b[0], int(b[1])))
    return tuple(out)


def write_table(path: os.PathLike, gpu_name: str, world: int, plain: Iterable[Entry], overlap: Iterable[Entry],
                source: str) -> Dict[str, object]:
    """Merge one (gpu_name, world) table into the JSON file at ``path`` (created if missing); returns the table.

    Entries are validated as :func:`load_crossovers` would (ValueError on a bad one)."""
    p = Path(path)
    data = json.loads(p.read_text()) if p.exists() else {"version": 1, "tables": {}}
    key = table_key(gpu_name, world)
    table = {"plain": [list(e) for e in plain], "overlap": [list(e) for e in overlap], "source": source}
    _entries(table["plain"], key)
    _entries(table["overlap"], key)
    data.setdefault("tables", {})[key] = table
    p.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    return table


def describe(entries: Sequence[Entry]) -> str:
    """One line per table for logs: ``<= 1.0 MiB p2p_lamport@64, <= inf p2p_twoshot_pipe@128``."""
    parts = []
    for mb, backend, sms in entries:
        size = "inf" if mb >= UNBOUNDED else f"{mb / (1 << 20):.2f} MiB"
        parts.append(f"<= {size} {backend}@{sms}")
    return ", ".join(parts) or "(none)"
