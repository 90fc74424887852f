"""Execute a program's expressions: :class:`StreamExecutor` and the state a program sees.

Each :class:`StreamExecutor` owns one program state (text, chat messages, variables) and, with
``use_thread`` (the default), a worker thread that executes submitted expressions in order. The
program's Python code therefore runs ahead of generation and only blocks when it reads a result
(``s["name"]``, ``s.text()``); the forks of a state each get their own executor, so their
generations run concurrently and the server batches them.

Errors raised while executing (a backend failure, a bad parameter) stop that executor: later
expressions are skipped, readers of its variables are woken, and the error is re-raised by
:meth:`StreamExecutor.check_error` (``run`` calls it for non-streaming programs).
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Any, Iterator, Optional

from sglang.lang import ir
from sglang.lang.backend.base_backend import STREAMED_LOGPROB_KEYS
from sglang.lang.ir import (
    SglConstantText,
    SglExpr,
    SglGen,
    SglRoleBegin,
    SglRoleEnd,
    SglSamplingParams,
    SglSelect,
    SglVarScopeBegin,
    SglVarScopeEnd,
)

logger = logging.getLogger(__name__)


class StreamExecutor:
    """Runs the expressions of one program state against ``backend``.

    Args:
        backend: a :class:`~sglang.lang.backend.base_backend.BaseBackend`.
        arguments: the program's keyword arguments (kept for reference).
        default_sampling_params: defaults for every ``gen`` (its own arguments win).
        stream: generate with the backend's streaming API (text arrives in chunks for ``text_iter``).
        use_thread: execute in a worker thread (False: each submit executes at once).

    Attributes (read them after :meth:`sync`): ``text_`` (str), ``messages_`` (list of
    ``{"role", "content"}``), ``variables`` (name -> str or, after a gathering join, list),
    ``meta_info`` (name -> dict), ``cur_role`` (open role or None), ``cur_role_begin_pos``.
    """

    def __init__(self, backend: Any, arguments: dict[str, Any], default_sampling_params: SglSamplingParams,
                 stream: bool = False, use_thread: bool = True) -> None:
        self.backend = backend
        self.arguments = dict(arguments)
        self.default_sampling_params = default_sampling_params
        self.stream = stream
        self.use_thread = use_thread
        self.text_ = ""
        self.messages_: list[dict[str, Any]] = []
        self.cur_role: Optional[str] = None
        self.cur_role_begin_pos: Optional[int] = None
        self.chat_emitted = ""  # everything the roles emitted (headers, contents, tails)
        self.variables: dict[str, Any] = {}
        self.variable_events: dict[str, threading.Event] = {}
        self.meta_info: dict[str, Any] = {}
        self.var_scopes: dict[str, int] = {}
        self.children: list[StreamExecutor] = []
        self.fork_start = 0  # len(text_) when this executor was forked from its parent
        self.error_: Optional[BaseException] = None
        self._cond = threading.Condition()
        self._chunks: list[str] = []  # every text append, for text_iter
        self._var_chunks: dict[str, list[str]] = {}
        self._var_chunk_meta: dict[str, list[Any]] = {}  # per variable chunk: its meta_info (see _chunk_meta)
        self._done = False
        self._queue: "queue.Queue[Optional[SglExpr]]" = queue.Queue()
        self._thread: Optional[threading.Thread] = None
        if use_thread:
            self._thread = threading.Thread(target=self._worker, daemon=True, name="sgl-executor")
            self._thread.start()

    # ------------------------------------------------------------ submission
    def submit(self, expr: SglExpr) -> None:
        """Queue ``expr`` (a string is not accepted here: see :func:`sglang.lang.ir.to_expr`)."""
        for leaf in ir.flatten(expr):
            name = getattr(leaf, "name", None)
            if isinstance(leaf, (SglGen, SglSelect, SglVarScopeBegin)) and name is not None:
                self.variable_events[name] = threading.Event()
        if self.use_thread:
            self._queue.put(expr)
        else:
            self._execute_safely(expr)

    def sync(self) -> None:
        """Block until every submitted expression has executed."""
        if self.use_thread:
            self._queue.join()

    def end(self) -> None:
        """Finish: wait for the queue, stop the worker, end the forks, wake ``text_iter`` readers."""
        self.sync()
        for child in self.children:
            child.end()
        if self._thread is not None and self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()
        with self._cond:
            self._done = True
            self._cond.notify_all()

    def check_error(self) -> None:
        """Re-raise the error that stopped this executor, if any."""
        if self.error_ is not None:
            raise self.error_

    def _worker(self) -> None:
        while True:
            expr = self._queue.get()
            try:
                if expr is None:
                    return
                self._execute_safely(expr)
            finally:
                self._queue.task_done()

    def _execute_safely(self, expr: SglExpr) -> None:
        if self.error_ is not None:
            return
        try:
            for leaf in ir.flatten(expr):
                self._execute(leaf)
        except BaseException as e:  # noqa: BLE001 - stored and re-raised in the program's thread
            logger.debug("program expression failed", exc_info=True)
            self.set_error(e)

    def set_error(self, e: BaseException) -> None:
        """Record ``e``, wake every reader (variables and text_iter)."""
        if self.error_ is None:
            self.error_ = e
        for ev in self.variable_events.values():
            ev.set()
        with self._cond:
            self._cond.notify_all()

    # ------------------------------------------------------------- execution
    def _append(self, text: str, var: Optional[str] = None, meta: Any = None) -> None:
        with self._cond:
            self.text_ += text
            self._chunks.append(text)
            if var is not None:
                self._var_chunks.setdefault(var, []).append(text)
                self._var_chunk_meta.setdefault(var, []).append(meta)
            self._cond.notify_all()

    def _set_var(self, name: Optional[str], value: Any, meta: Any = None) -> None:
        if name is None:
            return
        self.variables[name] = value
        if meta is not None:
            self.meta_info[name] = meta
        self.variable_events.setdefault(name, threading.Event()).set()
        with self._cond:
            self._cond.notify_all()

    def _execute(self, expr: SglExpr) -> None:
        if isinstance(expr, SglConstantText):
            self._append(expr.value)
        elif isinstance(expr, SglGen):
            self._execute_gen(expr)
        elif isinstance(expr, SglSelect):
            self._execute_select(expr)
        elif isinstance(expr, SglRoleBegin):
            self._role_begin(expr.role)
        elif isinstance(expr, SglRoleEnd):
            self._role_end(expr.role)
        elif isinstance(expr, SglVarScopeBegin):
            self.var_scopes[expr.name] = len(self.text_)
        elif isinstance(expr, SglVarScopeEnd):
            if expr.name not in self.var_scopes:
                raise ValueError(f"var_scope {expr.name!r} ends without having begun")
            self._set_var(expr.name, self.text_[self.var_scopes.pop(expr.name):])
        else:
            raise TypeError(f"cannot execute {type(expr).__name__}")

    def _execute_gen(self, expr: SglGen) -> None:
        params = self.default_sampling_params.merged(expr.overrides)
        if self.stream:
            meta: Any = None
            pieces = []
            sent: dict[str, int] = {}
            for chunk, meta in self.backend.generate_stream(self, params):
                if chunk:  # a chunk without text passes its tokens' logprobs on to the next one with text
                    pieces.append(chunk)
                    self._append(chunk, expr.name, _chunk_meta(meta, sent))
            self._set_var(expr.name, "".join(pieces), meta)
        else:
            text, meta = self.backend.generate(self, params)
            self._append(text, expr.name, meta)
            self._set_var(expr.name, text, meta)

    def _execute_select(self, expr: SglSelect) -> None:
        decision = self.backend.select(self, expr.choices, expr.temperature, expr.choices_method)
        self._append(decision.decision, expr.name, decision.meta_info)
        self._set_var(expr.name, decision.decision, decision.meta_info)

    def _role_begin(self, role: str) -> None:
        if self.cur_role is not None:
            raise ValueError(f"role {role!r} begins while role {self.cur_role!r} is still open; end it first")
        template = self.backend.get_chat_template()
        header = template.role_begin(self.messages_, role, self.chat_emitted)
        self.chat_emitted += header
        self._append(header)
        self.cur_role = role
        self.cur_role_begin_pos = len(self.text_)

    def _role_end(self, role: str) -> None:
        if self.cur_role != role:
            raise ValueError(f"role {role!r} ends but the open role is {self.cur_role!r}")
        content = self.text_[self.cur_role_begin_pos:]
        self.messages_.append({"role": role, "content": content})
        self.chat_emitted += content
        tail = self.backend.get_chat_template().role_end(self.messages_)
        self.chat_emitted += tail
        self._append(tail)
        self.cur_role = None
        self.cur_role_begin_pos = None

    # ---------------------------------------------------------------- reading
    def get_var(self, name: str) -> Any:
        """Value of variable ``name``, waiting for the expression that sets it.

        Raises:
            KeyError: no submitted expression sets ``name``.
            Exception: the error that stopped the executor before ``name`` was set.
        """
        ev = self.variable_events.get(name)
        if ev is not None:
            ev.wait()
        if name in self.variables:
            return self.variables[name]
        self.check_error()
        raise KeyError(f"program state has no variable {name!r}; known: {sorted(self.variables)}")

    def get_meta_info(self, name: str) -> Any:
        """Meta info of variable ``name`` (e.g. finish reason, logprobs, select scores), or None."""
        self.get_var(name)
        return self.meta_info.get(name)

    def fork(self, size: int) -> list["StreamExecutor"]:
        """``size`` executors that continue from this state (text, messages, variables copied).

        Raises:
            ValueError: ``size`` < 1.
        """
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f"fork size must be an integer >= 1, got {size!r}")
        self.sync()
        self.check_error()
        if size > 1 and self.text_:
            self.backend.cache_prefix(self)
        out = []
        for _ in range(size):
            e = StreamExecutor(self.backend, self.arguments, self.default_sampling_params, self.stream,
                               self.use_thread)
            e.text_ = self.text_
            e.messages_ = [dict(m) for m in self.messages_]
            e.cur_role, e.cur_role_begin_pos = self.cur_role, self.cur_role_begin_pos
            e.chat_emitted = self.chat_emitted
            e.variables = dict(self.variables)
            e.meta_info = dict(self.meta_info)
            e.fork_start = len(self.text_)
            out.append(e)
        self.children.extend(out)
        return out

    def iter_chunks(self, var_name: Optional[str] = None, with_meta: bool = False) -> Iterator[Any]:
        """Yield text as it is appended (only ``var_name``'s text if given) until it is complete.

        With ``with_meta`` and a ``var_name``, yield ``(text, meta_info)`` pairs instead: for a streamed ``gen``
        each chunk's meta_info holds, in its per-output-token logprob lists, only the tokens new since the previous
        chunk (``completion_tokens`` and ``output_token_logprobs_length`` stay running totals); otherwise the
        variable's meta_info. Every chunk is yielded once, however fast they arrive.

        Raises:
            Exception: the error that stopped the executor (after the text produced before it).
        """
        with_meta = with_meta and var_name is not None
        i = 0
        while True:
            with self._cond:
                while True:
                    chunks = self._chunks if var_name is None else self._var_chunks.get(var_name, [])
                    finished = (self._done or self.error_ is not None or
                                (var_name is not None and var_name in self.variables
                                 and self.variable_events.get(var_name, _SET).is_set()))
                    if i < len(chunks) or finished:
                        break
                    self._cond.wait()
                new = chunks[i:]
                metas = self._var_chunk_meta.get(var_name, [])[i:i + len(new)] if with_meta else []
                i = len(chunks)
            for k, c in enumerate(new):
                yield (c, metas[k] if k < len(metas) else None) if with_meta else c
            if finished and i >= len(chunks):
                break
        self.check_error()


def _chunk_meta(meta: Any, sent: dict[str, int]) -> Any:
    """The meta_info of one streamed chunk: ``meta`` (lists covering every output token so far) with each
    per-output-token logprob list cut to the entries not yet attached to an earlier chunk; ``sent`` (key -> entries
    attached so far) is updated. ``completion_tokens`` and ``output_token_logprobs_length`` are kept as running
    totals, so ``len(list) == completion_tokens - previous completion_tokens`` (SGLang's ``test_stream_logprobs``)."""
    if not isinstance(meta, dict):
        return meta
    out = dict(meta)
    for key in STREAMED_LOGPROB_KEYS:
        if isinstance(meta.get(key), list):
            out[key] = list(meta[key][sent.get(key, 0):])
            sent[key] = len(meta[key])
    return out


class _AlwaysSet:
    def is_set(self) -> bool:
        """Always True."""
        return True


_SET = _AlwaysSet()
