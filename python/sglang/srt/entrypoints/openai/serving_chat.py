"""``POST /v1/chat/completions``: chat template -> prompt ids -> generation -> OpenAI chat responses.

``max_completion_tokens`` (or the older ``max_tokens``) becomes
``max_new_tokens``; when neither is given the reply may fill the rest of the
context. ``response_format`` ``json_schema`` / ``json_object`` become SGLang's
``json_schema`` constraint.
"""

from __future__ import annotations

import logging
import uuid
from typing import Any, AsyncIterator, Iterator, Optional

from fastapi.responses import StreamingResponse

from sglang.srt.entrypoints.openai.protocol import (
    ChatCompletionChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatMessageOut,
    ChoiceLogprobs,
    DeltaMessage,
    TokenLogprob,
    TopLogprob,
)
from sglang.srt.entrypoints.openai.serving_completions import (
    build_sampling_params,
    note_model,
    finish_reason_of,
    prefetch,
    sse,
    stream_sse,
    usage_of,
)
from sglang.srt.entrypoints.parity_routes import SafeJSONResponse
from sglang.srt.managers.generate_req import GenerateReqInput

logger = logging.getLogger(__name__)


def messages_to_dicts(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    """OpenAI messages as template-ready dicts, text parts joined into one ``content`` string.

    Raises:
        ValueError: no messages, or a non-text content part (names ``messages[i].content``).
    """
    if not req.messages:
        raise ValueError("messages must not be empty")
    out = []
    for i, m in enumerate(req.messages):
        d = m.model_dump(exclude_none=True)
        if isinstance(m.content, list):
            texts = []
            for part in m.content:
                if part.type != "text" or part.text is None:
                    raise ValueError(f"messages[{i}].content: only text parts are supported, got type {part.type!r}")
                texts.append(part.text)
            d["content"] = "".join(texts)
        elif m.content is None:
            d["content"] = ""
        out.append(d)
    return out


def check_tools(req: ChatCompletionRequest) -> None:
    """Validate ``tools`` / ``tool_choice`` with SGLang's checks and error texts.

    Raises:
        ValueError: ``tool_choice`` "required" or a named function without ``tools``; a named function that is
            not among ``tools`` (``"Tool 'f' not found in tools list."``); a tool without ``function.name``; a
            ``function.parameters`` that is not a valid JSON Schema (``"Tool i function has invalid 'parameters'
            schema: ..."``, checked against Draft 2020-12 with ``jsonschema``).
    """
    tools, choice = req.tools, req.tool_choice
    if isinstance(choice, str) and choice.lower() == "required" and not tools:
        raise ValueError("Tools cannot be empty if tool choice is set to required.")
    names = []
    for i, tool in enumerate(tools or []):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ValueError(f"tools[{i}].function.name is required: each tool is "
                             '{"type": "function", "function": {"name": ..., "parameters": {...}}}')
        names.append(fn["name"])
    if choice is not None and not isinstance(choice, str):
        if not tools:
            raise ValueError("Tools cannot be empty if tool choice is set to a specific tool.")
        fn = choice.get("function") if isinstance(choice, dict) else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if name not in names:
            raise ValueError(f"Tool '{name}' not found in tools list.")
    check_parameter_schemas(tools or [])


def check_parameter_schemas(tools: list[dict[str, Any]]) -> None:
    """Each chat tool's ``function.parameters`` (when given) must be a valid JSON Schema (Draft 2020-12).

    Args:
        tools: chat-completions tools, ``{"type": "function", "function": {"name", "parameters", ...}}``.
    Raises:
        ValueError: SGLang's ``"Tool i function has invalid 'parameters' schema: ..."`` (``i`` the tool's index), or
            a schema nested too deeply / cyclic.
    """
    for i, tool in enumerate(tools):
        params = tool["function"].get("parameters")
        if params is None:
            continue
        from jsonschema import Draft202012Validator
        from jsonschema.exceptions import SchemaError

        try:
            Draft202012Validator.check_schema(params)
        except SchemaError as e:
            raise ValueError(f"Tool {i} function has invalid 'parameters' schema: {e.message}") from None
        except RecursionError:
            raise ValueError(f"Tool {i} function 'parameters' schema is too deeply nested or contains a "
                             "cycle.") from None


def template_tools_of(req: ChatCompletionRequest) -> Optional[list[dict[str, Any]]]:
    """The tools the chat template renders (SGLang): none for ``tool_choice`` ``"none"``, only the named function
    for a named choice, else all of ``tools``."""
    tools, choice = req.tools, req.tool_choice
    if not tools or (isinstance(choice, str) and choice.lower() == "none"):
        return None
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name")
        return [t for t in tools if t["function"]["name"] == name] or None
    return tools


def chat_logprobs(meta: dict[str, Any], start: int, pieces=None) -> ChoiceLogprobs:
    """OpenAI chat logprobs from SGLang ``meta_info`` output entries ``[start:]``.

    ``pieces``: a :class:`~sglang.srt.managers.token_pieces.TokenPieces` giving each token's exact
    text and UTF-8 ``bytes`` (None: the per-token texts in ``meta_info``)."""
    entries = list(meta.get("output_token_logprobs", []))[start:]
    tops = list(meta.get("output_top_logprobs", []))[start:] or [None] * len(entries)

    def piece(tid: int, text: Optional[str]) -> tuple[str, list[int]]:
        if pieces is not None:
            b = pieces.bytes_of(tid)
            return b.decode("utf-8", errors="replace"), list(b)
        return text or "", list((text or "").encode("utf-8"))

    content = []
    for (logprob, tid, text), top in zip(entries, tops):
        tok, b = piece(tid, text)
        tl = []
        for v, i, t in top or []:
            ttok, tb = piece(i, t)
            tl.append(TopLogprob(token=ttok, logprob=v, bytes=tb))
        content.append(TokenLogprob(token=tok, logprob=logprob, bytes=b, top_logprobs=tl))
    return ChoiceLogprobs(content=content)


class OpenAIServingChat:
    """Serves ``/v1/chat/completions`` on a :class:`~sglang.srt.managers.tokenizer_manager.TokenizerManager`."""

    def __init__(self, tokenizer_manager, server_args) -> None:
        self.tm = tokenizer_manager
        self.server_args = server_args

    def _to_generate(self, req: ChatCompletionRequest) -> GenerateReqInput:
        if req.n < 1:
            raise ValueError(f"n must be >= 1, got {req.n}")
        for name in ("max_tokens", "max_completion_tokens"):
            v = getattr(req, name)
            if v is not None and v < 0:
                raise ValueError(f"{name} must be >= 0, got {v}")
        check_tools(req)
        messages = messages_to_dicts(req)
        self.tm.preparer.check_text_bound("".join(str(m.get("content") or "") for m in messages), "messages")
        prompt_ids = self.tm.apply_chat_template(messages, tools=template_tools_of(req))
        max_new = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        if max_new is None:
            max_new = max(self.tm.context_len - len(prompt_ids), 0)
        params = build_sampling_params(req, max_new)
        return GenerateReqInput(
            input_ids=prompt_ids,
            sampling_params=params,
            rid=req.rid,
            return_logprob=req.logprobs,
            top_logprobs_num=(req.top_logprobs or 0) if req.logprobs else 0,
            return_text_in_logprobs=True,
            stream=req.stream,
            custom_logit_processor=req.custom_logit_processor,
            bootstrap_host=req.bootstrap_host, bootstrap_port=req.bootstrap_port, bootstrap_room=req.bootstrap_room,
        )

    async def handle(self, req: ChatCompletionRequest, raw_request=None):
        """Answer one request: a JSONResponse, or a StreamingResponse of SSE chunks ending in
        ``data: [DONE]``.

        Raises:
            ValueError / RequestError: bad input or a failed request (before streaming starts).
        """
        note_model(req.model, self.server_args)
        obj = await self.tm.preparer.run(self._to_generate, req)  # chat template + tokenization off the loop
        agen = self.tm.generate_request(obj, raw_request)
        first = await prefetch(agen)
        if req.stream:
            return StreamingResponse(self._stream(req, first, agen), media_type="text/event-stream")
        await agen.aclose()
        outs = first if isinstance(first, list) else [first]
        choices = []
        for i, out in enumerate(outs):
            reason, matched = finish_reason_of(out)
            lp = chat_logprobs(out["meta_info"], 0, self.tm.token_pieces) if req.logprobs else None
            choices.append(ChatCompletionChoice(index=i, message=ChatMessageOut(content=out["text"]), logprobs=lp,
                                                finish_reason=reason, matched_stop=matched))
        resp = ChatCompletionResponse(model=req.model or self.server_args.model_name, choices=choices,
                                      usage=usage_of(outs, req.n))
        return SafeJSONResponse(resp.model_dump())

    def _stream(self, req: ChatCompletionRequest, first, agen) -> AsyncIterator[str]:
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        model = req.model or self.server_args.model_name
        sent_text: dict[int, int] = {}
        sent_lp: dict[int, int] = {}

        def chunk(idx: int, delta: DeltaMessage, **kw) -> str:
            """One SSE ``chat.completion.chunk`` line for choice ``idx`` with ``delta``."""
            choice = ChatCompletionStreamChoice(index=idx, delta=delta, **kw)
            return sse(ChatCompletionStreamResponse(id=rid, model=model, choices=[choice]))

        def on_output(out: dict[str, Any]) -> Iterator[str]:
            idx = out.get("index", 0)
            if idx not in sent_text:
                sent_text[idx] = 0
                yield chunk(idx, DeltaMessage(role="assistant", content=""))
            delta = out["text"][sent_text[idx]:]
            sent_text[idx] = len(out["text"])
            lp = None
            if req.logprobs:
                lp = chat_logprobs(out["meta_info"], sent_lp.get(idx, 0), self.tm.token_pieces)
                sent_lp[idx] = len(out["meta_info"]["output_token_logprobs"])
            if delta or (lp is not None and lp.content):
                yield chunk(idx, DeltaMessage(content=delta), logprobs=lp)
            reason, matched = finish_reason_of(out)
            if reason is not None:
                yield chunk(idx, DeltaMessage(), finish_reason=reason, matched_stop=matched)

        def usage_chunk(finals: list[dict[str, Any]]) -> str:
            return sse(ChatCompletionStreamResponse(id=rid, model=model, choices=[], usage=usage_of(finals, req.n)))

        include_usage = req.stream_options is not None and req.stream_options.include_usage
        return stream_sse(first, agen, on_output, usage_chunk if include_usage else None)
