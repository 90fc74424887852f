"""The public frontend API, re-exported as ``sglang.*`` (``import sglang as sgl``).

Example::

    import sglang as sgl

    @sgl.function
    def qa(s, question):
        s += sgl.user(question)
        s += sgl.assistant(sgl.gen("answer", max_tokens=64))

    sgl.set_default_backend(sgl.RuntimeEndpoint("http://127.0.0.1:30000"))
    state = qa.run(question="What is 1+1?", temperature=0)
    print(state["answer"])
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional, Sequence, Union

from sglang.lang.choices import ChoicesSamplingMethod, token_length_normalized
from sglang.lang.ir import (
    SglExpr,
    SglExprList,
    SglFunction,
    SglGen,
    SglRoleBegin,
    SglRoleEnd,
    SglSelect,
    _check_name,
    normalize_json_schema,
    to_expr,
)
from sglang.lang.run import get_default_backend, resolve_backend, set_default_backend

logger = logging.getLogger(__name__)

__all__ = [
    "function", "gen", "select", "system", "user", "assistant", "system_begin", "system_end", "user_begin",
    "user_end", "assistant_begin", "assistant_end", "set_default_backend", "get_default_backend",
    "flush_cache", "get_server_info",
]


def function(func: Optional[Callable] = None, *, num_api_spec_tokens: Optional[int] = None):
    """Decorator turning ``func(s, ...)`` into a program: ``@sgl.function`` or ``@sgl.function(...)``.

    Returns:
        an :class:`~sglang.lang.ir.SglFunction` with ``.run(...)`` and ``.run_batch(...)``.
    """
    if func is None:
        return lambda f: SglFunction(f, num_api_spec_tokens=num_api_spec_tokens)
    return SglFunction(func, num_api_spec_tokens=num_api_spec_tokens)


def _check_number(name: str, value: Any, lo: Optional[float] = None) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if lo is not None and value < lo:
        raise ValueError(f"{name} must be >= {lo}, got {value}")


# Output-type constraints of ``gen(dtype=...)`` (SGLang frontend semantics): the text stays a string.
DTYPE_REGEX = {
    int: r"[-+]?[0-9]+",
    float: r"[-+]?[0-9]+(\.[0-9]+)?([eE][-+]?[0-9]+)?",
    bool: r"(True|False)",
    str: r"\"[^\"\n]*\"",
}


def gen(name: Optional[str] = None, max_tokens: Optional[int] = None, min_tokens: Optional[int] = None,
        stop: Union[str, Sequence[str], None] = None,
        stop_token_ids: Optional[Sequence[int]] = None, temperature: Optional[float] = None,
        top_p: Optional[float] = None, top_k: Optional[int] = None, min_p: Optional[float] = None,
        frequency_penalty: Optional[float] = None, presence_penalty: Optional[float] = None,
        ignore_eos: Optional[bool] = None, return_logprob: Optional[bool] = None,
        logprob_start_len: Optional[int] = None, top_logprobs_num: Optional[int] = None,
        return_text_in_logprobs: Optional[bool] = None, regex: Optional[str] = None, json_schema: Any = None,
        choices: Optional[Sequence[str]] = None,
        choices_method: Optional[ChoicesSamplingMethod] = None, dtype: Optional[type] = None) -> SglExpr:
    """Generate text at this point of the program; stored as variable ``name`` if given.

    Arguments left None take the ``run`` defaults. ``max_tokens`` is in tokens; ``stop`` strings end
    generation (not included in the text); ``regex`` / ``json_schema`` (a dict, pydantic model or JSON
    string) constrain the output (server-side constrained decoding). With ``choices`` this is
    :func:`select` (``temperature`` defaults to 0 there). ``min_tokens`` is the server's
    ``min_new_tokens`` (EOS and stop tokens are masked until then). ``dtype`` (``int``, ``float``,
    ``bool`` or ``str``) constrains the output to a literal of that type through a regex (``str``: a
    double-quoted string); the stored value stays text, as in SGLang.

    Raises:
        ValueError: bad values (negative ``max_tokens``, both ``regex`` and ``json_schema``, empty
            ``choices``, a non-string ``stop``, invalid JSON schema), naming the argument.
    """
    _check_name(name, "gen")
    if choices is not None:
        return select(name, choices, temperature=0.0 if temperature is None else temperature,
                      choices_method=choices_method or token_length_normalized)
    if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 0):
        raise ValueError(f"max_tokens must be an integer >= 0, got {max_tokens!r}")
    if min_tokens is not None and (not isinstance(min_tokens, int) or isinstance(min_tokens, bool) or min_tokens < 0):
        raise ValueError(f"min_tokens must be an integer >= 0, got {min_tokens!r}")
    if dtype is not None:
        if dtype not in DTYPE_REGEX:
            raise ValueError(f"dtype must be one of int, float, bool, str, got {dtype!r}")
        if regex is not None or json_schema is not None:
            raise ValueError("pass at most one of dtype, regex and json_schema")
        regex = DTYPE_REGEX[dtype]
    if regex is not None and json_schema is not None:
        raise ValueError("pass at most one of regex and json_schema")
    if regex is not None and not isinstance(regex, str):
        raise ValueError(f"regex must be a string, got {type(regex).__name__}")
    _check_number("temperature", temperature, 0.0)
    _check_number("top_p", top_p, 0.0)
    _check_number("min_p", min_p, 0.0)
    if stop is not None:
        if isinstance(stop, str):
            stop = (stop,)
        elif isinstance(stop, (list, tuple)) and all(isinstance(x, str) for x in stop):
            stop = tuple(stop)
        else:
            raise ValueError(f"stop must be a string or a list of strings, got {stop!r}")
    overrides = {
        "max_new_tokens": max_tokens, "min_new_tokens": min_tokens, "stop": stop,
        "stop_token_ids": tuple(stop_token_ids) if stop_token_ids is not None else None,
        "temperature": temperature, "top_p": top_p, "top_k": top_k, "min_p": min_p,
        "frequency_penalty": frequency_penalty, "presence_penalty": presence_penalty, "ignore_eos": ignore_eos,
        "return_logprob": return_logprob, "logprob_start_len": logprob_start_len,
        "top_logprobs_num": top_logprobs_num, "return_text_in_logprobs": return_text_in_logprobs,
        "regex": regex, "json_schema": normalize_json_schema(json_schema),
    }
    return SglGen(name, {k: v for k, v in overrides.items() if v is not None})



def gen_int(name: Optional[str] = None, max_tokens: Optional[int] = None, **kwargs: Any) -> SglExpr:
    """:func:`gen` constrained to an integer literal (``dtype=int``); other arguments as :func:`gen`."""
    return gen(name, max_tokens=max_tokens, dtype=int, **kwargs)


def gen_string(name: Optional[str] = None, max_tokens: Optional[int] = None, **kwargs: Any) -> SglExpr:
    """:func:`gen` constrained to a double-quoted string literal (``dtype=str``); other arguments as :func:`gen`."""
    return gen(name, max_tokens=max_tokens, dtype=str, **kwargs)


def select(name: Optional[str] = None, choices: Optional[Sequence[str]] = None, temperature: float = 0.0,
           choices_method: ChoicesSamplingMethod = token_length_normalized) -> SglExpr:
    """Append the most likely of ``choices`` (stored as variable ``name``; scores in its meta info).

    ``choices_method``: :data:`~sglang.lang.choices.token_length_normalized` (default),
    :data:`~sglang.lang.choices.greedy_token_selection` or
    :data:`~sglang.lang.choices.unconditional_likelihood_normalized`.

    Raises:
        ValueError: ``choices`` is missing, empty or holds non-strings.
    """
    _check_name(name, "select")
    if not isinstance(choices, (list, tuple)) or not choices or not all(isinstance(c, str) for c in choices):
        raise ValueError(f"choices must be a non-empty list of strings, got {choices!r}")
    _check_number("temperature", temperature, 0.0)
    if not callable(choices_method):
        raise ValueError(f"choices_method must be a method such as sgl.token_length_normalized, got "
                         f"{choices_method!r}")
    return SglSelect(name, list(choices), float(temperature), choices_method)


def _role(role: str, expr: Any) -> SglExpr:
    if expr is None:
        return SglExprList([SglRoleBegin(role), SglRoleEnd(role)])
    return SglExprList([SglRoleBegin(role), to_expr(expr), SglRoleEnd(role)])


def system(expr: Any = None) -> SglExpr:
    """A system turn holding ``expr`` (text or expressions)."""
    return _role("system", expr)


def user(expr: Any = None) -> SglExpr:
    """A user turn holding ``expr``."""
    return _role("user", expr)


def assistant(expr: Any = None) -> SglExpr:
    """An assistant turn holding ``expr`` (typically ``sgl.gen(...)``)."""
    return _role("assistant", expr)


def system_begin() -> SglExpr:
    """Opens a system turn (close it with :func:`system_end`)."""
    return SglRoleBegin("system")


def system_end() -> SglExpr:
    """Closes a system turn opened by :func:`system_begin`."""
    return SglRoleEnd("system")


def user_begin() -> SglExpr:
    """Opens a user turn (close it with :func:`user_end`)."""
    return SglRoleBegin("user")


def user_end() -> SglExpr:
    """Closes a user turn opened by :func:`user_begin`."""
    return SglRoleEnd("user")


def assistant_begin() -> SglExpr:
    """Opens an assistant turn (close it with :func:`assistant_end`)."""
    return SglRoleBegin("assistant")


def assistant_end() -> SglExpr:
    """Closes an assistant turn opened by :func:`assistant_begin`."""
    return SglRoleEnd("assistant")


def flush_cache(backend: Any = None) -> Any:
    """Flush the prefix cache of ``backend`` (default backend if None)."""
    return resolve_backend(backend).flush_cache()


def get_server_info(backend: Any = None) -> dict[str, Any]:
    """Server information of ``backend`` (default backend if None)."""
    return resolve_backend(backend).get_server_info()
