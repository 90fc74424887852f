"""The embedded default model (README quickstart: the trained stories260K shipped in the package) with --api-key
and --enable-metrics, on a real server."""

from __future__ import annotations

import json
import os
import re
import sys
import time

import pytest
import requests

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from conftest import shared_path  # noqa: E402
from server_utils import ServerProcess  # noqa: E402

KEY = "sk-test-123"
MODEL = "sglang-tw/stories260K"
PROMPT = "Once upon a time"  # the README's request


@pytest.fixture(scope="module")
def server():
    with ServerProcess(["--device", "cpu", "--enable-metrics"], api_key=KEY) as s:
        yield s


def post(server, path, body, **kw):
    return requests.post(server.url + path, json=body, headers=server.headers(), timeout=120, **kw)


def hf_greedy(prompt: str, n: int) -> list[int]:
    """Greedy continuation ids of ``prompt`` by transformers on ../shared/data/models/stories260K (the reference)."""
    transformers = pytest.importorskip("transformers")
    import torch

    path = shared_path("models", "stories260K")
    tok = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ids = tok(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=n, do_sample=False)
    return out[0, ids.shape[1]:].tolist()


def test_default_model_writes_english(server):
    """The README's two requests: greedy output equals the shared checkpoint's under transformers, in English."""
    import openai

    out = post(server, "/generate", {"text": PROMPT, "sampling_params": {"temperature": 0, "max_new_tokens": 32}})
    out = out.json()
    assert out["output_ids"] == hf_greedy(PROMPT, 32)
    text = out["text"]
    assert text.isascii() and re.fullmatch(r"[A-Za-z0-9 ,.'!?\"\n-]*", text), text
    assert len(re.findall(r"[A-Za-z]+", text)) >= 15 and " the " in text, text
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY)
    comp = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=32, temperature=0)
    assert comp.choices[0].text == text


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
    # abort a long streamed request by rid once its first chunk arrived (the model's context is 512 tokens)
    body = {"text": "x", "rid": "to-abort", "stream": True, "sampling_params": {"max_new_tokens": 480, "ignore_eos": True}}
    with requests.post(server.url + "/generate", json=body, headers=h, stream=True, timeout=120) as r:
        assert r.status_code == 200
        events = (ln[len(b"data: "):] for ln in r.iter_lines() if ln.startswith(b"data: "))
        chunks = [json.loads(next(events))]
        assert post(server, "/abort_request", {"rid": "to-abort"}).status_code == 200
        chunks += [json.loads(e) for e in events if e != b"[DONE]"]
    meta = chunks[-1]["meta_info"]
    assert meta["finish_reason"]["type"] == "abort" and meta["completion_tokens"] < 480, meta
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
