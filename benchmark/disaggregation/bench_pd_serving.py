"""End-to-end prefill/decode disaggregation vs aggregated serving, with ``bench_serving``.

Setups (``--setups``, run in the order given, each with its own servers, started concurrently):

* ``agg``: one aggregated server (``--agg-extra``; on a GPU host put it with ``--base-gpu-id``);
* ``agg2``: two (or ``len(--replica-gpus)``) aggregated replicas, replica i on ``--base-gpu-id <--replica-gpus[i]>``,
  behind ``mini_lb --workers`` (round robin): the fair, same-GPU-count baseline of PD on two GPUs. When ``agg`` comes
  right before ``agg2``, both are measured on the same servers (one start): ``agg2`` first, then ``agg`` on
  replica 0 alone;
* ``pd``: a prefill server (``--prefill-extra``; one per ``--prefill-gpus`` entry on cuda) + a decode server (``--decode-extra``) + ``mini_lb --prefill
  --decode`` (``--disaggregation-transfer-backend``, ``--disaggregation-transfer-mode``).

Every setup gets the same ``python -m sglang.bench_serving`` workload (ShareGPT from the shared data folder, or
random fixed-length prompts with ``--dataset random``), after two untimed warm-ups: ``--warmup`` concurrent requests
of the full input length to every server at its start, then, before every timed run (every setup and dataset), a
warm-up phase through the same URL (``benchmark/disaggregation/pd_serving_warmup.py``): the workload's own shape at its own rate and
concurrency for ``--warmup-seconds`` (another seed: other prompts), so the kernels of the decode batch sizes up to
the run's steady state and of its prefill shapes are compiled before the clock starts, then a prefix-cache flush
(which waits until the servers are idle). It is outside the timed metrics (its own ``bench_serving`` call) and the
transfer / hand-off counters (read after it); ``bench_serving``'s own single warm-up request (SGLang's convention)
stays off, since it would fall inside the counter window. ``--dataset random sharegpt`` runs each workload in turn on
the same servers (one start per setup); each dataset gets its own report. The table has TTFT / TPOT / ITL
(p99 included) / throughput per setup and the ratios pd / agg2 and pd / agg, plus the KV transfer share of TTFT
(the part of TTFT the transfer adds, over the timed requests, / mean TTFT through the router; pull: mean
``sglang:kv_transfer_seconds`` of the decode server, the pure transfer from the first READ posted to the last READ
DONE; push: mean ``sglang:kv_handoff_seconds{phase="tail"}``, the WRITE time after the prefill forward, since
layerwise WRITEs overlap the forward; the whole WRITE time's share is printed beside it), the decode-side hand-off
phases (``sglang:kv_handoff_seconds{phase}``: RoomReady -> first READ posted, last READ DONE -> decoding, and their
whole, RoomReady -> decoding, with its share of TTFT) and the READs (push: WRITEs) posted per request after
coalescing (``sglang:kv_transfer_reads``; floor with ``--kv-cache-layout layer_major``: one per layer and K/V per
run of consecutive slots; ``token_major``: one per run of consecutive slots; a fresh pool gives one run, prefix-cached
slots reused by the prefill side and a wrapped pool give more).
The report ``<out-dir>/<date>_pd_serving_<backend>_<mode>[_<dataset>].md`` and ``.json`` (date, hardware, command;
the suffix for every dataset after the first) is rewritten after every setup, so a run cut short keeps what it
measured. SIGTERM stops every server started. ``--record-dir DIR`` also writes a :mod:`benchmark.common.records`
record under ``DIR/disaggregation/`` at the end (:mod:`benchmark.disaggregation.pd_serving_record`).

CPU smoke run::

    python benchmark/disaggregation/bench_pd_serving.py --model-path ../shared/data/models/stories260K --device cpu \\
        --transfer-backend fake --num-prompts 16 --max-concurrency 4

GPU (two GPUs; the two-GPU PD script under scripts/gpu/)::

    python benchmark/disaggregation/bench_pd_serving.py --model-path ../shared/data/configs/meta-llama--Meta-Llama-3.1-8B \\
        --tokenizer-path ../shared/data/tokenizers/llama3 --device cuda --transfer-backend nixl \\
        --server-extra "--load-format dummy --dtype bfloat16" --setups pd agg agg2 \\
        --prefill-extra "--base-gpu-id 0" --decode-extra "--base-gpu-id 1" --agg-extra "--base-gpu-id 0" \\
        --dataset random --input-len 1024 --output-len 128 --num-prompts 64 --request-rate 8 --max-concurrency 0
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import datetime
import json
import os
import platform
import random
import re
import shlex
import signal
import socket
import subprocess
import sys
import time

import requests

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
from benchmark.disaggregation.pd_serving_warmup import bench_in_process, warm_phase, warmup_line  # noqa: E402
from sglang.srt.utils.nvls_env import apply_nvls_off_env  # noqa: E402

ENV = apply_nvls_off_env({**os.environ, "PYTHONUNBUFFERED": "1"})
METRICS = ["mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms",
           "mean_itl_ms", "p99_itl_ms", "output_throughput", "request_throughput", "completed"]
SETUPS = ("agg", "agg2", "pd")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free when asked (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    """A subprocess in its own session with a log file; :meth:`wait_healthy` polls ``url/health``."""

    def __init__(self, cmd: list[str], url: str, log: str, pid_file: str = ""):
        self.url, self.log, self.cmd = url, log, cmd
        self._f = open(log, "w")
        self.p = subprocess.Popen(cmd, stdout=self._f, stderr=subprocess.STDOUT, env=ENV, start_new_session=True)
        self.t0 = time.time()
        if pid_file:  # the calling script's trap kills these process groups if this process is killed hard
            with open(pid_file, "a") as f:
                f.write(f"{self.p.pid}\n")

    def wait_healthy(self, timeout: float) -> "Proc":
        """Block until ``/health`` is 200. Raises RuntimeError (naming the log) if it exits or times out."""
        end = time.time() + timeout
        while time.time() < end:
            if self.p.poll() is not None:
                raise RuntimeError(f"{self.cmd[:4]} exited with {self.p.returncode}; see {self.log}")
            try:
                if requests.get(self.url + "/health", timeout=2).status_code == 200:
                    print(f"[bench_pd_serving] {os.path.basename(self.log)[:-4]} healthy "
                          f"{time.time() - self.t0:.1f} s after its start", flush=True)
                    return self
            except requests.RequestException:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.url} not healthy after {timeout}s; see {self.log}")

    def stop(self) -> None:
        if self.p.poll() is None:
            try:
                os.killpg(self.p.pid, signal.SIGTERM)
                self.p.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.p.pid, signal.SIGKILL)
                self.p.wait(10)
            except ProcessLookupError:
                pass
        self._f.close()


def server(args, extra: list[str], tag: str, logdir: str) -> Proc:
    """Launch (not wait for) one ``sglang.launch_server`` with the common flags + ``extra``."""
    port = free_port()
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", args.model_path, "--device", args.device,
           "--port", str(port), "--enable-metrics", *shlex.split(args.server_extra), *extra]
    if args.tokenizer_path:
        cmd += ["--tokenizer-path", args.tokenizer_path]
    return Proc(cmd, f"http://127.0.0.1:{port}", os.path.join(logdir, f"{tag}.log"), args.pid_file)


def router(args, flags: list[str], logdir: str) -> Proc:
    """Launch ``mini_lb`` with ``flags`` (``--prefill/--decode`` or ``--workers``) and wait until healthy."""
    port = free_port()
    cmd = [sys.executable, "-m", "sglang.srt.disaggregation.mini_lb", *flags, "--port", str(port)]
    return Proc(cmd, f"http://127.0.0.1:{port}", os.path.join(logdir, "router.log"), args.pid_file).wait_healthy(120)


def warm_up(args, url: str) -> None:
    """``--warmup`` concurrent untimed requests of about ``--input-len`` words and 8 output tokens (compiles the
    kernels of the shapes the timed run uses). Raises RuntimeError on a non-200 answer."""
    rng = random.Random(args.seed + 7)
    words = "once upon a time the little dog ran to the park and saw a big red ball".split()

    def one(i: int) -> None:
        text = " ".join(rng.choice(words) for _ in range(args.input_len + i))
        r = requests.post(url + "/generate", json={"text": text, "sampling_params": {
            "max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}}, timeout=300)
        if r.status_code != 200:
            raise RuntimeError(f"warm-up request to {url} answered {r.status_code}: {r.text[:300]}")

    t0 = time.time()
    with cf.ThreadPoolExecutor(max(1, args.warmup)) as pool:
        list(pool.map(one, range(max(1, args.warmup))))
    print(f"[bench_pd_serving] warm-up of {url}: {time.time() - t0:.1f} s", flush=True)


def bench_argv(args, url: str, out: str, dataset: str, num_prompts: int = 0, seed: int | None = None) -> list[str]:
    """``python -m sglang.bench_serving``'s flags for ``dataset`` (``random`` or ``sharegpt``) against ``url``, one
    JSON line appended to ``out``; ``num_prompts`` / ``seed`` override ``--num-prompts`` / ``--seed`` (the warm-up)."""
    cmd = ["--disable-tqdm", "--backend", "sglang", "--base-url", url,
           "--tokenizer", args.tokenizer_path or args.model_path, "--model", args.model_path,
           "--num-prompts", str(num_prompts or args.num_prompts),
           "--seed", str(args.seed if seed is None else seed), "--output-file", out, "--warmup-requests", "0"]
    if dataset == "sharegpt":
        cmd += ["--dataset-name", "sharegpt", "--dataset-path", args.dataset_path, "--sharegpt-output-len",
                str(args.output_len), "--sharegpt-context-len", str(args.context_len)]
    else:
        cmd += ["--dataset-name", "random", "--random-input-len", str(args.input_len), "--random-output-len",
                str(args.output_len), "--random-range-ratio", str(args.range_ratio)]
    if args.request_rate:
        cmd += ["--request-rate", str(args.request_rate)]
    if args.max_concurrency:
        cmd += ["--max-concurrency", str(args.max_concurrency)]
    return cmd


def bench(args, url: str, out: str, dataset: str) -> dict:
    """One timed ``bench_serving`` run (its own process, :func:`bench_argv`) of ``dataset`` against ``url``; its JSON
    record. Raises RuntimeError when it fails."""
    cmd = [sys.executable, "-m", "sglang.bench_serving", *bench_argv(args, url, out, dataset)]
    r = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=args.bench_timeout)
    if r.returncode != 0:
        raise RuntimeError(f"bench_serving failed:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    with open(out) as f:
        return json.loads(f.read().strip().splitlines()[-1])


def warm_run(args, url: str, logdir: str, setup: str, dataset: str) -> dict:
    """The warm-up phase (:func:`pd_serving_warmup.warm_phase`) before the timed run of ``setup`` on ``dataset``
    through ``url``: :func:`bench_argv` with its count and seed, in this process; its record (``*_warmup.jsonl``)."""
    out = _jsonl(args, logdir, f"{setup}_warmup", dataset)
    return warm_phase(args, url, f"{setup}/{dataset}",
                      lambda n, seed: bench_in_process(bench_argv(args, url, out, dataset, n, seed)))


def transfer_seconds(url: str) -> dict:
    """A decode server's KV hand-off counters from its /metrics: ``seconds`` (sum of pure transfer times: first READ
    posted -> last READ DONE), ``requests``, ``bytes``, ``reads`` (READs/WRITEs posted after coalescing) and, pull mode,
    the sums of the decode-side phases ``setup`` (RoomReady -> first READ posted), ``wait`` (last READ DONE ->
    activated) and ``handoff`` (RoomReady -> activated), and, push mode, ``tail`` (the WRITE time after the prefill
    forward), all seconds."""
    text = requests.get(url + "/metrics", timeout=30).text

    def val(name: str, label: str = "", absent: float = 0.0) -> float:
        lab = rf"[^}}]*{re.escape(label)}[^}}]*" if label else r"[^}]*"
        m = re.search(rf"^{re.escape(name)}{{{lab}}} ([0-9.e+-]+)$", text, re.M)
        return float(m.group(1)) if m else absent

    out = {"seconds": val("sglang:kv_transfer_seconds_sum"), "requests": val("sglang:kv_transfer_seconds_count"),
           "bytes": val("sglang:kv_transfer_bytes_total"), "reads": val("sglang:kv_transfer_reads_total")}
    for phase in ("setup", "wait", "handoff", "tail"):  # no tail (pull, or a server without it): NaN
        out[phase] = val("sglang:kv_handoff_seconds_sum", f'phase="{phase}"', float("nan") if phase == "tail" else 0.0)
    return out


def _jsonl(args, logdir: str, setup: str, dataset: str) -> str:
    """The bench_serving output file of one setup and dataset (``<setup>.jsonl`` for the first dataset)."""
    suffix = "" if dataset == args.dataset[0] else f"_{dataset}"
    return os.path.join(logdir, f"{setup}{suffix}.jsonl")


def push_paths(urls: list[str]) -> dict:
    """Push mode: the prefill servers' counts of rooms pushed layer by layer during the forward (``layerwise``) and
    after it (``after_forward``), summed over ``urls`` (``/get_server_info``); ``{}`` when a server does not say."""
    out = {"layerwise": 0, "after_forward": 0}
    try:
        for url in urls:
            st = requests.get(url + "/get_server_info", timeout=30).json()["internal_states"][0]
            out["layerwise"] += int(st["disagg_push_layerwise"])
            out["after_forward"] += int(st["disagg_push_after_forward"])
    except (requests.RequestException, ValueError, KeyError, IndexError, TypeError):
        return {}
    return out


def run_aggregated(args, logdir: str, which: list[str], results: dict, report, warm: dict) -> None:
    """``agg`` and/or ``agg2`` on one set of replicas (``agg`` on replica 0 alone, ``agg2`` through mini_lb), every
    dataset of ``--dataset`` in turn, each after its :func:`warm_run` through the same URL;
    ``results[dataset][setup]`` and ``warm[dataset][setup]`` are filled."""
    n = max(2, len(args.replica_gpus)) if "agg2" in which else 1
    gpus = args.replica_gpus if args.device == "cuda" else [None] * n
    procs: list[Proc] = []
    try:
        for i in range(n):
            place = ["--base-gpu-id", str(gpus[i])] if gpus[i] is not None and n >= 2 else []
            procs.append(server(args, [*place, *shlex.split(args.agg_extra if n == 1 else "")], f"agg{i}", logdir))
        for p in procs:
            p.wait_healthy(args.startup_timeout)
        for p in procs:
            warm_up(args, p.url)
        if n >= 2:  # the same-GPU-count baseline first (a run cut short keeps the more important row)
            lb = router(args, ["--workers", *[p.url for p in procs]], logdir)
            procs.append(lb)
            for ds in args.dataset:
                warm[ds]["agg2"] = warm_run(args, lb.url, logdir, "agg2", ds)
                results[ds]["agg2"] = bench(args, lb.url, _jsonl(args, logdir, "agg2", ds), ds)
                report()
        if "agg" in which:
            for ds in args.dataset:
                warm[ds]["agg"] = warm_run(args, procs[0].url, logdir, "agg", ds)
                results[ds]["agg"] = bench(args, procs[0].url, _jsonl(args, logdir, "agg", ds), ds)
                report()
    finally:
        for p in reversed(procs):
            p.stop()


def transfer_summary(mode: str, d: dict, pd_result: dict, prefill_servers: int) -> dict:
    """Per-request means (ms) of a decode server's counter deltas ``d`` (:func:`transfer_seconds` keys, summed over
    the timed requests) and their shares of ``pd_result["mean_ttft_ms"]``. ``share_of_ttft`` is the part of TTFT the
    transfer adds: pull, the pure transfer (first READ posted -> last READ DONE); push, ``tail_mean_ms`` (the WRITE
    time after the prefill forward; NaN when the server does not report it). ``write_share_of_ttft``: the whole
    transfer time's share (push layerwise: it overlaps the forward). ``timed_completed``: the timed run's completed
    requests, which ``requests`` should equal (else the counter window held other requests, or one failed)."""
    n = max(d["requests"], 1)
    x = {"requests": d["requests"], "timed_completed": pd_result.get("completed", float("nan")),
         "bytes_sum": d["bytes"], "reads_sum": d["reads"], "seconds_sum": d["seconds"],
         "reads_per_request": d["reads"] / n, "mean_ms": 1000 * d["seconds"] / n, "prefill_servers": prefill_servers}
    for phase in ("setup", "wait", "handoff", "tail"):
        x[f"{phase}_mean_ms"] = 1000 * d[phase] / n
    ttft = max(pd_result["mean_ttft_ms"], 1e-9)
    x["added_mean_ms"] = x["mean_ms"] if mode == "pull" else x["tail_mean_ms"]
    x["share_of_ttft"] = x["added_mean_ms"] / ttft
    x["write_share_of_ttft"] = x["mean_ms"] / ttft
    x["handoff_share_of_ttft"] = x["handoff_mean_ms"] / ttft
    return x


def run_pd(args, logdir: str, results: dict, xfer: dict, report, warm: dict) -> None:
    """The ``pd`` setup: one prefill server per ``--prefill-gpus`` entry (placed there on cuda; else one), one decode
    server, the router; every dataset in turn, each after its :func:`warm_run` through the router:
    ``results[dataset]["pd"]``, ``warm[dataset]["pd"]`` and ``xfer[dataset]`` (the decode server's transfer counters
    over its timed requests only, read after the warm-up phase: :func:`transfer_summary`)."""
    pd = ["--disaggregation-transfer-backend", args.transfer_backend, "--disaggregation-transfer-mode",
          args.transfer_mode]
    gpus = [None] if not args.prefill_gpus else [g if args.device == "cuda" else None for g in args.prefill_gpus]
    procs: list[Proc] = []
    try:
        for i, g in enumerate(gpus):
            place = ["--base-gpu-id", str(g)] if g is not None else []
            procs.append(server(args, ["--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port",
                                       str(free_port()), *pd, *shlex.split(args.prefill_extra), *place],
                                f"prefill{i}", logdir))
        procs.append(server(args, ["--disaggregation-mode", "decode", *pd, *shlex.split(args.decode_extra)],
                            "decode", logdir))
        for p in list(procs):
            p.wait_healthy(args.startup_timeout)
        dec = procs[-1]
        lb = router(args, ["--prefill", *[p.url for p in procs[:-1]], "--decode", dec.url], logdir)
        procs.append(lb)
        warm_up(args, lb.url)
        for ds in args.dataset:
            warm[ds]["pd"] = warm_run(args, lb.url, logdir, "pd", ds)
            c0, p0 = transfer_seconds(dec.url), push_paths([p.url for p in procs[:-2]])
            results[ds]["pd"] = bench(args, lb.url, _jsonl(args, logdir, "pd", ds), ds)
            c1, p1 = transfer_seconds(dec.url), push_paths([p.url for p in procs[:-2]])
            xfer[ds] = transfer_summary(args.transfer_mode, {k: c1[k] - c0[k] for k in c1}, results[ds]["pd"],
                                        len(gpus))
            if args.transfer_mode == "push" and p0 and p1:
                xfer[ds].update({f"push_{k}": p1[k] - p0[k] for k in p1})
            report()
    finally:
        for p in reversed(procs):
            p.stop()


def transfer_lines(mode: str, backend: str, xfer: dict) -> list[str]:
    """The report's transfer lines (how the share is defined for ``mode`` included)."""
    unit = "READs" if mode == "pull" else "WRITEs"
    lines = [f"transfer: backend {backend}, mode {mode}; {int(xfer['requests'])} timed requests, "
             f"{xfer['bytes_sum'] / max(xfer['requests'], 1) / 2**20:.2f} MiB and {xfer['mean_ms']:.3f} ms and "
             f"{xfer.get('reads_per_request', float('nan')):.1f} {unit} (after coalescing) per request; "
             f"**transfer share of TTFT {100 * xfer['share_of_ttft']:.2f}%**"
             + (" (mean pure transfer, first READ posted -> last READ DONE, / mean router TTFT)" if mode == "pull"
                else f" (mean WRITE time after the prefill forward, {xfer.get('tail_mean_ms', float('nan')):.3f} ms: "
                     "layerwise, last layer posted -> last WRITE DONE seen, after the fact the whole push, / mean "
                     f"router TTFT; the whole WRITE time, first layer -> last WRITE DONE, overlapping the forward "
                     f"when layerwise, is {100 * xfer.get('write_share_of_ttft', float('nan')):.2f}%)")]
    done = xfer.get("timed_completed", xfer["requests"])
    if done == done and int(done) != int(xfer["requests"]):  # NaN (not known) skips the check
        lines[-1] += (f"; **the counters saw {int(xfer['requests'])} hand-offs but the timed run completed {int(done)} "
                      "requests** (other requests in the window, or failures)")
    if "push_layerwise" in xfer:
        lines[-1] += (f"; rooms pushed layer by layer {xfer['push_layerwise']}, after the forward "
                      f"{xfer['push_after_forward']}")
    if xfer.get("handoff_mean_ms"):
        phases = (f"RoomReady -> first READ posted {xfer['setup_mean_ms']:.3f} ms, last READ DONE -> decoding "
                  f"{xfer['wait_mean_ms']:.3f} ms, ") if mode == "pull" else ""
        lines += [f"decode-side hand-off per request: {phases}RoomReady -> decoding {xfer['handoff_mean_ms']:.3f} ms "
                  f"(**hand-off share of TTFT {100 * xfer['handoff_share_of_ttft']:.2f}%**); "
                  f"{int(xfer.get('prefill_servers', 1))} prefill server(s)"]
    return lines + [""]


def report_text(a, dataset: str, results: dict, xfer: dict, errors: dict, hw: str, warm: dict | None = None) -> str:
    """The markdown report of one dataset: header, warm-up line, transfer lines, metric table with the pd ratios,
    failures (``warm``: setup -> the warm-up phase's record)."""
    lines = [f"# PD disaggregation vs aggregated, {dataset} ({datetime.date.today().isoformat()} "
             f"{datetime.datetime.utcnow():%H:%M} UTC)", "",
             f"hardware: {hw}", f"command: `python {' '.join(shlex.quote(x) for x in sys.argv)}`",
             warmup_line(a, warm or {}), ""]
    if xfer:
        lines += transfer_lines(a.transfer_mode, a.transfer_backend, xfer)
    cols = [s for s in SETUPS if s in results]
    if not cols:
        lines.append("no setup measured")
    ratios = [(x, y) for x, y in (("pd", "agg2"), ("pd", "agg")) if x in results and y in results]
    lines += [] if not cols else ["| metric | " + " | ".join(cols) + "".join(f" | {x} / {y}" for x, y in ratios) + " |",
                                  "|---" * (1 + len(cols) + len(ratios)) + "|"]
    for m in METRICS if cols else []:
        row = [f"{results[c].get(m, float('nan')):.3f}" for c in cols]
        for x, y in ratios:
            vx, vy = results[x].get(m, 0), results[y].get(m, 0)
            row.append(f"{vx / vy if vy else float('nan'):.3f}")
        lines.append(f"| {m} | " + " | ".join(row) + " |")
    for s, e in errors.items():
        lines += ["", f"**{s} failed**: {e[-600:]}"]
    return "\n".join(lines) + "\n"


def write_report(a, results: dict, xfer: dict, errors: dict, warm: dict | None = None) -> None:
    """(Re)write the markdown table and the JSON of everything measured so far, one pair of files per dataset
    (``results`` / ``xfer`` / ``warm``: dataset -> setup -> metrics / dataset -> transfer summary / dataset -> setup
    -> the untimed warm-up phase's record)."""
    warm = warm or {}
    date = datetime.date.today().isoformat()
    hw = f"{platform.node()} {platform.processor() or platform.machine()} ({a.device})"
    if a.device == "cuda":
        try:
            import torch

            hw += f" {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
        except Exception:  # noqa: BLE001
            pass
    for i, ds in enumerate(a.dataset):
        text = report_text(a, ds, results.get(ds, {}), xfer.get(ds, {}), errors, hw, warm.get(ds, {}))
        print(text, flush=True)
        base = os.path.join(a.out_dir, f"{date}_pd_serving_{a.transfer_backend}_{a.transfer_mode}"
                            + ("" if i == 0 else f"_{ds}"))
        with open(base + ".md", "w") as f:
            f.write(text)
        with open(base + ".json", "w") as f:
            json.dump({"date": date, "hardware": hw, "command": sys.argv, "dataset": ds,
                       "results": results.get(ds, {}), "transfer": xfer.get(ds, {}), "warmup": warm.get(ds, {}),
                       "errors": errors}, f, indent=1)


def parse_args(argv=None) -> argparse.Namespace:
    """The CLI (``argv``: None reads sys.argv); argparse exits with a message naming a bad flag."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--tokenizer-path", default=None,
                    help="tokenizer folder for the servers and the client (default: --model-path); lets a "
                         "dummy-weight config folder (../shared/data/configs/...) be benchmarked without copying a "
                         "tokenizer beside it")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--setups", nargs="+", default=["agg", "pd"], choices=SETUPS)
    ap.add_argument("--transfer-backend", default="fake", choices=["fake", "nixl"])
    ap.add_argument("--transfer-mode", default="pull", choices=["pull", "push"])
    ap.add_argument("--server-extra", default="", help="flags for every server")
    ap.add_argument("--prefill-extra", default="")
    ap.add_argument("--decode-extra", default="")
    ap.add_argument("--agg-extra", default="", help="flags of the single aggregated server (agg without agg2)")
    ap.add_argument("--replica-gpus", nargs="+", type=int, default=[0, 1],
                    help="GPU of each agg2 replica (cuda; agg2 = as many replicas behind mini_lb --workers)")
    ap.add_argument("--prefill-gpus", nargs="+", type=int, default=None,
                    help="pd on cuda: one prefill server per GPU listed (--base-gpu-id), all behind the router "
                         "(e.g. 0 1 with --decode-extra '--base-gpu-id 2': 2 prefill : 1 decode)")
    ap.add_argument("--dataset", nargs="+", default=["sharegpt"], choices=["sharegpt", "random"],
                    help="workload(s); several run in turn on the same servers of each setup, one report each")
    ap.add_argument("--dataset-path", default=os.path.join(ROOT, "..", "shared", "data", "datasets", "sharegpt") + "/")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--range-ratio", type=float, default=1.0, help="random dataset: lengths in [ratio*len, len]")
    ap.add_argument("--context-len", type=int, default=400)
    ap.add_argument("--request-rate", type=float, default=0.0)
    ap.add_argument("--max-concurrency", type=int, default=8, help="0: no limit")
    ap.add_argument("--warmup", type=int, default=4, help="untimed concurrent warm-up requests per server at its start")
    ap.add_argument("--warmup-seconds", type=float, default=5.0,
                    help="untimed warm-up phase before every timed run: the workload at its own rate / concurrency "
                         "for this long (no rate: min(--num-prompts, 2 x --max-concurrency) requests), a flush; 0: off")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--startup-timeout", type=float, default=900)
    ap.add_argument("--bench-timeout", type=float, default=3600)
    ap.add_argument("--pid-file", default="", help="append the pid of every process started (for a caller's trap)")
    ap.add_argument("--out-dir", default=os.path.join(ROOT, "benchmark", "results", "disaggregation"))
    from benchmark.common.records import add_record_dir_argument
    add_record_dir_argument(ap, "disaggregation")
    return ap.parse_args(argv)


def main(argv=None) -> None:
    """Run the chosen setups one after another and write the Markdown/JSON report under ``--out-dir``."""
    a = parse_args(argv)
    a.dataset = list(dict.fromkeys(a.dataset))
    if a.warmup_seconds < 0:
        sys.exit(f"--warmup-seconds {a.warmup_seconds}: use 0 (no warm-up phase) or a positive number of seconds")
    if "agg2" in a.setups and len(a.replica_gpus) < 2:
        sys.exit(f"--replica-gpus {a.replica_gpus}: agg2 needs at least two GPUs")
    logdir = os.path.join(a.out_dir, "pd_serving_logs")
    os.makedirs(logdir, exist_ok=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally blocks: stop every server
    results: dict = {ds: {} for ds in a.dataset}  # dataset -> setup -> bench_serving record
    warm: dict = {ds: {} for ds in a.dataset}  # dataset -> setup -> the warm-up phase's record (untimed)
    xfer: dict = {}  # dataset -> transfer_summary of the pd setup
    errors: dict = {}

    def report() -> None:
        write_report(a, results, xfer, errors, warm)

    order = list(dict.fromkeys(a.setups))
    while order:
        s = order.pop(0)
        t0 = time.time()
        try:
            if s == "pd":
                run_pd(a, logdir, results, xfer, report, warm)
            else:
                which = [s] + (["agg2"] if s == "agg" and order[:1] == ["agg2"] else [])
                order = [o for o in order if o not in which]
                run_aggregated(a, logdir, which, results, report, warm)
        except Exception as e:  # noqa: BLE001 - the next setup still runs; the report names the failure
            errors[s] = f"{type(e).__name__}: {e}"
        print(f"[bench_pd_serving] {s} done in {time.time() - t0:.1f} s", flush=True)
        report()
    if a.record_dir and any(results.values()):
        from benchmark.disaggregation.pd_serving_record import write_pd_record

        write_pd_record(a, results, xfer, errors, METRICS, SETUPS)
    if errors:
        sys.exit(1)


if __name__ == "__main__":
    main()
