"""Offline serving throughput with ``--kv-cache-dtype fp8_e4m3`` vs ``auto`` (BF16 KV), SGLang's offline CI workload.

For each KV dtype: start ``python -m sglang.launch_server`` (Llama-3.1-8B config, dummy weights, bf16, the llama3
tokenizer, every other flag at its default), read its KV capacity (``max_total_tokens`` from ``/get_server_info``: an
FP8 cache should hold twice the tokens of a BF16 one in the same memory), run ``python -m sglang.bench_serving``
(random dataset, input 4096 / output 2048, ``--random-range-ratio 0.0``, 500 prompts, request rate inf, one warm-up
request, seed 1), stop the server. ``--repeats`` rounds alternate the order (round 0: as listed; round 1: reversed,
...). The record keeps every run and, per dtype, the median output tok/s, with FP8 / auto ratios.

``--smoke``: the same flow on the CPU with stories260K and a toy workload (8 prompts of 32 / 8 tokens): checks the
script, not the speed. Writes ``<out>/kv_cache_dtype_serving.json`` and ``.md`` (+ per-run server / bench logs).
``--record-dir DIR`` also writes a :mod:`benchmark.common.records` record (``what`` = ``kv_cache_dtype_serving``)
under ``DIR/quantization/`` (:func:`kv_cache_dtype_serving_record`).

    python benchmark/quantization/bench_kv_cache_dtype_serving.py --out /tmp/kvsrv            # GPU, ~6-8 min
    python benchmark/quantization/bench_kv_cache_dtype_serving.py --smoke --out /tmp/kvsrv    # CPU, ~2 min
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DATA = REPO.parent / "shared" / "data"
sys.path.insert(0, str(REPO / "python"))
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # the benchmark package when run as a file
from sglang.srt.utils.nvls_env import NVLS_OFF_ENV  # noqa: E402  (pure Python: the multicast-off env, defined once)
KEYS = ("completed", "failed", "duration", "output_throughput", "total_throughput", "request_throughput",
        "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms",
        "mean_itl_ms", "median_itl_ms", "p99_itl_ms")


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--dtypes", default="auto,fp8_e4m3", help="--kv-cache-dtype values, comma separated")
    p.add_argument("--repeats", type=int, default=1, help="rounds (order alternated); 1 round = one run per dtype")
    p.add_argument("--model-path", default=str(DATA / "configs" / "meta-llama--Meta-Llama-3.1-8B"))
    p.add_argument("--tokenizer-path", default=str(DATA / "tokenizers" / "llama3"))
    p.add_argument("--input-len", type=int, default=4096)
    p.add_argument("--output-len", type=int, default=2048)
    p.add_argument("--range-ratio", type=float, default=0.0)
    p.add_argument("--num-prompts", type=int, default=500)
    p.add_argument("--server-args", default="", help="extra launch_server flags for every run (quoted)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per run (start + benchmark)")
    p.add_argument("--smoke", action="store_true", help="CPU, stories260K, 8 prompts of 32/8 (flow check)")
    from benchmark.common.records import add_record_dir_argument
    add_record_dir_argument(p, "quantization")
    ns = p.parse_args(argv)
    ns.dtypes = [d.strip() for d in ns.dtypes.split(",") if d.strip()]
    if ns.smoke:
        ns.model_path = ns.tokenizer_path = str(DATA / "models" / "stories260K")
        ns.input_len, ns.output_len, ns.num_prompts, ns.range_ratio = 32, 8, 8, 0.0
    if len(ns.dtypes) < 1 or ns.repeats < 1:
        raise SystemExit("--dtypes needs at least one value and --repeats >= 1")
    for path in (ns.model_path, ns.tokenizer_path):
        if not os.path.isdir(path):
            raise SystemExit(f"{path} is not a folder (the shared data lives in ../shared/data beside the checkout)")
    return ns


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict:
    env = dict(os.environ, **NVLS_OFF_ENV, PYTHONUNBUFFERED="1")
    env.pop("TRITON_INTERPRET", None)
    paths = [str(REPO / "python"), str(REPO / "sgl-kernel" / "python"), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    return env


def _get(url: str, timeout: float = 5.0):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.status, json.loads(r.read() or b"null")


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM the server (it stops its children), then SIGKILL what is left of its own process group."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait(10)


def run_one(ns, kv_dtype: str, stem: Path) -> dict:
    """One server with ``--kv-cache-dtype kv_dtype`` and one bench_serving run against it."""
    port = _free_port()
    device = "cpu" if ns.smoke else "cuda"
    server = [sys.executable, "-m", "sglang.launch_server", "--model-path", ns.model_path, "--tokenizer-path",
              ns.tokenizer_path, "--device", device, "--port", str(port), "--kv-cache-dtype", kv_dtype]
    if not ns.smoke:
        server += ["--load-format", "dummy", "--dtype", "bfloat16"]
    server += ns.server_args.split()
    jsonl = Path(f"{stem}_bench_serving.jsonl")
    jsonl.unlink(missing_ok=True)
    bench = [sys.executable, "-m", "sglang.bench_serving", "--backend", "sglang", "--port", str(port), "--tokenizer",
             ns.tokenizer_path, "--dataset-name", "random", "--random-input-len", str(ns.input_len),
             "--random-output-len", str(ns.output_len), "--random-range-ratio", str(ns.range_ratio),
             "--num-prompts", str(ns.num_prompts), "--request-rate", "inf", "--seed", "1", "--warmup-requests", "1",
             "--disable-tqdm", "--output-file", str(jsonl)]
    deadline = time.monotonic() + ns.timeout
    with open(f"{stem}_server.log", "w") as slog:
        proc = subprocess.Popen(server, stdout=slog, stderr=subprocess.STDOUT, env=_env(), start_new_session=True)
        try:
            t0 = time.monotonic()
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"the server exited with code {proc.returncode} (see {slog.name})")
                if time.monotonic() > deadline - 60:
                    raise RuntimeError(f"the server was not healthy after {time.monotonic() - t0:.0f} s ({slog.name})")
                try:
                    if _get(f"http://127.0.0.1:{port}/health")[0] == 200:
                        break
                except OSError:
                    pass
                time.sleep(1)
            startup = time.monotonic() - t0
            info = _get(f"http://127.0.0.1:{port}/get_server_info", 30)[1]
            state = (info.get("internal_states") or [{}])[0]
            with open(f"{stem}_bench_serving.log", "w") as blog:
                rc = subprocess.run(bench, stdout=blog, stderr=subprocess.STDOUT, env=_env(),
                                    timeout=max(10.0, deadline - time.monotonic())).returncode
            if rc != 0 or not jsonl.exists():
                raise RuntimeError(f"bench_serving exited with code {rc} (see {blog.name})")
            rec = json.loads([ln for ln in jsonl.read_text().splitlines() if ln.strip()][-1])
        finally:
            _stop(proc)
    return {"kv_cache_dtype": kv_dtype, "server_startup_s": startup,
            "max_total_tokens": state.get("max_total_tokens", info.get("max_total_tokens")),
            "server_command": " ".join(server[1:]), "bench_command": " ".join(bench[1:]),
            **{k: rec.get(k) for k in KEYS}}


def summarize(runs: list[dict], dtypes: list[str]) -> list[dict]:
    """Per dtype: median output / total tok/s and TPOT over its runs, capacity, and ratios to the first dtype."""
    rows = []
    for d in dtypes:
        mine = [r for r in runs if r["kv_cache_dtype"] == d and r.get("output_throughput")]
        if not mine:
            rows.append({"kv_cache_dtype": d, "runs": 0})
            continue
        rows.append({"kv_cache_dtype": d, "runs": len(mine),
                     "output_tok_s": statistics.median(r["output_throughput"] for r in mine),
                     "total_tok_s": statistics.median(r["total_throughput"] for r in mine),
                     "median_tpot_ms": statistics.median(r["median_tpot_ms"] for r in mine),
                     "median_ttft_ms": statistics.median(r["median_ttft_ms"] for r in mine),
                     "max_total_tokens": mine[0]["max_total_tokens"],
                     "failed": sum(r.get("failed") or 0 for r in mine)})
    base = rows[0]
    for r in rows[1:]:
        if r.get("runs") and base.get("runs"):
            r["output_vs_first"] = r["output_tok_s"] / base["output_tok_s"]
            if r["max_total_tokens"] and base["max_total_tokens"]:
                r["capacity_vs_first"] = r["max_total_tokens"] / base["max_total_tokens"]
    return rows


def render(res: dict) -> str:
    out = [f"# Offline serving: --kv-cache-dtype ({res['date']}, {res['gpu']})", "",
           f"Command: `{res['command']}`  ", f"Commit {res['commit']}, torch {res['torch']}, mode {res['mode']}; "
           f"workload: random {res['workload']}; runs in order {res['order']}.", "",
           "| --kv-cache-dtype | runs | output tok/s | total tok/s | median TTFT ms | median TPOT ms | KV tokens "
           "(max_total_tokens) | output vs first | capacity vs first | failed |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        if not r.get("runs"):
            out.append(f"| {r['kv_cache_dtype']} | 0 | (failed: see the run logs) |||||||")
            continue
        out.append(f"| {r['kv_cache_dtype']} | {r['runs']} | {r['output_tok_s']:.0f} | {r['total_tok_s']:.0f} | "
                   f"{r['median_ttft_ms']:.0f} | {r['median_tpot_ms']:.2f} | {r['max_total_tokens']} | "
                   f"{r.get('output_vs_first', 1.0):.3f} | {r.get('capacity_vs_first', 1.0):.3f} | {r['failed']} |")
    for e in res.get("errors", []):
        out.append(f"\nError: {e}")
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    ns = parse_args(sys.argv[1:] if argv is None else argv)
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        import torch

        gpu = torch.cuda.get_device_name(0) if not ns.smoke and torch.cuda.is_available() else "cpu"
        tv = torch.__version__
    except ImportError:
        gpu, tv = "unknown", "unknown"
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip() or "unknown"
    res = {"benchmark": "kv_cache_dtype_serving", "mode": "smoke (CPU, stories260K)" if ns.smoke else "gpu",
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "gpu": gpu,
           "gpu_count": 1, "torch": tv, "commit": commit,
           "command": "python benchmark/quantization/bench_kv_cache_dtype_serving.py " + " ".join(
               sys.argv[1:] if argv is None else argv),
           "workload": f"{ns.input_len}/{ns.output_len}, range ratio {ns.range_ratio}, {ns.num_prompts} prompts, "
                       "request rate inf", "order": [], "runs": [], "errors": []}
    for rnd in range(ns.repeats):
        order = ns.dtypes if rnd % 2 == 0 else ns.dtypes[::-1]
        for d in order:
            res["order"].append(d)
            stem = out / f"kv_cache_dtype_serving_r{rnd}_{d}"
            try:
                run = run_one(ns, d, stem)
                res["runs"].append(run)
                print(f"round {rnd} {d}: {run['output_throughput']:.0f} output tok/s, KV tokens "
                      f"{run['max_total_tokens']}, median TPOT {run['median_tpot_ms']:.2f} ms", flush=True)
            except Exception as e:  # noqa: BLE001 - recorded; the other runs still go
                res["errors"].append(f"round {rnd} {d}: {e}")
                print(f"round {rnd} {d}: FAILED {e}", flush=True)
            res["rows"] = summarize(res["runs"], ns.dtypes)
            (out / "kv_cache_dtype_serving.json").write_text(json.dumps(res, indent=1))
            (out / "kv_cache_dtype_serving.md").write_text(render(res))
    print(render(res))
    if ns.record_dir:
        from benchmark.common import records

        js, _ = records.write_record(kv_cache_dtype_serving_record(res, ns), Path(ns.record_dir))
        print(f"record: {js}")
    return 1 if res["errors"] else 0


def kv_cache_dtype_serving_record(res: dict, ns, env=None) -> dict:
    """The result :func:`main` built (``res``: its ``rows`` from :func:`summarize`, ``order``, ``errors``) as a
    :mod:`benchmark.common.records` record. A row per KV dtype: median output / total tok/s, TTFT, TPOT, KV capacity;
    the first dtype's output tok/s and capacity are the same-run baselines (``base_output_tok_s``,
    ``base_max_total_tokens``) with ``output_vs_first`` and ``capacity_vs_first`` (this / first). No physical floor.
    Headline: the second dtype's output tok/s and KV capacity against the first's."""
    from benchmark.common import records

    rows = [{k: v for k, v in r.items() if k not in ("output_vs_first", "capacity_vs_first")}
            for r in res.get("rows", [])]
    first = rows[0] if rows and rows[0].get("runs") else {}
    for r in rows:
        if r.get("runs") and first:
            r["base_output_tok_s"] = first["output_tok_s"]
            r["base_max_total_tokens"] = first["max_total_tokens"]
    rows = records.add_ratio(rows, "output_vs_first", "output_tok_s", "base_output_tok_s")
    rows = records.add_ratio(rows, "capacity_vs_first", "max_total_tokens", "base_max_total_tokens")
    headline = []
    if first and len(rows) > 1 and rows[1].get("runs"):
        r, base = rows[1], rows[0]["kv_cache_dtype"]
        headline.append({"label": f"offline serving output throughput, --kv-cache-dtype {r['kv_cache_dtype']} vs "
                                  f"{base} ({res.get('workload', '')})", "value": round(r["output_tok_s"], 1),
                         "unit": "tok/s", "baseline": round(r["base_output_tok_s"], 1),
                         "ratio": r["output_vs_first"]})
        if r.get("max_total_tokens") is not None:
            headline.append({"label": f"KV cache capacity (max_total_tokens), {r['kv_cache_dtype']} vs {base}",
                             "value": r["max_total_tokens"], "unit": "tokens",
                             "baseline": r["base_max_total_tokens"], "ratio": r["capacity_vs_first"]})
    return records.make_record(
        subject="quantization", benchmark="benchmark.quantization.bench_kv_cache_dtype_serving",
        mode="smoke" if ns.smoke else "gpu", what="kv_cache_dtype_serving", rows=rows, env=env,
        command=res.get("command"),
        params={"dtypes": list(ns.dtypes), "repeats": ns.repeats, "model_path": ns.model_path,
                "input_len": ns.input_len, "output_len": ns.output_len, "range_ratio": ns.range_ratio,
                "num_prompts": ns.num_prompts, "server_args": ns.server_args, "order": list(res.get("order", []))},
        baselines=[c for c in ("base_output_tok_s", "base_max_total_tokens") if any(c in r for r in rows)],
        units={"output_tok_s": "tok/s", "total_tok_s": "tok/s", "base_output_tok_s": "tok/s",
               "median_tpot_ms": "ms", "median_ttft_ms": "ms", "max_total_tokens": "tokens",
               "base_max_total_tokens": "tokens"},
        notes=[f"error: {e}" for e in res.get("errors", [])], headline=headline, gpu_count=0 if ns.smoke else 1)


if __name__ == "__main__":
    raise SystemExit(main())
