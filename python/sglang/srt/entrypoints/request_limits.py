"""Request limits of the HTTP server: body size, JSON shape, ``n``, token ids (all checked before any work).

Every check raises ``ValueError`` naming the field (the HTTP layer answers 400) or :class:`BodyTooLarge`
(413). The limits are server options (``--max-request-body-mb``, ``--max-n``); see
``docs/limits_and_failures.md``.

* :class:`BodySizeLimitMiddleware`: a pure ASGI middleware that answers 413 when ``Content-Length`` exceeds the
  limit, and stops reading a chunked body as soon as it passes the limit (the rest is never buffered).
* :func:`parse_json_body`: ``json.loads`` plus one iterative walk over the parsed value that rejects nesting
  deeper than :data:`MAX_JSON_DEPTH` (deeper bodies made ``RecursionError`` 500s in the validators) and strings
  or keys holding a lone UTF-16 surrogate such as ``"\\ud800"`` (they cannot be encoded as UTF-8, so they made
  500s in the tokenizer or the inter-process encoder); the message names the field path (``rid[1]``).
* :func:`check_n`, :func:`check_token_ids`: the ``n`` bound and the token-id range, checked before anything
  is expanded or decoded.
* :func:`openai_field_names`: SGLang's sampling field names in an error message replaced by OpenAI's
  (``max_new_tokens`` -> ``max_tokens``) for the ``/v1`` routes.
"""

from __future__ import annotations

import json
import re
from typing import Any, Iterable

MAX_JSON_DEPTH = 100
"""Deepest nesting (objects/arrays) a request body may have."""

OFFLOAD_PARSE_BYTES = 1 << 20
"""Bodies at least this large are parsed on a worker thread (the event loop stays free)."""


class BodyTooLarge(Exception):
    """The request body exceeds the server's limit; answered with HTTP 413.

    Attributes:
        limit: the limit in bytes.
    """

    def __init__(self, limit: int) -> None:
        self.limit = int(limit)
        super().__init__(f"request body is larger than the server's limit of {self.limit} bytes "
                         f"({self.limit / (1 << 20):g} MiB, --max-request-body-mb); send a smaller request")


class BodySizeLimitMiddleware:
    """Pure ASGI middleware bounding every HTTP request body to ``max_bytes`` (413 beyond it).

    A declared ``Content-Length`` over the limit is refused before the body is read; an undeclared
    (chunked) body is counted while the app reads it and :class:`BodyTooLarge` is raised from
    ``receive()`` once it passes the limit (the app's exception handler turns it into the 413).

    Args:
        app: the ASGI app to wrap.
        max_bytes: the limit in bytes (> 0).
        error_response: ``callable(BodyTooLarge) -> ASGI response`` used for the declared-length case.
    """

    def __init__(self, app, max_bytes: int, error_response) -> None:
        self.app = app
        self.max_bytes = int(max_bytes)
        self.error_response = error_response

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.strip().isdigit() and int(declared) > self.max_bytes:
            await self.error_response(BodyTooLarge(self.max_bytes))(scope, receive, send)
            return
        seen = 0
        limit = self.max_bytes

        async def counting_receive():
            nonlocal seen
            message = await receive()
            if message.get("type") == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise BodyTooLarge(limit)
            return message

        await self.app(scope, counting_receive, send)


def _has_lone_surrogate(s: str) -> bool:
    if s.isascii():
        return False
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _path(parts: Iterable[Any]) -> str:
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or "request body"


def check_json_value(value: Any, max_depth: int = MAX_JSON_DEPTH) -> None:
    """Walk a parsed JSON value once (iteratively, so any depth is safe) and reject what would fail later.

    Raises:
        ValueError: nesting deeper than ``max_depth`` (names where), or a string / object key with a lone
            UTF-16 surrogate (names the field, e.g. ``text[1]``, ``messages[0].content``, ``rid``).
    """
    stack: list[tuple[Any, tuple, int]] = [(value, (), 0)]
    while stack:
        v, path, depth = stack.pop()
        if isinstance(v, str):
            if _has_lone_surrogate(v):
                raise ValueError(f"{_path(path)}: the string contains a lone UTF-16 surrogate (e.g. \\ud800), "
                                 "which is not valid Unicode; send valid UTF-8 text")
        elif isinstance(v, (dict, list)):
            if depth >= max_depth:
                raise ValueError(f"{_path(path)}: JSON nested deeper than {max_depth} levels; flatten the request")
            if isinstance(v, dict):
                for k, x in v.items():
                    if _has_lone_surrogate(k):
                        raise ValueError(f"{_path(path)}: an object key contains a lone UTF-16 surrogate; "
                                         "send valid UTF-8 text")
                    stack.append((x, path + (k,), depth + 1))
            else:
                stack.extend((x, path + (i,), depth + 1) for i, x in enumerate(v))


def parse_json_body(raw: bytes, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """Parse a request body and check it with :func:`check_json_value`.

    Args:
        raw: the body bytes (UTF-8 JSON).
        max_depth: deepest allowed nesting.

    Raises:
        ValueError: malformed JSON, nesting too deep (also when ``json`` itself recurses too deep), or a
            lone surrogate (the message names the field).
    """
    try:
        value = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"malformed JSON body: {e}") from None
    except RecursionError:
        raise ValueError(f"request body: JSON nested deeper than {max_depth} levels; flatten the request") from None
    check_json_value(value, max_depth)
    return value


def check_n(n: Any, max_n: int, field: str = "n") -> None:
    """Bound the number of samples per prompt before anything is expanded.

    Raises:
        ValueError: ``n`` above ``max_n`` (the message names ``n``, the limit and the flag).
    """
    if isinstance(n, (int, float)) and not isinstance(n, bool) and n > max_n:
        shown = f"{n:g}" if isinstance(n, float) else (str(n) if n < 10**12 else f"{float(n):g}")
        raise ValueError(f"{field} must be <= {max_n} (the server's --max-n), got {shown}; "
                         "send several requests for more samples")


def check_token_ids(ids: Any, vocab_size: int, field: str) -> None:
    """Check a token-id prompt (a list of ints, or a list of such lists) lies in ``[0, vocab_size)``.

    Raises:
        ValueError: naming ``field`` (and the index for a batch) and the offending id.
    """
    batch = isinstance(ids, list) and ids and isinstance(ids[0], list)
    for b, row in enumerate(ids if batch else [ids]):
        for t in row:
            if not (isinstance(t, int) and not isinstance(t, bool)) or not 0 <= t < vocab_size:
                where = f"{field}[{b}]" if batch else field
                shown = repr(t) if not isinstance(t, int) or abs(t) < 10**12 else f"{float(t):g}"
                raise ValueError(f"{where}: token ids must lie in [0, {vocab_size}) (the vocabulary size), "
                                 f"got {shown}")


_OPENAI_NAMES = (("max_new_tokens", "max_tokens"), ("min_new_tokens", "min_tokens"))
_OPENAI_RE = re.compile(r"\b(" + "|".join(a for a, _ in _OPENAI_NAMES) + r")\b")


def openai_field_names(message: str) -> str:
    """``message`` with SGLang's sampling field names replaced by the OpenAI request's names
    (``max_new_tokens`` -> ``max_tokens``, ``min_new_tokens`` -> ``min_tokens``)."""
    names = dict(_OPENAI_NAMES)
    return _OPENAI_RE.sub(lambda m: names[m.group(1)], message)
