"""The FastAPI app: SGLang's native routes and the OpenAI-compatible API.

:func:`create_app` wires the routes to a
:class:`~sglang.srt.managers.tokenizer_manager.TokenizerManager`;
:func:`launch_http_server` serves the app with uvicorn until SIGINT/SIGTERM
(uvicorn handles both; in-flight responses get ``timeout_graceful_shutdown``
seconds). Errors are JSON in OpenAI's shape
``{"error": {"message", "type", "param", "code"}}``: bad input (malformed
JSON, wrong types, out-of-range values) is 400 with a message naming the field,
a missing/invalid API key 401, an unknown model 404, a body over ``--max-request-body-mb`` 413 (limits:
:mod:`~sglang.srt.entrypoints.request_limits`, ``docs/limits_and_failures.md``). On shutdown, requests still
open near the end of the grace period end with a 503 error (streams: an error event + ``[DONE]``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import logging
import uuid
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

import pydantic
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from sglang.srt.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
    error_body,
)
from sglang.srt.entrypoints.openai.serving_chat import OpenAIServingChat
from sglang.srt.entrypoints.openai.serving_responses import register_responses_route
from sglang.srt.entrypoints.openai.serving_score import register_score_route
from sglang.srt.entrypoints.openai.serving_completions import (
    SSE_DONE,
    OpenAIServingCompletion,
    prefetch,
    sse,
    sse_error_tail,
)
from sglang.srt.entrypoints.parity_routes import (
    IncrementalLogprobs,
    SafeJSONResponse,
    register_parity_routes,
    server_info_aliases,
)
from sglang.srt.entrypoints.request_limits import (
    OFFLOAD_PARSE_BYTES,
    BodySizeLimitMiddleware,
    BodyTooLarge,
    openai_field_names,
    parse_json_body,
)
from sglang.srt.managers.generate_req import GenerateReqInput
from sglang.srt.managers.tokenizer_manager import RequestError

logger = logging.getLogger(__name__)

OPEN_PATHS = ("/health",)
"""Paths served without an API key."""

HEALTH_GENERATE_TIMEOUT_S = 20.0

_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "function-after", "function-before"}


def _error(status: int, message: str, **kw) -> JSONResponse:
    return JSONResponse(error_body(message, status, **kw), status_code=status)


def format_validation_error(e: pydantic.ValidationError | RequestValidationError) -> str:
    """One line naming the offending field of the first validation error, e.g.
    ``"temperature: Input should be a valid number (got 'hot')"``."""
    errors = e.errors()
    if not errors:
        return "invalid request"
    err = errors[0]
    loc = [str(x) for x in err.get("loc", ()) if not (isinstance(x, str) and ("[" in x or x in _TYPE_TAGS))]
    if loc and loc[0] == "body":
        loc = loc[1:]
    where = ".".join(loc) if loc else "request body"
    msg = f"{where}: {err.get('msg', 'invalid value')}"
    if "input" in err and loc:
        got = repr(err["input"])
        msg += f" (got {got[:80]}{'...' if len(got) > 80 else ''})"
    return msg


async def _json_body(request: Request) -> Any:
    raw = await request.body()
    if len(raw) >= OFFLOAD_PARSE_BYTES:  # parse + check large bodies off the event loop
        return await asyncio.to_thread(parse_json_body, raw)
    return parse_json_body(raw)


class _ApiKeyMiddleware:
    """Pure ASGI middleware: ``Authorization: Bearer <api_key>`` on every path but :data:`OPEN_PATHS`
    (pure ASGI so streaming responses and disconnect detection are untouched)."""

    def __init__(self, app, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode("latin-1")

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or scope["method"] == "OPTIONS":
            await self.app(scope, receive, send)
            return
        got = dict(scope.get("headers") or []).get(b"authorization", b"")
        if hmac.compare_digest(got, self.expected):
            await self.app(scope, receive, send)
            return
        resp = _error(401, "Unauthorized: missing or invalid API key (send 'Authorization: Bearer <key>')")
        await resp(scope, receive, send)


def _public_server_args(server_args) -> dict[str, Any]:
    d = dataclasses.asdict(server_args)
    if d.get("api_key"):
        d["api_key"] = "<redacted>"
    return d


def create_app(tokenizer_manager, server_args) -> FastAPI:
    """Build the FastAPI app serving ``tokenizer_manager``.

    Routes: ``POST /generate``, ``POST /v1/completions``, ``POST /v1/chat/completions``,
    ``GET /v1/models``, ``GET /health``, ``GET /health_generate``, ``GET /get_model_info``,
    ``GET /get_server_info``, ``GET|POST /flush_cache``, ``POST /abort_request``, and
    ``GET /metrics`` when ``server_args.enable_metrics``; SGLang's ``/server_info``, ``GET /v1/models/{model}``,
    ``/tokenize``, ``/detokenize`` (:mod:`~sglang.srt.entrypoints.parity_routes`), ``POST /v1/responses``
    (:mod:`~sglang.srt.entrypoints.openai.serving_responses`) and ``POST /v1/score``
    (:mod:`~sglang.srt.entrypoints.openai.serving_score`). The lifespan starts the manager's
    receive loop and closes the manager at shutdown.
    """
    tm = tokenizer_manager

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        """App lifespan: start the tokenizer manager's receive loop, close the manager at shutdown."""
        tm.start()
        try:
            yield
        finally:
            tm.close()

    app = FastAPI(title="sglang-tw", lifespan=lifespan)
    app.state.tokenizer_manager = tm
    if server_args.api_key:
        app.add_middleware(_ApiKeyMiddleware, api_key=server_args.api_key)
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=int(server_args.max_request_body_mb * (1 << 20)),
                       error_response=lambda e: _error(413, str(e)))
    serving_completion = OpenAIServingCompletion(tm, server_args)
    serving_chat = OpenAIServingChat(tm, server_args)

    # ------------------------------------------------------------ errors
    @app.exception_handler(ValueError)
    async def _value_error(_req: Request, e: ValueError):
        return _error(400, openai_field_names(str(e)) if _req.url.path.startswith("/v1/") else str(e))

    @app.exception_handler(BodyTooLarge)
    async def _body_too_large(_req: Request, e: BodyTooLarge):
        return _error(413, str(e))

    @app.exception_handler(pydantic.ValidationError)
    async def _pydantic_error(_req: Request, e: pydantic.ValidationError):
        return _error(400, format_validation_error(e))

    @app.exception_handler(RequestValidationError)
    async def _request_validation_error(_req: Request, e: RequestValidationError):
        return _error(400, format_validation_error(e))

    @app.exception_handler(RequestError)
    async def _request_error(_req: Request, e: RequestError):
        return _error(e.status_code, e.message)

    # ----------------------------------------------------------- native
    @app.get("/health")
    async def health() -> Response:
        """``GET /health``: 200 while the HTTP server is up and every worker lives (no model call); 503 naming the
        cause once a worker died (e.g. an AFD FFN worker)."""
        if tm.failure:
            return _error(503, f"unhealthy: {tm.failure}")
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate(request: Request) -> Response:
        """``GET /health_generate``: 200 once a 1-token greedy generation finishes within ``HEALTH_GENERATE_TIMEOUT_S``,
        else a 503 error."""
        tok = tm.tokenizer
        tid = getattr(tok, "bos_token_id", None) if tok is not None else None
        tid = tid if isinstance(tid, int) and 0 <= tid < tm.vocab_size else 0
        obj = GenerateReqInput(input_ids=[tid], sampling_params={"max_new_tokens": 1, "temperature": 0.0},
                               rid=f"HEALTH_CHECK_{uuid.uuid4().hex}")
        async def drain() -> None:
            """Consume the health-check generation's outputs."""
            async for _ in tm.generate_request(obj, request):
                pass

        try:
            await asyncio.wait_for(drain(), HEALTH_GENERATE_TIMEOUT_S)
        except Exception as e:  # any failure means unhealthy
            logger.warning("health_generate failed: %s", e)
            return _error(503, f"health check generation failed: {type(e).__name__}: {e}")
        return Response(status_code=200)

    @app.post("/generate")
    async def generate(request: Request):
        """``POST /generate`` (SGLang native): one JSON result, or an SSE stream when ``stream`` is true."""
        obj = GenerateReqInput.from_dict(await _json_body(request))
        agen = tm.generate_request(obj, request)
        first = await prefetch(agen)
        if not obj.stream:
            await agen.aclose()
            return SafeJSONResponse(first)
        return StreamingResponse(_sse_stream(first, agen), media_type="text/event-stream")

    async def _sse_stream(first, agen) -> AsyncIterator[str]:
        incremental = IncrementalLogprobs(server_args.incremental_streaming_output)
        try:
            out = first
            while out is not None:
                yield sse(incremental(out))
                out = await prefetch(agen)
        except (ValueError, RequestError) as e:
            yield sse_error_tail(e)
        finally:
            await agen.aclose()
        yield SSE_DONE

    @app.get("/get_model_info")
    async def get_model_info():
        """Model facts, plus what a frontend needs to render chat roles exactly as the server does."""
        tok = tm.tokenizer
        template = tm.chat_template or getattr(tok, "chat_template", None)
        add_bos = bool(tok is not None and tok.bos_token_id is not None
                       and tok("x").input_ids[:1] == [tok.bos_token_id])
        return {"model_path": server_args.model_path, "tokenizer_path": server_args.resolved_tokenizer_path,
                "is_generation": True, "served_model_name": server_args.model_name,
                "chat_template": template if isinstance(template, str) else None,
                "bos_token": getattr(tok, "bos_token", None), "eos_token": getattr(tok, "eos_token", None),
                "add_bos_token": add_bos}

    @app.get("/get_server_info")
    async def get_server_info():
        """``GET /get_server_info``: public server args, scheduler info, internal states (one per data-parallel
        scheduler) and version."""
        states = await tm.get_internal_states()
        import sglang

        return server_info_aliases({**_public_server_args(server_args), **tm.scheduler_info,
                                    "internal_states": states, "version": getattr(sglang, "__version__", "unknown")})

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache():
        """``GET|POST /flush_cache``: clear the prefix cache; 400 when requests are still running or waiting."""
        out = await tm.flush_cache()
        msg = out.message or ("Cache flushed." if out.success else
                              "Cache not flushed: requests are running or waiting; retry when idle.")
        return JSONResponse({"success": out.success, "message": msg}, status_code=200 if out.success else 400)

    @app.post("/abort_request")
    async def abort_request(request: Request):
        """``POST /abort_request`` ``{"rid", "abort_all"}``: abort one request or all (400 on bad fields)."""
        body = await _json_body(request)
        if not isinstance(body, dict):
            raise ValueError("the request body must be a JSON object like {\"rid\": \"...\"}")
        rid, abort_all = body.get("rid", ""), body.get("abort_all", False)
        if not isinstance(rid, str):
            raise ValueError(f"rid must be a string, got {rid!r}")
        if not isinstance(abort_all, bool):
            raise ValueError(f"abort_all must be a boolean, got {abort_all!r}")
        if not rid and not abort_all:
            raise ValueError("rid is required (or set abort_all to true)")
        n = await tm.abort_request(rid, abort_all=abort_all)
        return {"success": True, "num_aborted": n}

    register_parity_routes(app, tm, server_args, get_server_info)
    register_responses_route(app, tm, server_args)
    register_score_route(app, tm, format_validation_error)

    if server_args.enable_metrics and tm.metrics is not None:
        @app.get("/metrics")
        async def metrics():
            """``GET /metrics``: Prometheus text exposition of the server metrics."""
            return Response(tm.metrics.render(), media_type=tm.metrics.content_type)

    # ----------------------------------------------------------- OpenAI
    @app.get("/v1/models")
    async def list_models():
        """``GET /v1/models`` (OpenAI): the one served model."""
        card = ModelCard(id=server_args.model_name, root=server_args.model_path, max_model_len=tm.context_len)
        return ModelList(data=[card]).model_dump()

    @app.post("/v1/completions")
    async def v1_completions(request: Request):
        """``POST /v1/completions`` (OpenAI): validate the body, delegate to the completions handler."""
        req = CompletionRequest.model_validate(await _json_body(request))
        return await serving_completion.handle(req, request)

    @app.post("/v1/chat/completions")
    async def v1_chat_completions(request: Request):
        """``POST /v1/chat/completions`` (OpenAI): validate the body, delegate to the chat handler."""
        req = ChatCompletionRequest.model_validate(await _json_body(request))
        return await serving_chat.handle(req, request)

    return app


def launch_http_server(app: FastAPI, server_args, timeout_graceful_shutdown: float = 5.0) -> None:
    """Serve ``app`` on ``server_args.host:port`` with uvicorn (log level ``server_args.log_level``).

    Blocks until SIGINT/SIGTERM (or a fatal server error), shuts down gracefully (open
    connections such as streams get ``timeout_graceful_shutdown`` seconds; the app's lifespan
    closes the TokenizerManager) and then *returns normally*, so the caller can stop the
    scheduler/detokenizer processes afterwards. (uvicorn re-raises a caught signal to the
    previously installed handler after shutdown; a no-op handler is installed for the
    duration of the call so that re-raise ends here, and the caller's handlers are restored.)
    """
    import signal
    import threading

    import uvicorn

    from sglang.srt.entrypoints.graceful_shutdown import GracefulServer

    level = server_args.log_level.lower()
    if level not in ("critical", "error", "warning", "info", "debug", "trace"):
        level = "info"
    config = uvicorn.Config(app, host=server_args.host, port=server_args.port, log_level=level,
                            timeout_keep_alive=5, timeout_graceful_shutdown=timeout_graceful_shutdown,
                            lifespan="on")
    tm = getattr(app.state, "tokenizer_manager", None)
    server = GracefulServer(config, None if tm is None else
                            (lambda: tm.fail_all_threadsafe("the server is shutting down", 503)))
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, lambda _s, _f: None)
    try:
        server.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    logger.info("HTTP server stopped")
