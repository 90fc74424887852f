"""``POST /v1/score``: SGLang's scoring API (decoder-only scoring of query/item pairs).

For each item the server runs one prompt, ``query + item`` (``item + query`` with ``item_first``), and reports the
next-token probabilities of ``label_token_ids`` after it: ``exp(logprob)`` of each label under the full
vocabulary, or with ``apply_softmax`` a softmax over the labels' logprobs only (so each row sums to 1). ``query``
and ``items`` are both text (``items`` a string or a list of strings) or both token ids (``query`` a list of ids,
``items`` a list of id lists).

Request: ``{"model", "query", "items", "label_token_ids", "apply_softmax", "item_first"}``. Response:
``{"scores": [[float per label] per item], "model", "usage", "object": "scoring"}``. Errors are SGLang's: a 400
whose body carries ``object: "error"``, ``message``, ``type`` (``BadRequestError``), ``param`` and ``code`` at the
top level (the shape SGLang's scoring clients read), plus the same fields under ``error`` (OpenAI's shape, as
every other route of this server). An out-of-vocabulary label says ``Token ID <id> is out of vocabulary (vocab
size: <V>)`` as SGLang does.

The prompts run as one batch through the TokenizerManager with ``max_new_tokens=1`` (greedy) and
``token_ids_logprob=label_token_ids``; the labels' logprobs of the first output position are the scores.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Union

import pydantic
import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

from sglang.srt.entrypoints.openai.protocol import error_body
from sglang.srt.entrypoints.parity_routes import _json
from sglang.srt.managers.generate_req import GenerateReqInput
from sglang.srt.managers.tokenizer_manager import RequestError


class ScoringRequest(BaseModel):
    """The ``POST /v1/score`` body (SGLang's field names; unknown fields are ignored)."""

    model_config = ConfigDict(extra="ignore")
    model: Optional[str] = None
    query: Optional[Union[str, list[int]]] = None
    items: Optional[Union[str, list[str], list[list[int]]]] = None
    label_token_ids: Optional[list[int]] = None
    apply_softmax: bool = False
    item_first: bool = False


def score_prompts(req: ScoringRequest, vocab_size: int) -> tuple[Optional[list[str]], Optional[list[list[int]]]]:
    """The prompts to score, ``(texts, None)`` or ``(None, id lists)``, one per item.

    Raises:
        ValueError: SGLang's messages for a missing ``label_token_ids`` / ``items``, a label outside
            ``[0, vocab_size)``, or a query/items type mix; ids of a token-id prompt outside the vocabulary.
    """
    if req.label_token_ids is None:
        raise ValueError("label_token_ids must be provided")
    if req.items is None:
        raise ValueError("items must be provided")
    for t in req.label_token_ids:
        if t >= vocab_size:
            raise ValueError(f"Token ID {t} is out of vocabulary (vocab size: {vocab_size})")
        if t < 0:
            raise ValueError(f"label_token_ids must be token ids in [0, {vocab_size}), got {t}")
    items = [req.items] if isinstance(req.items, str) else req.items
    if isinstance(req.query, str) and all(isinstance(x, str) for x in items):
        return [f"{x}{req.query}" if req.item_first else f"{req.query}{x}" for x in items], None
    if isinstance(req.query, list) and items and all(isinstance(x, list) for x in items):
        for i, ids in enumerate([req.query, *items]):
            for t in ids:
                if not 0 <= t < vocab_size:
                    where = "query" if i == 0 else f"items[{i - 1}]"
                    raise ValueError(f"{where}: token ids must lie in [0, {vocab_size}), got {t}")
        return None, [x + req.query if req.item_first else req.query + x for x in items]
    raise ValueError("Invalid combination of query/items types for score_request.")


def label_scores(entries: Optional[list], label_ids: list[int], apply_softmax: bool) -> list[float]:
    """One item's scores from its first output position's ``token_ids_logprob`` entries.

    Args:
        entries: ``[logprob or None, token_id, text]`` per requested id (None logprob: masked, probability 0).
        label_ids: the labels, in the order the scores are returned.
        apply_softmax: softmax over the labels' logprobs instead of ``exp(logprob)``.
    Raises:
        RuntimeError: the server returned no logprobs for the position (an internal fault, never silent).
    """
    if not entries:
        raise RuntimeError("the scoring request returned no label logprobs")
    by_id = {int(e[1]): (float("-inf") if e[0] is None else float(e[0])) for e in entries}
    lps = [by_id.get(t, float("-inf")) for t in label_ids]
    if apply_softmax:
        return torch.softmax(torch.tensor(lps, dtype=torch.float64), dim=0).tolist()
    return [math.exp(v) if v != float("-inf") else 0.0 for v in lps]


async def score_request(tm, req: ScoringRequest, raw_request=None) -> dict[str, Any]:
    """Score ``req`` on the TokenizerManager ``tm``; returns the response body (see the module docstring).

    Raises:
        ValueError / RequestError: bad input or a failed request.
    """
    texts, ids = score_prompts(req, tm.vocab_size)
    model = req.model or tm.server_args.model_name
    if not (texts or ids):
        return {"scores": [], "model": model, "object": "scoring",
                "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}}
    obj = GenerateReqInput(text=texts, input_ids=ids, return_logprob=True, logprob_start_len=-1,
                           token_ids_logprob=list(req.label_token_ids),
                           sampling_params={"max_new_tokens": 1, "temperature": 0.0})
    agen = tm.generate_request(obj, raw_request)
    try:
        finals = await agen.__anext__()
    finally:
        await agen.aclose()
    scores = [label_scores(o["meta_info"].get("output_token_ids_logprobs", [None])[0], req.label_token_ids,
                           req.apply_softmax) for o in finals]
    prompt = sum(o["meta_info"]["prompt_tokens"] for o in finals)
    return {"scores": scores, "model": model, "object": "scoring",
            "usage": {"prompt_tokens": prompt, "completion_tokens": 0, "total_tokens": prompt}}


def score_error(message: str, status: int = 400) -> JSONResponse:
    """SGLang's scoring error (flat ``object/message/type/param/code``) plus OpenAI's nested ``error``."""
    body = error_body(message, status)
    return JSONResponse({"object": "error", **body["error"], **body}, status_code=status)


def register_score_route(app: FastAPI, tm, format_error) -> None:
    """Add ``POST /v1/score`` to ``app``.

    Args:
        app: the FastAPI app. tm: the TokenizerManager.
        format_error: turns a ``pydantic.ValidationError`` into a one-line message naming the field.
    """

    @app.post("/v1/score")
    async def v1_score(request: Request):
        """``POST /v1/score`` (SGLang): label-token probabilities after each query/item prompt."""
        try:
            req = ScoringRequest.model_validate(await _json(request))
            return await score_request(tm, req, request)
        except pydantic.ValidationError as e:
            return score_error(format_error(e))
        except RequestError as e:
            return score_error(e.message, e.status_code)
        except ValueError as e:
            return score_error(str(e))
