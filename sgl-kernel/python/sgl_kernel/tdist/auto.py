"""Per-shape choice between the overlapped decomposition (tdist/decomp.py) and NCCL + cuBLAS in sequence.

Overlap pays only when the GEMM is long enough to hide the transfer and the extra launches: below a break-even M the
sequence ``all_gather_into_tensor`` + GEMM (or GEMM + ``reduce_scatter_tensor``) wins. :class:`CalibrationTable` keeps
the break-even M per (op kind, K, N, world), measured by ``benchmark/bench_tdist.py`` (:meth:`from_timings`), and
the measured best piece count per M of the decomposition; :class:`AutoAgGemm` / :class:`AutoGemmRs` pick the path
per call from it (NCCL + cuBLAS below the break-even M) and pass the table's piece count to the decomposition (its
analytic :func:`~sgl_kernel.tdist.decomp.plan_chunks` for shapes the table lacks).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence, Tuple

import torch

KINDS = ("ag", "rs")
NEVER = 1 << 62  # min_m of a shape where the decomposition never won


@dataclass(frozen=True)
class CalibrationTable:
    """Break-even M per shape. entries: ``(kind, k, n, world, min_m)`` with kind ``"ag"`` (AG-GEMM) or ``"rs"``
    (GEMM-RS), K and N per rank (GEMM-RS: K_local and output N), min_m the smallest total M at which the
    decomposition is used. default_min_m: used for shapes not in the table. pieces: ``(kind, k, n, world, m,
    pieces)``, the piece count (1..4) measured fastest at total M ``m``; :meth:`pieces_for` applies the entry of the
    largest measured M <= the call's M (the smallest measured M below it). Raises ValueError on bad entries."""

    entries: Tuple[Tuple[str, int, int, int, int], ...] = ()
    default_min_m: int = 4096
    pieces: Tuple[Tuple[str, int, int, int, int, int], ...] = ()

    def __post_init__(self) -> None:
        for e in self.entries:
            if len(e) != 5 or e[0] not in KINDS or any(int(v) < 1 for v in e[1:]):
                raise ValueError(f"calibration entry {e!r} must be (kind in {KINDS}, k, n, world, min_m >= 1)")
        if self.default_min_m < 1:
            raise ValueError(f"default_min_m={self.default_min_m} must be >= 1")
        for e in self.pieces:
            if len(e) != 6 or e[0] not in KINDS or any(int(v) < 1 for v in e[1:5]) or not 1 <= int(e[5]) <= 4:
                raise ValueError(f"pieces entry {e!r} must be (kind in {KINDS}, k, n, world, m >= 1, pieces 1..4)")

    def pieces_for(self, kind: str, k: int, n: int, world: int, m: int) -> Optional[int]:
        """Measured best piece count of the decomposition for the shape at total M ``m`` (None: shape not
        measured; the decomposition then plans its own). A function of shared values, so equal on every rank."""
        pts = sorted((int(e[4]), int(e[5])) for e in self.pieces if tuple(e[:4]) == (kind, k, n, world))
        if not pts:
            return None
        below = [p for mm, p in pts if mm <= m]
        return below[-1] if below else pts[0][1]

    def min_m(self, kind: str, k: int, n: int, world: int) -> int:
        """Break-even M of the shape (the table's, else :attr:`default_min_m`)."""
        for e in self.entries:
            if e[:4] == (kind, k, n, world):
                return e[4]
        return self.default_min_m

    def choose(self, kind: str, k: int, n: int, world: int, m: int) -> str:
        """``"decomp"`` when ``m >= min_m`` of the shape, else ``"nccl"``."""
        if kind not in KINDS:
            raise ValueError(f"kind={kind!r} must be one of {KINDS}")
        return "decomp" if m >= self.min_m(kind, k, n, world) else "nccl"

    @classmethod
    def from_timings(cls, rows: Iterable[dict], default_min_m: int = 4096) -> "CalibrationTable":
        """Build from measured rows ``{kind, k, n, world, m, decomp_ms, nccl_ms}``: per shape, the smallest measured
        M from which the decomposition was faster at that M and every larger measured M (:data:`NEVER` if it never
        was). Rows with a missing time are skipped."""
        by_shape: dict = {}
        for r in rows:
            if r.get("decomp_ms") is None or r.get("nccl_ms") is None:
                continue
            key = (r["kind"], int(r["k"]), int(r["n"]), int(r["world"]))
            by_shape.setdefault(key, []).append((int(r["m"]), float(r["decomp_ms"]) < float(r["nccl_ms"])))
        entries = []
        for key, pts in sorted(by_shape.items()):
            pts.sort()
            min_m = NEVER
            for m, win in reversed(pts):
                if not win:
                    break
                min_m = m
            entries.append((*key, min_m))
        return cls(tuple(entries), default_min_m)

    def to_json(self) -> str:
        """JSON text (``from_json`` reads it back)."""
        return json.dumps({"default_min_m": self.default_min_m, "entries": [list(e) for e in self.entries],
                           "pieces": [list(e) for e in self.pieces]})

    @classmethod
    def from_json(cls, text: str) -> "CalibrationTable":
        """Parse :meth:`to_json` output; ValueError on malformed text."""
        try:
            d = json.loads(text)
            return cls(tuple(tuple(e) for e in d["entries"]), int(d["default_min_m"]),
                       tuple(tuple(e) for e in d.get("pieces", ())))
        except (KeyError, TypeError, json.JSONDecodeError) as e:
            raise ValueError(f"bad calibration table JSON: {e}") from e


# Measured on 2 x H100 80GB HBM3 (NVLink, multicast off), 2026-11-26 round 2 of issue 26 (bench_tdist.py --world 2
# --tp-shapes 4 --tokens 2048 8192, medians of CUDA events; notes/gpu6 issue26_bench.md), Llama-3.3-70B TP4 shapes,
# ms at M 2048 | 8192, best decomposition (pieces) vs NCCL + cuBLAS:
#   AG qkv     K 8192 N 2560:  0.136 (1) vs 0.205 | 0.456 (2) vs 0.733 -> decomposition from M 2048
#   AG gate_up K 8192 N 14336: 0.621 (1) vs 0.808 | 2.673 (2) vs 3.078 -> decomposition from M 2048
#   RS o_proj  K 2048 N 8192:  0.315 (1) vs 0.195 | 0.573 (2 and 4 tied) vs 0.683 -> NCCL + cuBLAS below M 8192
#   RS down    K 7168 N 8192:  0.394 (1) vs 0.400 | 1.424 (2) vs 1.673 -> NCCL + cuBLAS below M 8192 (a 1.5% win at
#   2048 is within run-to-run noise; the default plan lost there, 0.488)
# Other shapes and worlds use default_min_m and plan_chunks (the decomposition won at M = 8192 on every shape).
H100_TABLE = CalibrationTable(
    (("ag", 8192, 2560, 2, 2048), ("ag", 8192, 14336, 2, 2048), ("rs", 2048, 8192, 2, 8192),
     ("rs", 7168, 8192, 2, 8192)),
    default_min_m=4096,
    pieces=(("ag", 8192, 2560, 2, 2048, 1), ("ag", 8192, 2560, 2, 8192, 2),
            ("ag", 8192, 14336, 2, 2048, 1), ("ag", 8192, 14336, 2, 8192, 2),
            ("rs", 2048, 8192, 2, 2048, 1), ("rs", 2048, 8192, 2, 8192, 2),
            ("rs", 7168, 8192, 2, 2048, 1), ("rs", 7168, 8192, 2, 8192, 2)))


class AutoAgGemm:
    """AG-GEMM that uses ``decomp`` (a :class:`~sgl_kernel.tdist.decomp.DecompAgGemm`) at or above the table's
    break-even M and NCCL ``all_gather_into_tensor`` + cuBLAS below it (or when rows are uneven, which the NCCL call
    cannot gather). group: the NCCL process group of the heap's ranks (None: always the decomposition)."""

    def __init__(self, decomp, group=None, table: CalibrationTable = CalibrationTable()):
        self.decomp, self.group, self.table = decomp, group, table
        self.last_path = ""

    def __call__(self, a: torch.Tensor, b: torch.Tensor, rows: Sequence[int], out: Optional[torch.Tensor] = None):
        """Same contract as DecompAgGemm.__call__; ``last_path`` says which path ran ("decomp" or "nccl")."""
        import torch.distributed as dist

        h = self.decomp.heap
        m = sum(int(r) for r in rows)
        path = self.table.choose("ag", self.decomp.k, b.shape[1], h.world, m)
        if self.group is None or len(set(int(r) for r in rows)) != 1:
            path = "decomp"
        self.last_path = path
        if path == "decomp":
            pieces = None if self.decomp.chunks else self.table.pieces_for("ag", self.decomp.k, b.shape[1], h.world, m)
            return self.decomp(a, b, rows, out, chunks=pieces)
        full = torch.empty(m, a.shape[1], dtype=a.dtype, device=a.device)
        dist.all_gather_into_tensor(full, a, group=self.group)
        return torch.mm(full, b, out=out) if out is not None else full @ b


class AutoGemmRs:
    """GEMM-RS that uses ``decomp`` (a :class:`~sgl_kernel.tdist.decomp.DecompGemmRs`) at or above the table's
    break-even M and cuBLAS + NCCL ``reduce_scatter_tensor`` below it (or with uneven rows). group: as AutoAgGemm."""

    def __init__(self, decomp, group=None, table: CalibrationTable = CalibrationTable()):
        self.decomp, self.group, self.table = decomp, group, table
        self.last_path = ""

    def __call__(self, a: torch.Tensor, b: torch.Tensor, rows: Sequence[int], out: Optional[torch.Tensor] = None):
        """Same contract as DecompGemmRs.__call__; ``last_path`` says which path ran."""
        import torch.distributed as dist

        h = self.decomp.heap
        path = self.table.choose("rs", a.shape[1], self.decomp.n, h.world, a.shape[0])
        if self.group is None or len(set(int(r) for r in rows)) != 1:
            path = "decomp"
        self.last_path = path
        if path == "decomp":
            pieces = (None if self.decomp.chunks else
                      self.table.pieces_for("rs", a.shape[1], self.decomp.n, h.world, a.shape[0]))
            return self.decomp(a, b, rows, out, chunks=pieces)
        if out is None:
            out = torch.empty(int(rows[h.rank]), b.shape[1], dtype=a.dtype, device=a.device)
        dist.reduce_scatter_tensor(out, a @ b, group=self.group)
        return out
