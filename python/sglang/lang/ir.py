"""The expressions of an SGLang program and its sampling parameters.

A program (a Python function decorated with ``@sgl.function``) builds its output by appending
expressions to its state ``s``: constant text, :class:`SglGen` (generate text), :class:`SglSelect`
(pick one of several strings by likelihood), role markers (:class:`SglRoleBegin` /
:class:`SglRoleEnd`) and lists of those. The interpreter
(:class:`~sglang.lang.interpreter.StreamExecutor`) executes them in order against a backend.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence, Union

logger = logging.getLogger(__name__)

ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class SglSamplingParams:
    """Sampling parameters of one ``gen`` (SGLang's frontend defaults).

    Attributes mirror ``/generate``'s ``sampling_params`` (see
    :class:`sglang.srt.sampling.sampling_params.SamplingParams`): ``max_new_tokens`` and
    ``min_new_tokens`` (tokens),
    ``stop`` (strings), ``stop_token_ids``, ``temperature`` (0 = greedy), ``top_p``, ``top_k``
    (-1 = off), ``min_p``, ``frequency_penalty``, ``presence_penalty``, ``ignore_eos``, ``regex``
    and ``json_schema`` (a JSON string) for constrained decoding. The logprob fields
    (``return_logprob``, ``logprob_start_len``, ``top_logprobs_num``, ``return_text_in_logprobs``)
    are request-level fields of ``/generate``.
    """

    max_new_tokens: Optional[int] = 128
    min_new_tokens: int = 0
    stop: Union[str, tuple[str, ...]] = ()
    stop_token_ids: tuple[int, ...] = ()
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    ignore_eos: bool = False
    return_logprob: Optional[bool] = None
    logprob_start_len: Optional[int] = None
    top_logprobs_num: Optional[int] = None
    return_text_in_logprobs: Optional[bool] = None
    regex: Optional[str] = None
    json_schema: Optional[str] = None

    def merged(self, overrides: dict[str, Any]) -> "SglSamplingParams":
        """A copy with the (non-None) ``overrides`` applied, e.g. a ``gen``'s own arguments."""
        return dataclasses.replace(self, **{k: v for k, v in overrides.items() if v is not None})

    def stop_list(self) -> list[str]:
        """``stop`` as a list (a single string becomes a one-element list)."""
        if isinstance(self.stop, str):
            return [self.stop] if self.stop else []
        return list(self.stop)

    def to_srt_kwargs(self) -> dict[str, Any]:
        """The ``sampling_params`` dict of a ``/generate`` request."""
        out: dict[str, Any] = {
            "max_new_tokens": self.max_new_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "frequency_penalty": self.frequency_penalty,
            "presence_penalty": self.presence_penalty,
            "ignore_eos": self.ignore_eos,
        }
        if self.min_new_tokens:
            out["min_new_tokens"] = self.min_new_tokens
        if self.stop_list():
            out["stop"] = self.stop_list()
        if self.stop_token_ids:
            out["stop_token_ids"] = list(self.stop_token_ids)
        if self.regex is not None:
            out["regex"] = self.regex
        if self.json_schema is not None:
            out["json_schema"] = self.json_schema
        return out

    def to_logprob_kwargs(self) -> dict[str, Any]:
        """The request-level logprob fields of a ``/generate`` request (empty unless asked for)."""
        if not self.return_logprob:
            return {}
        out: dict[str, Any] = {"return_logprob": True}
        if self.logprob_start_len is not None:
            out["logprob_start_len"] = self.logprob_start_len
        if self.top_logprobs_num is not None:
            out["top_logprobs_num"] = self.top_logprobs_num
        if self.return_text_in_logprobs is not None:
            out["return_text_in_logprobs"] = self.return_text_in_logprobs
        return out


def _check_name(name: Any, what: str) -> Optional[str]:
    if name is not None and (not isinstance(name, str) or not name):
        raise ValueError(f"{what} name must be a non-empty string or None, got {name!r}")
    return name


def normalize_json_schema(schema: Any) -> Optional[str]:
    """A JSON schema as the JSON string the server expects (dicts and pydantic models are serialized).

    Raises:
        ValueError: ``schema`` is neither a dict, a pydantic model nor a string holding valid JSON.
    """
    if schema is None:
        return None
    if hasattr(schema, "model_json_schema"):  # a pydantic model class
        schema = schema.model_json_schema()
    if isinstance(schema, dict):
        return json.dumps(schema)
    if isinstance(schema, str):
        try:
            json.loads(schema)
        except json.JSONDecodeError as e:
            raise ValueError(f"json_schema is not valid JSON ({e}); pass a dict or a JSON string") from None
        return schema
    raise ValueError(f"json_schema must be a dict or a JSON string, got {type(schema).__name__}")


class SglExpr:
    """Base class of everything that can be appended to a program state."""

    def __add__(self, other: Any) -> "SglExprList":
        return SglExprList([self, to_expr(other)])

    def __radd__(self, other: Any) -> "SglExprList":
        return SglExprList([to_expr(other), self])


@dataclass(eq=False)
class SglConstantText(SglExpr):
    """Literal text appended as is."""

    value: str


@dataclass(eq=False)
class SglGen(SglExpr):
    """Generate text; stored in the state under ``name`` (if given) with its meta info.

    ``overrides`` holds the sampling fields the ``gen`` call set (the rest come from the
    ``run`` defaults).
    """

    name: Optional[str]
    overrides: dict[str, Any] = field(default_factory=dict)


@dataclass(eq=False)
class SglSelect(SglExpr):
    """Append the most likely of ``choices`` (scored by the backend, decided by ``choices_method``)."""

    name: Optional[str]
    choices: list[str]
    temperature: float
    choices_method: Any


@dataclass(eq=False)
class SglRoleBegin(SglExpr):
    """Opens a chat turn of ``role`` (rendered through the chat template)."""
    role: str


@dataclass(eq=False)
class SglRoleEnd(SglExpr):
    """Closes the chat turn of ``role``."""
    role: str


@dataclass(eq=False)
class SglVarScopeBegin(SglExpr):
    """Starts capturing the text appended from here into the variable ``name``."""
    name: str


@dataclass(eq=False)
class SglVarScopeEnd(SglExpr):
    """Ends the capture into the variable ``name``."""
    name: str


@dataclass(eq=False)
class SglExprList(SglExpr):
    """A sequence of expressions executed in order."""
    exprs: list[SglExpr]


def to_expr(value: Any) -> SglExpr:
    """Turn a string (or an expression) into an expression.

    Raises:
        TypeError: ``value`` is neither a string nor an :class:`SglExpr`.
    """
    if isinstance(value, SglExpr):
        return value
    if isinstance(value, str):
        return SglConstantText(value)
    raise TypeError(f"only strings and sgl expressions (gen, select, roles) can be added to a program "
                    f"state, got {type(value).__name__}; convert it with str() first")


def flatten(expr: SglExpr) -> list[SglExpr]:
    """The leaf expressions of ``expr`` in execution order."""
    if isinstance(expr, SglExprList):
        out: list[SglExpr] = []
        for e in expr.exprs:
            out.extend(flatten(e))
        return out
    return [expr]


def check_role(role: str) -> str:
    """Raises ValueError unless ``role`` is one of system/user/assistant."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    return role


class SglFunction:
    """A program: a Python function whose first parameter is the program state ``s``.

    Args:
        func: ``func(s, *args, **kwargs)``; it appends expressions to ``s``.
        num_api_spec_tokens: accepted for SGLang compatibility; API speculative execution is not
            implemented (a value other than None logs a warning).
        bind_arguments: keyword arguments bound with :meth:`bind`.

    Raises:
        TypeError: ``func`` is not callable or takes no parameter for the state.
    """

    def __init__(self, func: Callable, num_api_spec_tokens: Optional[int] = None,
                 bind_arguments: Optional[dict[str, Any]] = None) -> None:
        if not callable(func):
            raise TypeError(f"sgl.function needs a callable, got {type(func).__name__}")
        params = list(inspect.signature(func).parameters.values())
        if not params:
            raise TypeError(f"{func.__name__} must take the program state as its first parameter, e.g. def "
                            f"{func.__name__}(s, ...)")
        if num_api_spec_tokens is not None:
            logger.warning("num_api_spec_tokens=%s is ignored: API speculative execution is not implemented",
                           num_api_spec_tokens)
        self.func = func
        self.num_api_spec_tokens = num_api_spec_tokens
        self.bind_arguments = dict(bind_arguments or {})
        self.__name__ = getattr(func, "__name__", "sgl_function")
        self.__doc__ = func.__doc__

    def bind(self, **kwargs: Any) -> "SglFunction":
        """A copy of the program with some keyword arguments fixed."""
        return SglFunction(self.func, self.num_api_spec_tokens, {**self.bind_arguments, **kwargs})

    def check_arguments(self, args: Sequence[Any], kwargs: dict[str, Any]) -> None:
        """Raises TypeError (naming the problem) when the arguments do not fit the program's signature."""
        try:
            inspect.signature(self.func).bind(None, *args, **kwargs)
        except TypeError as e:
            raise TypeError(f"bad arguments for program {self.__name__}: {e}") from None

    def run(self, *args: Any, max_new_tokens: int = 128, stop: Union[str, Sequence[str], None] = None,
            stop_token_ids: Optional[Sequence[int]] = None, temperature: float = 1.0, top_p: float = 1.0,
            top_k: int = -1, min_p: float = 0.0, frequency_penalty: float = 0.0,
            presence_penalty: float = 0.0, ignore_eos: bool = False, return_logprob: bool = False,
            logprob_start_len: Optional[int] = None, top_logprobs_num: Optional[int] = None,
            return_text_in_logprobs: Optional[bool] = None, stream: bool = False, backend: Any = None,
            use_thread: bool = True, **kwargs: Any):
        """Run the program once and return its :class:`~sglang.lang.interpreter.ProgramState`.

        The sampling arguments are defaults for every ``gen`` of the program (a ``gen``'s own
        arguments win). ``backend`` defaults to the one set with ``sgl.set_default_backend``
        (a :class:`~sglang.lang.runtime.Runtime` is accepted and uses its endpoint).
        With ``stream=True`` the program runs in a background thread and the state is returned at
        once (iterate ``state.text_iter()``); otherwise this blocks until the program ends.

        Raises:
            ValueError: no backend, or bad sampling arguments.
            TypeError: the program arguments do not fit the function's signature.
            Exception: whatever the program or the backend raised (non-streaming runs).
        """
        from sglang.lang.run import run_program

        defaults = make_default_params(
            max_new_tokens=max_new_tokens, stop=stop, stop_token_ids=stop_token_ids, temperature=temperature,
            top_p=top_p, top_k=top_k, min_p=min_p, frequency_penalty=frequency_penalty,
            presence_penalty=presence_penalty, ignore_eos=ignore_eos, return_logprob=return_logprob,
            logprob_start_len=logprob_start_len, top_logprobs_num=top_logprobs_num,
            return_text_in_logprobs=return_text_in_logprobs)
        return run_program(self, backend, args, {**self.bind_arguments, **kwargs}, defaults, stream=stream,
                           use_thread=use_thread)

    def run_batch(self, batch_kwargs: Sequence[dict[str, Any]], *, max_new_tokens: int = 128,
                  stop: Union[str, Sequence[str], None] = None, stop_token_ids: Optional[Sequence[int]] = None,
                  temperature: float = 1.0, top_p: float = 1.0, top_k: int = -1, min_p: float = 0.0,
                  frequency_penalty: float = 0.0, presence_penalty: float = 0.0, ignore_eos: bool = False,
                  return_logprob: bool = False, logprob_start_len: Optional[int] = None,
                  top_logprobs_num: Optional[int] = None, return_text_in_logprobs: Optional[bool] = None,
                  backend: Any = None, num_threads: Union[str, int] = "auto", progress_bar: bool = False,
                  generator_style: bool = False):
        """Run the program once per entry of ``batch_kwargs`` (a list of keyword-argument dicts).

        Programs run concurrently on ``num_threads`` threads (``"auto"``: ``max(96, 16 * CPUs)``,
        capped at the batch size; 1 runs them one after another), the server batches their
        requests. Returns the states in input order (``generator_style=True``: an iterator yielding
        them in that order as they complete); a program that failed has ``state.error()`` set (and
        is logged) instead of raising, so the others' results survive.

        Raises:
            ValueError: ``batch_kwargs`` is not a list of dicts, ``num_threads`` is invalid, no backend.
        """
        from sglang.lang.run import run_program_batch

        defaults = make_default_params(
            max_new_tokens=max_new_tokens, stop=stop, stop_token_ids=stop_token_ids, temperature=temperature,
            top_p=top_p, top_k=top_k, min_p=min_p, frequency_penalty=frequency_penalty,
            presence_penalty=presence_penalty, ignore_eos=ignore_eos, return_logprob=return_logprob,
            logprob_start_len=logprob_start_len, top_logprobs_num=top_logprobs_num,
            return_text_in_logprobs=return_text_in_logprobs)
        return run_program_batch(self, backend, batch_kwargs, defaults, num_threads=num_threads,
                                 progress_bar=progress_bar, generator_style=generator_style)

    def __call__(self, *args: Any, **kwargs: Any):
        """Call the program inside another program: ``fn(s, ...)`` appends to the caller's state ``s``.

        Raises:
            TypeError: the first argument is not a program state (use :meth:`run` to start a program).
        """
        from sglang.lang.state import ProgramState

        if not args or not isinstance(args[0], ProgramState):
            raise TypeError(f"{self.__name__}(...) can only be called inside another program with its state "
                            f"as the first argument; use {self.__name__}.run(...) to run it")
        return self.func(*args, **{**self.bind_arguments, **kwargs})

    def __repr__(self) -> str:
        return f"SglFunction({self.__name__})"


def make_default_params(**kw: Any) -> SglSamplingParams:
    """Build the ``run`` defaults, normalizing ``stop`` / ``stop_token_ids`` to tuples.

    Raises:
        ValueError: ``max_new_tokens`` is negative or ``stop`` is not a string or list of strings.
    """
    stop = kw.pop("stop")
    if stop is None:
        stop = ()
    elif isinstance(stop, str):
        stop = (stop,)
    elif isinstance(stop, (list, tuple)) and all(isinstance(x, str) for x in stop):
        stop = tuple(stop)
    else:
        raise ValueError(f"stop must be a string or a list of strings, got {stop!r}")
    ids = kw.pop("stop_token_ids")
    mnt = kw.get("max_new_tokens")
    if mnt is not None and (not isinstance(mnt, int) or isinstance(mnt, bool) or mnt < 0):
        raise ValueError(f"max_new_tokens must be an integer >= 0, got {mnt!r}")
    return SglSamplingParams(stop=stop, stop_token_ids=tuple(ids or ()), **kw)
