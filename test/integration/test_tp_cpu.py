"""CPU tensor parallelism end to end: ``--tp N`` servers (gloo ranks) give TP=1's greedy tokens on the
stories260K checkpoints; a bad ``--tp`` and a dead rank fail fast and clearly; ``bench_one_batch --tp``
runs (and labels its no-comm counterfactual)."""

from __future__ import annotations

import functools
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
import requests

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "unit"))
from conftest import shared_path  # noqa: E402
from server_utils import ENV, ServerProcess  # noqa: E402

PROMPTS = ["Once upon a time", "The little dog", "Lily and Tom went to the park. They", "One day, a bird"]
N_NEW = 24


@functools.lru_cache(maxsize=None)
def tp1_greedy(path: str, prompt_ids: tuple[int, ...], n: int = N_NEW) -> list[int]:
    """TP=1 greedy tokens from our own engine in this process (EOS ignored)."""
    import torch
    from model_harness import ModelHarness

    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_loader.loader import load_model

    config = ModelConfig.from_path(path)
    h = ModelHarness(load_model(config, "auto", "cpu"), config, max_reqs=1, max_len=len(prompt_ids) + n + 1)
    out, new = [], list(prompt_ids)
    for _ in range(n):
        tok = int(torch.argmax(h.step([("r", new)])[0]))
        out.append(tok)
        new = [tok]
    return out


@functools.lru_cache(maxsize=None)
def tokenize(path: str, text: str) -> tuple[int, ...]:
    from sglang.srt.utils.common import get_tokenizer

    return tuple(get_tokenizer(path).encode(text))


def generate(server, payload):
    r = requests.post(server.url + "/generate", json=payload, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(scope="module", params=[("stories260K", 2, 1), ("stories260K-moe", 2, 1), ("stories260K", 4, 1),
                                        ("stories260K-moe", 2, 2)], ids=lambda p: f"{p[0]}-tp{p[1]}-ep{p[2]}")
def tp_server(request):
    name, tp, ep = request.param
    path = shared_path("models", name)
    with ServerProcess(["--model-path", path, "--device", "cpu", "--tp", str(tp), "--ep-size", str(ep),
                        "--chunked-prefill-size", "16"]) as s:
        s.model_path, s.tp = path, tp
        yield s


def test_greedy_tokens_equal_tp1(tp_server):
    params = {"temperature": 0, "max_new_tokens": N_NEW, "ignore_eos": True}
    outs = generate(tp_server, {"text": PROMPTS, "sampling_params": params})  # one batch, chunked prefill
    for prompt, out in zip(PROMPTS, outs):
        ids = tokenize(tp_server.model_path, prompt)
        assert out["output_ids"] == tp1_greedy(tp_server.model_path, ids), prompt
    info = requests.get(tp_server.url + "/get_server_info", timeout=30).json()
    assert info["tp_size"] == tp_server.tp
    if tp_server.model_path.endswith("stories260K"):
        assert outs[0]["text"].startswith(", there was a little girl named Lily")


def test_seeded_sampling_is_reproducible_across_ranks(tp_server):
    params = {"temperature": 0.9, "top_p": 0.95, "max_new_tokens": 16, "seed": 1234, "ignore_eos": True}
    a = generate(tp_server, {"text": PROMPTS[1], "sampling_params": params})
    b = generate(tp_server, {"text": PROMPTS[1], "sampling_params": params})
    assert a["output_ids"] == b["output_ids"] and len(a["output_ids"]) == 16


def _launch(args, timeout=120):
    return subprocess.run([sys.executable, "-m", "sglang.launch_server", "--device", "cpu", *args],
                          capture_output=True, text=True, timeout=timeout, env=ENV)


def test_bad_tp_fails_at_startup():
    t0 = time.time()
    p = _launch(["--model-path", shared_path("models", "stories260K"), "--tp", "3", "--port", "1"])
    assert p.returncode == 1
    assert "--tp-size=3 does not divide num_attention_heads=8" in p.stdout + p.stderr
    assert time.time() - t0 < 60


def test_dead_rank_stops_server_with_clear_error():
    s = ServerProcess(["--model-path", shared_path("models", "stories260K"), "--device", "cpu", "--tp", "2"])
    try:
        generate(s, {"text": "hi", "sampling_params": {"max_new_tokens": 2}})
        with open(s.log_path) as f:
            pid = int(re.search(r"scheduler TP rank 1 started \(pid (\d+)\)", f.read()).group(1))
        result = {}

        def in_flight() -> None:  # running when the rank dies: must get a 503 naming the cause
            try:
                r = requests.post(s.url + "/generate", timeout=90, json={
                    "text": ["Once upon a time"] * 4, "sampling_params": {"max_new_tokens": 500, "ignore_eos": True}})
                result["status"], result["body"] = r.status_code, r.text
            except requests.RequestException as e:
                result["status"] = type(e).__name__

        t = threading.Thread(target=in_flight, daemon=True)
        t.start()
        time.sleep(0.3)
        os.kill(pid, signal.SIGKILL)
        s.proc.wait(timeout=60)  # no hang: the launcher notices and exits
        assert s.proc.returncode == 1
        log = s.log_tail(200)
        assert "exited unexpectedly" in log and "scheduler TP rank" in log
        t.join(30)
        assert result.get("status") == 503, result
        assert "exited unexpectedly" in result["body"], result
    finally:
        assert s.stop() == []


def test_bench_one_batch_tp2_and_nocomm_label(tmp_path):
    out = tmp_path / "result.jsonl"
    base = [sys.executable, "-m", "sglang.bench_one_batch", "--model-path", shared_path("models", "stories260K"),
            "--device", "cpu", "--batch-size", "1", "3", "--input-len", "16", "--output-len", "4", "--tp", "2",
            "--result-filename", str(out)]
    p = subprocess.run(base, capture_output=True, text=True, timeout=180, env=ENV)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "Prefill. latency" in p.stdout and "Decode.  median latency" in p.stdout
    p = subprocess.run(base + ["--debug-nocomm", "--profile-comm", "--profile-tokens", "1", "32",
                               "--profile-repeats", "1"], capture_output=True, text=True, timeout=180, env=ENV)
    assert p.returncode == 0, p.stdout + p.stderr
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith(("Prefill", "Decode", "Total", "[NO-COMM"))]
    assert lines and all(ln.startswith("[NO-COMM COUNTERFACTUAL (outputs are wrong)]") for ln in lines), lines
    recs = [json.loads(ln) for ln in out.read_text().splitlines()]
    assert [r["batch_size"] for r in recs if "batch_size" in r] == [1, 3, 1, 3]
    assert [r["debug_nocomm"] for r in recs if "batch_size" in r] == [False, False, True, True]
    prof = [r for r in recs if r.get("mode") == "profile_comm"]
    assert [r["tokens"] for r in prof] == [1, 32] and all(r["latency_comm_s"] > 0 for r in prof)
