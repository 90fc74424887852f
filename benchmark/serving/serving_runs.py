"""SGLang's one-GPU CI serving tests against servers of chosen settings, one server per case, in one time budget.

SGLang's ``test/srt/test_bench_serving.py`` (Llama-3.1-8B-Instruct on one GPU) runs ``bench_serving`` with random
4096/2048 prompts, ``--random-range-ratio 0.0`` and seed 0:

* ``offline``: 500 prompts at request rate inf (``test_offline_throughput_default``: output tok/s > 4000; with
  ``--attention-backend triton --context-length 8192``: > 3700);
* ``online``: 100 prompts at 1 request/s (``test_online_latency_default``: median E2E < 11000 ms, median TTFT < 86 ms,
  median ITL < 10 ms).

A case is ``NAME|ENV|FLAGS|WORKLOADS``: ``ENV`` space-separated ``KEY=VALUE`` for the server's environment, ``FLAGS``
extra ``launch_server`` flags, ``WORKLOADS`` a comma list of ``offline`` / ``online`` run in order on the same
server, e.g. ``"old|SGLANG_DECODE_SPLIT_POLICY=wave|--mem-fraction-static 0.85|offline"``. Every server gets the
model, tokenizer, ``--load-format dummy``, dtype, device and port; with ``--trace`` the scheduler's step trace
(``SGLANG_STEP_TRACE``) goes to ``<work>/<NAME>.trace.jsonl``, and each workload's own steps are cut out of it into
``<work>/<NAME>.<WORKLOAD>.trace.jsonl``. Cases run in the order given; a case starts only when
``--min-case-s`` seconds of the budget are left, and each benchmark is cut ``--reserve-s`` before the budget ends (a
cut offline run has no throughput, but its trace still compares with another over their common horizon:
``benchmark/serving/step_trace_report.py``).

Outputs: ``<work>/runs.json`` (one entry per case: settings, server facts read from its log, each workload's metrics
or why it has none), a markdown table (stdout and ``--md``) with SGLang's CI bars and ours (1.1x / 0.8x of them)
beside the numbers, and with ``--record-dir`` a ``benchmark.common.records`` record (subject ``serving``).

Usage (repo root; GPU)::

    python benchmark/serving/serving_runs.py --work /tmp/w --budget-s 500 --trace \\
        --case "new|||offline,online" --case "old|SGLANG_DECODE_SPLIT_POLICY=wave|--mem-fraction-static 0.85|offline"
    python benchmark/serving/serving_runs.py --cpu ...   # stories260K on CPU, 8 prompts of 64/32 (a dry run)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

# SGLang's CI bars (test_bench_serving.py) and ours: 1.1x the throughput bars, 0.8x the latency bars
BARS = {
    "offline": {"output_throughput": (">", 4000.0, 4400.0)},
    "offline_triton8k": {"output_throughput": (">", 3700.0, 4070.0)},
    "online": {"median_e2e_latency_ms": ("<", 11000.0, 8800.0), "median_ttft_ms": ("<", 86.0, 69.0),
               "median_itl_ms": ("<", 10.0, 8.0)},
}
# min_s: a workload is not started with less budget left (the online test takes >= 100 s by construction)
WORKLOADS = {"offline": {"num_prompts": 500, "request_rate": "inf", "min_s": 60},
             "online": {"num_prompts": 100, "request_rate": "1", "min_s": 125}}
METRICS = ("completed", "duration", "output_throughput", "median_e2e_latency_ms", "median_ttft_ms", "median_itl_ms",
           "p99_itl_ms", "total_output_tokens")
LOG_FACTS = {  # server log line -> fact
    "kv_tokens": re.compile(r"KV cache (\d+) tokens"),
    "graph_max_bs": re.compile(r"CUDA graphs up to batch (\d+)"),
    "reserve_mib": re.compile(r"activation reserve (\d+) MiB"),
    "capture_s": re.compile(r"captured CUDA graphs .* in ([\d.]+) s"),
    "max_running": re.compile(r"max running requests (\d+)"),
}


@dataclass
class Case:
    """One server: its name, environment additions, extra flags and workloads (see the module docstring)."""

    name: str
    env: dict = field(default_factory=dict)
    flags: list = field(default_factory=list)
    workloads: list = field(default_factory=lambda: ["offline"])

    @classmethod
    def parse(cls, spec: str) -> "Case":
        """``NAME|ENV|FLAGS|WORKLOADS`` -> Case. Raises ValueError naming the bad part."""
        parts = spec.split("|")
        if len(parts) != 4 or not re.fullmatch(r"[a-z0-9][a-z0-9_-]*", parts[0]):
            raise ValueError(f"--case {spec!r}: use NAME|ENV|FLAGS|WORKLOADS with NAME in [a-z0-9_-], e.g. "
                             "'old|SGLANG_DECODE_SPLIT_POLICY=wave|--mem-fraction-static 0.85|offline'")
        env = {}
        for kv in parts[1].split():
            k, sep, v = kv.partition("=")
            if not sep or not k:
                raise ValueError(f"--case {spec!r}: environment entry {kv!r} is not KEY=VALUE")
            env[k] = v
        loads = [w.strip() for w in parts[3].split(",") if w.strip()]
        bad = [w for w in loads if w not in WORKLOADS]
        if bad or not loads:
            raise ValueError(f"--case {spec!r}: workloads {bad or loads} not in {sorted(WORKLOADS)}")
        return cls(parts[0], env, shlex.split(parts[2]), loads)


def bar_key(case: Case, workload: str) -> str:
    """Which bar a result is held to: the triton + 8K-context offline test has its own."""
    if workload == "offline" and "--attention-backend" in case.flags and "--context-length" in case.flags:
        return "offline_triton8k"
    return workload


def check_bars(key: str, metrics: dict) -> dict:
    """``{metric: {"value", "sglang_bar", "our_bar", "meets_sglang", "meets_ours"}}`` for the metrics with a bar."""
    out = {}
    for m, (op, sg, ours) in BARS.get(key, {}).items():
        v = metrics.get(m)
        ok = (lambda b: v is not None and (v > b if op == ">" else v < b))
        out[m] = {"value": v, "sglang_bar": f"{op} {sg:g}", "our_bar": f"{op} {ours:g}", "meets_sglang": ok(sg),
                  "meets_ours": ok(ours)}
    return out


def server_facts(log_text: str) -> dict:
    """The facts of :data:`LOG_FACTS` found in a server log (last occurrence)."""
    out = {}
    for k, rx in LOG_FACTS.items():
        hits = rx.findall(log_text)
        if hits:
            out[k] = float(hits[-1]) if "." in hits[-1] else int(hits[-1])
    return out


class Runner:
    """Runs cases within a budget (see the module docstring)."""

    def __init__(self, a):
        self.a = a
        self.t0 = time.monotonic()
        self.work = Path(a.work)
        self.work.mkdir(parents=True, exist_ok=True)
        self.last_start_s = 60.0  # server start estimate for the budget check (the last measured one)

    def left(self) -> float:
        return self.a.budget_s - (time.monotonic() - self.t0)

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.a.port}/health", timeout=2) as r:
                return r.status == 200
        except Exception:  # not up yet
            return False

    def bench_cmd(self, workload: str, out_file: Path) -> list:
        w = WORKLOADS[workload]
        n = self.a.cpu_prompts if self.a.cpu else w["num_prompts"]
        return [sys.executable, "-m", "sglang.bench_serving", "--backend", "sglang", "--port", str(self.a.port),
                "--tokenizer", self.a.tokenizer, "--dataset-name", "random", "--random-input-len", str(self.a.input_len),
                "--random-output-len", str(self.a.output_len), "--random-range-ratio", "0.0", "--num-prompts", str(n),
                "--request-rate", w["request_rate"], "--seed", "0", "--disable-tqdm", "--output-file", str(out_file)]

    def server_cmd(self, case: Case) -> list:
        return [sys.executable, "-m", "sglang.launch_server", "--model-path", self.a.model_path, "--tokenizer-path",
                self.a.tokenizer, "--load-format", "dummy", "--dtype", self.a.dtype, "--device", self.a.device,
                "--port", str(self.a.port), *self.a.server_extra, *case.flags]

    def run_case(self, case: Case) -> dict:
        res = {"case": case.name, "env": case.env, "flags": case.flags, "workloads": {}}
        trace = self.work / f"{case.name}.trace.jsonl"
        env = dict(os.environ, **case.env)
        if self.a.trace:
            env["SGLANG_STEP_TRACE"] = str(trace)
            res["trace"] = str(trace)
        if self.a.dry_run:
            res["server_cmd"] = shlex.join(self.server_cmd(case))
            res["bench_cmds"] = [shlex.join(self.bench_cmd(w, self.work / f"{case.name}.{w}.jsonl"))
                                 for w in case.workloads]
            print(f"[dry run] {case.name}: {' '.join(f'{k}={v}' for k, v in case.env.items())} {res['server_cmd']}")
            for c in res["bench_cmds"]:
                print(f"[dry run]   {c}")
            return res
        need = max(self.a.min_case_s, self.last_start_s + WORKLOADS[case.workloads[0]]["min_s"] + self.a.reserve_s)
        if self.a.cpu:
            need = self.a.min_case_s
        if self.left() < need:
            res["skipped"] = f"{self.left():.0f} s of the budget left (< {need:.0f} s: start + its first workload)"
            print(f"== {case.name}: not run ({res['skipped']})", flush=True)
            return res
        log_path = self.work / f"{case.name}.server.log"
        t_start = time.monotonic()
        print(f"== {case.name}: starting server ({self.left():.0f} s left) env {case.env} flags {case.flags}",
              flush=True)
        with open(log_path, "w") as log:
            proc = subprocess.Popen(self.server_cmd(case), env=env, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        try:
            limit = min(self.a.start_limit_s, self.left() - self.a.reserve_s)
            while time.monotonic() - t_start < limit and proc.poll() is None and not self._healthy():
                time.sleep(1)
            res["start_s"] = round(time.monotonic() - t_start, 1)
            self.last_start_s = res["start_s"]
            if not self._healthy():
                res["error"] = f"server not healthy after {res['start_s']} s (exit code {proc.poll()})"
                print(f"!! {case.name}: {res['error']}", flush=True)
                return res
            print(f"   healthy after {res['start_s']} s", flush=True)
            for w in case.workloads:
                res["workloads"][w] = self.run_workload(case, w)
        finally:
            self._stop(proc)
            if self.a.device == "cuda":
                res["gpu_free_wait_s"] = self._wait_gpu_free(30.0)
            text = log_path.read_text(errors="replace") if log_path.exists() else ""
            res["server"] = server_facts(text)
            res["server_log_tail"] = [ln for ln in text.splitlines() if "Decode batch" not in ln][-25:]
        return res

    def _trace_lines(self, case: Case) -> list:
        path = self.work / f"{case.name}.trace.jsonl"
        return path.read_text().splitlines() if self.a.trace and path.exists() else []

    def run_workload(self, case: Case, w: str) -> dict:
        out_file = self.work / f"{case.name}.{w}.jsonl"
        out_file.unlink(missing_ok=True)
        lim = self.left() - self.a.reserve_s
        if lim < (20 if self.a.cpu else WORKLOADS[w]["min_s"]):
            return {"skipped": f"{self.left():.0f} s left"}
        n0 = len(self._trace_lines(case))
        t = time.monotonic()
        try:
            cp = subprocess.run(self.bench_cmd(w, out_file), capture_output=True, text=True, timeout=lim)
            rc, tail = cp.returncode, (cp.stdout + cp.stderr)[-3000:]
        except subprocess.TimeoutExpired as e:
            rc, tail = "timeout", ((e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes)
                                   else (e.stdout or ""))[-3000:]
        r = {"seconds": round(time.monotonic() - t, 1), "exit": rc}
        if self.a.trace:  # this workload's steps alone (the server's trace file holds every workload in turn)
            time.sleep(1.0)  # the last results' lines are written when the scheduler has processed them
            part = self._trace_lines(case)[n0:]
            (self.work / f"{case.name}.{w}.trace.jsonl").write_text("\n".join(part) + ("\n" if part else ""))
            r["trace_steps"] = len(part)
        lines = out_file.read_text().splitlines() if out_file.exists() else []
        if lines:
            m = json.loads(lines[-1])
            r["metrics"] = {k: m.get(k) for k in METRICS}
            r["bars"] = check_bars(bar_key(case, w), r["metrics"])
        else:
            r["error"] = f"no result (exit {rc}); output tail: {tail[-600:]}"
        print(f"   {w}: {json.dumps(r.get('metrics', r.get('error')))[:400]}", flush=True)
        return r

    @staticmethod
    def _wait_gpu_free(limit_s: float) -> float:
        """Wait (at most ``limit_s``) until ``nvidia-smi`` lists no compute process, so the next server sizes its KV
        pool on the whole device; returns the seconds waited (0 without nvidia-smi)."""
        t = time.monotonic()
        while time.monotonic() - t < limit_s:
            try:
                out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"],
                                     capture_output=True, text=True, timeout=10).stdout
            except (OSError, subprocess.SubprocessError):
                return 0.0
            if not out.strip():
                break
            time.sleep(0.5)
        return round(time.monotonic() - t, 1)

    @staticmethod
    def _stop(proc: subprocess.Popen) -> None:
        for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
            if proc.poll() is not None:
                return
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                proc.wait(wait)
            except subprocess.TimeoutExpired:
                continue


def markdown(results: list, gpu: str) -> str:
    """One row per (case, workload): the metrics with a bar, SGLang's bar and ours, and the server facts."""
    lines = [f"Serving runs on {gpu} (SGLang CI workloads: random 4096/2048, range ratio 0.0, seed 0; offline 500 "
             "prompts at rate inf, online 100 prompts at 1 req/s)", "",
             "| case | workload | metric | value | SGLang CI bar | our bar | meets ours | KV tokens | graph max bs |"
             " start s |", "|---|---|---|---:|---|---|---|---:|---:|---:|"]
    for r in results:
        srv = r.get("server", {})
        facts = f"{srv.get('kv_tokens', '-')} | {srv.get('graph_max_bs', '-')} | {r.get('start_s', '-')}"
        if r.get("skipped") or r.get("error") or not r["workloads"]:
            lines.append(f"| {r['case']} | - | - | {r.get('skipped') or r.get('error') or 'dry run'} | | | | {facts} |")
            continue
        for w, wr in r["workloads"].items():
            if "bars" not in wr:
                lines.append(f"| {r['case']} | {w} | - | {wr.get('skipped') or wr.get('error', '')[:120]} | | | | "
                             f"{facts} |")
                continue
            for m, b in wr["bars"].items():
                v = b["value"]
                lines.append(f"| {r['case']} | {w} | {m} | {'-' if v is None else f'{v:.1f}'} | {b['sglang_bar']} | "
                             f"{b['our_bar']} | {'yes' if b['meets_ours'] else 'no'} | {facts} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--case", action="append", required=True, help="NAME|ENV|FLAGS|WORKLOADS (repeatable, in order)")
    p.add_argument("--work", required=True, help="folder for logs, bench outputs, traces and runs.json")
    p.add_argument("--budget-s", type=float, default=500.0)
    p.add_argument("--reserve-s", type=float, default=15.0, help="seconds kept after the last benchmark")
    p.add_argument("--min-case-s", type=float, default=100.0, help="a case starts only with this much budget left")
    p.add_argument("--start-limit-s", type=float, default=180.0)
    p.add_argument("--model-path", default=str(REPO.parent / "shared/data/configs/meta-llama--Meta-Llama-3.1-8B"))
    p.add_argument("--tokenizer", default=str(REPO.parent / "shared/data/tokenizers/llama3"))
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cuda")
    p.add_argument("--port", type=int, default=30271)
    p.add_argument("--input-len", type=int, default=4096)
    p.add_argument("--output-len", type=int, default=2048)
    p.add_argument("--server-extra", default="", help="flags every server gets (e.g. --max-total-tokens on CPU)")
    p.add_argument("--trace", action="store_true", help="scheduler step trace per case (SGLANG_STEP_TRACE)")
    p.add_argument("--cpu", action="store_true", help="stories260K on CPU, --cpu-prompts prompts of 64/32 tokens")
    p.add_argument("--cpu-prompts", type=int, default=8)
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    p.add_argument("--md", default=None)
    from benchmark.common.records import add_record_dir_argument
    add_record_dir_argument(p, "serving")
    p.add_argument("--baseline-case", default=None, help="the case the record's ratios are taken against")
    a = p.parse_args(argv)
    try:
        cases = [Case.parse(c) for c in a.case]
    except ValueError as e:
        p.error(str(e))
    if len({c.name for c in cases}) != len(cases):
        p.error("--case names must be distinct")
    a.server_extra = shlex.split(a.server_extra)
    if a.cpu:
        data = REPO.parent / "shared/data/models/stories260K"
        a.model_path, a.tokenizer, a.dtype, a.device = str(data), str(data), "float32", "cpu"
        a.input_len, a.output_len = 64, 32
        a.server_extra = a.server_extra or ["--max-total-tokens", "4096"]
    r = Runner(a)
    results = [r.run_case(c) for c in cases]
    from benchmark.common.records import environment

    env = environment(REPO)
    gpu = f"{env['gpu']['count']} x {env['gpu']['model']}" if env["gpu"]["count"] else "CPU"
    (r.work / "runs.json").write_text(json.dumps({"env": env, "results": results}, indent=1))
    md = markdown(results, gpu)
    print("\n" + md)
    if a.md:
        Path(a.md).write_text(md)
    if a.record_dir and not a.dry_run:
        write_serving_record(results, env, a.record_dir, a.baseline_case)
    return 0


def _throughput_bar(workload_result: dict) -> Optional[float]:
    """SGLang's CI output-throughput bar (tok/s) a workload result was held to, or None (the online test has none)."""
    bar = (workload_result.get("bars") or {}).get("output_throughput")
    return float(bar["sglang_bar"].split()[-1]) if bar else None


def ci_headline(rows: list) -> list:
    """The record's headline: each case's output throughput on a workload with a throughput bar, against SGLang's CI
    bar for it (``value / bar``; above 1 passes SGLang's test)."""
    out = []
    for r in rows:
        if r.get("output_throughput") is None or not r.get("sglang_ci_throughput_bar"):
            continue
        out.append({"label": f"SGLang CI {r['workload']} output throughput, {r['case']} "
                             f"({r['flags'] or 'defaults'}) vs SGLang's bar",
                    "value": round(r["output_throughput"], 1), "unit": "tok/s",
                    "baseline": r["sglang_ci_throughput_bar"],
                    "ratio": round(r["output_throughput"] / r["sglang_ci_throughput_bar"], 3)})
    return out


def write_serving_record(results: list, env: dict, root: str, baseline: Optional[str] = None) -> None:
    """The runs as a ``benchmark.common.records`` record (subject serving): one row per (case, workload); with
    ``baseline`` (a case name) each row also carries that case's same-workload output throughput and the ratio."""
    from benchmark.common.records import add_ratio, make_record, write_record

    base = {}
    for r in results:
        if r["case"] == baseline:
            base = {w: (wr.get("metrics") or {}).get("output_throughput") for w, wr in r.get("workloads", {}).items()}
    rows = []
    for r in results:
        for w, wr in r.get("workloads", {}).items():
            m = wr.get("metrics") or {}
            rows.append({"case": r["case"], "workload": w, "env": " ".join(f"{k}={v}" for k, v in r["env"].items()),
                         "flags": " ".join(r["flags"]), **{k: m.get(k) for k in METRICS},
                         "kv_tokens": r.get("server", {}).get("kv_tokens"),
                         "graph_max_bs": r.get("server", {}).get("graph_max_bs"),
                         "meets_our_bars": all(b["meets_ours"] for b in wr.get("bars", {}).values()) if m else None,
                         "sglang_ci_throughput_bar": _throughput_bar(wr),
                         **({"baseline_output_throughput": base.get(w)} if baseline else {})})
    if not rows:
        return
    if baseline:
        rows = add_ratio(rows, "throughput_vs_baseline", "output_throughput", "baseline_output_throughput")
    rows = add_ratio(rows, "throughput_vs_sglang_ci_bar", "output_throughput", "sglang_ci_throughput_bar")
    rec = make_record(subject="serving", benchmark="benchmark.serving.serving_runs", mode="ci", what="sglang_ci_1gpu",
                      rows=rows, env=env, gpu_count=1, baselines=["baseline_output_throughput"] if baseline else [],
                      headline=ci_headline(rows),
                      params={"baseline_case": baseline}, units={"output_throughput": "tok/s", "duration": "s",
                                                             "median_e2e_latency_ms": "ms", "median_ttft_ms": "ms",
                                                             "median_itl_ms": "ms", "p99_itl_ms": "ms"},
                      notes=["SGLang CI bars: offline > 4000 tok/s (triton + 8K context: > 3700); online median E2E "
                             "< 11000 ms, TTFT < 86 ms, ITL < 10 ms; ours 1.1x / 0.8x of them."])
    js, md = write_record(rec, Path(root))
    print(f"record: {js} {md}")


if __name__ == "__main__":
    sys.exit(main())
