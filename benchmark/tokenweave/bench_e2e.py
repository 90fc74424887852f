"""TokenWeave end to end, order-controlled: prefill-heavy ``sgl.Engine`` throughput with TokenWeave off and on,
and greedy output equality on vs off (TokenWeave = Gond et al. 2025, sec. 3-4).

Each run is one child process that starts ``sgl.Engine`` (``--load-format dummy`` seeded weights by default, so
every start holds the same weights; ``skip_tokenizer_init``, token-id prompts), generates a warm-up batch, then
``--reps`` timed batches of ``--num-prompts`` prompts of ``--input-len`` random token ids (fixed seed, the same in
every run) with ``--output-len`` greedy tokens (temperature 0, ignore_eos), radix cache off so no rep reuses a
prefix, and shuts down. Runs go off, on, off, on, ... (``--rounds`` pairs), so start-up, compile and warm-up
costs fall on both sides; a pair is only started when the time the last pair took still fits in ``--budget``.
Per side the median over all timed reps of all its runs is reported (prefill = input tokens / wall second of
the batch, the batch being prefill-bound with few output tokens), the on/off ratio of the medians, and greedy
equality: every run's output ids compared with the first ``off`` run's, prompt by prompt (off vs off is the
run-to-run floor: a mismatch there is nondeterminism, not TokenWeave).

Usage::

    python benchmark/tokenweave/bench_e2e.py --model-path ../shared/data/configs/meta-llama--Llama-3.3-70B-Instruct \\
        --tp 4 --num-prompts 32 --input-len 4096 --output-len 4 --budget 280 --out results.md
    python benchmark/tokenweave/bench_e2e.py --model-path ../shared/data/models/stories260K --load-format auto \\
        --device cpu --tp 2 --num-prompts 4 --input-len 64 --output-len 8 --min-tokens 8   # CPU gloo check

``--record-dir DIR`` also writes the project's JSON record + markdown (:func:`e2e_record`) under ``DIR/tokenweave/``:
headline TokenWeave on vs off, median prefill and total tok/s.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "python"), str(ROOT)]  # sglang, and the benchmark package when run as a file
from sglang.srt.utils.nvls_env import NVLS_OFF_ENV  # noqa: E402  (pure Python: no torch/CUDA import)


def engine_kwargs(a, side: str) -> dict:
    """``sgl.Engine`` keyword arguments (ServerArgs field names) of one run; ``side`` is ``off`` or ``on``.

    Raises:
        ValueError: ``side`` is neither ``off`` nor ``on``.
    """
    if side not in ("off", "on"):
        raise ValueError(f"side={side!r}: use 'off' or 'on'")
    kw = dict(model_path=a.model_path, tp_size=a.tp, load_format=a.load_format, skip_tokenizer_init=True,
              disable_radix_cache=True, random_seed=0, log_level=a.log_level)
    if a.device == "cpu":
        kw["device"] = "cpu"
    else:
        kw.update(dtype=a.dtype, disable_cuda_graph=a.disable_cuda_graph)
        if a.cuda_graph_max_bs:
            kw["cuda_graph_max_bs"] = a.cuda_graph_max_bs
    for name in ("max_total_tokens", "chunked_prefill_size", "mem_fraction_static", "max_running_requests"):
        if getattr(a, name) is not None:
            kw[name] = getattr(a, name)
    if a.chunked_prefill_size:
        kw["max_prefill_tokens"] = a.chunked_prefill_size
    if side == "on":
        kw["enable_tokenweave"] = True
        if a.min_tokens is not None:
            kw["tokenweave_min_tokens"] = a.min_tokens
        if a.comm_sms is not None:
            kw["tokenweave_comm_sms"] = a.comm_sms
        if a.full_residual:
            kw["tokenweave_sharded_residual"] = False
    return kw


def make_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """``n`` prompts of ``length`` token ids, uniform in ``[10, vocab - 10)`` from a seeded generator (the same in
    every run and process). Raises ValueError for a vocabulary under 32 ids or non-positive sizes."""
    import random

    if vocab < 32 or n < 1 or length < 1:
        raise ValueError(f"vocab={vocab}, n={n}, length={length}: need vocab >= 32 and n, length >= 1")
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab - 10) for _ in range(length)] for _ in range(n)]


def _vocab_size(model_path: str) -> int:
    cfg = json.loads((Path(model_path) / "config.json").read_text())
    return int(cfg.get("vocab_size") or cfg.get("text_config", {}).get("vocab_size"))


def _timed(engine, prompts: list[list[int]], params: dict) -> tuple[float, list[list[int]]]:
    t0 = time.perf_counter()
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    dt = time.perf_counter() - t0
    return dt, [list(o["output_ids"]) for o in outs]


def worker(a, side: str, result_file: str) -> None:
    """One run (child process): start the engine, warm up, ``--reps`` timed batches, shut down; writes a JSON
    record (start-up seconds, per-rep seconds, prefill and total tokens/s, the output ids of the last rep)."""
    import sglang as sgl

    prompts = make_prompts(a.num_prompts, a.input_len, _vocab_size(a.model_path), seed=1234)
    params = {"max_new_tokens": a.output_len, "temperature": 0.0, "ignore_eos": True}
    t0 = time.perf_counter()
    engine = sgl.Engine(**engine_kwargs(a, side))
    rec: dict = {"side": side, "start_s": time.perf_counter() - t0, "reps_s": []}
    try:
        warm = make_prompts(min(a.num_prompts, max(2, a.tp)), a.input_len, _vocab_size(a.model_path), seed=99)
        rec["warmup_s"] = _timed(engine, warm, params)[0]
        for _ in range(a.reps):
            dt, ids = _timed(engine, prompts, params)
            rec["reps_s"].append(dt)
        n_out = sum(len(x) for x in ids)
        rec["output_ids"] = ids
        rec["prefill_tok_s"] = [a.num_prompts * a.input_len / s for s in rec["reps_s"]]
        rec["total_tok_s"] = [(a.num_prompts * a.input_len + n_out) / s for s in rec["reps_s"]]
    finally:
        engine.shutdown()
    Path(result_file).write_text(json.dumps(rec))


def _child_cmd(a, side: str, result_file: str) -> list[str]:
    argv = [x for x in a.argv if x != "--dry-run"]
    return [sys.executable, str(Path(__file__).resolve()), *argv, "--worker", side, "--result-file", result_file]


def _child_env() -> dict:
    path = os.pathsep.join([str(ROOT / "python"), str(ROOT / "sgl-kernel" / "python")])
    old = os.environ.get("PYTHONPATH")
    return dict(os.environ, **NVLS_OFF_ENV, PYTHONUNBUFFERED="1", PYTHONPATH=path + (os.pathsep + old if old else ""))


def run_one(a, side: str, timeout: float) -> dict:
    """Run one child (``side``) under ``timeout`` seconds; its record, or ``{"side", "error"}`` on failure
    (exit code or timeout, with the log tail) so the other runs still report."""
    with tempfile.TemporaryDirectory() as d:
        res, log = Path(d) / "run.json", Path(d) / "run.log"
        t0 = time.monotonic()
        with open(log, "w") as fh:
            p = subprocess.Popen(_child_cmd(a, side, str(res)), stdout=fh, stderr=subprocess.STDOUT,
                                 env=_child_env(), start_new_session=True)
            try:
                rc = p.wait(timeout=max(1.0, timeout))
            except subprocess.TimeoutExpired:
                _kill_group(p)
                rc = "timeout"
            _reap_group(p.pid)
        wall = time.monotonic() - t0
        text = log.read_text(errors="replace")
        if rc == 0 and res.exists():
            rec = json.loads(res.read_text())
            rec["wall_s"] = wall
            rec["tw_lines"] = _tokenweave_lines(text)
            return rec
        tail = text[-1500:]
        return {"side": side, "error": f"rc={rc} after {wall:.0f}s", "log_tail": tail, "wall_s": wall}


def _tokenweave_lines(log: str, most: int = 6) -> list[str]:
    """The distinct TokenWeave decisions, residual mode and communicator choices a run logged (message part only),
    so the report shows whether ``on`` split any batch, with which residual, and which communicator each side
    used."""
    seen: list[str] = []
    for line in log.splitlines():
        mode, msg = re.search(r"TokenWeave on: .*residual (\w+)", line), None
        if mode:
            msg = f"TokenWeave residual: {mode.group(1)}"
        elif "TokenWeave:" in line or "communicator" in line.lower():
            msg = re.sub(r"rank \d+/", "rank */", line.split("] ", 1)[-1].strip())[:140]
        if msg is not None and msg not in seen:
            seen.append(msg)
    return seen[:most]


def _reap_group(pgid: int) -> None:
    """SIGKILL what is left of a finished child's process group (an engine subprocess that outlived its
    parent would hold GPU memory the next run needs); a no-op when the group is gone."""
    import signal

    try:
        os.killpg(pgid, signal.SIGKILL)
        time.sleep(1.0)
    except (ProcessLookupError, PermissionError):
        pass


def _kill_group(p: subprocess.Popen) -> None:
    import signal

    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            return
        try:
            p.wait(timeout=10)
            return
        except subprocess.TimeoutExpired:
            continue


def alternate(a, run=run_one) -> list[dict]:
    """Runs in the order off, on, off, on, ... (``--rounds`` pairs). A pair starts only while the budget left
    exceeds 1.1x the longest pair so far (the first pair always starts, each run capped by the budget left)."""
    t0, runs, longest = time.monotonic(), [], 0.0
    for r in range(a.rounds):
        left = a.budget - (time.monotonic() - t0)
        if r and left < 1.1 * longest:
            print(f"[e2e] round {r + 1} skipped: {left:.0f}s left, a pair took {longest:.0f}s", flush=True)
            break
        p0 = time.monotonic()
        for side in ("off", "on"):
            left = a.budget - (time.monotonic() - t0)
            rec = run(a, side, left - 2)
            rec["round"] = r + 1
            runs.append(rec)
            print(f"[e2e] round {r + 1} {side}: " + (rec.get("error") or
                  f"start {rec['start_s']:.1f}s, reps {', '.join(f'{x:.2f}' for x in rec['reps_s'])}s"), flush=True)
        longest = max(longest, time.monotonic() - p0)
    return runs


def greedy_rows(runs: list[dict]) -> list[str]:
    """Per successful run, how many prompts' greedy output ids equal the first ``off`` run's (and the first
    differing prompt/position), as markdown rows."""
    ok = [r for r in runs if "output_ids" in r]
    ref = next((r for r in ok if r["side"] == "off"), None)
    if ref is None:
        return ["| - | no successful off run: greedy equality not checked | |"]
    rows = []
    for r in ok:
        if r is ref:
            continue
        same = sum(x == y for x, y in zip(r["output_ids"], ref["output_ids"]))
        first = next(((i, next((j for j, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y))))
                      for i, (x, y) in enumerate(zip(r["output_ids"], ref["output_ids"])) if x != y), None)
        where = f"first diff: prompt {first[0]} token {first[1]}" if first else "all equal"
        rows.append(f"| {r['side']} (round {r['round']}) vs off (round {ref['round']}) | "
                    f"{same}/{len(ref['output_ids'])} | {where} |")
    return rows


def complete_rounds(runs: list[dict]) -> set[int]:
    """The rounds in which both the off and the on run succeeded: only these enter the medians, so a pair cut
    short by the budget or a failure cannot tilt the order control."""
    ok = {(r["round"], r["side"]) for r in runs if "prefill_tok_s" in r}
    return {rnd for rnd, side in ok if side == "off" and (rnd, "on") in ok}


def report(a, runs: list[dict]) -> str:
    """The markdown report: settings, per-run rows, per-side medians and on/off ratios, greedy equality."""
    done = complete_rounds(runs)
    med = {}
    for side in ("off", "on"):
        use = [r for r in runs if r["side"] == side and r["round"] in done]
        vals = [v for r in use for v in r["prefill_tok_s"]]
        tot = [v for r in use for v in r["total_tok_s"]]
        med[side] = (statistics.median(vals), statistics.median(tot), len(vals)) if vals else None
    lines = ["# TokenWeave end to end (sgl.Engine, order-controlled)", "",
             f"- date: {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}",
             f"- hardware: {_hardware(a.device)}", f"- command: `{' '.join([sys.executable] + sys.argv)}`",
             f"- model: {a.model_path} ({a.load_format} weights), TP {a.tp}, {a.num_prompts} prompts x "
             f"{a.input_len} random ids in, {a.output_len} greedy out, {a.reps} timed rep(s) per run; order "
             + ", ".join(f"{r['side']}" for r in runs), "",
             "| run | side | start s | warm-up s | reps s | prefill tok/s (per rep) |", "|---|---|---:|---:|---|---|"]
    for i, r in enumerate(runs):
        if "error" in r:
            lines.append(f"| {i + 1} | {r['side']} | FAILED: {r['error']} | | | |")
            continue
        lines.append(f"| {i + 1} | {r['side']} | {r['start_s']:.1f} | {r['warmup_s']:.2f} | "
                     f"{', '.join(f'{x:.2f}' for x in r['reps_s'])} | "
                     f"{', '.join(f'{x:.0f}' for x in r['prefill_tok_s'])} |")
    lines += ["", f"Medians over the complete off/on pairs only (rounds {sorted(done) or 'none'}).", "",
              "| TokenWeave | median prefill tok/s | median total tok/s | samples |", "|---|---:|---:|---:|"]
    for side in ("off", "on"):
        m = med[side]
        lines.append(f"| {side} | " + (f"{m[0]:.0f} | {m[1]:.0f} | {m[2]}" if m else "n/a | n/a | 0") + " |")
    if med["off"] and med["on"]:
        lines.append(f"| on / off | {med['on'][0] / med['off'][0]:.3f} | {med['on'][1] / med['off'][1]:.3f} | |")
    lines += ["", "| greedy ids | prompts equal | detail |", "|---|---:|---|", *greedy_rows(runs), ""]
    for side in ("off", "on"):
        first = next((r for r in runs if r["side"] == side and "tw_lines" in r), None)
        if first is not None:
            lines.append(f"- {side} run log: " + ("; ".join(first["tw_lines"]) or "no TokenWeave/communicator line"))
    for r in runs:
        if "error" in r:
            lines += ["", f"log tail of the failed {r['side']} run (round {r['round']}):", "```",
                      r["log_tail"][-800:], "```"]
    return "\n".join(lines) + "\n"


def e2e_record(a, runs: list[dict], env: Optional[dict] = None, command: Optional[str] = None) -> dict:
    """``--record-dir``: the run as a :mod:`benchmark.common.records` record (``what`` = ``tokenweave_e2e``): one row
    per complete off/on round (median prefill and total tok/s of each side's reps, TokenWeave off = the same-run
    baseline, ``on_over_off_*`` ratios, > 1: on faster, and the on run's greedy prompts equal to the first off run's);
    headline: the report's medians over all complete rounds, prefill and total tok/s, on vs off."""
    from benchmark.common import records

    done, ref = complete_rounds(runs), next((r for r in runs if r["side"] == "off" and "output_ids" in r), None)
    side = {(r["round"], r["side"]): r for r in runs if "prefill_tok_s" in r}
    rows = []
    for rnd in sorted(done):
        off, on = side[rnd, "off"], side[rnd, "on"]
        rows.append({"round": rnd, **{f"{s}_{k}": statistics.median(x[k]) for s, x in (("off", off), ("on", on))
                                      for k in ("prefill_tok_s", "total_tok_s")},
                     "off_start_s": off["start_s"], "on_start_s": on["start_s"],
                     "on_greedy_equal": sum(x == y for x, y in zip(on["output_ids"], ref["output_ids"])),
                     "prompts": len(ref["output_ids"])})
    for k in ("prefill_tok_s", "total_tok_s"):
        rows = records.add_ratio(rows, f"on_over_off_{k[:-6]}", f"on_{k}", f"off_{k}")
    headline = []
    for k, label in (("prefill_tok_s", "prefill"), ("total_tok_s", "total")):
        med = {s: [v for r in runs if r["side"] == s and r["round"] in done for v in r[k]] for s in ("off", "on")}
        if med["off"] and med["on"]:
            on, off = statistics.median(med["on"]), statistics.median(med["off"])
            headline.append({"label": f"TokenWeave on, sgl.Engine {label} throughput, TP {a.tp}, {a.num_prompts} x "
                                      f"{a.input_len} in", "value": round(on, 1), "unit": "tok/s",
                             "baseline": round(off, 1), "ratio": round(on / off, 3)})
    params = {k: getattr(a, k) for k in ("model_path", "tp", "load_format", "device", "num_prompts", "input_len",
                                         "output_len", "reps", "rounds", "min_tokens", "comm_sms", "full_residual")}
    return records.make_record(
        subject="tokenweave", benchmark="benchmark.tokenweave.bench_e2e", mode="e2e", what="tokenweave_e2e",
        rows=rows, params=params, baselines=["off_prefill_tok_s", "off_total_tok_s"] if rows else [],
        units={k: "tok/s" if k.endswith("tok_s") else "s" for r in rows[:1] for k in r if k.endswith("_s")},
        headline=headline, notes=[f"order: {', '.join(r['side'] for r in runs)}; failed runs: "
                                  f"{sum('error' in r for r in runs)}"],
        gpu_count=a.tp if a.device == "cuda" else 0, env=env, command=command)


def _hardware(device: str) -> str:
    if device == "cpu":
        return f"CPU {platform.machine()} ({os.cpu_count()} cores)"
    try:
        q = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                           text=True, timeout=20).stdout.split("\n")
        names = [x for x in q if x.strip()]
        return f"{len(names)} x {names[0]}" if names else "unknown GPU"
    except (OSError, subprocess.SubprocessError):
        return "unknown GPU"


def parse_args(argv=None) -> argparse.Namespace:
    """Flags (see the module docstring); argparse errors name the bad value."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-path", required=True, help="folder with config.json (dummy weights) or a checkpoint")
    p.add_argument("--tp", type=int, default=4)
    p.add_argument("--load-format", default="dummy", choices=("dummy", "auto"))
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=4096)
    p.add_argument("--output-len", type=int, default=4)
    p.add_argument("--reps", type=int, default=2, help="timed batches per engine start")
    p.add_argument("--rounds", type=int, default=2, help="off/on pairs, alternated")
    p.add_argument("--budget", type=float, default=300.0, help="seconds for all runs (later pairs skipped)")
    p.add_argument("--min-tokens", type=int, default=None, help="--tokenweave-min-tokens (default: auto)")
    p.add_argument("--comm-sms", type=int, default=None, help="--tokenweave-comm-sms")
    p.add_argument("--full-residual", action="store_true",
                   help="the on side with --tokenweave-full-residual (default: the sharded residual)")
    p.add_argument("--max-total-tokens", type=int, default=None)
    p.add_argument("--chunked-prefill-size", type=int, default=None, help="also sets --max-prefill-tokens")
    p.add_argument("--mem-fraction-static", type=float, default=None)
    p.add_argument("--max-running-requests", type=int, default=None)
    p.add_argument("--disable-cuda-graph", action="store_true")
    p.add_argument("--cuda-graph-max-bs", type=int, default=None)
    p.add_argument("--log-level", default="info", help="engine log level (info shows TokenWeave's split choices)")
    p.add_argument("--out", default="", help="markdown report path (default: benchmark/results/tokenweave/<date>_...md)")
    from benchmark.common.records import add_record_dir_argument
    add_record_dir_argument(p, "tokenweave")
    p.add_argument("--dry-run", action="store_true", help="print the engine arguments of both sides and exit")
    p.add_argument("--worker", choices=("off", "on"), help=argparse.SUPPRESS)
    p.add_argument("--result-file", default="", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    a.argv = list(sys.argv[1:] if argv is None else argv)
    for name in ("tp", "num_prompts", "input_len", "output_len", "reps", "rounds"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')}={getattr(a, name)} must be >= 1")
    if a.budget <= 0:
        p.error(f"--budget={a.budget} must be > 0 seconds")
    if not (Path(a.model_path) / "config.json").is_file():
        p.error(f"--model-path={a.model_path!r} has no config.json")
    return a


def main(argv=None) -> int:
    """Parent: alternate the runs, write the report; exit 0 when both sides produced numbers, 1 otherwise.
    Child (``--worker``): one run."""
    a = parse_args(argv)
    if a.worker:
        worker(a, a.worker, a.result_file)
        return 0
    if a.dry_run:
        for side in ("off", "on"):
            print(f"{side}: {json.dumps(engine_kwargs(a, side), sort_keys=True)}")
        print(f"child: {' '.join(_child_cmd(a, 'on', 'RESULT.json'))}")
        return 0
    runs = alternate(a)
    text = report(a, runs)
    print(text)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d_%H%M")
    out = Path(a.out or ROOT / "benchmark" / "results" / "tokenweave" / f"{stamp}_tokenweave_e2e_engine.md")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    if a.record_dir:  # the parent process: one writer
        sys.path.insert(0, str(ROOT))
        from benchmark.common.records import write_record

        print(f"record: {write_record(e2e_record(a, runs), Path(a.record_dir))[0]}")
    return 0 if "| on / off |" in text else 1


if __name__ == "__main__":
    sys.exit(main())
