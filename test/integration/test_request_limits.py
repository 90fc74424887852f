"""Hostile and careless requests against the real HTTP server + TokenizerManager (fake scheduler, see
``fake_backend.py``): every one gets a fast 4xx naming the field, nothing blocks the event loop, a rejected
request leaks nothing, and a shutdown ends open streams with an error event + ``[DONE]``.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time

import pytest
import requests

from fake_backend import MODEL, SLOW_MAX_NEW, FakeScheduler, _free_port, _wait_idle
from sglang.srt.managers.io_struct import TokenizedGenerateReqInput
from sglang.srt.server_args import PortArgs, ServerArgs

BIG_CONTEXT = 10**8  # a context no prompt here can exceed: the cheap bound never applies


class LimitServer:
    """create_app over a TokenizerManager + FakeScheduler, served by the launcher's GracefulServer."""

    def __init__(self, context_len: int = 512, grace_s: float = 5.0, **server_kw) -> None:
        import uvicorn

        from sglang.srt.entrypoints.graceful_shutdown import GracefulServer
        from sglang.srt.entrypoints.http_server import create_app
        from sglang.srt.managers.tokenizer_manager import TokenizerManager

        port = _free_port()
        self.args = ServerArgs(model_path=MODEL, port=port, served_model_name="stories", **server_kw)
        self.port_args = PortArgs.init_new()
        info = {"context_len": context_len, "max_total_tokens": 4096, "vocab_size": 512,
                "max_req_input_len": context_len - 1}
        self.tm = TokenizerManager(self.args, self.port_args, info, disconnect_poll_s=0.2, control_timeout_s=5)
        self.fake = FakeScheduler(self.port_args, self.tm.tokenizer)
        self.fake.start()
        self.url = f"http://127.0.0.1:{port}"
        config = uvicorn.Config(create_app(self.tm, self.args), host="127.0.0.1", port=port, log_level="info",
                                timeout_graceful_shutdown=grace_s)
        self.server = GracefulServer(config, lambda: self.tm.fail_all_threadsafe("the server is shutting down"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 20
        while not self.server.started:
            assert time.time() < deadline, "uvicorn did not start"
            time.sleep(0.02)

    def sent_rids(self) -> list[str]:
        return [m.rid for m in self.fake.received if isinstance(m, TokenizedGenerateReqInput)]

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)
        self.fake.stop_event.set()
        self.fake.join(timeout=5)


def _need_model():
    if not os.path.isdir(MODEL):
        pytest.skip(f"stories260K checkpoint not found at {MODEL} (needs ../shared/data beside the repo)")


@pytest.fixture(scope="module")
def srv():
    _need_model()
    s = LimitServer(max_n=8, max_request_body_mb=1.0)
    yield s
    s.close()


def _err(r, status: int) -> str:
    assert r.status_code == status, (r.status_code, r.text[:300])
    return r.json()["error"]["message"]


# ------------------------------------------------------------------------ n
@pytest.mark.parametrize("route,body", [
    ("/generate", {"text": "hi", "sampling_params": {"n": 1e30, "max_new_tokens": 1}}),
    ("/generate", {"text": "hi", "sampling_params": {"n": 20000, "max_new_tokens": 1}}),
    ("/generate", {"text": ["a", "b"], "sampling_params": [{"n": 1}, {"n": 9}]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 1e6, "max_tokens": 1}),
    ("/v1/completions", {"prompt": "hi", "n": 20000, "max_tokens": 1}),
])
def test_n_above_limit_is_a_fast_400_naming_n(srv, route, body):
    r = requests.post(srv.url + route, json=body, timeout=20)
    msg = _err(r, 400)
    assert msg.startswith("n must be <= 8") and "--max-n" in msg, msg
    assert requests.get(srv.url + "/health", timeout=5).status_code == 200
    assert srv.tm.num_inflight == 0


def test_n_at_limit_is_served(srv):
    r = requests.post(srv.url + "/generate", json={"text": "hi", "sampling_params": {"n": 8, "max_new_tokens": 2}})
    assert r.status_code == 200 and len(r.json()) == 8
    _wait_idle(srv.tm)


# --------------------------------------------------------------- body limit
def test_body_over_limit_is_413(srv):
    body = json.dumps({"text": "a " * (600 * 1024)}).encode()
    assert len(body) > 1 << 20
    for route in ("/generate", "/v1/completions", "/v1/chat/completions"):
        msg = _err(requests.post(srv.url + route, data=body, headers={"content-type": "application/json"}), 413)
        assert "--max-request-body-mb" in msg

    def chunks():  # no Content-Length: counted while read
        yield b'{"text": "'
        for _ in range(40):
            yield b"a " * 32768
        yield b'"}'

    _err(requests.post(srv.url + "/generate", data=chunks(), headers={"content-type": "application/json"}), 413)
    assert not any(len(m.input_ids) > 1000 for m in srv.fake.received if isinstance(m, TokenizedGenerateReqInput))


def test_prompt_provably_over_context_is_refused_untokenized(srv, monkeypatch):
    calls = []
    real = srv.tm.tokenizer.encode
    monkeypatch.setattr(srv.tm.tokenizer, "encode", lambda *a, **k: calls.append(1) or real(*a, **k))
    msg = _err(requests.post(srv.url + "/generate", json={"text": "Once upon a time " * 30000}), 400)
    assert msg.startswith("text: the prompt") and "context length" in msg
    msg = _err(requests.post(srv.url + "/v1/chat/completions",
                             json={"messages": [{"role": "user", "content": "Once upon a time " * 30000}]}), 400)
    assert msg.startswith("messages: the prompt")
    assert calls == []


def test_health_answers_within_1s_while_a_huge_prompt_tokenizes():
    _need_model()
    s = LimitServer(context_len=BIG_CONTEXT, max_request_body_mb=64.0)
    try:
        text = "Once upon a time, a little cat sat on the mat. " * 200_000  # ~9.6 MB, seconds to tokenize
        result = {}

        def big():
            result["r"] = requests.post(s.url + "/generate", json={"text": text, "sampling_params":
                                                                    {"max_new_tokens": 1}}, timeout=120)

        t = threading.Thread(target=big)
        t.start()
        time.sleep(0.5)
        worst, probes = 0.0, 0
        while t.is_alive() and probes < 20:
            t0 = time.monotonic()
            assert requests.get(s.url + "/health", timeout=5).status_code == 200
            worst = max(worst, time.monotonic() - t0)
            probes += 1
            time.sleep(0.2)
        t.join(120)
        assert probes >= 3, "the huge request finished too quickly to probe /health during it"
        assert worst < 1.0, f"/health took {worst:.2f} s while a prompt was tokenized"
        assert result["r"].status_code == 200, result["r"].text[:200]
        _wait_idle(s.tm)
    finally:
        s.close()


# ------------------------------------------------------------ 500s -> 400s
@pytest.mark.parametrize("prompt,where,shown", [([-1], "prompt", "-1"), ([2**70], "prompt", "1.18059e+21"),
                                                ([[3, 4], [-5]], "prompt[1]", "-5"), ([512], "prompt", "512")])
def test_echo_of_bad_token_ids_is_400_naming_prompt(srv, prompt, where, shown):
    r = requests.post(srv.url + "/v1/completions", json={"prompt": prompt, "echo": True, "max_tokens": 1})
    msg = _err(r, 400)
    assert msg.startswith(f"{where}: token ids must lie in [0, 512)") and msg.endswith(shown), msg


@pytest.mark.parametrize("route", ["/generate", "/v1/completions", "/v1/chat/completions", "/abort_request"])
def test_deeply_nested_json_is_400_on_every_post_route(srv, route):
    for depth in (150, 1000, 100_000):
        body = "[" * depth + "]" * depth
        msg = _err(requests.post(srv.url + route, data=body, headers={"content-type": "application/json"}), 400)
        assert "nested deeper than 100 levels" in msg, msg
    nested = {"text": "hi", "sampling_params": {"max_new_tokens": 1, "x": json.loads("[" * 120 + "]" * 120)}}
    if route == "/generate":
        assert "sampling_params.x" in _err(requests.post(srv.url + route, json=nested), 400)


@pytest.mark.parametrize("route,body,field", [
    ("/generate", '{"text": "\\ud800", "sampling_params": {"max_new_tokens": 1}}', "text"),
    ("/generate", '{"text": ["ok", "a\\udfff"], "sampling_params": {"max_new_tokens": 1}}', "text[1]"),
    ("/generate", '{"text": "hi", "sampling_params": {"stop": ["\\ud800"]}}', "sampling_params.stop[0]"),
    ("/generate", '{"text": "hi", "rid": "\\ud800"}', "rid"),
    ("/v1/completions", '{"prompt": "x\\ud800", "max_tokens": 1}', "prompt"),
    ("/v1/completions", '{"prompt": "x", "stop": "\\ud800"}', "stop"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages[0].content"),
])
def test_lone_surrogate_is_400_naming_the_field(srv, route, body, field):
    msg = _err(requests.post(srv.url + route, data=body, headers={"content-type": "application/json"}), 400)
    assert msg.startswith(f"{field}: the string contains a lone UTF-16 surrogate"), msg


# ------------------------------------------------------------ all or nothing
def test_rejected_batch_leaks_nothing_and_frees_its_rids(srv):
    before = len(srv.sent_rids())
    r = requests.post(srv.url + "/generate", data='{"text": ["Once upon", "a time"], "rid": ["A1", "\\udc81"], '
                      '"sampling_params": {"max_new_tokens": 4}}', headers={"content-type": "application/json"})
    assert _err(r, 400).startswith("rid[1]:")
    # a batch whose second prompt is too long: the first is not sent either
    r = requests.post(srv.url + "/generate", json={"text": ["Once upon", "x " * 600], "rid": ["A2", "B2"],
                                                  "sampling_params": {"max_new_tokens": 4}})
    assert "context length" in _err(r, 400)
    assert len(srv.sent_rids()) == before and srv.tm.num_inflight == 0
    for rid in ("A1", "A2"):
        r = requests.post(srv.url + "/generate", json={"text": "Once upon", "rid": rid,
                                                      "sampling_params": {"max_new_tokens": 4}})
        assert r.status_code == 200, r.text
    assert srv.sent_rids()[before:] == ["A1", "A2"]
    _wait_idle(srv.tm)


# ------------------------------------------------------------ smaller ones
def test_openai_errors_name_max_tokens(srv):
    r = requests.post(srv.url + "/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 10**6})
    msg = _err(r, 400)
    assert "max_tokens" in msg and "max_new_tokens" not in msg, msg
    r = requests.post(srv.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                              "max_tokens": 10**6})
    msg = _err(r, 400)
    assert "max_tokens" in msg and "max_new_tokens" not in msg, msg
    r = requests.post(srv.url + "/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 10**6}})
    assert "max_new_tokens" in _err(r, 400)  # the native route keeps SGLang's name


@pytest.mark.parametrize("ref", ["file:///etc/passwd", "http://example.com/s.json", "other.json#/defs/a"])
def test_json_schema_external_ref_is_400(srv, ref):
    pytest.importorskip("xgrammar")
    schema = {"type": "object", "properties": {"a": {"$ref": ref}}}
    r = requests.post(srv.url + "/generate", json={"text": "hi", "sampling_params": {"json_schema": json.dumps(schema)}})
    assert "external $ref" in _err(r, 400)
    r = requests.post(srv.url + "/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}})
    assert "external $ref" in _err(r, 400)
    local = {"$defs": {"a": {"type": "integer"}}, "type": "object", "properties": {"a": {"$ref": "#/$defs/a"}}}
    r = requests.post(srv.url + "/generate", json={"text": "hi", "sampling_params": {
        "json_schema": json.dumps(local), "max_new_tokens": 2}})
    assert r.status_code == 200, r.text
    _wait_idle(srv.tm)


# ------------------------------------------------------------------ shutdown
def test_shutdown_ends_open_streams_with_error_event_and_done(caplog):
    _need_model()
    s = LimitServer(grace_s=2.0)
    bodies: dict[str, bytes] = {}

    def stream(route, body):
        with requests.post(s.url + route, json={**body, "stream": True}, stream=True, timeout=30) as r:
            bodies[route] = b"".join(r.iter_content(None))

    slow = {"max_new_tokens": SLOW_MAX_NEW}
    threads = [threading.Thread(target=stream, args=a) for a in (
        ("/generate", {"text": "Once upon", "sampling_params": slow}),
        ("/v1/completions", {"prompt": "Once upon", "max_tokens": SLOW_MAX_NEW}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": SLOW_MAX_NEW}))]
    for t in threads:
        t.start()
    deadline = time.time() + 10
    while s.tm.num_inflight < 3:
        assert time.time() < deadline
        time.sleep(0.05)
    time.sleep(0.3)
    caplog.set_level(logging.INFO)
    uv = logging.getLogger("uvicorn")  # uvicorn's loggers do not propagate to the root logger
    uv.addHandler(caplog.handler)
    t0 = time.monotonic()
    try:
        s.close()  # what SIGTERM does: uvicorn's graceful shutdown
        for t in threads:
            t.join(10)
    finally:
        uv.removeHandler(caplog.handler)
    assert time.monotonic() - t0 < 4.0
    for route, body in bodies.items():
        text = body.decode()
        assert text.endswith("data: [DONE]\n\n"), (route, text[-300:])
        last = json.loads(text.split("\n\n")[-3][len("data: "):])
        assert last["error"]["code"] == 503 and "shutting down" in last["error"]["message"], (route, last)
    assert len(bodies) == 3
    logged = caplog.text
    assert "Shutting down" in logged  # the capture works
    assert "Traceback" not in logged and "CancelledError" not in logged and "Cancel " not in logged, logged[-2000:]


# ------------------------------------------------------- no client to poll
def test_request_without_client_outlives_the_disconnect_poll(srv, monkeypatch):
    """Engine / health_generate requests (``request=None``) longer than ``disconnect_poll_s`` (5 ms here) finish:
    the wait once degenerated to ``wait_for(event.wait(), 0)``, which can never see the event (a hang)."""
    import asyncio

    from sglang.srt.managers.generate_req import GenerateReqInput

    async def run():
        out = None
        obj = GenerateReqInput(text="Once upon a time", sampling_params={"max_new_tokens": 199, "ignore_eos": True})
        async for o in srv.tm.generate_request(obj, None):
            out = o
        return out

    monkeypatch.setattr(srv.tm, "disconnect_poll_s", 0.005)
    t0 = time.monotonic()
    out = asyncio.run_coroutine_threadsafe(run(), srv.tm._loop).result(timeout=60)
    assert len(out["output_ids"]) == 199 and out["meta_info"]["finish_reason"]["type"] == "length"
    assert time.monotonic() - t0 > 0.005  # it did outlive one poll period
    _wait_idle(srv.tm)
