"""Decide whether a request is finished after each new token (pure function, used by the scheduler).

Finish reasons are SGLang's dicts (see :mod:`sglang.srt.managers.io_struct`):
``{"type": "length", "length": n}`` and ``{"type": "stop", "matched": <token id | stop string | stop_regex
pattern>}``.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

from sglang.srt.sampling.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

REPLACEMENT_CHAR = "\ufffd"
STOP_REGEX_TIMEOUT_S = 0.1
"""Longest one ``stop_regex`` search may take per step before the request is aborted (400)."""


def stop_str_window(params: SamplingParams) -> int:
    """How many trailing tokens to decode when looking for stop strings.

    A stop string may be split over more tokens in generated text than when tokenized alone (e.g. a
    model may spell "hello" one byte token at a time), so the window covers both the standalone token
    count (``stop_str_max_len``, SGLang's bound) and the UTF-8 byte length (every non-special token
    carries at least one byte), plus one token of left context (leading-space handling). When the
    window starts inside a multi-byte character it is widened by up to 3 tokens (see ``_match_stop_str``).
    """
    stops = params.stop_strs or []
    max_bytes = max((len(s.encode("utf-8")) for s in stops), default=0)
    return max(params.stop_str_max_len, max_bytes) + 1


def _count_overlapping(text: str, sub: str) -> int:
    n, start = 0, text.find(sub)
    while start >= 0:
        n += 1
        start = text.find(sub, start + 1)
    return n


def _match_stop_str(output_ids: list[int], params: SamplingParams, tokenizer: Any) -> Optional[str]:
    """The first stop string completed by the last token, or None."""
    decode_kw = dict(
        skip_special_tokens=params.skip_special_tokens,
        spaces_between_special_tokens=params.spaces_between_special_tokens,
    )
    start = max(0, len(output_ids) - stop_str_window(params))
    tail = tokenizer.decode(output_ids[start:], **decode_kw)
    # A window starting inside a multi-byte character decodes to U+FFFD, and byte-fallback decoders
    # then garble the adjacent byte tokens too: move the start back to the character's first byte.
    extra = 0
    while tail.startswith(REPLACEMENT_CHAR) and start > 0 and extra < 3:
        start, extra = start - 1, extra + 1
        tail = tokenizer.decode(output_ids[start:], **decode_kw)
    window = output_ids[start:]
    hits = [s for s in params.stop_strs if s in tail]
    if not hits:
        return None
    # Only an occurrence the newest token completed counts: an older one was seen (and ignored,
    # because of min_new_tokens) in an earlier step.
    prev = tokenizer.decode(window[:-1], **decode_kw) if len(window) > 1 else ""
    for s in hits:
        if _count_overlapping(tail, s) > _count_overlapping(prev, s):
            return s
    return None


def _match_stop_regex(output_ids: list[int], params: SamplingParams, tokenizer: Any) -> Optional[dict[str, Any]]:
    """The finish reason of the first ``stop_regex`` pattern that matches the decoded output, or None.

    Like SGLang, the tail searched covers the longest possible match (``stop_regex_max_len`` characters,
    each at most 4 byte tokens, plus context); an unbounded pattern (``\\d+``) searches the whole output.
    A match that existed before the newest token would have ended the request at that token, so any
    match now is the one the newest token completed (or, under ``min_new_tokens``, one found as soon as
    matching is allowed). Each search may take at most :data:`STOP_REGEX_TIMEOUT_S` (a pathological
    pattern must not stall the scheduler): past that the request is aborted with a 400 naming the pattern.
    """
    import regex

    from sglang.srt.sampling.sampling_params import STOP_REGEX_UNBOUNDED

    width = getattr(params, "stop_regex_max_len", STOP_REGEX_UNBOUNDED) or STOP_REGEX_UNBOUNDED
    start = 0 if width >= STOP_REGEX_UNBOUNDED else max(0, len(output_ids) - (4 * width + 2))
    tail = tokenizer.decode(output_ids[start:], skip_special_tokens=params.skip_special_tokens,
                            spaces_between_special_tokens=params.spaces_between_special_tokens)
    for pattern in params.stop_regex_strs:
        try:
            hit = regex.search(pattern, tail, timeout=STOP_REGEX_TIMEOUT_S)
        except TimeoutError:
            logger.warning("stop_regex %r exceeded %.2f s; aborting the request", pattern, STOP_REGEX_TIMEOUT_S)
            return {"type": "abort", "status_code": 400,
                    "message": f"stop_regex {pattern!r} took longer than {STOP_REGEX_TIMEOUT_S} s to match; "
                               "simplify the pattern"}
        if hit:
            return {"type": "stop", "matched": pattern}
    return None


def check_finish(
    output_ids: list[int],
    params: SamplingParams,
    eos_token_ids: set[int],
    tokenizer: Any,
    max_new_tokens_cap: Optional[int] = None,
) -> Optional[dict[str, Any]]:
    """Finish reason of a request right after its newest token, or None if it continues.

    Checked in SGLang's order: length first; then the newest token against ``stop_token_ids`` and EOS
    (unless ``ignore_eos``), only once more than ``min_new_tokens`` tokens exist (the stop token itself
    is not content); then stop strings, only once ``min_new_tokens`` tokens exist, in the decoded tail (only the last :func:`stop_str_window` tokens are decoded, so the cost per
    step does not grow with the output).

    Args:
        output_ids: all tokens generated so far (the newest last).
        params: the request's normalized :class:`SamplingParams` (``stop_strs`` set by ``normalize``).
        eos_token_ids: the model's EOS ids.
        tokenizer: HF tokenizer used to decode the tail for stop strings; None disables stop strings.
        max_new_tokens_cap: most tokens the context still allows (context length - prompt length);
            None = no cap.
    Returns:
        ``{"type": "length", "length": limit}``, ``{"type": "stop", "matched": token_id}``,
        ``{"type": "stop", "matched": stop_str}`` or None.
    """
    limit = params.max_new_tokens
    if max_new_tokens_cap is not None:
        limit = max_new_tokens_cap if limit is None else min(limit, max_new_tokens_cap)
    n = len(output_ids)
    if limit is not None and n >= limit:
        return {"type": "length", "length": limit}
    if n == 0 or n < params.min_new_tokens:
        return None
    last = output_ids[-1]
    # A stop token is not content: it ends the request only after min_new_tokens real tokens
    # (matching the min_new_tokens logit mask, which bans it as token 1..min_new_tokens).
    if n > params.min_new_tokens:
        if params.stop_token_ids and last in params.stop_token_ids:
            return {"type": "stop", "matched": last}
        if not params.ignore_eos and last in eos_token_ids:
            return {"type": "stop", "matched": last}
    if params.stop_strs and tokenizer is not None:
        matched = _match_stop_str(output_ids, params, tokenizer)
        if matched is not None:
            return {"type": "stop", "matched": matched}
    if getattr(params, "stop_regex_strs", None) and tokenizer is not None:
        reason = _match_stop_regex(output_ids, params, tokenizer)
        if reason is not None:
            return reason
    return None
