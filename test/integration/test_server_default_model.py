"""The embedded default model (README quickstart) with --api-key and --enable-metrics, on a real server."""

from __future__ import annotations

import os
import sys
import threading
import time

import pytest
import requests

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from server_utils import ENV, ServerProcess  # noqa: E402

KEY = "sk-test-123"
MODEL = "sglang-tw/tiny-random-llama"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    ENV["SGLANG_TW_CACHE"] = str(tmp_path_factory.mktemp("cache"))
    try:
        with ServerProcess(["--device", "cpu", "--enable-metrics"], api_key=KEY) as s:
            yield s
    finally:
        ENV.pop("SGLANG_TW_CACHE", None)


def post(server, path, body, **kw):
    return requests.post(server.url + path, json=body, headers=server.headers(), timeout=120, **kw)


def test_default_model_is_built_deterministically(server, tmp_path):
    from sglang.srt.configs.default_model import VERSION, ensure_default_model

    a = ensure_default_model(str(tmp_path / "a"))
    b = ensure_default_model(str(tmp_path / "b"))
    for f in ("model.safetensors", "tokenizer.json", "config.json"):
        assert open(os.path.join(a, f), "rb").read() == open(os.path.join(b, f), "rb").read(), f
    served = os.path.join(ENV["SGLANG_TW_CACHE"], f"tiny-random-llama-{VERSION}")
    assert open(os.path.join(served, "model.safetensors"), "rb").read() == open(os.path.join(a, "model.safetensors"), "rb").read()


def test_auth(server):
    assert requests.get(server.url + "/health", timeout=10).status_code == 200
    r = requests.post(server.url + "/generate", json={"text": "hi"}, timeout=10)
    assert r.status_code == 401
    r = requests.get(server.url + "/v1/models", headers={"Authorization": "Bearer wrong"}, timeout=10)
    assert r.status_code == 401
    models = requests.get(server.url + "/v1/models", headers=server.headers(), timeout=10).json()
    assert models["data"][0]["id"] == MODEL


def test_generate_and_chat(server):
    import openai

    out = post(server, "/generate", {"text": "Hello", "sampling_params": {"max_new_tokens": 8, "temperature": 0}}).json()
    assert out["meta_info"]["completion_tokens"] <= 8 and len(out["output_ids"]) == out["meta_info"]["completion_tokens"]
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=6,
                                          temperature=0)
    assert chat.choices[0].finish_reason in ("stop", "length") and chat.usage.prompt_tokens > 5
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=6,
                                            temperature=0, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == chat.choices[0].message.content


def test_n_and_seed(server):
    body = {"text": "abc", "sampling_params": {"max_new_tokens": 12, "temperature": 1.0, "n": 3, "seed": 7,
                                               "ignore_eos": True}}
    a = post(server, "/generate", body).json()
    b = post(server, "/generate", body).json()
    assert len(a) == 3 and [x["output_ids"] for x in a] == [x["output_ids"] for x in b]
    assert len({tuple(x["output_ids"]) for x in a}) > 1  # the copies get different seeds


def test_penalties_and_filters_run(server):
    body = {"text": "abc", "sampling_params": {"max_new_tokens": 10, "temperature": 0.8, "top_p": 0.9, "top_k": 20,
                                               "min_p": 0.05, "frequency_penalty": 0.5, "presence_penalty": 0.3,
                                               "repetition_penalty": 1.2, "ignore_eos": True}}
    out = post(server, "/generate", body).json()
    assert out["meta_info"]["completion_tokens"] == 10


def test_control_routes(server):
    h = server.headers()
    assert requests.get(server.url + "/health_generate", headers=h, timeout=60).status_code == 200
    info = requests.get(server.url + "/get_model_info", headers=h, timeout=10).json()
    assert info["is_generation"] is True
    assert post(server, "/flush_cache", {}).status_code == 200
    # abort a long request by rid
    result = {}

    def run():
        result["r"] = post(server, "/generate", {"text": "x", "rid": "to-abort",
                                                 "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}})

    t = threading.Thread(target=run)
    t.start()
    time.sleep(1.0)
    assert post(server, "/abort_request", {"rid": "to-abort"}).status_code == 200
    t.join(60)
    assert not t.is_alive()
    r = result["r"]
    fr = r.json()["meta_info"]["finish_reason"] if r.status_code == 200 else None
    assert r.status_code != 200 or fr["type"] == "abort"
    st = server.internal_state()
    assert st["num_running_reqs"] == 0


def test_metrics(server):
    post(server, "/generate", {"text": "metrics", "sampling_params": {"max_new_tokens": 4}})
    time.sleep(1.5)  # scheduler stats arrive once a second
    text = requests.get(server.url + "/metrics", headers=server.headers(), timeout=10).text
    for name in ("sglang:time_to_first_token_seconds", "sglang:inter_token_latency_seconds",
                 "sglang:e2e_request_latency_seconds", "sglang:num_running_reqs", "sglang:num_queue_reqs",
                 "sglang:token_usage", "sglang:cache_hit_rate"):
        assert name in text, name

    def metric(text: str, name: str) -> float:
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(name + "{") or line.startswith(name + " "))

    # a non-streaming request: TTFT is the time to its first token, not its whole latency
    body = {"text": "a long one", "sampling_params": {"max_new_tokens": 200, "ignore_eos": True}}
    post(server, "/generate", body)
    after = requests.get(server.url + "/metrics", headers=server.headers(), timeout=10).text
    d_ttft = metric(after, "sglang:time_to_first_token_seconds_sum") - metric(text, "sglang:time_to_first_token_seconds_sum")
    d_e2e = metric(after, "sglang:e2e_request_latency_seconds_sum") - metric(text, "sglang:e2e_request_latency_seconds_sum")
    d_itl = (metric(after, "sglang:inter_token_latency_seconds_count")
             - metric(text, "sglang:inter_token_latency_seconds_count"))
    assert 0 < d_ttft < d_e2e, (d_ttft, d_e2e)
    assert d_itl > 0
