"""Per-shape choice between the overlapped decomposition (tdist/decomp.py) and NCCL + cuBLAS in sequence.

Overlap pays only when the GEMM is long enough to hide the transfer and the extra launches: below a break-even M the
sequence ``all_gather_into_tensor`` + GEMM (or GEMM + ``reduce_scatter_tensor``) wins. :class:`CalibrationTable` keeps
the break-even M per (op kind, K, N, world), measured by ``benchmark/tdist/bench_kernels.py`` (:meth:`from_timings`), and
the measured best piece count per M of the decomposition; :class:`AutoAgGemm` / :class:`AutoGemmRs` pick the path
per call from it (NCCL + cuBLAS below the break-even M) and pass the table's piece count to the decomposition (its
analytic :func:`~sgl_kernel.tdist.decomp.plan_chunks` for shapes the table lacks).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence, Tuple

import torch

from sgl_kernel.tdist.decomp import SCHEDULES

KINDS = ("ag", "rs")
TIE = 0.02  # relative: paths this close to the fastest are a tie (see CalibrationTable._best_rows)
PATHS = ("decomp", "nccl", "symm")  # decomposition; NCCL + cuBLAS in sequence; torch's fused symmetric-memory op
NEVER = 1 << 62  # min_m of a shape where the decomposition never won


@dataclass(frozen=True)
class CalibrationTable:
    """Break-even M per shape. entries: ``(kind, k, n, world, min_m)`` with kind ``"ag"`` (AG-GEMM) or ``"rs"``
    (GEMM-RS), K and N per rank (GEMM-RS: K_local and output N), min_m the smallest total M at which the
    decomposition is used. default_min_m: used for shapes not in the table. pieces: ``(kind, k, n, world, m,
    pieces)``, the piece count (1..4) measured fastest at total M ``m``; :meth:`pieces_for` applies the entry of the
    largest measured M <= the call's M (the smallest measured M below it). best: ``(kind, k, n, world, m, path)``,
    the path (:data:`PATHS`) measured fastest at total M ``m``, applied like ``pieces``; where it names ``"symm"``
    (torch's fused symmetric-memory op) the caller needs a symmetric-memory group, else ``min_m`` decides.
    schedules: ``(kind, k, n, world, m, schedule)``, the per-peer stream schedule of the decomposition
    (:data:`~sgl_kernel.tdist.decomp.SCHEDULES`) measured fastest at total M ``m``, applied like ``pieces`` (shapes
    without one keep the op's schedule). Raises ValueError on bad entries."""

    entries: Tuple[Tuple[str, int, int, int, int], ...] = ()
    default_min_m: int = 4096
    pieces: Tuple[Tuple[str, int, int, int, int, int], ...] = ()
    best: Tuple[Tuple[str, int, int, int, int, str], ...] = ()
    schedules: Tuple[Tuple[str, int, int, int, int, str], ...] = ()

    def __post_init__(self) -> None:
        for e in self.entries:
            if len(e) != 5 or e[0] not in KINDS or any(int(v) < 1 for v in e[1:]):
                raise ValueError(f"calibration entry {e!r} must be (kind in {KINDS}, k, n, world, min_m >= 1)")
        if self.default_min_m < 1:
            raise ValueError(f"default_min_m={self.default_min_m} must be >= 1")
        for e in self.pieces:
            if len(e) != 6 or e[0] not in KINDS or any(int(v) < 1 for v in e[1:5]) or not 1 <= int(e[5]) <= 4:
                raise ValueError(f"pieces entry {e!r} must be (kind in {KINDS}, k, n, world, m >= 1, pieces 1..4)")
        for e in self.best:
            if len(e) != 6 or e[0] not in KINDS or any(int(v) < 1 for v in e[1:5]) or e[5] not in PATHS:
                raise ValueError(f"best entry {e!r} must be (kind in {KINDS}, k, n, world, m >= 1, path in {PATHS})")
        for e in self.schedules:
            if len(e) != 6 or e[0] not in KINDS or any(int(v) < 1 for v in e[1:5]) or e[5] not in SCHEDULES:
                raise ValueError(f"schedules entry {e!r} must be (kind in {KINDS}, k, n, world, m >= 1, schedule in "
                                 f"{SCHEDULES})")

    @staticmethod
    def _at(rows, key, m):
        """The value of the entry with the largest measured M <= m (the smallest measured M's below it), None if
        the shape has no entry."""
        pts = sorted((int(e[4]), e[5]) for e in rows if tuple(e[:4]) == key)
        if not pts:
            return None
        below = [v for mm, v in pts if mm <= m]
        return below[-1] if below else pts[0][1]

    def pieces_for(self, kind: str, k: int, n: int, world: int, m: int) -> Optional[int]:
        """Measured best piece count of the decomposition for the shape at total M ``m`` (None: shape not
        measured; the decomposition then plans its own). A function of shared values, so equal on every rank."""
        p = self._at(self.pieces, (kind, k, n, world), m)
        return None if p is None else int(p)

    def schedule_for(self, kind: str, k: int, n: int, world: int, m: int) -> Optional[str]:
        """Measured best per-peer stream schedule of the decomposition at total M ``m`` (None: not measured)."""
        return self._at(self.schedules, (kind, k, n, world), m)

    def min_m(self, kind: str, k: int, n: int, world: int) -> int:
        """Break-even M of the shape (the table's, else :attr:`default_min_m`)."""
        for e in self.entries:
            if e[:4] == (kind, k, n, world):
                return e[4]
        return self.default_min_m

    def choose(self, kind: str, k: int, n: int, world: int, m: int, symm: bool = False) -> str:
        """The path for a call: the ``best`` entry's when the shape has one (``"symm"`` only when ``symm``, i.e. the
        caller has a symmetric-memory group), else ``"decomp"`` when ``m >= min_m`` of the shape, else ``"nccl"``.
        A function of shared values, so equal on every rank."""
        if kind not in KINDS:
            raise ValueError(f"kind={kind!r} must be one of {KINDS}")
        b = self._at(self.best, (kind, k, n, world), m)
        if b is not None and (b != "symm" or symm):
            return b
        return "decomp" if m >= self.min_m(kind, k, n, world) else "nccl"

    @classmethod
    def from_timings(cls, rows: Iterable[dict], default_min_m: int = 4096) -> "CalibrationTable":
        """Build from measured rows ``{kind, k, n, world, m, decomp_ms, nccl_ms}``: per shape, the smallest measured
        M from which the decomposition was faster at that M and every larger measured M (:data:`NEVER` if it never
        was; rows with a missing decomp or NCCL time are skipped), and the fastest path per measured (shape, M) as
        ``best`` (``symm_ms``, torch's fused symmetric-memory op, optional)."""
        rows_l = list(rows)
        by_shape: dict = {}
        for r in rows_l:
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
        return cls(tuple(entries), default_min_m, best=cls._best_rows(rows_l))

    @staticmethod
    def _best_rows(rows) -> tuple:
        """``best`` entries from rows with any of ``decomp_ms`` / ``nccl_ms`` / ``symm_ms``: the fastest path per
        measured (shape, M), where a path within :data:`TIE` of the fastest counts as a tie and the earlier path of
        :data:`PATHS` wins it (the decomposition keeps a shape whose symm-mem or NCCL time is equal within noise:
        on 2 x H200 a tie-broken pick of torch's op for ``down`` at M 8192, 1.431 vs 1.436 ms, ran at 1.535 ms)."""
        out = []
        for r in rows:
            t = {p: float(r[f"{p}_ms"]) for p in PATHS if r.get(f"{p}_ms") is not None}
            if t:
                fastest = min(t.values())
                pick = next(p for p in PATHS if p in t and t[p] <= fastest * (1 + TIE))
                out.append((r["kind"], int(r["k"]), int(r["n"]), int(r["world"]), int(r["m"]), pick))
        return tuple(sorted(out))

    def to_json(self) -> str:
        """JSON text (``from_json`` reads it back)."""
        return json.dumps({"default_min_m": self.default_min_m, "entries": [list(e) for e in self.entries],
                           "pieces": [list(e) for e in self.pieces], "best": [list(e) for e in self.best],
                           "schedules": [list(e) for e in self.schedules]})

    @classmethod
    def from_json(cls, text: str) -> "CalibrationTable":
        """Parse :meth:`to_json` output; ValueError on malformed text."""
        try:
            d = json.loads(text)
            return cls(tuple(tuple(e) for e in d["entries"]), int(d["default_min_m"]),
                       tuple(tuple(e) for e in d.get("pieces", ())), tuple(tuple(e) for e in d.get("best", ())),
                       tuple(tuple(e) for e in d.get("schedules", ())))
        except (KeyError, TypeError, json.JSONDecodeError) as e:
            raise ValueError(f"bad calibration table JSON: {e}") from e


# Measured on 2 x H100 80GB HBM3 (NVLink, multicast off), 2026-11-26 (bench_tdist.py --world 2
# --tp-shapes 4 --tokens 2048 8192, medians of CUDA events), Llama-3.3-70B TP4 shapes,
# ms at M 2048 | 8192, best decomposition (pieces) vs NCCL + cuBLAS:
#   AG qkv     K 8192 N 2560:  0.136 (1) vs 0.205 | 0.456 (2) vs 0.733 -> decomposition from M 2048
#   AG gate_up K 8192 N 14336: 0.621 (1) vs 0.808 | 2.673 (2) vs 3.078 -> decomposition from M 2048
#   RS o_proj  K 2048 N 8192:  0.315 (1) vs 0.195 | 0.573 (2 and 4 tied) vs 0.683 -> NCCL + cuBLAS below M 8192
#   RS down    K 7168 N 8192:  0.394 (1) vs 0.400 | 1.424 (2) vs 1.673 -> NCCL + cuBLAS below M 8192 (a 1.5% win at
#   2048 is within run-to-run noise; the default plan lost there, 0.488)
# torch's fused symm-mem ops in the same run, M 8192: qkv 0.527, gate_up 2.805, o_proj 0.557, down 1.421 ms: the
# best path at M 8192 is the decomposition except for o_proj (symm 0.557 vs 0.573; taken only where the caller has
# a symmetric-memory group; down's 1.421 vs 1.424 is a tie and stays on the decomposition).
# Other shapes and worlds use default_min_m and plan_chunks (the decomposition won at M = 8192 on every shape).
H100_TABLE = CalibrationTable(
    (("ag", 8192, 2560, 2, 2048), ("ag", 8192, 14336, 2, 2048), ("rs", 2048, 8192, 2, 8192),
     ("rs", 7168, 8192, 2, 8192)),
    default_min_m=4096,
    pieces=(("ag", 8192, 2560, 2, 2048, 1), ("ag", 8192, 2560, 2, 8192, 2),
            ("ag", 8192, 14336, 2, 2048, 1), ("ag", 8192, 14336, 2, 8192, 2),
            ("rs", 2048, 8192, 2, 2048, 1), ("rs", 2048, 8192, 2, 8192, 2),
            ("rs", 7168, 8192, 2, 2048, 1), ("rs", 7168, 8192, 2, 8192, 2)),
    best=(("ag", 8192, 2560, 2, 2048, "decomp"), ("ag", 8192, 2560, 2, 8192, "decomp"),
          ("ag", 8192, 14336, 2, 2048, "decomp"), ("ag", 8192, 14336, 2, 8192, "decomp"),
          ("rs", 2048, 8192, 2, 2048, "nccl"), ("rs", 2048, 8192, 2, 8192, "symm"),
          ("rs", 7168, 8192, 2, 2048, "nccl"), ("rs", 7168, 8192, 2, 8192, "decomp")))


def _overlay(base: CalibrationTable, top: CalibrationTable) -> CalibrationTable:
    """``base`` with ``top``'s rows replacing those of the same key (entries: the shape; pieces / best /
    schedules: the shape and M); ``base``'s default_min_m."""
    def merge(a, b, n):
        keys = {tuple(e[:n]) for e in b}
        return tuple(sorted([e for e in a if tuple(e[:n]) not in keys] + list(b)))
    return CalibrationTable(merge(base.entries, top.entries, 4), base.default_min_m, merge(base.pieces, top.pieces, 5),
                            merge(base.best, top.best, 5), merge(base.schedules, top.schedules, 5))


# Measured on 4 x H200 (NVLink, multicast off), 2026-11-27 00:16Z (scripts/gpu/four_gpu.sh tdist_auto: benchmark/tdist/bench_kernels.py
# --world 4 --tp-shapes 4 --tokens 2048 8192 --iters 20 --variants decomp pieces auto graph profile, medians of CUDA
# events, max over ranks), Llama-3.3-70B TP4 shapes, ms at M 2048 | 8192: best decomposition (pieces, schedule) /
# NCCL + cuBLAS / torch symm-mem fused:
#   AG qkv     K 8192 N 2560:  0.328 (1, ring) / 0.222 / 0.687 -> nccl | 0.605 (2, ring) / 0.782 / 0.495 -> symm
#   AG gate_up K 8192 N 14336: 0.690 (1, ring) / 0.818 / 0.877 -> decomp | 2.853 (1, all) / 3.000 / 2.879 -> decomp
#   RS o_proj  K 2048 N 8192:  0.714 (1, all) / 0.203 / 0.725 -> nccl | 0.759 (1, ring) / 0.719 / 0.716 -> nccl (tie)
#   RS down    K 7168 N 8192:  0.515 (1, ring) / 0.421 / 0.499 -> nccl | 1.496 (2, all) / 1.733 / 1.416 -> symm
# and at world 2 (GPUs 0-1 of the same host, M 8192 only): qkv 0.445 (2, all) / 0.720 / 0.562 -> decomp; o_proj
# 0.506 (4, all) / 0.674 / 0.530 -> decomp. Shapes and M not measured on H200 keep the H100 world-2 rows (used on
# H200 before this table) or the defaults. Measured before the receive waits got their own streams (decomp.py,
# 2026-11-27): the GEMM-RS decomposition rows at world 4 are expected to move; re-calibrate from the next run.
H200_TABLE = _overlay(H100_TABLE, CalibrationTable(
    (("ag", 8192, 2560, 4, 8192), ("ag", 8192, 14336, 4, 2048), ("rs", 2048, 8192, 4, NEVER),
     ("rs", 7168, 8192, 4, 8192)),
    pieces=(("ag", 8192, 2560, 4, 2048, 1), ("ag", 8192, 2560, 4, 8192, 2), ("ag", 8192, 14336, 4, 2048, 1),
            ("ag", 8192, 14336, 4, 8192, 1), ("rs", 2048, 8192, 4, 2048, 1), ("rs", 2048, 8192, 4, 8192, 1),
            ("rs", 7168, 8192, 4, 2048, 1), ("rs", 7168, 8192, 4, 8192, 2),
            ("ag", 8192, 2560, 2, 8192, 2), ("rs", 2048, 8192, 2, 8192, 4)),
    best=(("ag", 8192, 2560, 4, 2048, "nccl"), ("ag", 8192, 2560, 4, 8192, "symm"),
          ("ag", 8192, 14336, 4, 2048, "decomp"), ("ag", 8192, 14336, 4, 8192, "decomp"),
          ("rs", 2048, 8192, 4, 2048, "nccl"), ("rs", 2048, 8192, 4, 8192, "nccl"),
          ("rs", 7168, 8192, 4, 2048, "nccl"), ("rs", 7168, 8192, 4, 8192, "symm"),
          ("ag", 8192, 2560, 2, 8192, "decomp"), ("rs", 2048, 8192, 2, 8192, "decomp")),
    schedules=(("ag", 8192, 2560, 4, 2048, "ring"), ("ag", 8192, 2560, 4, 8192, "ring"),
               ("ag", 8192, 14336, 4, 2048, "ring"), ("ag", 8192, 14336, 4, 8192, "all"),
               ("rs", 2048, 8192, 4, 2048, "all"), ("rs", 2048, 8192, 4, 8192, "ring"),
               ("rs", 7168, 8192, 4, 2048, "ring"), ("rs", 7168, 8192, 4, 8192, "all"),
               ("ag", 8192, 2560, 2, 8192, "all"), ("rs", 2048, 8192, 2, 8192, "all"))))

BUILTIN_TABLES = (("H200", H200_TABLE), ("H100", H100_TABLE))  # (substring of the GPU name, table), first match


def table_for(device_name: str) -> CalibrationTable:
    """The built-in calibration table of a GPU model (``torch.cuda.get_device_name()``, e.g. "NVIDIA H200"):
    :data:`H200_TABLE` for H200s, :data:`H100_TABLE` for H100s, the default :class:`CalibrationTable` (the
    decomposition from ``default_min_m``, pieces from :func:`~sgl_kernel.tdist.decomp.plan_chunks`) for any other
    GPU (its timings are unknown)."""
    for key, table in BUILTIN_TABLES:
        if key in device_name:
            return table
    return CalibrationTable()


class AutoAgGemm:
    """AG-GEMM on the path the table picks per call (:meth:`CalibrationTable.choose`): ``decomp`` (a
    :class:`~sgl_kernel.tdist.decomp.DecompAgGemm`), NCCL ``all_gather_into_tensor`` + cuBLAS, or torch's
    ``symm_mem.fused_all_gather_matmul`` (only with ``symm_group``). group: the NCCL process group of the heap's
    ranks (None: always the decomposition); symm_group: the name of a group with torch symmetric memory enabled
    (None: the symm path is never taken). Uneven rows always take the decomposition (NCCL cannot gather them)."""

    def __init__(self, decomp, group=None, table: CalibrationTable = CalibrationTable(),
                 symm_group: Optional[str] = None):
        self.decomp, self.group, self.table, self.symm_group = decomp, group, table, symm_group
        self.last_path = ""

    def __call__(self, a: torch.Tensor, b: torch.Tensor, rows: Sequence[int], out: Optional[torch.Tensor] = None):
        """Same contract as DecompAgGemm.__call__; ``last_path`` says which path ran ("decomp", "nccl", "symm")."""
        import torch.distributed as dist

        h = self.decomp.heap
        m = sum(int(r) for r in rows)
        path = self.table.choose("ag", self.decomp.k, b.shape[1], h.world, m, self.symm_group is not None)
        if self.group is None or len(set(int(r) for r in rows)) != 1:
            path = "decomp"
        self.last_path = path
        if path == "decomp":
            pieces = None if self.decomp.chunks else self.table.pieces_for("ag", self.decomp.k, b.shape[1], h.world, m)
            sched = self.table.schedule_for("ag", self.decomp.k, b.shape[1], h.world, m)
            if sched is not None:
                self.decomp.hs.schedule = sched  # the same on every rank (a function of the shared table and M)
            return self.decomp(a, b, rows, out, chunks=pieces)
        if path == "symm":
            res = torch.ops.symm_mem.fused_all_gather_matmul(a, [b], 0, self.symm_group)[1][0]
            return res if out is None else out.copy_(res)
        full = torch.empty(m, a.shape[1], dtype=a.dtype, device=a.device)
        dist.all_gather_into_tensor(full, a, group=self.group)
        return torch.mm(full, b, out=out) if out is not None else full @ b


class AutoGemmRs:
    """GEMM-RS on the path the table picks per call: ``decomp`` (a
    :class:`~sgl_kernel.tdist.decomp.DecompGemmRs`), cuBLAS + NCCL ``reduce_scatter_tensor``, or torch's
    ``symm_mem.fused_matmul_reduce_scatter`` (only with ``symm_group``). group, symm_group: as AutoAgGemm."""

    def __init__(self, decomp, group=None, table: CalibrationTable = CalibrationTable(),
                 symm_group: Optional[str] = None):
        self.decomp, self.group, self.table, self.symm_group = decomp, group, table, symm_group
        self.last_path = ""

    def __call__(self, a: torch.Tensor, b: torch.Tensor, rows: Sequence[int], out: Optional[torch.Tensor] = None):
        """Same contract as DecompGemmRs.__call__; ``last_path`` says which path ran."""
        import torch.distributed as dist

        h = self.decomp.heap
        path = self.table.choose("rs", a.shape[1], self.decomp.n, h.world, a.shape[0], self.symm_group is not None)
        if self.group is None or len(set(int(r) for r in rows)) != 1:
            path = "decomp"
        self.last_path = path
        if path == "decomp":
            pieces = (None if self.decomp.chunks else
                      self.table.pieces_for("rs", a.shape[1], self.decomp.n, h.world, a.shape[0]))
            sched = self.table.schedule_for("rs", a.shape[1], self.decomp.n, h.world, a.shape[0])
            if sched is not None:
                self.decomp.hs.schedule = sched  # the same on every rank (a function of the shared table and M)
            return self.decomp(a, b, rows, out, chunks=pieces)
        if path == "symm":
            res = torch.ops.symm_mem.fused_matmul_reduce_scatter(a, b, "sum", 0, self.symm_group)
            return res if out is None else out.copy_(res)
        if out is None:
            out = torch.empty(int(rows[h.rank]), b.shape[1], dtype=a.dtype, device=a.device)
        dist.reduce_scatter_tensor(out, a @ b, group=self.group)
        return out
