"""Lay one decode GPU run's outputs into one results file ``<date>_decode_one_gpu.md``.

Reads what the one-GPU decode script (``scripts/gpu/``) leaves under ``--out``: ``decode_step_ab.json``
(``benchmark/decode/step_ab.py``: floors, ``bench_one_batch`` rows, decode old/new, the serving path's decode step
with overlap off/on, prefill, kernel breakdown; a status table against the decode targets),
``host_cuda/decode_host.json`` (``benchmark/decode/host_step.py --device cuda``), ``extend_configs.md``
(``benchmark/attention/extend_configs.py``), ``decode_serving_*.jsonl``
(``bench_serving``), ``decode_gpu_test.log`` / ``decode_pytest.log``; any missing part is reported as missing.

Usage: ``python benchmark/decode/gpu_run_report.py --out DIR --command "..." --commit SHA``; writes
``DIR/<YYYY-MM-DD>_decode_one_gpu.md`` and prints its path.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import sys
from pathlib import Path
from typing import Optional

if __package__ in (None, ""):  # run as a file: the repository root makes the benchmark package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

TARGETS = {1: 1.3, 32: 1.2, 128: 1.2}  # the decode targets: decode step / memory floor
PREFILL_TARGET = 0.70


def _load(path: Path) -> Optional[dict]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _met(ratio: float, target: float, op: str = "<=") -> str:
    ok = ratio <= target if op == "<=" else ratio >= target
    return f"{ratio:.3f} ({op} {target}: {'met' if ok else 'not met'})"


def _tests(out: Path) -> list[str]:
    lines = []
    for name in ("decode_pytest.log", "decode_gpu_test.log"):
        p = out / name
        if not p.exists():
            lines.append(f"- `{name}`: missing")
            continue
        text = p.read_text(errors="replace")
        summary = [ln.strip() for ln in text.splitlines() if re.search(r"\d+ (passed|failed|error)", ln)]
        lines.append(f"- `{name}`: {summary[-1] if summary else 'no pytest summary line'}")
        lines += [f"    {ln.strip()}" for ln in text.splitlines()
                  if re.search(r"KV pool|batch 128 x 1024|largest step", ln)]
    return lines


def _cli(res: dict) -> list[str]:
    out = ["## bench_one_batch at the defaults vs the memory floor", "",
           "| batch | in | out | median decode (ms) | floor (ms) | step/floor (target) | prefill (s) |",
           "|---:|---:|---:|---:|---:|---|---:|"]
    for r in res.get("cli", []):
        t = TARGETS.get(r["batch"], 1.2)
        out.append(f"| {r['batch']} | {r['input_len']} | {r['output_len']} | {r['median_decode_ms']:.3f} | "
                   f"{r['floor_ms']:.3f} | {_met(r['ratio'], t)} | {r['prefill_s']:.3f} |")
    return out + [""]


def _decode(res: dict) -> list[str]:
    out = ["## Decode step, host path old (before the host-path rework) vs new, same graphs, one process, order alternated", "",
           "| batch | path | step (ms) | floor (ms) | step/floor (target) | host before forward (ms) | "
           "host in forward (ms) | replay (ms) | replay/floor | nodes |",
           "|---:|---|---:|---:|---|---:|---:|---:|---:|---|"]
    for r in res.get("decode", []):
        nodes = r.get("nodes") or {}
        nd = f"{nodes.get('total', 'n/a')} ({nodes.get('kernel', '?')} kernels)" if nodes else "n/a"
        t = TARGETS.get(r["batch"], 1.2)
        out.append(f"| {r['batch']} | {r['setting']} | {r['step_ms']:.3f} | {r['floor_ms']:.3f} | "
                   f"{_met(r['ratio'], t)} | {r['pre_ms']:.3f} | {r['host_ms']:.3f} | {r['replay_ms']:.3f} | "
                   f"{r['replay_ms'] / r['floor_ms']:.3f} | {nd} |")
    return out + [""]


def _status(res: dict) -> list[str]:
    """The decode targets per batch: step / floor of every decode row of this call against the target."""
    out = ["## Decode status vs the targets (step / memory floor; this call, this GPU)", "",
           "| batch | target | bench_one_batch | harness (new host path) | graph replay alone | serving, overlap off | "
           "serving, overlap host futures | serving, overlap (as served) | met by the served step |",
           "|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for bs in sorted({r["batch"] for key in ("cli", "decode", "serving") for r in res.get(key, [])}):
        t = TARGETS.get(bs, 1.2)

        def cell(key, field, value, rows=res):
            got = [r["ratio"] for r in rows.get(key, []) if r["batch"] == bs and r.get(field, value) == value]
            return f"{got[0]:.3f}" if got else "n/a"

        replay = [r["replay_ms"] / r["floor_ms"] for r in res.get("decode", [])
                  if r["batch"] == bs and r.get("setting") == "new"]
        served = cell("serving", "mode", "overlap")
        met = "n/a" if served == "n/a" else ("yes" if float(served) <= t else "no")
        out.append(f"| {bs} | {t} | {cell('cli', 'batch', bs)} | {cell('decode', 'setting', 'new')} | "
                   f"{f'{replay[0]:.3f}' if replay else 'n/a'} | "
                   f"{cell('serving', 'mode', 'plain')} | {cell('serving', 'mode', 'overlap-host')} | {served} | "
                   f"{met} |")
    return out + [""]


def _serving_decode(res: dict) -> list[str]:
    if not res.get("serving"):
        return ["Serving-path decode step: not measured this call.", ""]
    from benchmark.decode.served_step import render_rows

    return render_rows(res["serving"]) + [""]


def _host(out_dir: Path) -> list[str]:
    h = _load(out_dir / "host_cuda" / "decode_host.json")
    if not h:
        return ["Host micro-benchmark on the GPU machine: missing.", ""]
    out = [f"## Host part of a decode step ({h['header']})", "",
           "| batch | stage legacy | stage packed | sampling build | sampling reuse | CLI step host old | "
           "CLI step host new |", "|---:|---:|---:|---:|---:|---:|---:|"]
    out += [f"| {r['batch']} | {r['stage_legacy_us']:.1f} | {r['stage_packed_us']:.1f} | {r['sampling_build_us']:.1f} "
            f"| {r['sampling_reuse_us']:.1f} | {r['step_host_old_us']:.1f} | {r['step_host_new_us']:.1f} |"
            for r in h["rows"]]
    return out + [""]


def _prefill(res: dict) -> list[str]:
    out = []
    p = res.get("prefill")
    if p:
        out += ["## Prefill", "", f"Prefill of {p['tokens']} tokens (one request, median of the timed runs after a "
                f"warm-up): {p['median_s'] * 1e3:.1f} ms, {p['flops_per_s'] / 1e12:.0f} TFLOP/s = "
                f"{_met(p['ratio'], PREFILL_TARGET, '>=')} of the matmul rate.", ""]
    if res.get("breakdown"):
        from benchmark.common.kernel_breakdown import render_breakdowns

        out += ["## GPU time by kernel category (torch.profiler, one call each)", ""]
        out += render_breakdowns(res["breakdown"]) + [""]
    return out


def _serving(out_dir: Path) -> list[str]:
    keys = ["completed", "output_throughput", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "median_itl_ms",
            "p99_itl_ms", "mean_tpot_ms"]
    rows = []
    for path in sorted(out_dir.glob("decode_serving_*.jsonl")):
        lines = [ln for ln in path.read_text().splitlines() if ln.strip()]
        if lines:
            r = json.loads(lines[-1])
            cells = [f"{r[k]:.1f}" if isinstance(r.get(k), float) else str(r.get(k, "n/a")) for k in keys]
            rows.append(f"| {path.stem[len('decode_serving_'):]} | " + " | ".join(cells) + " |")
    if not rows:
        return ["bench_serving: not run (time budget) or failed; see decode_run.log.", ""]
    return (["## bench_serving @64 at the defaults (random 1024/256; ShareGPT)", "",
             "| workload | " + " | ".join(keys) + " |", "|---|" + "---:|" * len(keys)] + rows + [""])


def render(out_dir: Path, command: str, commit: str) -> str:
    """The results file's text for the outputs under ``out_dir``."""
    res = _load(out_dir / "decode_step_ab.json") or {}
    date = res.get("date", "unknown date")
    head = [f"# Decode on one GPU ({date}, {res.get('gpu', 'GPU unknown')})", "",
            f"- GPU: {res.get('gpu', 'unknown')}; torch {res.get('torch', 'unknown')}; commit {commit}.",
            f"- Command: `{command}`.",
            "- Model: Llama-3.1-8B config, dummy bf16 weights, Llama-3 tokenizer; defaults unless stated."]
    if res:
        head.append(f"- Floors (same call): copy bandwidth {res['hbm_bytes_per_s'] / 1e12:.3f} TB/s (read + write), "
                    f"bf16 matmul {res['matmul_flops_per_s'] / 1e12:.0f} TFLOP/s; memory floor of a decode step = "
                    "(weight bytes + KV bytes read) / copy bandwidth.")
    else:
        head.append("- decode_step_ab.json missing: no floors, decode or prefill numbers in this run.")
    body = head + ["", "## Correctness (GPU tests of this run)", ""] + _tests(out_dir) + [""]
    body += _status(res) + _cli(res) + _decode(res) + _serving_decode(res) + _host(out_dir) + _prefill(res)
    ext = out_dir / "extend_configs.md"
    body += (["## " + ext.read_text().strip(), ""] if ext.exists()
             else ["Extend attention config sweep: missing.", ""])
    body += _serving(out_dir)
    return "\n".join(body) + "\n"


def main(argv=None) -> int:
    """Write ``<out>/<date>_decode_one_gpu.md`` (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--command", required=True, help="the command that produced --out (recorded in the file)")
    p.add_argument("--commit", default="unknown")
    cfg = p.parse_args(argv)
    out = Path(cfg.out)
    text = render(out, cfg.command, cfg.commit)
    res = _load(out / "decode_step_ab.json") or {}
    day = str(res.get("date") or datetime.date.today().isoformat())[:10]
    path = out / f"{day}_decode_one_gpu.md"
    path.write_text(text)
    sys.stdout.write(f"{path}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
