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


class _Worker:
    """A stdlib HTTP server standing in for a worker: ``/flush_cache`` answers ``flush_status``, ``/v1/models`` 200."""

    def __init__(self, flush_status: int) -> None:
        import http.server
        import threading

        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def _answer(self, status: int, body: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_POST(self):  # noqa: N802
                outer.flushes += self.path == "/flush_cache"
                n = int(self.headers.get("Content-Length") or 0)
                outer.posts.append((self.path, self.rfile.read(n)))
                self._answer(flush_status, b'{"success": %s}' % (b"true" if flush_status == 200 else b"false"))

            def do_GET(self):  # noqa: N802
                self._answer(200, b'{"data": [{"id": "m"}]}')

            def log_message(self, *args):
                pass

        self.flushes = 0
        self.posts: list = []
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_flush_cache_and_decode_proxies_name_the_failing_worker():
    ok_p, ok_d, busy_d = _Worker(200), _Worker(200), _Worker(400)
    dead = "http://127.0.0.1:9"  # nothing listens
    try:
        st = RouterState(prefill=[PrefillWorker(ok_p.url, "127.0.0.1", 1)], decode=[ok_d.url])
        with TestClient(create_app(st)) as client:  # one event loop for the router's aiohttp session
            assert client.post("/flush_cache").json() == {"success": True}
            assert ok_p.flushes == ok_d.flushes == 1
            assert client.get("/v1/models").json()["data"][0]["id"] == "m"
            st.decode += [busy_d.url, dead]
            r = client.post("/flush_cache")
            assert r.status_code == 400 and "2 of 4 workers" in r.json()["message"], r.text
            msg = r.json()["message"]
            assert f"{busy_d.url}: " in msg and f"{dead}: " in msg and f"{ok_d.url}: " not in msg, msg
            st.decode = [dead]
            for path in ("/v1/models", "/get_model_info"):
                r = client.get(path)
                assert r.status_code == 502 and dead in r.text, (path, r.text)
    finally:
        for w in (ok_p, ok_d, busy_d):
            w.close()


def test_aggregated_workers_round_robin_unchanged_bodies():
    """--workers: plain round robin over aggregated replicas; bodies go through unchanged (no bootstrap fields);
    a dead replica is a 502 naming it; --workers with --prefill/--decode is a CLI error."""
    import json

    a, b = _Worker(200), _Worker(200)
    dead = "http://127.0.0.1:9"
    try:
        st = RouterState(regular=[a.url, b.url])
        with TestClient(create_app(st)) as client:
            for i in range(4):
                assert client.post("/generate", json={"text": f"p{i}"}).status_code == 200
            got = {w.url: [json.loads(body) for path, body in w.posts if path == "/generate"] for w in (a, b)}
            assert got == {a.url: [{"text": "p0"}, {"text": "p2"}], b.url: [{"text": "p1"}, {"text": "p3"}]}
            assert client.get("/get_server_info").json()["workers"] == [a.url, b.url]
            assert client.post("/flush_cache").json() == {"success": True} and a.flushes == b.flushes == 1
            st.regular = [dead]
            r = client.post("/v1/completions", json={"prompt": "x"})
            assert r.status_code == 502 and f"worker {dead}" in r.text, r.text
    finally:
        a.close()
        b.close()
    with pytest.raises(SystemExit):
        main(["--workers", "http://a", "--decode", "http://c"])
