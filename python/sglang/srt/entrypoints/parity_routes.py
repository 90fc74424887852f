"""SGLang routes and response shapes kept out of ``http_server.py``: ``/server_info``,
``GET /v1/models/{model}``, ``/tokenize`` / ``/v1/tokenize``, ``/detokenize`` / ``/v1/detokenize``,
the incremental logprobs of a streamed ``/generate``, and JSON encoding that survives non-finite
floats.

CPU-only; :func:`register_parity_routes` adds the routes to the app built by
:func:`~sglang.srt.entrypoints.http_server.create_app`.
"""

from __future__ import annotations

import json
import math
from typing import Any, Optional, Union

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

from sglang.srt.entrypoints.openai.protocol import ModelCard, error_body

INCREMENTAL_META_KEYS = ("output_token_logprobs", "output_top_logprobs", "output_token_ids_logprobs")
"""``meta_info`` lists of the output tokens. A streamed ``/generate`` sends them cumulative by default (like
``text`` and ``output_ids``, SGLang's default); with ``--incremental-streaming-output`` each chunk holds only the
entries of the chunk's new tokens (exactly one per token of its ``output_ids`` delta). ``output_token_logprobs_length``
is always the running total, so ``length - len(chunk list)`` is the chunk's offset (0 for a cumulative list), and
``completion_tokens`` is cumulative in both modes. The prompt's lists (``input_token_logprobs``, ``input_top_logprobs``,
``input_token_ids_logprobs``) are complete in every chunk in both modes, as SGLang's tokenizer manager sends them."""


# ------------------------------------------------------------------ JSON
def finite_json(obj: Any) -> Any:
    """``obj`` with every non-finite float (``-inf`` of a masked token, NaN) replaced by None, which is
    how SGLang's orjson responses serialize them (``null``)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite_json(v) for v in obj]
    return obj


def dumps(obj: Any) -> str:
    """Strict JSON text of ``obj`` (non-finite floats become ``null``, see :func:`finite_json`)."""
    try:
        return json.dumps(obj, ensure_ascii=False, allow_nan=False)
    except ValueError:
        return json.dumps(finite_json(obj), ensure_ascii=False, allow_nan=False)


class SafeJSONResponse(JSONResponse):
    """A JSONResponse whose body is always valid JSON (non-finite floats as ``null``), never a 500/400."""

    def render(self, content: Any) -> bytes:
        return dumps(content).encode("utf-8")


# ------------------------------------------------------- streamed /generate
class IncrementalLogprobs:
    """Shapes the cumulative ``/generate`` outputs of one stream into its chunks (SGLang's two stream modes).

    Cumulative mode (``incremental=False``, SGLang's default): outputs pass unchanged, so every chunk's output
    logprob lists cover exactly the tokens of its (cumulative) ``output_ids``, whatever the chunking.
    Incremental mode (``--incremental-streaming-output``): per batch ``index``, ``text``, ``output_ids`` and the
    output logprob lists (:data:`INCREMENTAL_META_KEYS`) hold only what is new since the previous chunk, all cut at
    the same token offset (one logprob entry per new token), while ``completion_tokens`` and
    ``output_token_logprobs_length`` stay running totals and the prompt's logprob lists stay complete, so
    ``len(chunk list) == completion_tokens - previous completion_tokens`` for every chunk (the contract of SGLang's
    ``test_stream_logprobs``).

    Args:
        incremental: the server's ``incremental_streaming_output``.
    """

    def __init__(self, incremental: bool = False) -> None:
        self.incremental = incremental
        self._sent_tokens: dict[int, int] = {}
        self._sent_chars: dict[int, int] = {}

    def __call__(self, out: Any) -> Any:
        """Shape one streamed output dict (anything else is returned unchanged)."""
        if not self.incremental or not isinstance(out, dict) or "meta_info" not in out:
            return out
        idx = out.get("index", 0)
        start, chars = self._sent_tokens.get(idx, 0), self._sent_chars.get(idx, 0)
        ids, text = out.get("output_ids") or [], out.get("text") or ""
        self._sent_tokens[idx], self._sent_chars[idx] = len(ids), len(text)
        meta = dict(out["meta_info"])
        for key in INCREMENTAL_META_KEYS:
            if key in meta:
                meta[key] = meta[key][start:len(ids)]
        return {**out, "text": text[chars:], "output_ids": list(ids[start:]), "meta_info": meta}


# ---------------------------------------------------------- tokenize API
class TokenizeRequest(BaseModel):
    """SGLang's ``/tokenize`` body: ``prompt`` (a string or a list of strings) with ``add_special_tokens``, or
    chat ``messages`` (OpenAI message objects, rendered with the server's chat template, plus ``tools`` and
    ``add_generation_prompt``, default true)."""

    model_config = ConfigDict(extra="ignore")
    model: Optional[str] = None
    prompt: Optional[Union[str, list[str]]] = None
    messages: Optional[list[dict[str, Any]]] = None
    tools: Optional[list[dict[str, Any]]] = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = True


def chat_prompt_ids(tm, req: TokenizeRequest) -> list[int]:
    """Token ids of ``req.messages`` rendered by the chat template exactly as ``/v1/chat/completions`` does.

    Raises:
        ValueError / pydantic.ValidationError: a malformed message (naming ``messages[i]...``) or a template
            that fails on them.
    """
    from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest
    from sglang.srt.entrypoints.openai.serving_chat import messages_to_dicts

    chat = ChatCompletionRequest.model_validate({"messages": req.messages, "tools": req.tools})
    return tm.apply_chat_template(messages_to_dicts(chat), tools=req.tools,
                                  add_generation_prompt=req.add_generation_prompt)


class DetokenizeRequest(BaseModel):
    """SGLang's ``/detokenize`` body: ``tokens`` (ids, or a list of id lists), ``skip_special_tokens``."""

    model_config = ConfigDict(extra="ignore")
    model: Optional[str] = None
    tokens: Union[list[int], list[list[int]]]
    skip_special_tokens: bool = True


def server_info_aliases(info: dict[str, Any]) -> dict[str, Any]:
    """Add SGLang's field names to our server-info dict (``max_total_num_tokens`` for ``max_total_tokens``);
    ours stay as aliases."""
    out = dict(info)
    if "max_total_tokens" in out and "max_total_num_tokens" not in out:
        out["max_total_num_tokens"] = out["max_total_tokens"]
    return out


def register_parity_routes(app: FastAPI, tm, server_args, server_info_fn) -> None:
    """Add the routes of this module to ``app``.

    Args:
        app: the FastAPI app.
        tm: the :class:`~sglang.srt.managers.tokenizer_manager.TokenizerManager`.
        server_args: the server's :class:`~sglang.srt.server_args.ServerArgs`.
        server_info_fn: the coroutine function answering ``/get_server_info`` (``/server_info`` is its alias).
    """
    app.add_api_route("/server_info", server_info_fn, methods=["GET"])

    @app.get("/v1/models/{model:path}")
    async def retrieve_model(model: str):
        """``GET /v1/models/{model}`` (the OpenAI SDK's ``models.retrieve``): the model card, or 404."""
        if model not in (server_args.model_name, server_args.model_path):
            return JSONResponse(error_body(f"The model {model!r} does not exist; this server serves "
                                           f"{server_args.model_name!r}", 404, param="model"), status_code=404)
        return ModelCard(id=server_args.model_name, root=server_args.model_path,
                         max_model_len=tm.context_len).model_dump()

    def need_tokenizer():
        if tm.tokenizer is None:
            raise ValueError("tokenization needs a tokenizer but the server runs with --skip-tokenizer-init")
        return tm.tokenizer

    async def tokenize(request: Request):
        """``POST /tokenize`` / ``/v1/tokenize``: ``{"tokens", "count", "max_model_len"}`` (lists for a
        list prompt; chat ``messages`` give the ids of the rendered chat template)."""
        req = TokenizeRequest.model_validate(await _json(request))
        tok = need_tokenizer()
        if (req.prompt is None) == (req.messages is None):
            raise ValueError("set exactly one of prompt (text) and messages (chat messages)")
        if req.messages is not None:
            ids = chat_prompt_ids(tm, req)
            return {"tokens": ids, "count": len(ids), "max_model_len": tm.context_len}
        prompts = [req.prompt] if isinstance(req.prompt, str) else req.prompt
        ids = [tok.encode(p, add_special_tokens=req.add_special_tokens) for p in prompts]
        if isinstance(req.prompt, str):
            return {"tokens": ids[0], "count": len(ids[0]), "max_model_len": tm.context_len}
        return {"tokens": ids, "count": [len(x) for x in ids], "max_model_len": tm.context_len}

    async def detokenize(request: Request):
        """``POST /detokenize`` / ``/v1/detokenize``: ``{"text"}`` (a list for a list of id lists)."""
        req = DetokenizeRequest.model_validate(await _json(request))
        tok = need_tokenizer()
        batch = bool(req.tokens) and isinstance(req.tokens[0], list)
        seqs = req.tokens if batch else [req.tokens]
        for seq in seqs:
            for t in seq:
                if not 0 <= t < tm.vocab_size:
                    raise ValueError(f"tokens must lie in [0, {tm.vocab_size}) (the vocabulary size), got {t}")
        texts = [tok.decode(s, skip_special_tokens=req.skip_special_tokens) for s in seqs]
        return {"text": texts if batch else texts[0]}

    for path in ("/tokenize", "/v1/tokenize"):
        app.add_api_route(path, tokenize, methods=["POST"])
    for path in ("/detokenize", "/v1/detokenize"):
        app.add_api_route(path, detokenize, methods=["POST"])


async def _json(request: Request) -> Any:
    raw = await request.body()
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"malformed JSON body: {e}") from None


