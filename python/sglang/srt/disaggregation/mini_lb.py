"""The prefill/decode router, SGLang's ``mini_lb`` interface::

    python -m sglang.srt.disaggregation.mini_lb --prefill http://P1 [http://P2 ...] --decode http://D1 [...] \\
        [--prefill-bootstrap-ports 8998 ...] --host 127.0.0.1 --port 8000

For every request it picks a prefill and a decode server (round robin), draws a ``bootstrap_room`` per prompt,
adds ``bootstrap_host`` / ``bootstrap_port`` (the prefill server's bootstrap server; learned from its
``/get_server_info`` unless ``--prefill-bootstrap-ports`` overrides) and sends the request to both at
once; the answer (JSON or SSE stream) is the decode server's. The prefill server's answer is drained.
With ``--workers http://A http://B ...`` instead (aggregated replicas, no disaggregation) it is a plain
round-robin load balancer: each request goes unchanged to the next worker and its answer is relayed (the
same-GPU-count baseline of ``benchmark/disaggregation/bench_pd_serving.py``).
Routes: ``/generate``, ``/v1/completions``, ``/v1/chat/completions`` (streaming and not), ``/v1/models``,
``/health``, ``/get_server_info``, and for dynamic workers ``POST /add_worker?url=U&role=prefill|decode``
(``&bootstrap_port=N`` optional) and ``POST /remove_worker?url=U``: a removed worker gets no new requests
while the requests it holds finish (or fail cleanly if it goes away).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import random
from dataclasses import dataclass, field
from typing import Any, Optional
from urllib.parse import urlparse

import aiohttp
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from sglang.srt.disaggregation.rooms import new_room

logger = logging.getLogger(__name__)


@dataclass
class PrefillWorker:
    """A prefill server: its URL and its bootstrap server's address."""

    url: str
    bootstrap_host: str
    bootstrap_port: int


@dataclass
class RouterState:
    """The router's worker lists (mutated only on the event loop)."""

    prefill: list[PrefillWorker] = field(default_factory=list)
    decode: list[str] = field(default_factory=list)
    regular: list[str] = field(default_factory=list)  # aggregated replicas (--workers): no prefill/decode split
    rr: Any = field(default_factory=lambda: itertools.count())
    rng: random.Random = field(default_factory=random.Random)

    def pick(self) -> tuple[PrefillWorker, str]:
        """Round-robin (prefill, decode) pair. Raises LookupError when a side has no worker."""
        if not self.prefill or not self.decode:
            raise LookupError(f"the router has {len(self.prefill)} prefill and {len(self.decode)} decode workers; "
                              "add workers with POST /add_worker")
        i = next(self.rr)
        return self.prefill[i % len(self.prefill)], self.decode[i % len(self.decode)]

    def pick_regular(self) -> str:
        """Round-robin aggregated replica (``--workers``). Raises LookupError when there is none."""
        if not self.regular:
            raise LookupError("the router has no aggregated worker")
        return self.regular[next(self.rr) % len(self.regular)]


async def learn_bootstrap_address(session: aiohttp.ClientSession, url: str,
                                  timeout_s: float = 30.0) -> tuple[str, int]:
    """``(host, port)`` of a prefill server's bootstrap server: the port from ``/get_server_info``, the host from
    its ``disaggregation_bootstrap_host`` when reported (``--use-ray``: the bootstrap server lives on prefill
    rank 0's node, which need not be the HTTP server's), else the URL's host.

    Raises:
        ValueError: the server is not a prefill server or does not answer (the message names the URL).
    """
    try:
        async with session.get(url + "/get_server_info", timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
            info = await r.json()
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        raise ValueError(f"prefill server {url} did not answer /get_server_info: {e}") from e
    if info.get("disaggregation_mode") != "prefill":
        raise ValueError(f"{url} runs --disaggregation-mode {info.get('disaggregation_mode')!r}, not prefill")
    return (info.get("disaggregation_bootstrap_host") or urlparse(url).hostname,
            int(info["disaggregation_bootstrap_port"]))


async def learn_bootstrap_port(session: aiohttp.ClientSession, url: str, timeout_s: float = 30.0) -> int:
    """The ``disaggregation_bootstrap_port`` a prefill server reports in ``/get_server_info`` (the port of
    :func:`learn_bootstrap_address`).

    Raises:
        ValueError: the server is not a prefill server or does not answer (the message names the URL).
    """
    return (await learn_bootstrap_address(session, url, timeout_s))[1]


def _num_prompts(path: str, body: dict) -> Optional[int]:
    """Prompts in a batch request (None for a single prompt)."""
    if path == "/generate":
        if isinstance(body.get("text"), list):
            return len(body["text"])
        ids = body.get("input_ids")
        if isinstance(ids, list) and ids and isinstance(ids[0], list):
            return len(ids)
        return None
    if path == "/v1/completions":
        p = body.get("prompt")
        if isinstance(p, list) and p and (isinstance(p[0], str) or isinstance(p[0], list)):
            return len(p)
    return None


class _Proxy:
    """The router's HTTP side over ``state``: one long-lived aiohttp session to the workers, request routing
    (PD: prefill fire-and-forget + decode answer; plain ``--workers``: round-robin) and relaying."""

    def __init__(self, state: RouterState, timeout_s: float) -> None:
        self.state, self.timeout_s = state, timeout_s
        self._session: Optional[aiohttp.ClientSession] = None
        self.background: set = set()  # prefill tasks in flight (kept referenced until done)

    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s),
                                                  connector=aiohttp.TCPConnector(limit=0))
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def drain_prefill(self, url: str, body: dict) -> None:
        try:
            async with self.session().post(url, json=body) as r:
                data = await r.read()
                if r.status != 200:
                    logger.warning("prefill %s answered %d: %s", url, r.status, data[:300])
        except Exception as e:  # noqa: BLE001 - the decode side fails the room itself (timeouts)
            logger.warning("prefill request to %s failed: %s", url, e)

    async def route(self, path: str, request: Request):
        """Route one generation request: 400 for a body that is not a JSON object, 503 without workers."""
        try:
            body = await request.json()
        except Exception:
            return JSONResponse({"error": {"message": "the request body is not valid JSON"}}, status_code=400)
        if not isinstance(body, dict):
            return JSONResponse({"error": {"message": "the request body must be a JSON object"}}, status_code=400)
        state = self.state
        try:
            if state.regular:
                return await self.forward(state.pick_regular(), path, body, "worker")
            pw, dw = state.pick()
        except LookupError as e:
            return JSONResponse({"error": {"message": str(e)}}, status_code=503)
        n = _num_prompts(path, body)
        body = dict(body, bootstrap_host=pw.bootstrap_host, bootstrap_port=pw.bootstrap_port,
                    bootstrap_room=new_room(state.rng) if n is None else [new_room(state.rng) for _ in range(n)])
        prefill_task = asyncio.ensure_future(self.drain_prefill(pw.url + path, body))  # never awaited by the
        self.background.add(prefill_task)  # answer: a frozen prefill server must not hold up the decode side
        prefill_task.add_done_callback(self.background.discard)
        return await self.forward(dw, path, body)

    async def forward(self, dw: str, path: str, body: dict, role: str = "decode server"):
        """POST ``body`` to worker ``dw`` and relay its answer (JSON, or SSE for ``stream``); 502 naming the
        worker when it cannot be reached or dies mid-stream."""
        try:
            resp = await self.session().post(dw + path, json=body)
        except aiohttp.ClientError as e:
            return JSONResponse({"error": {"message": f"{role} {dw} failed: {e}"}}, status_code=502)
        if not body.get("stream") or resp.status != 200:
            try:
                data = await resp.read()
            except aiohttp.ClientError as e:
                return JSONResponse({"error": {"message": f"{role} {dw} failed: {e}"}}, status_code=502)
            finally:
                resp.release()
            return Response(content=data, status_code=resp.status,
                            media_type=resp.headers.get("Content-Type", "application/json"))

        async def relay():
            try:
                async for chunk in resp.content.iter_any():
                    yield chunk
            except aiohttp.ClientError as e:  # the decode server died mid-stream: end with an error event
                logger.warning("%s %s failed mid-stream: %s", role, dw, e)
                msg = json.dumps({"error": {"message": f"{role} {dw} failed: {e}", "code": 502}})
                yield f"data: {msg}\n\n".encode()
            finally:
                resp.release()

        return StreamingResponse(relay(), status_code=200, media_type="text/event-stream")

    async def call(self, method: str, url: str) -> tuple[int, bytes]:
        """``(status, body)`` of one request to a worker; ``(502, message)`` when it cannot be reached."""
        try:
            async with self.session().request(method, url) as r:
                return r.status, await r.read()
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            return 502, json.dumps({"error": {"message": f"worker {url} failed: {e!r}"}}).encode()

    async def from_decode(self, path: str) -> Response:
        """The first decode worker's answer to ``GET path`` (503 without one, 502 when it cannot be reached)."""
        workers = self.state.decode or self.state.regular
        if not workers:
            return JSONResponse({"error": {"message": "no decode worker"}}, status_code=503)
        status, data = await self.call("GET", workers[0] + path)
        return Response(content=data, status_code=status, media_type="application/json")


def _add_generation_routes(app: FastAPI, proxy: _Proxy) -> None:
    def route_post(path: str) -> None:
        async def handler(request: Request):
            return await proxy.route(path, request)

        app.post(path, name=path.strip("/").replace("/", "_"))(handler)

    for path in ("/generate", "/v1/completions", "/v1/chat/completions"):
        route_post(path)

    @app.get("/v1/models")
    async def models():
        return await proxy.from_decode("/v1/models")

    @app.get("/get_model_info")
    async def model_info():
        return await proxy.from_decode("/get_model_info")


def _add_admin_routes(app: FastAPI, proxy: _Proxy) -> None:
    state = proxy.state

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache():
        """Flush every worker's cache; 200 only when all did, else 400 naming each worker that did not."""
        urls = [p.url for p in state.prefill] + state.decode + state.regular
        answers = await asyncio.gather(*(proxy.call("POST", u + "/flush_cache") for u in urls))
        failed = {u: data.decode(errors="replace")[:300] for u, (status, data) in zip(urls, answers) if status != 200}
        if not failed:
            return JSONResponse({"success": True})
        why = "; ".join(f"{u}: {m}" for u, m in failed.items())
        return JSONResponse({"success": False, "message": f"Cache not flushed on {len(failed)} of {len(urls)} "
                                                          f"workers ({why})."}, status_code=400)

    @app.get("/health")
    async def health():
        return Response(status_code=200)

    @app.get("/get_server_info")
    async def server_info():
        return {"prefill": [vars(p) for p in state.prefill], "decode": list(state.decode),
                "workers": list(state.regular)}

    @app.post("/add_worker")
    async def add_worker(url: str, role: str, bootstrap_port: Optional[int] = None):
        url = url.rstrip("/")
        if role not in ("prefill", "decode"):
            return JSONResponse({"error": {"message": f"role must be prefill or decode, got {role!r}"}},
                                status_code=400)
        if role == "decode":
            if url not in state.decode:
                state.decode.append(url)
            return {"success": True, "decode": state.decode}
        try:
            host, port = ((urlparse(url).hostname, bootstrap_port) if bootstrap_port
                          else await learn_bootstrap_address(proxy.session(), url))
        except ValueError as e:
            return JSONResponse({"error": {"message": str(e)}}, status_code=400)
        if all(p.url != url for p in state.prefill):
            state.prefill.append(PrefillWorker(url, host, port))
        return {"success": True, "prefill": [p.url for p in state.prefill]}

    @app.post("/remove_worker")
    async def remove_worker(url: str):
        url = url.rstrip("/")
        before = len(state.prefill) + len(state.decode)
        state.prefill = [p for p in state.prefill if p.url != url]
        state.decode = [d for d in state.decode if d != url]
        if before == len(state.prefill) + len(state.decode):
            return JSONResponse({"error": {"message": f"url {url} is not a worker of this router"}}, status_code=404)
        return {"success": True}


def create_app(state: RouterState, timeout_s: float = 600.0) -> FastAPI:
    """The router's FastAPI app over ``state`` (``timeout_s``: total seconds per request to a worker)."""
    app = FastAPI()
    proxy = _Proxy(state, timeout_s)
    app.on_event("shutdown")(proxy.close)
    _add_generation_routes(app, proxy)
    _add_admin_routes(app, proxy)
    return app


def main(argv: Optional[list[str]] = None) -> None:
    """Parse the CLI, learn the prefill servers' bootstrap ports, serve."""
    import uvicorn

    p = argparse.ArgumentParser(prog="python -m sglang.srt.disaggregation.mini_lb")
    p.add_argument("--prefill", nargs="*", default=[], help="prefill server URLs")
    p.add_argument("--decode", nargs="*", default=[], help="decode server URLs")
    p.add_argument("--workers", nargs="*", default=[],
                   help="aggregated server URLs: round-robin load balancing without disaggregation (not with "
                        "--prefill/--decode)")
    p.add_argument("--prefill-bootstrap-ports", nargs="*", type=int, default=None,
                   help="bootstrap port of each --prefill server (default: asked from each server)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout (s)")
    p.add_argument("--log-level", default="info")
    a = p.parse_args(argv)
    logging.basicConfig(level=a.log_level.upper(), format="%(asctime)s mini_lb %(levelname)s %(message)s")
    if a.prefill_bootstrap_ports is not None and len(a.prefill_bootstrap_ports) != len(a.prefill):
        p.error(f"--prefill-bootstrap-ports has {len(a.prefill_bootstrap_ports)} ports for {len(a.prefill)} "
                "--prefill servers; give one per server")
    if a.workers and (a.prefill or a.decode):
        p.error("--workers (aggregated replicas) cannot be combined with --prefill/--decode; use one mode")
    state = RouterState(decode=[u.rstrip("/") for u in a.decode], regular=[u.rstrip("/") for u in a.workers])

    async def learn() -> None:
        async with aiohttp.ClientSession() as s:
            for i, url in enumerate(a.prefill):
                url = url.rstrip("/")
                if a.prefill_bootstrap_ports:
                    host, port = urlparse(url).hostname, a.prefill_bootstrap_ports[i]
                else:
                    host, port = await learn_bootstrap_address(s, url)
                state.prefill.append(PrefillWorker(url, host, port))

    try:
        asyncio.run(learn())
    except ValueError as e:
        p.error(str(e))
    logger.info("router: prefill %s, decode %s, aggregated %s", [(w.url, w.bootstrap_port) for w in state.prefill],
                state.decode, state.regular)
    uvicorn.run(create_app(state, a.timeout), host=a.host, port=a.port, log_level="warning")


if __name__ == "__main__":
    main()
