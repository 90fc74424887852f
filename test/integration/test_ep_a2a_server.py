"""Expert parallelism by all-to-all end to end on CPU: a ``--tp 2 --ep-size 2 --moe-a2a-backend nccl`` server on
stories260K-moe8 (8 different experts) gives TP1's greedy tokens for the shared prompts while another request is
decoding (mixed prefill + decode batches, chunked prefill); then a killed EP rank gives every in-flight client a 503
naming the dead rank within seconds (no hang, no 200 with wrong tokens) and the server exits non-zero. Bad flags are
refused before any worker starts."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import requests

from conftest import shared_path
from server_utils import ENV, ServerProcess

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "unit"))
from ep_a2a_worker import tp1_greedy_tokens  # noqa: E402

PROMPTS = ["Once upon a time", "The little dog", "Lily and Tom went to the park. They", "One day, a bird"]
N_NEW = 32


def _post(url: str, payload: dict, timeout: float = 300) -> requests.Response:
    return requests.post(url + "/generate", json=payload, timeout=timeout)


def test_ep2_nccl_server_greedy_equals_tp1_and_dead_rank_fails_closed():
    path = shared_path("models", "stories260K-moe8")
    s = ServerProcess(["--model-path", path, "--device", "cpu", "--tp", "2", "--ep-size", "2",
                       "--moe-a2a-backend", "nccl", "--chunked-prefill-size", "16"])
    try:
        log = open(s.log_path).read()
        assert "MoE all-to-all (nccl) on 5 MoE layers" in log and "token scope tp_slice" in log
        info = requests.get(s.url + "/get_server_info", timeout=30).json()
        assert info["moe_a2a_backend"] == "nccl" and info["ep_size"] == 2
        # a long request decodes while the batch of shared prompts prefills in chunks (mixed batches)
        bg = {}
        t = threading.Thread(target=lambda: bg.update(r=_post(s.url, {"text": "Once upon a time", "sampling_params": {
            "temperature": 0, "max_new_tokens": 120, "ignore_eos": True}})), daemon=True)
        t.start()
        time.sleep(0.5)
        outs = _post(s.url, {"text": PROMPTS, "sampling_params": {"temperature": 0, "max_new_tokens": N_NEW,
                                                                   "ignore_eos": True}}).json()
        t.join(300)
        from sglang.srt.utils.common import get_tokenizer

        tok = get_tokenizer(path)
        for prompt, out in zip(PROMPTS, outs):
            assert out["output_ids"] == tp1_greedy_tokens(path, tok.encode(prompt), N_NEW), prompt
        assert bg["r"].status_code == 200
        assert bg["r"].json()["output_ids"][:N_NEW] == tp1_greedy_tokens(path, tok.encode("Once upon a time"), N_NEW)

        # kill EP rank 1 while three clients are decoding: each gets a 503 naming it, within seconds
        pid = int(re.search(r"scheduler TP rank 1 started \(pid (\d+)\)", open(s.log_path).read()).group(1))
        results: dict = {}

        def client(i: int) -> None:
            try:
                r = _post(s.url, {"text": PROMPTS[i], "sampling_params": {"max_new_tokens": 450, "ignore_eos": True}},
                          timeout=120)
                results[i] = (r.status_code, r.text, time.monotonic())
            except requests.RequestException as e:
                results[i] = (type(e).__name__, str(e), time.monotonic())

        threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(3)]
        for th in threads:
            th.start()
        time.sleep(1.0)
        t_kill = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        for th in threads:
            th.join(60)
        assert len(results) == 3, results
        for i, (status, body, t_done) in results.items():
            assert status == 503, (i, status, body[:300])
            assert "exited unexpectedly" in body and "scheduler TP rank" in body, body[:300]
            assert t_done - t_kill < 30, (i, t_done - t_kill)
        s.proc.wait(timeout=60)
        assert s.proc.returncode == 1
    finally:
        assert s.stop() == []


def _launch(args: list) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sglang.launch_server", "--device", "cpu", "--port", "1", *args],
                          capture_output=True, text=True, timeout=120, env=ENV)


def test_bad_moe_a2a_flags_fail_before_any_worker_starts():
    moe8 = shared_path("models", "stories260K-moe8")
    for args, want in (
        (["--model-path", moe8, "--tp", "2", "--ep-size", "2", "--moe-a2a-backend", "deepep"],
         "--moe-a2a-backend='deepep' is invalid: DeepEP is not part of this server; use nccl"),
        (["--model-path", moe8, "--moe-a2a-backend", "nccl"], "needs --ep-size > 1; add --ep-size 2"),
        (["--model-path", shared_path("models", "stories260K"), "--tp", "2", "--ep-size", "2",
          "--moe-a2a-backend", "nccl"], "needs a MoE model"),
    ):
        t0 = time.time()
        p = _launch(args)
        out = p.stdout + p.stderr
        assert p.returncode != 0 and want in out, (args, out[-2000:])
        assert "scheduler TP rank" not in out, out[-2000:]  # nothing was spawned
        assert time.time() - t0 < 60
