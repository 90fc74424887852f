"""The mini_lb router without servers: batch detection, round robin, and its answers when workers are
missing or requests are malformed (503 / 400 / 404 naming the problem)."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from sglang.srt.disaggregation.mini_lb import PrefillWorker, RouterState, _num_prompts, create_app, main


def test_num_prompts():
    assert _num_prompts("/generate", {"text": "a"}) is None
    assert _num_prompts("/generate", {"text": ["a", "b"]}) == 2
    assert _num_prompts("/generate", {"input_ids": [1, 2]}) is None
    assert _num_prompts("/generate", {"input_ids": [[1], [2], [3]]}) == 3
    assert _num_prompts("/v1/completions", {"prompt": ["a", "b"]}) == 2
    assert _num_prompts("/v1/completions", {"prompt": [1, 2]}) is None
    assert _num_prompts("/v1/chat/completions", {"messages": []}) is None


def test_round_robin_pairs():
    st = RouterState(prefill=[PrefillWorker("http://p1", "p1", 1), PrefillWorker("http://p2", "p2", 2)],
                     decode=["http://d1"])
    pairs = [st.pick() for _ in range(4)]
    assert [p.url for p, _ in pairs] == ["http://p1", "http://p2", "http://p1", "http://p2"]
    assert {d for _, d in pairs} == {"http://d1"}
    with pytest.raises(LookupError, match="add_worker"):
        RouterState().pick()


def test_router_errors_without_servers():
    client = TestClient(create_app(RouterState()))
    assert client.get("/health").status_code == 200
    r = client.post("/generate", json={"text": "hi"})
    assert r.status_code == 503 and "add_worker" in r.text
    assert client.post("/generate", content=b"{not json").status_code == 400
    assert client.post("/add_worker", params={"url": "http://x", "role": "router"}).status_code == 400
    assert client.post("/remove_worker", params={"url": "http://x"}).status_code == 404
    r = client.post("/add_worker", params={"url": "http://127.0.0.1:9/", "role": "decode"})
    assert r.status_code == 200 and r.json()["decode"] == ["http://127.0.0.1:9"]
    r = client.post("/add_worker", params={"url": "http://127.0.0.1:9", "role": "prefill"})  # nothing listens
    assert r.status_code == 400 and "did not answer" in r.text
    assert client.post("/remove_worker", params={"url": "http://127.0.0.1:9"}).status_code == 200


def test_cli_bootstrap_ports_must_match():
    with pytest.raises(SystemExit):
        main(["--prefill", "http://a", "http://b", "--decode", "http://c", "--prefill-bootstrap-ports", "1"])
