"""End-to-end prefill/decode disaggregation vs the aggregated server, with ``bench_serving``.

Starts, in one run and on the same machine: an aggregated server, and a prefill server + a decode server + the
mini_lb router (``--disaggregation-transfer-backend``, ``--disaggregation-transfer-mode``); runs the same
``python -m sglang.bench_serving`` workload (ShareGPT from the shared data folder by default) against each;
prints a table of TTFT / TPOT / throughput with the ratio router / aggregated, and the transfer share of TTFT
(mean ``sglang:kv_transfer_seconds`` of the decode server / mean TTFT through the router). Writes
``benchmark/results/<date>_pd_serving_<backend>_<mode>.md`` and ``.json`` (date, hardware, command).

CPU smoke run::

    python benchmark/bench_pd_serving.py --model-path ../shared/data/models/stories260K --device cpu \\
        --transfer-backend fake --num-prompts 16 --max-concurrency 4

GPU (two GPUs: prefill on 0, decode on 1; nixl)::

    python benchmark/bench_pd_serving.py --model-path <llama> --device cuda --transfer-backend nixl \\
        --prefill-extra "--base-gpu-id 0" --decode-extra "--base-gpu-id 1" --num-prompts 200 --request-rate 8
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shlex
import socket
import subprocess
import sys
import time

import requests

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
from sglang.srt.utils.nvls_env import apply_nvls_off_env  # noqa: E402

ENV = apply_nvls_off_env({**os.environ, "PYTHONUNBUFFERED": "1"})
METRICS = ["mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms", "mean_itl_ms",
           "output_throughput", "request_throughput", "completed"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    """A subprocess with a log file, waited on until ``url/health`` answers."""

    def __init__(self, cmd: list[str], url: str, log: str, timeout: float):
        self.url, self.log = url, log
        self._f = open(log, "w")
        self.p = subprocess.Popen(cmd, stdout=self._f, stderr=subprocess.STDOUT, env=ENV, start_new_session=True)
        end = time.time() + timeout
        while time.time() < end:
            if self.p.poll() is not None:
                raise RuntimeError(f"{cmd[:4]} exited; see {log}")
            try:
                if requests.get(url + "/health", timeout=2).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(1)
        self.stop()
        raise RuntimeError(f"{url} not healthy after {timeout}s; see {log}")

    def stop(self) -> None:
        if self.p.poll() is None:
            os.killpg(self.p.pid, 15)
            try:
                self.p.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.p.pid, 9)
        self._f.close()


def server(args, extra: list[str], tag: str, logdir: str) -> Proc:
    port = free_port()
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", args.model_path, "--device", args.device,
           "--port", str(port), "--enable-metrics", *shlex.split(args.server_extra), *extra]
    if args.tokenizer_path:
        cmd += ["--tokenizer-path", args.tokenizer_path]
    return Proc(cmd, f"http://127.0.0.1:{port}", os.path.join(logdir, f"{tag}.log"), args.startup_timeout)


def bench(args, url: str, out: str) -> dict:
    cmd = [sys.executable, "-m", "sglang.bench_serving", "--disable-tqdm", "--backend", "sglang", "--base-url", url,
           "--tokenizer", args.tokenizer_path or args.model_path, "--model", args.model_path,
           "--num-prompts", str(args.num_prompts),
           "--seed", str(args.seed), "--output-file", out, "--warmup-requests", "1"]
    if args.dataset == "sharegpt":
        cmd += ["--dataset-name", "sharegpt", "--dataset-path", args.dataset_path, "--sharegpt-output-len",
                str(args.output_len), "--sharegpt-context-len", str(args.context_len)]
    else:
        cmd += ["--dataset-name", "random", "--random-input-len", str(args.input_len), "--random-output-len",
                str(args.output_len)]
    if args.request_rate:
        cmd += ["--request-rate", str(args.request_rate)]
    if args.max_concurrency:
        cmd += ["--max-concurrency", str(args.max_concurrency)]
    r = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=args.bench_timeout)
    if r.returncode != 0:
        raise RuntimeError(f"bench_serving failed:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    with open(out) as f:
        return json.loads(f.read().strip().splitlines()[-1])


def transfer_seconds(url: str) -> tuple[float, float, float]:
    """(sum of KV transfer seconds, requests, sum of transfer bytes) from a decode server's /metrics."""
    text = requests.get(url + "/metrics", timeout=30).text

    def val(name: str) -> float:
        m = re.search(rf"^{re.escape(name)}{{[^}}]*}} ([0-9.e+-]+)$", text, re.M)
        return float(m.group(1)) if m else 0.0

    return (val("sglang:kv_transfer_seconds_sum"), val("sglang:kv_transfer_seconds_count"),
            val("sglang:kv_transfer_bytes_total"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--tokenizer-path", default=None,
                    help="tokenizer folder for the servers and the client (default: --model-path); lets a "
                         "dummy-weight config folder (../shared/data/configs/...) be benchmarked without copying a "
                         "tokenizer beside it")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--transfer-backend", default="fake", choices=["fake", "nixl"])
    ap.add_argument("--transfer-mode", default="pull", choices=["pull", "push"])
    ap.add_argument("--server-extra", default="", help="flags for every server")
    ap.add_argument("--prefill-extra", default="")
    ap.add_argument("--decode-extra", default="")
    ap.add_argument("--dataset", default="sharegpt", choices=["sharegpt", "random"])
    ap.add_argument("--dataset-path", default=os.path.join(ROOT, "..", "shared", "data", "datasets", "sharegpt") + "/")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--context-len", type=int, default=400)
    ap.add_argument("--request-rate", type=float, default=0.0)
    ap.add_argument("--max-concurrency", type=int, default=8)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--startup-timeout", type=float, default=900)
    ap.add_argument("--bench-timeout", type=float, default=3600)
    ap.add_argument("--out-dir", default=os.path.join(ROOT, "benchmark", "results"))
    a = ap.parse_args()
    logdir = os.path.join(a.out_dir, "pd_serving_logs")
    os.makedirs(logdir, exist_ok=True)
    results: dict = {}
    agg = server(a, [], "aggregated", logdir)
    try:
        results["aggregated"] = bench(a, agg.url, os.path.join(logdir, "aggregated.jsonl"))
    finally:
        agg.stop()
    pd = ["--disaggregation-transfer-backend", a.transfer_backend, "--disaggregation-transfer-mode", a.transfer_mode]
    procs = []
    try:
        pre = server(a, ["--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(free_port()), *pd,
                         *shlex.split(a.prefill_extra)], "prefill", logdir)
        procs.append(pre)
        dec = server(a, ["--disaggregation-mode", "decode", *pd, *shlex.split(a.decode_extra)], "decode", logdir)
        procs.append(dec)
        port = free_port()
        lb = Proc([sys.executable, "-m", "sglang.srt.disaggregation.mini_lb", "--prefill", pre.url, "--decode", dec.url,
                   "--port", str(port)], f"http://127.0.0.1:{port}", os.path.join(logdir, "router.log"), 120)
        procs.append(lb)
        results["router"] = bench(a, lb.url, os.path.join(logdir, "router.jsonl"))
        xfer_s, xfer_n, xfer_b = transfer_seconds(dec.url)
    finally:
        for p in reversed(procs):
            p.stop()
    mean_xfer_ms = 1000 * xfer_s / max(xfer_n, 1)
    share = mean_xfer_ms / max(results["router"]["mean_ttft_ms"], 1e-9)
    date = datetime.date.today().isoformat()
    hw = f"{platform.node()} {platform.processor() or platform.machine()} ({a.device})"
    if a.device == "cuda":
        try:
            import torch

            hw += " " + torch.cuda.get_device_name(0)
        except Exception:  # noqa: BLE001
            pass
    lines = [f"# PD disaggregation vs aggregated ({date})", "", f"hardware: {hw}",
             f"command: `python {' '.join(shlex.quote(x) for x in sys.argv)}`", "",
             f"transfer: backend {a.transfer_backend}, mode {a.transfer_mode}; {int(xfer_n)} requests, "
             f"{xfer_b / max(xfer_n, 1) / 1024:.1f} KiB and {mean_xfer_ms:.3f} ms per request; "
             f"**transfer share of TTFT {100 * share:.2f}%** (mean transfer / mean router TTFT)", "",
             "| metric | aggregated | router (P+D) | router / aggregated |", "|---|---|---|---|"]
    for m in METRICS:
        x, y = results["aggregated"].get(m, 0), results["router"].get(m, 0)
        lines.append(f"| {m} | {x:.3f} | {y:.3f} | {y / x if x else float('nan'):.3f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    base = os.path.join(a.out_dir, f"{date}_pd_serving_{a.transfer_backend}_{a.transfer_mode}")
    with open(base + ".md", "w") as f:
        f.write(text)
    with open(base + ".json", "w") as f:
        json.dump({"date": date, "hardware": hw, "command": sys.argv, "results": results,
                   "transfer": {"seconds_sum": xfer_s, "requests": xfer_n, "bytes_sum": xfer_b,
                                "mean_ms": mean_xfer_ms, "share_of_ttft": share}}, f, indent=1)


if __name__ == "__main__":
    main()
