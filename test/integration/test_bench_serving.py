"""``python -m sglang.bench_serving`` as a subprocess against one real CPU server on stories260K.

Every run uses ignore_eos (the default), so the server must generate exactly the sampled output
lengths: the reported token totals are checked against the dataset sampled here with the same
seed and tokenizer.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from conftest import shared_path  # noqa: E402
from server_utils import ENV, ServerProcess, free_port  # noqa: E402

LABELS = ["Backend:", "Traffic request rate:", "Max request concurrency:", "Successful requests:",
          "Benchmark duration (s):", "Total input tokens:", "Total generated tokens:", "Request throughput (req/s):",
          "Input token throughput (tok/s):", "Output token throughput (tok/s):", "Total token throughput (tok/s):",
          "Concurrency:", "End-to-End Latency", "Time to First Token", "Inter-Token Latency",
          "Mean E2E Latency (ms):", "Median E2E Latency (ms):", "P99 E2E Latency (ms):", "Mean TTFT (ms):",
          "Median TTFT (ms):", "P99 TTFT (ms):", "Mean TPOT (ms):", "Median TPOT (ms):", "P99 TPOT (ms):",
          "Mean ITL (ms):", "Median ITL (ms):", "P99 ITL (ms):"]
JSON_FIELDS = ["backend", "dataset_name", "request_rate", "max_concurrency", "duration", "completed",
               "total_input_tokens", "total_output_tokens", "request_throughput", "input_throughput",
               "output_throughput", "total_throughput", "concurrency", "mean_e2e_latency_ms", "median_e2e_latency_ms",
               "p99_e2e_latency_ms", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms",
               "median_tpot_ms", "p99_tpot_ms", "mean_itl_ms", "median_itl_ms", "p99_itl_ms"]


@pytest.fixture(scope="module")
def model_dir():
    return shared_path("models", "stories260K")


@pytest.fixture(scope="module")
def server(model_dir):
    srv = ServerProcess(["--model-path", model_dir, "--device", "cpu"])
    yield srv
    assert srv.stop() == []


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from sglang.srt.utils.common import get_tokenizer

    return get_tokenizer(model_dir)


def _bench(args: list[str], timeout: float = 180) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "sglang.bench_serving", "--disable-tqdm", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=ENV)


def _expected(cfg_kw: dict, tokenizer) -> tuple[int, int]:
    from sglang.benchmark_datasets import DatasetConfig, get_dataset

    rows = get_dataset(DatasetConfig(**cfg_kw), tokenizer)
    return sum(r.prompt_len for r in rows), sum(r.output_len for r in rows)


def _check_result(proc, rec: dict, backend: str, n: int, in_tok: int, out_tok: int) -> None:
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "============ Serving Benchmark Result ============" in out
    for label in LABELS:
        assert label in out, label
    for f in JSON_FIELDS:
        assert f in rec, f
    assert rec["backend"] == backend and rec["completed"] == n
    assert rec["total_input_tokens"] == in_tok
    assert rec["total_output_tokens"] == out_tok
    assert rec["request_throughput"] == pytest.approx(n / rec["duration"])
    assert 0 < rec["median_ttft_ms"] <= rec["p99_ttft_ms"] <= rec["max_e2e_latency_ms"]
    assert 0 < rec["mean_itl_ms"] and rec["mean_tpot_ms"] > 0
    line = next(ln for ln in out.splitlines() if ln.startswith("Total generated tokens:"))
    assert int(line.split()[-1]) == out_tok


def _read_jsonl(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(ln) for ln in f if ln.strip()]


@pytest.mark.parametrize("backend,dataset", [("sglang", "random"), ("sglang", "random-ids"),
                                             ("sglang-oai", "random")])
def test_random_datasets(server, model_dir, tokenizer, tmp_path, backend, dataset):
    seed = random.randrange(1 << 20)
    n, in_len, out_len = 10, random.randint(16, 48), random.randint(8, 20)
    out_file = tmp_path / "res.jsonl"
    proc = _bench(["--backend", backend, "--base-url", server.url, "--model", model_dir, "--dataset-name", dataset,
                   "--num-prompts", str(n), "--random-input-len", str(in_len), "--random-output-len", str(out_len),
                   "--random-range-ratio", "0.5", "--max-concurrency", "4", "--seed", str(seed),
                   "--output-file", str(out_file)])
    in_tok, out_tok = _expected(dict(name=dataset, num_prompts=n, seed=seed, random_input_len=in_len,
                                     random_output_len=out_len, random_range_ratio=0.5), tokenizer)
    recs = _read_jsonl(out_file)
    assert len(recs) == 1, proc.stderr[-2000:]
    _check_result(proc, recs[0], backend, n, in_tok, out_tok)
    assert recs[0]["max_concurrency"] == 4 and recs[0]["dataset_name"] == dataset


@pytest.mark.parametrize("backend", ["sglang", "sglang-oai"])
def test_sharegpt_shared_folder(server, model_dir, tokenizer, tmp_path, backend):
    folder = shared_path("datasets", "sharegpt")
    seed = random.randrange(1 << 20)
    out_file = tmp_path / "res.jsonl"
    proc = _bench(["--backend", backend, "--host", "127.0.0.1", "--port", str(server.port), "--tokenizer", model_dir,
                   "--dataset-name", "sharegpt", "--dataset-path", folder + "/", "--num-prompts", "8",
                   "--sharegpt-output-len", "12", "--sharegpt-context-len", "300", "--request-rate", "40",
                   "--seed", str(seed), "--output-file", str(out_file)])
    in_tok, out_tok = _expected(dict(name="sharegpt", num_prompts=8, seed=seed, dataset_path=folder + "/",
                                     sharegpt_output_len=12, sharegpt_context_len=300), tokenizer)
    assert out_tok == 8 * 12
    recs = _read_jsonl(out_file)
    assert len(recs) == 1, proc.stderr[-2000:]
    _check_result(proc, recs[0], backend, 8, in_tok, out_tok)
    assert recs[0]["request_rate"] == 40.0


def test_sweep_with_plot_vllm_backend(server, model_dir, tmp_path):
    pytest.importorskip("matplotlib")
    out_file, png = tmp_path / "sweep.jsonl", tmp_path / "lat.png"
    proc = _bench(["--backend", "vllm", "--base-url", server.url, "--model", model_dir, "--dataset-name", "random",
                   "--num-prompts", "6", "--random-input-len", "24", "--random-output-len", "8",
                   "--request-rate", "20,inf", "--max-concurrency", "2", "--output-file", str(out_file),
                   "--plot", str(png)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    recs = _read_jsonl(out_file)
    assert [r["request_rate"] for r in recs] == [20.0, float("inf")]
    assert all(r["completed"] == 6 and r["backend"] == "vllm" for r in recs)
    assert proc.stdout.count("Serving Benchmark Result") == 2
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_unreachable_server_fails_clearly(model_dir):
    proc = _bench(["--backend", "sglang", "--port", str(free_port()), "--model", model_dir, "--dataset-name",
                   "random", "--num-prompts", "2", "--random-input-len", "8", "--random-output-len", "4"], timeout=120)
    assert proc.returncode != 0
    assert "warmup request failed" in proc.stderr


def test_readme_sweep_command_works_without_dataset_flags(server, tmp_path):
    """README: ``python -m sglang.bench_serving --request-rate 4,8,16,inf --plot latency.png`` (plus the test
    server's port and small sizes): no ShareGPT path, so random prompts, with a warning."""
    pytest.importorskip("matplotlib")
    png, out_file = tmp_path / "latency.png", tmp_path / "r.jsonl"
    proc = _bench(["--port", str(server.port), "--request-rate", "4,8,16,inf", "--plot", str(png), "--num-prompts",
                   "3", "--random-input-len", "8", "--random-output-len", "4", "--output-file", str(out_file)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "no --dataset-path" in proc.stderr
    recs = _read_jsonl(out_file)
    assert [r["request_rate"] for r in recs] == [4.0, 8.0, 16.0, float("inf")]
    assert all(r["dataset_name"] == "random" and r["completed"] == 3 for r in recs)
    assert png.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("args,flag", [(["--dataset-name", "sharegpt", "--dataset-path", "/nonexistent/sg.json"],
                                        "--dataset-path"),
                                       (["--num-prompts", "0"], "--num-prompts"),
                                       (["--request-rate", "4,x"], "--request-rate")])
def test_bad_bench_args_fail_before_contacting_the_server(args, flag):
    proc = _bench(["--port", "1", *args], timeout=60)  # nothing listens on port 1: contacting it would fail otherwise
    assert proc.returncode == 2
    assert f"error: {flag}" in proc.stderr and "/v1/models" not in proc.stderr, proc.stderr[-1500:]
