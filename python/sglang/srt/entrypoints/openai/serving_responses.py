"""``POST /v1/responses``: OpenAI's Responses API (text in; text or tool calls out) on the chat pipeline.

Supported: ``input`` as a string (one user message) or a list of message items (``{"role", "content"}``
with string content or ``input_text`` / ``output_text`` parts, optionally ``"type": "message"``),
``instructions`` (a system message placed first), ``max_output_tokens``, ``temperature``, ``top_p``,
``seed``, the server's chat template, ``stream`` (Server-Sent Events with OpenAI's event
types: ``response.created``, ``response.in_progress``, ``response.output_item.added``,
``response.content_part.added``, ``response.output_text.delta``, ``response.output_text.done``,
``response.content_part.done``, ``response.output_item.done``, ``response.completed``; each event
carries ``type`` and a ``sequence_number``), ``metadata`` / ``user`` (echoed).

``tools`` and ``tool_choice`` are validated and served as SGLang serves them on a model without a tool-call
parser (:mod:`~sglang.srt.entrypoints.openai.responses_tools`): function tools reach the chat template, a forced
``tool_choice`` constrains the output to a JSON array of calls, returned as ``function_call`` items.

Rejected with a 400 in OpenAI's error shape (naming the field): ``previous_response_id`` / ``conversation``
(no stored state: ``store`` is accepted but nothing is kept), ``background``, non-text input parts (images,
files), ``text.format`` other than ``text``.
A finished response has ``status: "completed"`` and ``incomplete_details: null``, also when
``max_output_tokens`` cut it (SGLang reports it so; the stream ends with ``response.completed``). ``usage``
carries OpenAI's ``input_tokens`` / ``output_tokens`` / ``total_tokens`` and SGLang's ``prompt_tokens`` /
``completion_tokens``.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, AsyncIterator, Iterator, Optional, Union

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict

from sglang.srt.entrypoints.openai.responses_tools import (
    ResponseTool,
    ToolChoice,
    chat_tools,
    check_tools,
    parse_required_calls,
    required_calls_schema,
    template_tools,
)
from sglang.srt.entrypoints.openai.serving_chat import check_parameter_schemas
from sglang.srt.entrypoints.openai.serving_completions import note_model, prefetch
from sglang.srt.entrypoints.parity_routes import SafeJSONResponse, dumps
from sglang.srt.managers.generate_req import GenerateReqInput
from sglang.srt.managers.tokenizer_manager import RequestError

_ROLES = ("system", "developer", "user", "assistant")
_TEXT_PARTS = ("input_text", "output_text", "text")


class ResponsesRequest(BaseModel):
    """The ``POST /v1/responses`` body (fields this server reads; unknown fields are ignored)."""

    model_config = ConfigDict(extra="ignore")
    model: Optional[str] = None
    input: Union[str, list[dict[str, Any]]]
    instructions: Optional[str] = None
    max_output_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    stream: bool = False
    tools: Optional[list[ResponseTool]] = None
    tool_choice: Optional[ToolChoice] = None
    previous_response_id: Optional[str] = None
    conversation: Optional[Any] = None
    background: Optional[bool] = None
    store: Optional[bool] = None
    metadata: Optional[dict[str, Any]] = None
    user: Optional[str] = None
    text: Optional[dict[str, Any]] = None
    parallel_tool_calls: Optional[bool] = None
    seed: Optional[int] = None


def input_messages(req: ResponsesRequest) -> list[dict[str, str]]:
    """Chat messages (``{"role", "content"}``) for the request: ``instructions`` as a system message,
    then the input items.

    Raises:
        ValueError: naming ``input[i]...`` for an unsupported item, role or content part, or an empty input.
    """
    msgs: list[dict[str, str]] = []
    if req.instructions:
        msgs.append({"role": "system", "content": req.instructions})
    if isinstance(req.input, str):
        if req.input == "":
            raise ValueError("input must not be empty")
        msgs.append({"role": "user", "content": req.input})
        return msgs
    if not req.input:
        raise ValueError("input must not be an empty list")
    for i, item in enumerate(req.input):
        if not isinstance(item, dict):
            raise ValueError(f"input[{i}] must be a message object like {{\"role\": \"user\", \"content\": \"...\"}}")
        kind = item.get("type", "message")
        if kind != "message":
            raise ValueError(f"input[{i}].type {kind!r} is not supported by this server; only message items are")
        role = item.get("role")
        if role not in _ROLES:
            raise ValueError(f"input[{i}].role must be one of {', '.join(_ROLES)}, got {role!r}")
        content = item.get("content")
        if isinstance(content, str):
            text = content
        elif isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                ptype = part.get("type") if isinstance(part, dict) else None
                if ptype not in _TEXT_PARTS or not isinstance(part.get("text"), str):
                    raise ValueError(f"input[{i}].content[{j}]: only text parts (input_text) are supported, "
                                     f"got type {ptype!r}")
                texts.append(part["text"])
            text = "".join(texts)
        else:
            raise ValueError(f"input[{i}].content must be a string or a list of input_text parts")
        msgs.append({"role": "system" if role == "developer" else role, "content": text})
    return msgs


def _check_unsupported(req: ResponsesRequest) -> None:
    check_tools(req.tools or [], req.tool_choice or "auto")
    check_parameter_schemas(chat_tools(req.tools or []))
    if req.previous_response_id is not None:
        raise ValueError("previous_response_id is not supported: this server stores no responses; "
                         "send the whole conversation in input")
    if req.conversation is not None:
        raise ValueError("conversation is not supported: this server stores no conversations")
    if req.background:
        raise ValueError("background is not supported by this server; set it to false")
    fmt = (req.text or {}).get("format") if isinstance(req.text, dict) else None
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
        raise ValueError("text.format: only {\"type\": \"text\"} is supported by this server")
    if req.max_output_tokens is not None and req.max_output_tokens < 1:
        raise ValueError(f"max_output_tokens must be >= 1, got {req.max_output_tokens}")


def usage_of_output(meta: dict[str, Any]) -> dict[str, Any]:
    """The response ``usage`` of a finished output's ``meta_info``: OpenAI's fields plus SGLang's
    ``prompt_tokens`` / ``completion_tokens`` (token counts)."""
    p, c = meta["prompt_tokens"], meta["completion_tokens"]
    return {"input_tokens": p, "input_tokens_details": {"cached_tokens": meta.get("cached_tokens", 0)},
            "output_tokens": c, "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": p + c,
            "prompt_tokens": p, "completion_tokens": c}


class OpenAIServingResponses:
    """Serves ``/v1/responses`` on a :class:`~sglang.srt.managers.tokenizer_manager.TokenizerManager`."""

    def __init__(self, tokenizer_manager, server_args) -> None:
        self.tm = tokenizer_manager
        self.server_args = server_args

    def _to_generate(self, req: ResponsesRequest) -> tuple[GenerateReqInput, bool]:
        """The generation request, and whether ``tool_choice`` forces calls (the output is then a JSON array)."""
        _check_unsupported(req)
        tools, choice = req.tools or [], req.tool_choice or "auto"
        prompt_ids = self.tm.apply_chat_template(input_messages(req), tools=template_tools(tools, choice))
        max_new = req.max_output_tokens
        if max_new is None:
            max_new = max(self.tm.context_len - len(prompt_ids), 0)
        forced = required_calls_schema(tools, choice, req.parallel_tool_calls)
        params = {"max_new_tokens": max_new, "temperature": req.temperature, "top_p": req.top_p, "seed": req.seed,
                  "json_schema": json.dumps(forced) if forced is not None else None}
        obj = GenerateReqInput(input_ids=prompt_ids, sampling_params={k: v for k, v in params.items() if v is not None},
                               stream=req.stream)
        return obj, forced is not None

    def _output_items(self, req: ResponsesRequest, msg_id: str, text: str, forced: bool) -> list[dict[str, Any]]:
        """The finished output: the calls parsed from a forced ``tool_choice``'s JSON, else one message."""
        calls = parse_required_calls(text, req.tools or []) if forced else None
        return calls if calls is not None else [self._message(msg_id, text, "completed")]

    def _response(self, req: ResponsesRequest, rid: str, created: int, status: str,
                  output: list[dict[str, Any]], out: Optional[dict[str, Any]] = None) -> dict[str, Any]:
        """The ``response`` object (OpenAI's shape) in state ``status``."""
        incomplete = None  # SGLang reports a max_output_tokens cut as completed, without details
        usage = usage_of_output(out["meta_info"]) if out is not None else None
        return {
            "id": rid, "object": "response", "created_at": created, "status": status, "error": None,
            "incomplete_details": incomplete, "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens, "model": req.model or self.server_args.model_name,
            "output": output, "parallel_tool_calls": True if req.parallel_tool_calls is None else req.parallel_tool_calls,
            "previous_response_id": None, "reasoning": None, "store": False,
            "temperature": 1.0 if req.temperature is None else req.temperature,
            "text": {"format": {"type": "text"}}, "tool_choice": req.tool_choice or "auto",
            "tools": [t.model_dump() for t in req.tools or []],
            "top_p": 1.0 if req.top_p is None else req.top_p, "truncation": "disabled", "usage": usage,
            "user": req.user, "metadata": req.metadata or {},
        }

    @staticmethod
    def _message(msg_id: str, text: Optional[str], status: str) -> dict[str, Any]:
        content = [] if text is None else [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
        return {"type": "message", "id": msg_id, "status": status, "role": "assistant", "content": content}

    async def handle(self, req: ResponsesRequest, raw_request=None):
        """Answer one request: the ``response`` JSON, or an SSE stream of Responses events.

        Raises:
            ValueError / RequestError: bad input (400 naming the field) or a failed request.
        """
        note_model(req.model, self.server_args)
        obj, forced = self._to_generate(req)
        agen = self.tm.generate_request(obj, raw_request)
        first = await prefetch(agen)
        rid, msg_id, created = f"resp_{uuid.uuid4().hex}", f"msg_{uuid.uuid4().hex}", int(time.time())
        if req.stream:
            return StreamingResponse(self._stream(req, first, agen, rid, msg_id, created, forced),
                                     media_type="text/event-stream")
        await agen.aclose()
        output = self._output_items(req, msg_id, first["text"], forced)
        return SafeJSONResponse(self._response(req, rid, created, "completed", output, first))

    async def _stream(self, req, first, agen, rid: str, msg_id: str, created: int,
                      forced: bool) -> AsyncIterator[str]:
        """The SSE events of one response. Text streams as ``response.output_text.delta`` events; with a forced
        ``tool_choice`` the JSON is collected and each parsed call is sent when generation ends (its
        ``output_item.added``, one arguments / input ``delta``, ``done``, ``output_item.done``)."""
        seq = [0]

        def event(kind: str, **payload) -> str:
            data = {"type": kind, "sequence_number": seq[0], **payload}
            seq[0] += 1
            return f"event: {kind}\ndata: {dumps(data)}\n\n"

        def message_start() -> Iterator[str]:
            yield event("response.output_item.added", output_index=0, item=self._message(msg_id, None, "in_progress"))
            yield event("response.content_part.added", item_id=msg_id, output_index=0, content_index=0,
                        part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})

        loc = {"item_id": msg_id, "output_index": 0, "content_index": 0}
        yield event("response.created", response=self._response(req, rid, created, "in_progress", []))
        yield event("response.in_progress", response=self._response(req, rid, created, "in_progress", []))
        if not forced:
            for e in message_start():
                yield e
        sent = 0
        out = last = first
        try:
            while out is not None:
                if not forced:
                    delta = out["text"][sent:]
                    sent = len(out["text"])
                    if delta:
                        yield event("response.output_text.delta", **loc, delta=delta, logprobs=[])
                last = out
                out = await prefetch(agen)
        except (ValueError, RequestError) as e:
            status = e.status_code if isinstance(e, RequestError) else 400
            err = {"code": str(status), "message": str(e)}
            failed = self._response(req, rid, created, "failed", [])
            failed["error"] = err
            yield event("response.failed", response=failed)
            return
        finally:
            await agen.aclose()
        text = last["text"]
        items = self._output_items(req, msg_id, text, forced)
        if items and items[0]["type"] == "message":
            if forced:  # a forced call's JSON that did not parse: the text is the answer
                for e in message_start():
                    yield e
                if text:
                    yield event("response.output_text.delta", **loc, delta=text, logprobs=[])
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            yield event("response.output_text.done", **loc, text=text, logprobs=[])
            yield event("response.content_part.done", **loc, part=part)
            yield event("response.output_item.done", output_index=0, item=items[0])
        else:
            for i, item in enumerate(items):
                for e in _call_events(event, i, item):
                    yield e
        final = self._response(req, rid, created, "completed", items, last)
        yield event("response.completed", response=final)


def _call_events(event, index: int, item: dict[str, Any]) -> Iterator[str]:
    """The events of one finished call item: ``output_item.added`` (empty arguments / input, in progress), the
    arguments (``response.function_call_arguments.delta`` / ``.done``) or input
    (``response.custom_tool_call_input.delta`` / ``.done``) in one delta, ``output_item.done``."""
    field, kind = ("arguments", "response.function_call_arguments") if item["type"] == "function_call" else \
        ("input", "response.custom_tool_call_input")
    yield event("response.output_item.added", output_index=index,
                item={**item, field: "", **({"status": "in_progress"} if "status" in item else {})})
    yield event(f"{kind}.delta", item_id=item["id"], output_index=index, delta=item[field])
    yield event(f"{kind}.done", item_id=item["id"], output_index=index, **{field: item[field]})
    yield event("response.output_item.done", output_index=index, item=item)


def register_responses_route(app: FastAPI, tm, server_args) -> None:
    """Add ``POST /v1/responses`` to ``app``."""
    serving = OpenAIServingResponses(tm, server_args)

    @app.post("/v1/responses")
    async def v1_responses(request: Request):
        """``POST /v1/responses`` (OpenAI Responses API): validate the body, delegate to the handler."""
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"malformed JSON body: {e}") from None
        return await serving.handle(ResponsesRequest.model_validate(body), request)
