"""Pydantic models of the OpenAI-compatible API (completions, chat, models, errors).

Field names and defaults follow OpenAI's API reference; SGLang's extra
sampling fields (``top_k``, ``min_p``, ``repetition_penalty``, ``regex``,
``json_schema``, ``ebnf``, ``ignore_eos``, ...) are accepted too. Unknown
request fields are ignored (OpenAI SDKs send fields this server does not use).
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field


def _now() -> int:
    return int(time.time())


# ------------------------------------------------------------------ shared
class ErrorBody(BaseModel):
    """The ``error`` object of an OpenAI error response: message, type, param, code."""
    message: str
    type: str
    param: Optional[str] = None
    code: Union[int, str, None] = None


class ErrorResponse(BaseModel):
    """``{"error": {"message", "type", "param", "code"}}`` (OpenAI's error shape)."""

    error: ErrorBody


class PromptTokensDetails(BaseModel):
    """OpenAI ``usage.prompt_tokens_details``: ``cached_tokens`` = prompt tokens served from the prefix cache."""
    cached_tokens: int = 0


class UsageInfo(BaseModel):
    """OpenAI ``usage`` object: prompt / completion / total token counts."""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: Optional[PromptTokensDetails] = None


class StreamOptions(BaseModel):
    """OpenAI ``stream_options``: ``include_usage`` adds a final usage chunk to a stream; ``continuous_usage_stats``
    (SGLang extra) is accepted but not read."""
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingExtras(BaseModel):
    """Sampling fields shared by completions and chat (OpenAI's and SGLang's extras)."""

    model_config = ConfigDict(extra="ignore")

    model: Optional[str] = None  # None: the served model (SGLang accepts requests without it)
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    n: int = 1
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    stop: Optional[Union[str, list[str]]] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    seed: Optional[int] = None
    user: Optional[str] = None
    # SGLang extras
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    min_tokens: Optional[int] = None
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    regex: Optional[str] = None
    json_schema: Optional[Union[str, dict[str, Any]]] = None  # a dict is sent as its JSON text
    ebnf: Optional[str] = None
    rid: Optional[str] = None
    stop_regex: Optional[Union[str, list[str]]] = None
    custom_logit_processor: Optional[str] = None  # needs --enable-custom-logit-processor
    custom_params: Optional[dict[str, Any]] = None
    # prefill/decode disaggregation (set by the mini_lb router; see GenerateReqInput)
    bootstrap_host: Optional[Union[str, list[str]]] = None
    bootstrap_port: Optional[Union[int, list[int]]] = None
    bootstrap_room: Optional[Union[int, list[int]]] = None


# ------------------------------------------------------------- completions
class JsonSchemaFormat(BaseModel):
    """OpenAI ``response_format.json_schema``: name, the JSON schema (field ``schema``), strict; unknown fields kept."""
    model_config = ConfigDict(extra="allow", populate_by_name=True)

    name: Optional[str] = None
    schema_: Optional[dict[str, Any]] = Field(default=None, alias="schema")
    strict: Optional[bool] = None


class ResponseFormat(BaseModel):
    """OpenAI ``response_format``: ``text`` (no constraint), ``json_object`` (any JSON object) or
    ``json_schema`` (``json_schema.schema`` constrains the output)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None


class CompletionRequest(_SamplingExtras):
    """``POST /v1/completions`` body. ``prompt``: text, token ids, or a batch of either."""

    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: Optional[int] = 16
    logprobs: Optional[int] = None
    echo: bool = False
    best_of: Optional[int] = None
    suffix: Optional[str] = None
    logit_bias: Optional[dict[str, float]] = None
    response_format: Optional[ResponseFormat] = None  # SGLang accepts it on completions too


class CompletionLogprobs(BaseModel):
    """OpenAI completions ``choices[i].logprobs``: per-token text, logprob, top alternatives and text offsets."""
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[Optional[float]] = Field(default_factory=list)
    top_logprobs: list[Optional[dict[str, float]]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    """One OpenAI completions choice; ``matched_stop`` (SGLang extra) is the stop string or token id that ended it."""
    index: int
    text: str
    logprobs: Optional[CompletionLogprobs] = None
    finish_reason: Optional[str] = None
    matched_stop: Union[None, int, str] = None


class CompletionResponse(BaseModel):
    """OpenAI ``text_completion`` object returned by a non-streamed ``POST /v1/completions``."""
    id: str = Field(default_factory=lambda: f"cmpl-{uuid.uuid4().hex}")
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: Optional[UsageInfo] = None


class CompletionStreamResponse(BaseModel):
    """One SSE chunk of a streamed completion (``choices`` is empty in the final usage chunk)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: Optional[UsageInfo] = None


# -------------------------------------------------------------------- chat
class ChatContentPart(BaseModel):
    """One part of an OpenAI chat message's list ``content`` (``type`` + ``text``; extra fields kept)."""
    model_config = ConfigDict(extra="allow")

    type: str
    text: Optional[str] = None


class ChatMessage(BaseModel):
    """One OpenAI chat request message: role, content (string or list of parts), name, tool calls."""
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: Optional[Union[str, list[ChatContentPart]]] = None
    name: Optional[str] = None
    tool_calls: Optional[list[dict[str, Any]]] = None
    tool_call_id: Optional[str] = None


class ChatCompletionRequest(_SamplingExtras):
    """``POST /v1/chat/completions`` body."""

    messages: list[ChatMessage]
    max_tokens: Optional[int] = None
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(default=None, ge=0, le=20)
    response_format: Optional[ResponseFormat] = None
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Optional[Union[str, dict[str, Any]]] = None
    logit_bias: Optional[dict[str, float]] = None


class TopLogprob(BaseModel):
    """OpenAI chat ``top_logprobs`` entry: an alternative token, its logprob and UTF-8 bytes."""
    token: str
    logprob: float
    bytes: Optional[list[int]] = None


class TokenLogprob(BaseModel):
    """OpenAI chat ``logprobs.content`` entry: the sampled token, its logprob, bytes and top alternatives."""
    token: str
    logprob: float
    bytes: Optional[list[int]] = None
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(BaseModel):
    """OpenAI chat ``choices[i].logprobs``: the per-token ``content`` list."""
    content: Optional[list[TokenLogprob]] = None


class ChatMessageOut(BaseModel):
    """OpenAI chat response ``message`` (role ``assistant``, text content)."""
    role: Literal["assistant"] = "assistant"
    content: Optional[str] = None


class ChatCompletionChoice(BaseModel):
    """One OpenAI chat completion choice; ``matched_stop`` (SGLang extra): the stop string or token id that ended it."""
    index: int
    message: ChatMessageOut
    logprobs: Optional[ChoiceLogprobs] = None
    finish_reason: Optional[str] = None
    matched_stop: Union[None, int, str] = None


class ChatCompletionResponse(BaseModel):
    """OpenAI ``chat.completion`` object returned by a non-streamed ``POST /v1/chat/completions``."""
    id: str = Field(default_factory=lambda: f"chatcmpl-{uuid.uuid4().hex}")
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatCompletionChoice]
    usage: Optional[UsageInfo] = None


class DeltaMessage(BaseModel):
    """OpenAI ``chat.completion.chunk`` ``delta`` in SGLang's shape: ``role``, ``content``,
    ``reasoning_content`` and ``tool_calls`` are always present (null when empty), the final chunk too."""
    role: Optional[Literal["assistant"]] = None
    content: Optional[str] = None
    reasoning_content: Optional[str] = None
    tool_calls: Optional[list[dict[str, Any]]] = None


class ChatCompletionStreamChoice(BaseModel):
    """One choice of an OpenAI ``chat.completion.chunk`` (every ``delta`` key present, see :class:`DeltaMessage`)."""
    index: int
    delta: DeltaMessage
    logprobs: Optional[ChoiceLogprobs] = None
    finish_reason: Optional[str] = None
    matched_stop: Union[None, int, str] = None


class ChatCompletionStreamResponse(BaseModel):
    """One SSE chunk of a streamed chat completion (``choices`` is empty in the final usage chunk)."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: Optional[UsageInfo] = None


# ------------------------------------------------------------------ models
class ModelCard(BaseModel):
    """OpenAI ``model`` object (``GET /v1/models`` entry); ``root`` and ``max_model_len`` are SGLang extras."""
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "sglang"
    root: Optional[str] = None
    max_model_len: Optional[int] = None


class ModelList(BaseModel):
    """OpenAI ``GET /v1/models`` response: a ``list`` of model cards."""
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)


def error_body(message: str, status_code: int, err_type: Optional[str] = None,
               param: Optional[str] = None, code: Union[int, str, None] = None) -> dict[str, Any]:
    """The JSON body of an error response (OpenAI's shape).

    Args:
        message: what went wrong (names the offending field where there is one).
        status_code: HTTP status; picks the default ``type`` (400 BadRequestError, 401
            AuthenticationError, 404 NotFoundError, 5xx InternalServerError/ServiceUnavailableError).
        code: defaults to ``status_code``.
    """
    default_types = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
                     422: "BadRequestError", 499: "ClientClosedRequest", 500: "InternalServerError",
                     503: "ServiceUnavailableError"}
    t = err_type or default_types.get(status_code, "BadRequestError" if status_code < 500 else "InternalServerError")
    body = ErrorResponse(error=ErrorBody(message=message, type=t, param=param,
                                         code=status_code if code is None else code))
    return body.model_dump()
