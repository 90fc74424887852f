"""HTTP server + TokenizerManager against a fake scheduler (see ``fake_backend.py``): /generate
(single, batch, n, stream, logprobs), every bad-input case (4xx naming the field, nothing sent to the
scheduler), scheduler-side aborts, abort on disconnect, /abort_request, auth, /metrics and the info routes.
"""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest
import requests

from fake_backend import (  # noqa: F401 (srv, auth_srv: fixtures)
    CONTEXT_LEN,
    MODEL,
    PACED_RID_PREFIX,
    SLOW_MAX_NEW,
    _sse_events,
    _wait_idle,
    auth_srv,
    fake_ids,
    srv,
)
from sglang.srt.managers.io_struct import TokenizedGenerateReqInput


# ------------------------------------------------------------------ /generate
def test_generate_single_matches_tokenizer(srv):
    tok = srv.tm.tokenizer
    text, max_new = "Once upon a time, a cat", 9
    r = requests.post(srv.url + "/generate", json={"text": text, "sampling_params": {"max_new_tokens": max_new}})
    assert r.status_code == 200, r.text
    out = r.json()
    prompt_ids = tok.encode(text)
    sent = [m for m in srv.fake.received if isinstance(m, TokenizedGenerateReqInput)][-1]
    assert sent.input_ids == prompt_ids and prompt_ids[0] == tok.bos_token_id
    expect = fake_ids(prompt_ids, max_new)
    assert out["output_ids"] == expect
    assert out["text"] == tok.decode(expect)
    m = out["meta_info"]
    assert m["finish_reason"] == {"type": "length", "length": max_new}
    assert (m["prompt_tokens"], m["completion_tokens"], m["cached_tokens"]) == (len(prompt_ids), max_new, 3)
    assert m["e2e_latency"] > 0 and m["id"] == sent.rid
    _wait_idle(srv.tm)


def test_generate_stream_is_cumulative_and_equals_non_stream(srv):
    body = {"input_ids": [1, 403, 407, 261], "sampling_params": {"max_new_tokens": 7}}
    full = requests.post(srv.url + "/generate", json=body).json()
    # paced (one output per 50 ms): outputs that reach the TokenizerManager together are coalesced into one chunk
    r = requests.post(srv.url + "/generate", json={**body, "stream": True, "rid": PACED_RID_PREFIX + "stream"})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    chunks = [json.loads(e) for e in _sse_events(r)]
    assert len(chunks) >= 3
    for a, b in zip(chunks, chunks[1:]):
        assert b["text"].startswith(a["text"])
        assert b["output_ids"][: len(a["output_ids"])] == a["output_ids"]
    assert chunks[-1]["text"] == full["text"] and chunks[-1]["output_ids"] == full["output_ids"]
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])


def test_generate_batch_n_and_logprobs(srv):
    tok = srv.tm.tokenizer
    ids = [[1, 300, 301], [1, 450, 451, 452]]
    body = {"input_ids": ids, "sampling_params": [{"max_new_tokens": 3, "n": 2, "temperature": 0},
                                                  {"max_new_tokens": 5}],
            "return_logprob": True, "logprob_start_len": 1, "top_logprobs_num": 2, "return_text_in_logprobs": True}
    r = requests.post(srv.url + "/generate", json=body)
    assert r.status_code == 200, r.text
    outs = r.json()
    assert isinstance(outs, list) and len(outs) == 3
    assert [o["output_ids"] for o in outs] == [fake_ids(ids[0], 3)] * 2 + [fake_ids(ids[1], 5)]
    m = outs[2]["meta_info"]
    assert m["output_token_logprobs"] == [[-0.1 * (k + 1), t, tok.decode([t])]
                                          for k, t in enumerate(fake_ids(ids[1], 5))]
    assert m["input_token_logprobs"][0] == [None, 450, tok.decode([450])]
    assert len(m["input_token_logprobs"]) == len(ids[1]) - 1
    assert m["input_top_logprobs"][0] == []
    assert [len(x) for x in m["output_top_logprobs"]] == [2] * 5
    # batch stream carries an index per chunk
    r = requests.post(srv.url + "/generate", json={"text": ["a b", "c d"], "stream": True,
                                                   "sampling_params": {"max_new_tokens": 4}})
    chunks = [json.loads(e) for e in _sse_events(r)]
    assert {c["index"] for c in chunks} == {0, 1}
    _wait_idle(srv.tm)


GENERATE_BAD = [
    ("{not json", "JSON"),
    ({"text": 5}, "text"),
    ({"text": ""}, "text"),
    ({}, "text"),
    ({"text": "a", "input_ids": [1]}, "input_ids"),
    ({"input_ids": [1, 2, 9999]}, "input_ids"),
    ({"input_ids": [3 + k % 500 for k in range(CONTEXT_LEN)]}, "context length"),
    ({"text": "a", "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens"),
    ({"text": "a", "sampling_params": {"max_new_tokens": "ten"}}, "max_new_tokens"),
    ({"text": "a", "sampling_params": {"max_new_tokens": 600}}, "max_new_tokens"),
    ({"text": "a", "sampling_params": {"temperature": -0.5}}, "temperature"),
    ({"text": "a", "sampling_params": {"temperature": "hot"}}, "temperature"),
    ({"text": "a", "sampling_params": {"top_p": 0}}, "top_p"),
    ({"text": "a", "sampling_params": {"top_p": 1.5}}, "top_p"),
    ({"text": "a", "sampling_params": {"n": 0}}, "n"),
    ({"text": "a", "sampling_params": {"bogus": 1}}, "bogus"),
    ({"text": ["a", "b"], "sampling_params": [{}]}, "sampling_params"),
    ({"text": "a", "return_logprob": True, "logprob_start_len": 50}, "logprob_start_len"),
    ('{"text": "a", "sampling_params": {"temperature": NaN}}', "temperature"),
    ('{"text": "a", "sampling_params": {"top_p": Infinity}}', "top_p"),
    ({"text": "a", "sampling_params": {"seed": 10 ** 23}}, "seed"),
]


@pytest.mark.parametrize("body, field", GENERATE_BAD)
def test_generate_bad_input_is_400_naming_the_field(srv, body, field):
    before = len(srv.fake.received)
    data = body if isinstance(body, str) else json.dumps(body)
    for stream in (False, True):
        if stream and isinstance(body, dict):
            data = json.dumps({**body, "stream": True})
        r = requests.post(srv.url + "/generate", data=data, headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert field in err["message"] and err["code"] == 400 and err["type"] == "BadRequestError"
    assert len(srv.fake.received) == before  # nothing reached the scheduler


def test_scheduler_abort_with_status_surfaces_as_http_error(srv):
    for stream in (False, True):
        r = requests.post(srv.url + "/generate", json={"text": "hi", "stream": stream,
                                                       "sampling_params": {"regex": "FAIL"}})
        assert r.status_code == 400 and "regex FAIL" in r.json()["error"]["message"]
    r = requests.post(srv.url + "/v1/completions", json={"model": "stories", "prompt": "hi", "regex": "FAIL"})
    assert r.status_code == 400 and "regex FAIL" in r.json()["error"]["message"]
    _wait_idle(srv.tm)


# --------------------------------------------------------------------- aborts
def _wait_for_abort(fake, rid_pred, timeout=5.0, count=1) -> list[str]:
    """Wait until at least ``count`` AbortReqs matching ``rid_pred`` reached the fake scheduler.

    The aborts of an n>1 request arrive as separate messages, so a caller expecting several
    must say how many; returning on the first one races with the rest.
    """
    deadline = time.time() + timeout
    hits: list[str] = []
    while time.time() < deadline:
        hits = [r for r in list(fake.aborts) if rid_pred(r)]
        if len(hits) >= count:
            return hits
        time.sleep(0.02)
    raise AssertionError(f"expected {count} AbortReq(s) at the scheduler, got {hits}; aborts={fake.aborts}")


def test_stream_disconnect_sends_abort(srv):
    body = {"text": "a long story", "rid": "disc-stream", "stream": True,
            "sampling_params": {"max_new_tokens": SLOW_MAX_NEW + 50}}
    with requests.post(srv.url + "/generate", json=body, stream=True) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line)
        assert first.startswith(b"data: ")
    _wait_for_abort(srv.fake, lambda rid: rid == "disc-stream")
    _wait_idle(srv.tm)


def test_non_stream_disconnect_sends_abort(srv):
    body = json.dumps({"text": "a long story", "rid": "disc-plain",
                       "sampling_params": {"max_new_tokens": SLOW_MAX_NEW + 50}}).encode()
    port = int(srv.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        time.sleep(0.3)
    _wait_for_abort(srv.fake, lambda rid: rid == "disc-plain")
    _wait_idle(srv.tm)


def test_abort_request_route(srv):
    result = {}

    def run():
        result["r"] = requests.post(srv.url + "/generate", json={
            "text": "x y", "rid": "to-abort", "sampling_params": {"max_new_tokens": SLOW_MAX_NEW + 10, "n": 2}})

    t = threading.Thread(target=run)
    t.start()
    deadline = time.time() + 5
    while srv.tm.num_inflight < 2 and time.time() < deadline:
        time.sleep(0.01)
    r = requests.post(srv.url + "/abort_request", json={"rid": "to-abort"})
    assert r.status_code == 200 and r.json()["num_aborted"] == 2
    t.join(timeout=10)
    outs = result["r"].json()
    assert [o["meta_info"]["finish_reason"]["type"] for o in outs] == ["abort", "abort"]
    assert sorted(_wait_for_abort(srv.fake, lambda rid: rid.startswith("to-abort"), count=2)) == ["to-abort-0", "to-abort-1"]
    assert requests.post(srv.url + "/abort_request", json={"rid": 5}).status_code == 400
    _wait_idle(srv.tm)


# ------------------------------------------------------------- info routes
def test_info_routes_and_metrics(srv):
    assert requests.get(srv.url + "/health").status_code == 200
    assert requests.get(srv.url + "/health_generate").status_code == 200
    info = requests.get(srv.url + "/get_model_info").json()
    assert info == {"model_path": MODEL, "tokenizer_path": MODEL, "is_generation": True,
                    "served_model_name": srv.args.model_name, "chat_template": None,  # stories260K has none
                    "bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True}
    si = requests.get(srv.url + "/get_server_info").json()
    assert si["context_len"] == CONTEXT_LEN and si["port"] == srv.args.port
    assert si["internal_states"][0]["num_running_reqs"] == 0
    fc = requests.post(srv.url + "/flush_cache")
    assert fc.status_code == 200 and fc.json()["success"] is True
    requests.post(srv.url + "/generate", json={"text": "metrics please", "sampling_params": {"max_new_tokens": 4}})
    text = requests.get(srv.url + "/metrics").text
    for name in ("sglang:time_to_first_token_seconds_count", "sglang:inter_token_latency_seconds_count",
                 "sglang:e2e_request_latency_seconds_count", "sglang:prompt_tokens_total",
                 "sglang:generation_tokens_total", "sglang:num_requests_total", "sglang:num_running_reqs",
                 "sglang:num_queue_reqs", "sglang:token_usage", "sglang:cache_hit_rate"):
        assert name in text, name
    vals = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith("sglang:") and "{" in line and "_bucket" not in line}
    assert vals["sglang:num_requests_total"] >= 1 and vals["sglang:generation_tokens_total"] >= 4
    assert vals["sglang:token_usage"] == 0.25 and vals["sglang:cache_hit_rate"] == 0.5


def test_api_key(auth_srv):
    import openai

    url = auth_srv.url
    assert requests.get(url + "/health").status_code == 200
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekret-key"}):
        r = requests.get(url + "/v1/models", headers=headers)
        assert r.status_code == 401 and "API key" in r.json()["error"]["message"]
        r = requests.post(url + "/generate", json={"text": "a"}, headers=headers)
        assert r.status_code == 401
    ok = {"Authorization": "Bearer sekret-key"}
    assert requests.get(url + "/v1/models", headers=ok).status_code == 200
    assert requests.get(url + "/metrics", headers=ok).status_code == 404  # metrics disabled
    client = openai.OpenAI(base_url=url + "/v1", api_key="sekret-key")
    assert client.completions.create(model="stories", prompt="hi", max_tokens=2).usage.completion_tokens == 2
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="nope").models.list()
    _wait_idle(auth_srv.tm)
