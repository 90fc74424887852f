"""One markdown table of several ``bench_pd_serving.py`` runs (one setup each: a pd variant or agg2), with the pd rows'
ratios against the agg2 row of the same call (the PD targets: transfer share of TTFT <= 2%, ITL p99 agg2 /
pd >= 1.5, output throughput pd / agg2 >= 0.9).

Usage (CLI output only)::

    python scripts/gpu/pd_rows_table.py --dataset random --row "pd pull token_major=OUT/tok" --row "agg2=OUT/agg2"

Each ``--row LABEL=DIR`` names a ``--out-dir`` of benchmark/disaggregation/bench_pd_serving.py; the row is its ``*_pd_serving_*.json`` whose
``dataset`` is ``--dataset`` (files without that key count as their run's first dataset, given by the file name
having no ``_sharegpt``/``_random`` suffix). A directory without such a file, or whose run failed, prints its error.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os

COLS = ("mean_ttft_ms", "median_ttft_ms", "mean_tpot_ms", "p99_itl_ms", "output_throughput", "completed")
SHARE = {"pull": "pure READ time (first READ posted -> last READ DONE)",
         "push": "WRITE time after the prefill forward (layerwise: last layer posted -> last WRITE DONE seen)"}


def load(run_dir: str, dataset: str) -> dict:
    """The bench_pd_serving JSON record of ``dataset`` in ``run_dir`` (the newest), or ``{}`` when there is none."""
    best = {}
    for f in sorted(glob.glob(os.path.join(run_dir, "*_pd_serving_*.json"))):
        try:
            with open(f) as fh:
                d = json.load(fh)
        except (OSError, ValueError):
            continue
        ds = d.get("dataset") or next((x for x in ("sharegpt", "random") if f.endswith(f"_{x}.json")), dataset)
        if ds == dataset:
            best = d
    return best


def fmt(v, spec: str = ".2f") -> str:
    """``v`` formatted, ``-`` for a missing or NaN value."""
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def row_values(d: dict) -> tuple[str, dict, dict, str]:
    """(setup, bench_serving record, transfer summary, transfer mode) of one run; setup "" when nothing measured."""
    res = d.get("results", {})
    setup = "pd" if "pd" in res else ("agg2" if "agg2" in res else "")
    cmd = d.get("command", [])
    mode = cmd[cmd.index("--transfer-mode") + 1] if "--transfer-mode" in cmd else "pull"
    return setup, res.get(setup, {}), d.get("transfer") or {}, mode


def table(rows: list[tuple[str, str]], dataset: str) -> list[str]:
    """The markdown lines: one line per row, ratios of every pd row to the agg2 row, then failures and the share's
    definition per mode."""
    got = [(label, *row_values(d), d) for label, d in ((label, load(path, dataset)) for label, path in rows)]
    base = next((r for _, s, r, _, _, _ in got if s == "agg2"), None)
    out = ["| row | TTFT mean ms | TTFT p50 ms | TPOT mean ms | ITL p99 ms | out tok/s | done | transfer ms/req in TTFT | "
           "transfer share of TTFT | READs (pull) / WRITEs (push) per req | ITL p99 agg2 / row | tok/s row / agg2 |",
           "|---" * 12 + "|"]
    notes, modes = [], set()
    for label, setup, r, x, mode, d in got:
        if not setup:
            err = "; ".join(f"{k}: {v[-300:]}" for k, v in (d.get("errors") or {}).items()) or "no result file"
            notes.append(f"- {label}: not measured ({err})")
            continue
        itl = tput = "-"
        if setup == "pd" and base:
            itl = fmt(base.get("p99_itl_ms", math.nan) / max(r.get("p99_itl_ms", math.nan), 1e-9))
            tput = fmt(r.get("output_throughput", math.nan) / max(base.get("output_throughput", math.nan), 1e-9))
        share = "-"
        if x:
            modes.add(mode)
            share = f"{fmt(100 * x.get('share_of_ttft', math.nan))}% ({mode})"
        out.append(f"| {label} | " + " | ".join(fmt(r.get(c), ".1f" if c != "completed" else ".0f") for c in COLS)
                   + f" | {fmt(x.get('added_mean_ms', x.get('mean_ms')), '.3f')} | {share} | "
                   f"{fmt(x.get('reads_per_request'), '.1f')} | {itl} | {tput} |")
        if x and mode == "push":
            notes.append(f"- {label}: whole WRITE time {fmt(x.get('mean_ms'), '.3f')} ms per request "
                         f"({fmt(100 * x.get('write_share_of_ttft', math.nan))}% of TTFT; layerwise it overlaps the "
                         "prefill forward)")
        for k, v in (d.get("errors") or {}).items():
            notes.append(f"- {label}: {k} failed: {v[-300:]}")
    out += [""] + notes
    out += [f"- transfer share of TTFT ({m}) = mean {SHARE[m]} / mean router TTFT" for m in sorted(modes) if m in SHARE]
    return out


def main(argv=None) -> None:
    """Print the table of ``--row`` runs for ``--dataset``."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dataset", default="random")
    ap.add_argument("--row", action="append", default=[], help="LABEL=DIR (a benchmark/disaggregation/bench_pd_serving.py --out-dir)")
    a = ap.parse_args(argv)
    rows = []
    for spec in a.row:
        label, sep, path = spec.partition("=")
        if not sep:
            ap.error(f"--row {spec!r}: expected LABEL=DIR")
        rows.append((label, path))
    print("\n".join(table(rows, a.dataset)))


if __name__ == "__main__":
    main()
