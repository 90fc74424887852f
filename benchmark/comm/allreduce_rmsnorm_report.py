"""Main table of ``benchmark/comm/bench_allreduce_rmsnorm.py``: what a plain call gets vs what only split calls get.

The fused AllReduce + RMSNorm targets (>= NCCL + fused norm, >= NCCL symmetric, >= torch symmetric memory)
are about the calls the communicator makes. A plain call updates the full residual; only TokenWeave's split calls
(TokenWeave sec. 3.3) may keep the residual sharded (``*_sharded`` methods: each rank updates only its own rows,
which saves the residual's AllGather). So per (world, T) row the table reports three tw-comm times, each with its
speed-ups (baseline time / tw time, > 1 = tw-comm faster) over NCCL + norm, NCCL symmetric and torch symm-mem:

* ``auto``: the call as the communicator makes it for a plain full-residual call at this T (backend and SMs
  picked by ``tw_comm.select_backend`` from the packaged calibration table of this GPU and world, the built-in
  rules without one); row keys ``auto`` (pick label) and ``auto_us``;
* ``best full``: the fastest full-residual configuration timed in the row (default methods, SM / CTA sweeps,
  ``cal:`` calibration candidates), i.e. what a perfect table would give a plain call;
* ``best sharded``: the fastest ``*_sharded`` configuration (only split calls can use it), labelled apart.

Pure functions of the row dicts (no torch), so the table is unit-tested on synthetic timings.
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

# keys of a row that are not tw-comm timings
NON_TW_KEYS = ("world", "T", "bytes", "floor_us", "baseline", "nccl_symm", "torch_symm", "auto", "auto_us")
BASELINES = (("baseline", "NCCL"), ("nccl_symm", "nccl_symm"), ("torch_symm", "torch_symm"))


def method_of(key: str) -> str:
    """The method name of a timing key: ``cta:twoshot_bulk@16`` / ``cal:p2p_twoshot@128`` / ``twoshot@8`` ->
    ``twoshot_bulk`` / ``p2p_twoshot`` / ``twoshot``."""
    return key.split(":")[-1].split("@")[0]


def is_sharded(key: str) -> bool:
    """Whether a timing key is a sharded-residual configuration (usable only by TokenWeave's split calls)."""
    return "_sharded" in method_of(key)


def tw_timings(row: dict, tw_methods: Sequence[str]) -> dict:
    """{key: us} of every tw-comm configuration timed in ``row``: the default ``tw_methods``, the sweeps
    (``name@N``, ``cta:name@N``) and the plain calibration candidates (``cal:``). Overlapped candidates (``ovl:``)
    are left out: they repeat sweep entries at the overlap SM budget."""
    return {k: v for k, v in row.items()
            if isinstance(v, float) and k not in NON_TW_KEYS and not k.startswith("ovl:")
            and (k in tw_methods or "@" in k)}


def best(row: dict, tw_methods: Sequence[str], sharded: bool) -> Optional[Tuple[str, float]]:
    """(key, us) of the fastest full-residual (``sharded`` False) or sharded configuration of ``row``; None when
    none was timed."""
    cand = {k: v for k, v in tw_timings(row, tw_methods).items() if is_sharded(k) == sharded}
    if not cand:
        return None
    k = min(cand, key=cand.get)
    return k, cand[k]


def _speedups(row: dict, us: Optional[float]) -> list:
    """Cells: each baseline's time / ``us`` (n/a where either is missing)."""
    return [f"{row[b] / us:.2f}x" if us and row.get(b) else "n/a" for b, _ in BASELINES]


def main_table(rows: Sequence[dict], tw_methods: Sequence[str]) -> list:
    """Markdown lines of the main table: per (world, T) the baselines, every default tw-comm method, then
    ``auto`` / ``best full`` / ``best sharded`` with their speed-ups over each baseline and best full / floor.
    Rows without any tw-comm timing are skipped."""
    fmt = lambda v: f"{v:.1f}" if isinstance(v, float) else "n/a"  # noqa: E731
    heads = ["world", "T", "floor", "NCCL + norm", "nccl_symm", "torch_symm", *tw_methods, "auto (pick)",
             "best full (method)", "best sharded (method)"]
    for side in ("auto", "full", "sharded"):
        heads += [f"{b} / {side}" for _, b in BASELINES]
    heads += ["full / floor"]
    lines = ["times: us per call. auto = a plain full-residual call as the communicator makes it (packaged table's "
             "pick); best full = fastest full-residual configuration timed; best sharded = fastest sharded-residual "
             "one (only TokenWeave's split calls can use it). `X / auto` = X's time / auto's time (> 1: tw-comm "
             "faster).", "", "| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
    for r in rows:
        if not tw_timings(r, tw_methods):
            continue
        full, shard, auto_us = best(r, tw_methods, False), best(r, tw_methods, True), r.get("auto_us")
        cell = lambda b: f"{b[1]:.1f} ({b[0]})" if b else "n/a"  # noqa: E731
        auto = f"{fmt(auto_us)} ({r.get('auto', '?')})"
        lines.append("| " + " | ".join(
            [str(r["world"]), str(r["T"]), f"{r['floor_us']:.1f}", fmt(r.get("baseline")), fmt(r.get("nccl_symm")),
             fmt(r.get("torch_symm")), *(fmt(r.get(m)) for m in tw_methods), auto, cell(full), cell(shard),
             *_speedups(r, auto_us), *_speedups(r, full and full[1]), *_speedups(r, shard and shard[1]),
             f"{full[1] / r['floor_us']:.2f}x" if full else "n/a"]) + " |")
    return lines


FLOOR = {"column": "floor_us", "model": "line rate: 2(n-1)/n * S / 450 GB/s (S = T x hidden x 2 bytes)"}


def record_rows(rows: Sequence[dict], tw_methods: Sequence[str]) -> list:
    """The benchmark's rows with the main table's derived columns: ``best_full`` / ``best_full_us``,
    ``best_sharded`` / ``best_sharded_us`` and the speed-ups ``nccl_over_auto`` / ``nccl_over_best_full`` /
    ``nccl_symm_over_auto`` (baseline time / tw-comm time, > 1: tw-comm faster) and ``best_full_over_floor``."""
    from benchmark.common.records import add_ratio

    out = []
    for r in rows:
        full, shard = best(r, tw_methods, False), best(r, tw_methods, True)
        out.append({**r, "best_full": full and full[0], "best_full_us": full and full[1],
                    "best_sharded": shard and shard[0], "best_sharded_us": shard and shard[1]})
    out = add_ratio(out, "nccl_over_auto", "baseline", "auto_us")
    out = add_ratio(out, "nccl_over_best_full", "baseline", "best_full_us")
    out = add_ratio(out, "nccl_symm_over_auto", "nccl_symm", "auto_us")
    return add_ratio(out, "best_full_over_floor", "best_full_us", "floor_us")


def build_record(rows: Sequence[dict], notes: Sequence[str], tw_methods: Sequence[str], *, params: dict,
                 gpu_count: Optional[int] = None, env: Optional[dict] = None, command: Optional[str] = None) -> dict:
    """The run as a :mod:`benchmark.common.records` record (``what`` = ``allreduce_rmsnorm``): rows from
    :func:`record_rows`, NCCL + norm / nccl_symm / torch_symm as the same-run baselines, the line-rate floor;
    headline: ``auto`` vs NCCL + fused norm at the largest world, at its smallest and its largest T."""
    from benchmark.common import records

    rows = record_rows(rows, tw_methods)
    cols = {k for r in rows for k in r}
    units = {k: "us" for k in cols if k.endswith("_us") or k in tw_methods or "@" in k
             or k in ("baseline", "nccl_symm", "torch_symm")}
    headline = []
    timed = [r for r in rows if r.get("auto_us") and r.get("baseline")]
    if timed:
        world = max(r["world"] for r in timed)
        at = sorted((r for r in timed if r["world"] == world), key=lambda r: r["T"])
        for r in ([at[0], at[-1]] if len(at) > 1 else at):
            headline.append({"label": f"fused AllReduce + RMSNorm (auto: {r.get('auto')}), world {world}, "
                                      f"T={r['T']}", "value": round(r["auto_us"], 2), "unit": "us",
                             "baseline": round(r["baseline"], 2), "ratio": r["nccl_over_auto"]})
    return records.make_record(
        subject="comm", benchmark="benchmark.comm.bench_allreduce_rmsnorm", mode="allreduce_rmsnorm",
        what="allreduce_rmsnorm", rows=rows, params=params,
        baselines=[b for b, _ in BASELINES if b in cols], units=units, floor=FLOOR, headline=headline,
        notes=list(notes), gpu_count=gpu_count, env=env, command=command)
