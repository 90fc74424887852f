"""One GPU: the real Llama-3.1-8B config with dummy bf16 weights and the real Llama-3 tokenizer serves requests."""

from __future__ import annotations

import concurrent.futures as cf
import os
import sys
import time

import pytest
import requests

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from conftest import shared_path  # noqa: E402
from server_utils import ServerProcess  # noqa: E402


@pytest.mark.gpu
def test_dummy_llama31_8b_serves_requests():
    cfg = shared_path("configs", "meta-llama--Meta-Llama-3.1-8B")
    tok = shared_path("tokenizers", "llama3")
    with ServerProcess(["--model-path", cfg, "--load-format", "dummy", "--tokenizer-path", tok, "--device", "cuda",
                        "--dtype", "bfloat16", "--context-length", "8192"], timeout=600) as s:
        info = requests.get(s.url + "/get_server_info", timeout=30).json()
        assert info["internal_states"][0]["max_total_tokens"] > 100_000
        t0 = time.time()
        payload = {"text": "The capital of France is", "sampling_params": {"max_new_tokens": 64, "ignore_eos": True,
                                                                          "temperature": 0}}
        with cf.ThreadPoolExecutor(16) as ex:
            outs = list(ex.map(lambda _: requests.post(s.url + "/generate", json=payload, timeout=300).json(),
                               range(32)))
        dt = time.time() - t0
        assert all(o["meta_info"]["completion_tokens"] == 64 for o in outs)
        # Greedy is deterministic for the same batch shape. (Across the 32 concurrent requests above it is not:
        # they run at different padded batch sizes, bf16 GEMMs are batch-variant, and random dummy weights make
        # near-tied logits, so ties may flip, as in SGLang.)
        one = [requests.post(s.url + "/generate", json=payload, timeout=300).json()["output_ids"] for _ in range(2)]
        assert one[0] == one[1]
        chat = requests.post(s.url + "/v1/chat/completions", timeout=300, json={
            "model": info.get("served_model_name") or cfg, "max_tokens": 16,
            "messages": [{"role": "user", "content": "Say hi"}]})
        assert chat.status_code == 200, chat.text
        assert chat.json()["usage"]["prompt_tokens"] > 5
        print(f"dummy Llama-3.1-8B: 32 requests x 64 tokens in {dt:.2f}s ({32 * 64 / dt:.0f} tok/s)")
