"""Status of the tdist targets from a ``benchmark/tdist/bench_kernels.py`` results table (markdown, as written by
``benchmark.tdist.kernels_lib.table``): one line per target with the measured ratios and met / not met.

Targets (world 2 here): AG-GEMM >= 1.15x and GEMM-RS >= 1.1x NCCL + cuBLAS at M = 8192 on every shape;
>= 1.0x or the automatic fallback (the auto op took NCCL + cuBLAS) at M = 2048; >= torch's fused symmetric-memory
op at M = 8192 (or the auto op took it); all-to-all <= 1.5x NCCL ``all_to_all_single``'s time at 1024 tokens.
Ratios are the table's (baseline ms / tdist ms, tdist = the auto op where measured).

Usage: python benchmark/tdist/targets_status.py BENCH.md [OUT.md]
"""

from __future__ import annotations

import sys
from typing import Dict, List, Optional


def parse(text: str) -> List[Dict[str, str]]:
    """Rows of the results table (the first markdown table whose header has the ``nccl/tdist`` column) as dicts
    keyed by the header cells (lower-cased). Lines outside that table are skipped: the bench file also holds the
    profile table (other columns), whose rows must not be read as targets."""
    rows, head = [], None
    for line in text.splitlines():
        if not line.startswith("|"):
            if head is not None and not line.strip():
                break  # the results table ended (a note cell broken over lines does not end it)
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if head is None:
            if "nccl/tdist" in [c.lower() for c in cells]:
                head = [c.lower() for c in cells]
        elif not set(cells[0]) <= {"-"}:
            rows.append(dict(zip(head, cells)))
    return rows


def _ratio(cell: str) -> Optional[float]:
    try:
        return float(cell.rstrip("x"))
    except (AttributeError, ValueError):
        return None


def status(rows: List[Dict[str, str]]) -> List[str]:
    """Markdown lines: | target | shape | M | measured | met |."""
    out = ["| target | shape | M | measured | met |", "|---|---|---|---|---|"]
    for r in rows:
        op, m, shape = r.get("op", ""), r.get("m", ""), r.get("shape", "").split(" ")[0]
        r1, r2 = _ratio(r.get("nccl/tdist", "")), _ratio(r.get("symm/tdist", ""))
        path = r.get("tdist auto ms (path)", "-")
        path = path[path.find("(") + 1: path.find(")")].split(",")[0] if "(" in path else "-"
        if op in ("AG-GEMM", "GEMM-RS") and m == "8192":
            goal = 1.15 if op == "AG-GEMM" else 1.1
            out.append(f"| {op} >= {goal}x NCCL+cuBLAS | {shape} | {m} | {r.get('nccl/tdist')} (auto: {path}) | "
                       f"{'yes' if r1 is not None and r1 >= goal else 'no'} |")
            ok = (r2 is not None and r2 >= 1.0) or path == "symm"
            out.append(f"| {op} >= torch symm-mem fused | {shape} | {m} | {r.get('symm/tdist')} (auto: {path}) | "
                       f"{'yes' if ok else 'no'}{' (fallback to the fused op)' if path == 'symm' else ''} |")
        elif op in ("AG-GEMM", "GEMM-RS") and m == "2048":
            ok = (r1 is not None and r1 >= 1.0) or path == "nccl"
            out.append(f"| {op} >= 1.0x or fallback | {shape} | {m} | {r.get('nccl/tdist')} (auto: {path}) | "
                       f"{'yes' if ok else 'no'}{' (fallback)' if path == 'nccl' and (r1 or 0) < 1.0 else ''} |")
        elif op == "all-to-all":
            slow = 1.0 / r1 if r1 else None
            out.append(f"| all-to-all <= 1.5x NCCL time | H=7168 | {m} | "
                       f"{'-' if slow is None else f'{slow:.2f}x NCCL time'} | "
                       f"{'yes' if slow is not None and slow <= 1.5 else 'no'} |")
    return out


def main(argv=None) -> None:
    """CLI: print (and optionally write) the status table of a results file."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        sys.exit(0 if argv else 2)
    with open(argv[0]) as f:
        text = "\n".join(status(parse(f.read()))) + "\n"
    print(text)
    if len(argv) > 1:
        with open(argv[1], "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
