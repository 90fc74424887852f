"""HTTP server + TokenizerManager against a fake scheduler (real ZMQ sockets, real tokenizer).

The fake answers each TokenizedGenerateReqInput with BatchStrOut deltas of
deterministic tokens, so every response can be checked against the tokenizer.
Covers: /generate (single, batch, n, stream, logprobs), OpenAI routes through
the official client, every bad-input case (4xx naming the field, nothing sent
to the scheduler), scheduler-side aborts, abort on disconnect, /abort_request,
auth, /metrics and the info routes.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time

import pytest
import requests
import zmq

from sglang.srt.managers.io_struct import (
    AbortReq,
    BatchStrOut,
    FlushCacheReqInput,
    FlushCacheReqOutput,
    GetInternalStateReq,
    GetInternalStateReqOutput,
    SchedulerStats,
    TokenizedGenerateReqInput,
    decode_msg,
    encode_msg,
)
from sglang.srt.server_args import PortArgs, ServerArgs

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL = os.path.join(REPO, "..", "shared", "data", "models", "stories260K")
CONTEXT_LEN = 512
SLOW_MAX_NEW = 200  # requests asking for at least this many tokens are streamed slowly


def fake_ids(input_ids: list[int], n: int) -> list[int]:
    """The fake's output tokens: merged pieces (ids 259..511) derived from the prompt."""
    s = sum(input_ids) * 7
    return [259 + (s + 13 * k) % 253 for k in range(n)]


class FakeScheduler(threading.Thread):
    """Scheduler + detokenizer stand-in on the TokenizerManager's real IPC endpoints."""

    def __init__(self, port_args: PortArgs, tokenizer) -> None:
        super().__init__(daemon=True)
        self.tok = tokenizer
        self.ctx = zmq.Context()
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.bind(port_args.scheduler_input_ipc)
        self.push = self.ctx.socket(zmq.PUSH)
        self.push.connect(port_args.tokenizer_ipc)
        self.received: list = []
        self.aborts: list[str] = []
        self.active: dict[str, dict] = {}
        self.stop_event = threading.Event()

    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.pull, zmq.POLLIN)
        while not self.stop_event.is_set():
            if poller.poll(2):
                self._on(decode_msg(self.pull.recv()))
            self._step()
        self.pull.close(0)
        self.push.close(0)
        self.ctx.term()

    def _send(self, msg) -> None:
        self.push.send(encode_msg(msg))

    def _on(self, msg) -> None:
        self.received.append(msg)
        if isinstance(msg, TokenizedGenerateReqInput):
            sp = msg.sampling_params
            if sp.get("regex") == "FAIL":
                self._out(msg, [], "", {"type": "abort", "message": "regex FAIL cannot be compiled",
                                        "status_code": 400})
                return
            n = sp["max_new_tokens"]
            self.active[msg.rid] = {"req": msg, "ids": fake_ids(msg.input_ids, n), "done": 0, "text": "",
                                    "first": True, "next": 0.0, "slow": n >= SLOW_MAX_NEW}
        elif isinstance(msg, AbortReq):
            self.aborts.append(msg.rid)
            st = self.active.pop(msg.rid, None)
            if st is not None:
                self._out(st["req"], [], "", {"type": "abort", "message": "aborted"})
        elif isinstance(msg, FlushCacheReqInput):
            self._send(FlushCacheReqOutput(success=not self.active))
        elif isinstance(msg, GetInternalStateReq):
            self._send(GetInternalStateReqOutput(state={"num_running_reqs": len(self.active), "used_tokens": 0}))

    def _out(self, req, ids, text, reason, st=None) -> None:
        base = 0 if st is None else st["done"] - len(ids)  # position of ids[0] in the output
        lp = [(-0.1 * (base + k + 1), t) for k, t in enumerate(ids)]
        tops = [[(-0.1 * (base + k + 1), t), (-2.0 - k, 300)][: req.top_logprobs_num] for k, t in enumerate(ids)]
        first = st is None or st["first"]
        in_lp = in_top = None
        if req.return_logprob and first and req.logprob_start_len >= 0:
            rest = req.input_ids[req.logprob_start_len:]
            in_lp = [(None, rest[0])] + [(-0.5, t) for t in rest[1:]]
            in_top = [[]] + [[(-0.5, t)][: req.top_logprobs_num] for t in rest[1:]]
        done = len(ids) if st is None else st["done"]
        self._send(BatchStrOut(
            rids=[req.rid], finished_reasons=[reason], output_strs=[text], output_ids=[ids],
            prompt_tokens=[len(req.input_ids)], completion_tokens=[done], cached_tokens=[3],
            output_token_logprobs=[lp] if req.return_logprob else None,
            output_top_logprobs=[tops] if req.return_logprob else None,
            input_token_logprobs=[in_lp] if req.return_logprob else None,
            input_top_logprobs=[in_top] if req.return_logprob else None))
        if st is not None:
            st["first"] = False

    def _step(self) -> None:
        now = time.time()
        for rid, st in list(self.active.items()):
            if now < st["next"]:
                continue
            st["next"] = now + (0.05 if st["slow"] else 0.0)
            k = 1 if st["slow"] else 2
            new = st["ids"][st["done"]: st["done"] + k]
            st["done"] += len(new)
            full = self.tok.decode(st["ids"][: st["done"]])
            delta, st["text"] = full[len(st["text"]):], full
            finished = st["done"] >= len(st["ids"])
            reason = {"type": "length", "length": len(st["ids"])} if finished else None
            self._out(st["req"], new, delta, reason, st)
            if finished:
                del self.active[rid]
                self._send(SchedulerStats(num_running_reqs=len(self.active), num_queue_reqs=0, token_usage=0.25,
                                          used_tokens=7, max_total_tokens=4096, cache_hit_rate=0.5))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A uvicorn server in a thread serving create_app over a TokenizerManager + FakeScheduler."""

    def __init__(self, **server_kw) -> None:
        import uvicorn

        from sglang.srt.entrypoints.http_server import create_app
        from sglang.srt.managers.tokenizer_manager import TokenizerManager

        port = _free_port()
        self.args = ServerArgs(model_path=MODEL, port=port, served_model_name="stories", **server_kw)
        self.port_args = PortArgs.init_new()
        info = {"context_len": CONTEXT_LEN, "max_total_tokens": 4096, "vocab_size": 512, "max_req_input_len": 506}
        self.tm = TokenizerManager(self.args, self.port_args, info, disconnect_poll_s=0.2, control_timeout_s=5)
        self.fake = FakeScheduler(self.port_args, self.tm.tokenizer)
        self.fake.start()
        self.url = f"http://127.0.0.1:{port}"
        config = uvicorn.Config(create_app(self.tm, self.args), host="127.0.0.1", port=port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 20
        while not self.server.started:
            assert time.time() < deadline, "uvicorn did not start"
            time.sleep(0.02)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.fake.stop_event.set()
        self.fake.join(timeout=5)


@pytest.fixture(scope="module")
def srv():
    if not os.path.isdir(MODEL):
        pytest.skip(f"stories260K checkpoint not found at {MODEL} (needs ../shared/data beside the repo)")
    s = Server(enable_metrics=True)
    yield s
    s.close()


@pytest.fixture(scope="module")
def auth_srv():
    if not os.path.isdir(MODEL):
        pytest.skip(f"stories260K checkpoint not found at {MODEL} (needs ../shared/data beside the repo)")
    s = Server(api_key="sekret-key")
    yield s
    s.close()


def _sse_events(resp) -> list[str]:
    body = resp.content.decode()
    assert body.endswith("data: [DONE]\n\n"), body[-200:]
    parts = body.split("\n\n")
    assert parts[-1] == ""
    assert all(p.startswith("data: ") for p in parts[:-1]), body[:300]
    return [p[len("data: "):] for p in parts[:-2]]


def _wait_idle(tm, timeout=5.0) -> None:
    deadline = time.time() + timeout
    while tm.num_inflight and time.time() < deadline:
        time.sleep(0.02)
    assert tm.num_inflight == 0


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
    r = requests.post(srv.url + "/generate", json={**body, "stream": True})
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


OPENAI_BAD = [
    ("/v1/completions", {"model": "stories", "prompt": ""}, "prompt"),
    ("/v1/completions", {"model": "stories", "prompt": "a", "max_tokens": -1}, "max_tokens"),
    ("/v1/completions", {"model": "stories", "prompt": "a", "temperature": -1}, "temperature"),
    ("/v1/completions", {"model": "stories", "prompt": "a", "temperature": "hot"}, "temperature"),
    ("/v1/completions", {"model": "stories", "prompt": "a", "top_p": 2}, "top_p"),
    ("/v1/completions", {"model": "stories", "prompt": "a", "n": 0}, "n"),
    ("/v1/completions", {"model": "stories", "prompt": "a " * 600}, "context length"),
    ("/v1/completions", "[1, 2", "JSON"),
    ("/v1/chat/completions", {"model": "stories", "messages": []}, "messages"),
    ("/v1/chat/completions", {"model": "stories", "messages": "hi"}, "messages"),
    ("/v1/chat/completions", {"model": "stories", "messages": [{"role": "user", "content": "a"}],
                              "top_p": 0}, "top_p"),
    ("/v1/chat/completions", {"model": "stories", "messages": [{"role": "user", "content": "a"}],
                              "max_completion_tokens": -3}, "max_completion_tokens"),
    ("/v1/chat/completions", '{"model": "stories", "messages": [{"role": "user", "content": "a"}], '
                             '"temperature": NaN}', "temperature"),
    ("/v1/completions", '{"model": "stories", "prompt": "a", "top_p": -Infinity}', "top_p"),
]


@pytest.mark.parametrize("path, body, field", OPENAI_BAD)
def test_openai_bad_input_is_400_naming_the_field(srv, path, body, field):
    data = body if isinstance(body, str) else json.dumps(body)
    r = requests.post(srv.url + path, data=data, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert field in r.json()["error"]["message"]


# -------------------------------------------------------------------- OpenAI
def test_openai_client_completions_and_chat(srv):
    import openai

    tok = srv.tm.tokenizer
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused")
    prompt = "Once upon a time"
    c = client.completions.create(model="stories", prompt=prompt, max_tokens=6, temperature=0)
    expect = fake_ids(tok.encode(prompt), 6)
    assert c.choices[0].text == tok.decode(expect)
    assert c.choices[0].finish_reason == "length"
    assert (c.usage.prompt_tokens, c.usage.completion_tokens) == (len(tok.encode(prompt)), 6)
    stream = client.completions.create(model="stories", prompt=prompt, max_tokens=6, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == c.choices[0].text
    assert chunks[-1].usage.total_tokens == c.usage.total_tokens
    c2 = client.completions.create(model="stories", prompt=[prompt, "The dog"], max_tokens=3, n=2, logprobs=2,
                                   echo=True)
    assert [ch.index for ch in c2.choices] == [0, 1, 2, 3]
    assert c2.choices[2].text.startswith("The dog")
    assert len(c2.choices[0].logprobs.tokens) == len(tok.encode(prompt)) + 3

    msgs = [{"role": "system", "content": "Tell stories."}, {"role": "user", "content": "A cat"}]
    ids = srv.tm.apply_chat_template(msgs)
    chat = client.chat.completions.create(model="stories", messages=msgs, max_tokens=5, logprobs=True, top_logprobs=1)
    assert chat.choices[0].message.content == tok.decode(fake_ids(ids, 5))
    assert chat.choices[0].message.role == "assistant"
    assert chat.usage.prompt_tokens == len(ids) and chat.usage.completion_tokens == 5
    pieces_of = srv.tm.token_pieces  # exact in-sequence text and bytes (leading spaces kept)
    content = chat.choices[0].logprobs.content
    assert [t.token for t in content] == [pieces_of.text_of(t) for t in fake_ids(ids, 5)]
    assert b"".join(bytes(t.bytes) for t in content) == b"".join(pieces_of.bytes_of(t) for t in fake_ids(ids, 5))
    stream = client.chat.completions.create(model="stories", messages=msgs, max_tokens=5, stream=True, n=2)
    pieces: dict[int, str] = {}
    finish = {}
    for ch in stream:
        for choice in ch.choices:
            pieces[choice.index] = pieces.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
    assert pieces == {0: chat.choices[0].message.content, 1: chat.choices[0].message.content}
    assert finish == {0: "length", 1: "length"}
    r = requests.post(srv.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 6, "temperature": 0})
    assert r.status_code == 200 and r.json()["model"] == "stories"  # model may be omitted, as in SGLang
    assert r.json()["choices"][0]["text"] == c.choices[0].text
    models = client.models.list()
    assert [m.id for m in models.data] == ["stories"]
    other = client.completions.create(model="gpt-4", prompt=prompt, max_tokens=6, temperature=0)
    assert other.choices[0].text == c.choices[0].text  # any model name is served, as SGLang does
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.chat.completions.create(model="stories", messages=msgs, temperature=-1)
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


# ------------------------------------------------------------ chat template
def test_chat_template_has_one_bos_and_fallback_without_template():
    from sglang.srt.managers.tokenizer_manager import TokenizerManager

    llama3 = os.path.join(REPO, "..", "shared", "data", "tokenizers", "llama3")
    if not os.path.isdir(llama3) or not os.path.isdir(MODEL):
        pytest.skip("needs ../shared/data/tokenizers/llama3 and models/stories260K beside the repo")
    rng = __import__("random").Random(7)
    words = ["cat", "moon", "river", "blue", "seven"]
    msgs = [{"role": "system", "content": " ".join(rng.choice(words) for _ in range(4))},
            {"role": "user", "content": " ".join(rng.choice(words) for _ in range(6))}]
    info = {"context_len": 8192, "max_total_tokens": 1, "vocab_size": 128256, "max_req_input_len": 8000}
    tm = TokenizerManager(ServerArgs(model_path=llama3), PortArgs.init_new(), info)
    try:
        ids = tm.apply_chat_template(msgs)
        bos = tm.tokenizer.convert_tokens_to_ids("<|begin_of_text|>")
        assert ids[0] == bos and ids.count(bos) == 1
        text = tm.tokenizer.decode(ids)
        assert all(m["content"] in text for m in msgs)
        assert text.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
    finally:
        tm.close()
    info = {"context_len": CONTEXT_LEN, "max_total_tokens": 1, "vocab_size": 512, "max_req_input_len": 500}
    tm = TokenizerManager(ServerArgs(model_path=MODEL), PortArgs.init_new(), info)
    try:
        ids = tm.apply_chat_template(msgs)
        assert ids[0] == tm.tokenizer.bos_token_id and ids.count(tm.tokenizer.bos_token_id) == 1
        text = tm.tokenizer.decode(ids, skip_special_tokens=True)
        assert msgs[1]["content"] in text and text.rstrip().endswith("assistant:")
    finally:
        tm.close()


def test_chat_template_flag_string_file_and_bad_value(tmp_path):
    from sglang.srt.managers.tokenizer_manager import TokenizerManager

    if not os.path.isdir(MODEL):
        pytest.skip(f"stories260K checkpoint not found at {MODEL}")
    template = ("{{ bos_token }}{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
                "{% if add_generation_prompt %}[assistant]{% endif %}")
    path = tmp_path / "t.jinja"
    path.write_text(template)
    info = {"context_len": CONTEXT_LEN, "max_total_tokens": 1, "vocab_size": 512, "max_req_input_len": 500}
    rng = __import__("random").Random(11)
    msgs = [{"role": "user", "content": " ".join(rng.choice(["sun", "dog", "tree"]) for _ in range(5))}]
    for value in (template, str(path)):
        tm = TokenizerManager(ServerArgs(model_path=MODEL, chat_template=value), PortArgs.init_new(), info)
        try:
            ids = tm.apply_chat_template(msgs)
            assert ids[0] == tm.tokenizer.bos_token_id and ids.count(tm.tokenizer.bos_token_id) == 1
            text = tm.tokenizer.decode(ids, skip_special_tokens=True)
            assert text == f"[user]{msgs[0]['content']}[assistant]"
        finally:
            tm.close()
    with pytest.raises(ValueError, match="chat-template"):
        TokenizerManager(ServerArgs(model_path=MODEL, chat_template="no-such-file.jinja"), PortArgs.init_new(), info)
