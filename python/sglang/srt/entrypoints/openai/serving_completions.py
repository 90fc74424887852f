"""``POST /v1/completions``, plus helpers shared with the chat endpoint.

OpenAI fields map onto SGLang sampling params (``max_tokens`` ->
``max_new_tokens``, ``min_tokens`` -> ``min_new_tokens``, the rest by name);
the TokenizerManager validates them and its ValueErrors become 400s.
"""

from __future__ import annotations

import json
import logging
import uuid
from typing import Any, AsyncIterator, Callable, Iterator, Optional, Union

from fastapi.responses import StreamingResponse

from sglang.srt.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
    PromptTokensDetails,
    UsageInfo,
    error_body,
)
from sglang.srt.entrypoints.parity_routes import SafeJSONResponse
from sglang.srt.entrypoints.request_limits import check_token_ids
from sglang.srt.managers.generate_req import GenerateReqInput
from sglang.srt.managers.tokenizer_manager import RequestError

logger = logging.getLogger(__name__)


# ------------------------------------------------------------------ helpers
def note_model(model: Optional[str], server_args) -> None:
    """Accept any ``model`` value, as SGLang does (one server serves one model; clients often send
    ``"default"``, a short name or another provider's name); a name that differs from the served
    model is logged at debug level. The response echoes the request's ``model``."""
    if model is not None and model not in (server_args.model_name, server_args.model_path, "default"):
        logger.debug("request names model %r; serving %r", model, server_args.model_name)


def build_sampling_params(req, max_new_tokens: Optional[int]) -> dict[str, Any]:
    """Map an OpenAI request (completion or chat) to an SGLang ``sampling_params`` dict.

    ``response_format`` ``{"type": "json_schema", "json_schema": {"schema": S}}`` becomes
    ``json_schema = json.dumps(S)``, ``{"type": "json_object"}`` becomes ``json_schema =
    '{"type": "object"}'`` (as SGLang); ``{"type": "text"}`` adds nothing. A ``json_schema`` extra
    given as a JSON object is sent as its JSON text.

    ``logit_bias`` (``{token id: bias}``), ``stop_regex`` and ``custom_params`` pass through as SGLang
    sampling params.

    Raises:
        ValueError: ``response_format`` of type json_schema lacks ``json_schema.schema``, or both
            ``response_format`` and ``json_schema`` are set.
    """
    d = {
        "max_new_tokens": max_new_tokens,
        "stop": req.stop,
        "stop_token_ids": req.stop_token_ids,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "top_k": req.top_k,
        "min_p": req.min_p,
        "presence_penalty": req.presence_penalty,
        "frequency_penalty": req.frequency_penalty,
        "repetition_penalty": req.repetition_penalty,
        "min_new_tokens": req.min_tokens,
        "ignore_eos": req.ignore_eos,
        "skip_special_tokens": req.skip_special_tokens,
        "spaces_between_special_tokens": req.spaces_between_special_tokens,
        "no_stop_trim": req.no_stop_trim,
        "n": req.n,
        "seed": req.seed,
        "regex": req.regex,
        "json_schema": json.dumps(req.json_schema) if isinstance(req.json_schema, dict) else req.json_schema,
        "ebnf": req.ebnf,
        "stop_regex": req.stop_regex,
        "logit_bias": getattr(req, "logit_bias", None) or None,
        "custom_params": req.custom_params,
    }
    rf = getattr(req, "response_format", None)
    if rf is not None and rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.schema_ is None:
            raise ValueError("response_format.json_schema.schema is required for type json_schema")
        if d["json_schema"] is not None:
            raise ValueError("set either response_format or json_schema, not both")
        d["json_schema"] = json.dumps(rf.json_schema.schema_)
    elif rf is not None and rf.type == "json_object":
        if d["json_schema"] is not None:
            raise ValueError("set either response_format or json_schema, not both")
        d["json_schema"] = '{"type": "object"}'
    return {k: v for k, v in d.items() if v is not None}


def finish_reason_of(out: dict[str, Any]) -> tuple[Optional[str], Union[None, int, str]]:
    """(OpenAI finish_reason, matched stop) of an SGLang output dict."""
    fr = out["meta_info"].get("finish_reason")
    if not fr:
        return None, None
    return fr.get("type"), fr.get("matched")


def usage_of(outputs: list[dict[str, Any]], n: int) -> UsageInfo:
    """Usage over outputs ordered prompt-major with ``n`` samples per prompt (prompt counted once)."""
    prompt = sum(o["meta_info"]["prompt_tokens"] for o in outputs[::n])
    cached = sum(o["meta_info"]["cached_tokens"] for o in outputs[::n])
    completion = sum(o["meta_info"]["completion_tokens"] for o in outputs)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


def sse(obj: Any) -> str:
    """One server-sent event line: ``data: <json>\\n\\n``."""
    from sglang.srt.entrypoints.parity_routes import dumps

    if hasattr(obj, "model_dump"):
        obj = obj.model_dump()
    return f"data: {dumps(obj)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


async def prefetch(agen: AsyncIterator[Any]) -> Optional[Any]:
    """First item of ``agen`` (None if empty), so errors surface before a stream starts."""
    try:
        return await agen.__anext__()
    except StopAsyncIteration:
        return None


def sse_error_tail(e: Exception) -> str:
    """An SSE error event (OpenAI's error shape) for a failure after the stream started."""
    status = e.status_code if isinstance(e, RequestError) else 400
    return sse(error_body(str(e), status))


async def stream_sse(first: Any, agen: AsyncIterator[Any], on_output: Callable[[dict[str, Any]], Iterator[str]],
                     usage_chunk: Optional[Callable[[list[dict[str, Any]]], str]]) -> AsyncIterator[str]:
    """Drive one streamed OpenAI response over ``generate_request`` outputs (``first`` already fetched, the rest
    from ``agen``): ``on_output(out)`` yields the SSE lines of each output; then ``usage_chunk(finals)`` (finished
    outputs in batch ``index`` order) when the client asked for usage; an error after the stream started becomes
    an SSE error event (:func:`sse_error_tail`); ``agen`` is closed (aborting unfinished requests); ``[DONE]`` last.
    """
    finals: dict[int, dict] = {}
    try:
        out = first
        while out is not None:
            for line in on_output(out):
                yield line
            if finish_reason_of(out)[0] is not None:
                finals[out.get("index", 0)] = out
            out = await prefetch(agen)
        if usage_chunk is not None:
            yield usage_chunk([finals[i] for i in sorted(finals)])
    except (ValueError, RequestError) as e:
        yield sse_error_tail(e)
    finally:
        await agen.aclose()
    yield SSE_DONE


# --------------------------------------------------------------- endpoint
class OpenAIServingCompletion:
    """Serves ``/v1/completions`` on a :class:`~sglang.srt.managers.tokenizer_manager.TokenizerManager`."""

    def __init__(self, tokenizer_manager, server_args) -> None:
        self.tm = tokenizer_manager
        self.server_args = server_args

    def _to_generate(self, req: CompletionRequest) -> tuple[GenerateReqInput, list[str]]:
        p = req.prompt
        if p == "" or p == []:
            raise ValueError("prompt must not be empty")
        if isinstance(p, list) and any(x == "" or x == [] for x in p):
            raise ValueError("prompt must not contain an empty prompt")
        if req.suffix:
            raise ValueError("suffix is not supported by this server; remove it")
        if req.best_of is not None and req.best_of != req.n:
            raise ValueError("best_of is not supported by this server (only best_of == n)")
        if req.logprobs is not None and req.logprobs < 0:
            raise ValueError(f"logprobs must be >= 0, got {req.logprobs}")
        if req.n < 1:
            raise ValueError(f"n must be >= 1, got {req.n}")
        if req.max_tokens is not None and req.max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {req.max_tokens}")
        is_text = isinstance(p, str) or (isinstance(p, list) and p and isinstance(p[0], str))
        if not is_text:  # ids are checked before anything decodes them (echo)
            check_token_ids(p, self.tm.vocab_size, "prompt")
        if isinstance(p, str):
            echo_texts = [p]
        elif is_text:
            echo_texts = list(p)
        elif p and isinstance(p[0], list):
            echo_texts = [self.tm.decode_ids(x) for x in p] if req.echo else [""] * len(p)
        else:
            echo_texts = [self.tm.decode_ids(p)] if req.echo else [""]
        want_lp = req.logprobs is not None
        obj = GenerateReqInput(
            text=p if is_text else None,
            input_ids=None if is_text else p,
            sampling_params=build_sampling_params(req, req.max_tokens),
            rid=req.rid,
            return_logprob=want_lp,
            logprob_start_len=0 if (want_lp and req.echo) else -1,
            top_logprobs_num=req.logprobs or 0,
            return_text_in_logprobs=True,
            stream=req.stream,
            custom_logit_processor=req.custom_logit_processor,
            bootstrap_host=req.bootstrap_host, bootstrap_port=req.bootstrap_port, bootstrap_room=req.bootstrap_room,
        )
        return obj, echo_texts

    async def handle(self, req: CompletionRequest, raw_request=None):
        """Answer one request: a JSONResponse, or a StreamingResponse of SSE chunks ending in
        ``data: [DONE]``.

        Raises:
            ValueError / RequestError: bad input or a failed request (before streaming starts).
        """
        note_model(req.model, self.server_args)
        obj, echo_texts = await self.tm.preparer.run(self._to_generate, req)  # echo decodes off the loop
        agen = self.tm.generate_request(obj, raw_request)
        first = await prefetch(agen)
        if req.stream:
            return StreamingResponse(self._stream(req, first, agen, echo_texts), media_type="text/event-stream")
        await agen.aclose()
        outs = first if isinstance(first, list) else [first]
        choices = []
        for i, out in enumerate(outs):
            echo = echo_texts[i // req.n] if req.echo else ""
            reason, matched = finish_reason_of(out)
            lp = None
            if req.logprobs is not None:
                lp, _ = _completion_logprobs(out["meta_info"], 0, 0, req.echo, self.tm.token_pieces)
            choices.append(CompletionChoice(index=i, text=echo + out["text"], logprobs=lp,
                                            finish_reason=reason, matched_stop=matched))
        resp = CompletionResponse(model=req.model or self.server_args.model_name, choices=choices,
                                  usage=usage_of(outs, req.n))
        return SafeJSONResponse(resp.model_dump())

    def _stream(self, req: CompletionRequest, first, agen, echo_texts) -> AsyncIterator[str]:
        rid = f"cmpl-{uuid.uuid4().hex}"
        model = req.model or self.server_args.model_name
        sent_text: dict[int, int] = {}
        sent_lp: dict[int, int] = {}
        text_offset: dict[int, int] = {}

        def on_output(out: dict[str, Any]) -> Iterator[str]:
            idx = out.get("index", 0)
            delta = out["text"][sent_text.get(idx, 0):]
            if idx not in sent_text and req.echo:
                delta = echo_texts[idx // req.n] + delta
            sent_text[idx] = len(out["text"])
            lp = None
            if req.logprobs is not None:
                start = sent_lp.get(idx, 0)
                lp, text_offset[idx] = _completion_logprobs(
                    out["meta_info"], start, text_offset.get(idx, 0), req.echo and idx not in sent_lp,
                    self.tm.token_pieces)
                sent_lp[idx] = len(out["meta_info"]["output_token_logprobs"])
            reason, matched = finish_reason_of(out)
            if delta or reason is not None or lp is not None:
                choice = CompletionChoice(index=idx, text=delta, logprobs=lp, finish_reason=reason,
                                          matched_stop=matched)
                yield sse(CompletionStreamResponse(id=rid, model=model, choices=[choice]))

        def usage_chunk(finals: list[dict[str, Any]]) -> str:
            return sse(CompletionStreamResponse(id=rid, model=model, choices=[], usage=usage_of(finals, req.n)))

        include_usage = req.stream_options is not None and req.stream_options.include_usage
        return stream_sse(first, agen, on_output, usage_chunk if include_usage else None)


def _completion_logprobs(meta: dict[str, Any], start: int, offset: int, with_input: bool,
                         pieces=None) -> tuple[CompletionLogprobs, int]:
    """OpenAI completion logprobs from SGLang meta_info, output entries from ``start`` on
    (input entries first when ``with_input``, i.e. echo); ``offset`` is the first token's text offset.

    With ``pieces`` (:class:`~sglang.srt.managers.token_pieces.TokenPieces`) tokens keep their
    leading spaces and ``text_offset`` indexes the returned text (special tokens such as BOS add
    no text); without, the per-token texts of ``meta_info`` are used. Returns the logprobs and
    the offset where the next chunk's tokens start."""
    entries = list(meta.get("output_token_logprobs", []))[start:]
    tops = list(meta.get("output_top_logprobs", []))[start:] or [None] * len(entries)
    if with_input:
        in_entries = list(meta.get("input_token_logprobs", []))
        in_tops = list(meta.get("input_top_logprobs", [])) or [None] * len(in_entries)
        entries, tops = in_entries + entries, in_tops + tops

    def text_of(tid: int, text: Optional[str]) -> str:
        return pieces.text_of(tid) if pieces is not None else (text or "")

    lp = CompletionLogprobs()
    for (logprob, tid, text), top in zip(entries, tops):
        lp.tokens.append(text_of(tid, text))
        lp.token_logprobs.append(logprob)
        lp.top_logprobs.append(None if top is None else {text_of(i, t): v for v, i, t in top})
    if pieces is not None:
        offs = pieces.offsets([e[1] for e in entries], offset, at_sequence_start=with_input)
    else:
        offs = [offset]
        for t in lp.tokens:
            offs.append(offs[-1] + len(t))
    lp.text_offset = offs[:-1]
    return lp, offs[-1]
