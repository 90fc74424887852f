"""What a program sees as ``s``: :class:`ProgramState`, and :class:`ProgramStateGroup` for forks.

``s += "text"``, ``s += sgl.gen("x")``, ``s += sgl.select("c", choices=[...])`` append; ``s["x"]``
reads a variable (waiting for it); ``with s.user(): ...`` or ``s += sgl.user("...")`` adds a chat
turn; ``forks = s.fork(n)`` continues the state ``n`` ways (concurrently), ``forks.join()`` gathers
the forks' new variables back into ``s`` as lists.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any, AsyncIterator, Iterator, Optional, Sequence

from sglang.lang import ir
from sglang.lang.interpreter import StreamExecutor

logger = logging.getLogger(__name__)


class ProgramState:
    """The state of one running program (wraps a :class:`StreamExecutor`).

    Attributes:
        stream_executor: the executor.
        ret_value: what the program function returned (set when it finishes).
    """

    def __init__(self, stream_executor: StreamExecutor) -> None:
        self.stream_executor = stream_executor
        self.ret_value: Any = None

    # ---------------------------------------------------------------- append
    def __iadd__(self, other: Any) -> "ProgramState":
        self.stream_executor.submit(ir.to_expr(other))
        return self

    def _role(self, role: str, expr: Any = None):
        if expr is None:
            return self._role_scope(role)
        self.stream_executor.submit(ir.SglExprList([ir.SglRoleBegin(role), ir.to_expr(expr),
                                                    ir.SglRoleEnd(role)]))
        return None

    @contextlib.contextmanager
    def _role_scope(self, role: str):
        self.stream_executor.submit(ir.SglRoleBegin(role))
        yield self
        self.stream_executor.submit(ir.SglRoleEnd(role))

    def system(self, expr: Any = None):
        """``s.system("text")`` adds a system turn; ``with s.system(): ...`` wraps appends in one."""
        return self._role("system", expr)

    def user(self, expr: Any = None):
        """``s.user("text")`` adds a user turn; ``with s.user(): ...`` wraps appends in one."""
        return self._role("user", expr)

    def assistant(self, expr: Any = None):
        """``s.assistant(sgl.gen("a"))`` adds an assistant turn; ``with s.assistant(): ...`` wraps appends."""
        return self._role("assistant", expr)

    @contextlib.contextmanager
    def var_scope(self, name: str):
        """``with s.var_scope("x"): ...``: everything appended inside becomes variable ``x``."""
        ir._check_name(name, "var_scope")
        self.stream_executor.submit(ir.SglVarScopeBegin(name))
        yield self
        self.stream_executor.submit(ir.SglVarScopeEnd(name))

    def fork(self, size: int = 1, position_ids_offset: Optional[Sequence[int]] = None) -> "ProgramStateGroup":
        """``size`` copies of this state that continue independently and concurrently.

        Raises:
            ValueError: ``size`` < 1.
            NotImplementedError: ``position_ids_offset`` is given (not supported).
        """
        if position_ids_offset is not None:
            raise NotImplementedError("fork(position_ids_offset=...) is not supported by this fork")
        execs = self.stream_executor.fork(size)
        return ProgramStateGroup([ProgramState(e) for e in execs], self)

    # ---------------------------------------------------------------- read
    def text(self) -> str:
        """All text so far (waits for pending expressions)."""
        self.stream_executor.sync()
        return self.stream_executor.text_

    def messages(self) -> list[dict[str, Any]]:
        """The completed chat turns ``[{"role", "content"}]`` (waits for pending expressions)."""
        self.stream_executor.sync()
        return [dict(m) for m in self.stream_executor.messages_]

    def sync(self) -> None:
        """Wait for every pending expression."""
        self.stream_executor.sync()

    def error(self) -> Optional[BaseException]:
        """The error that stopped the program, or None."""
        return self.stream_executor.error_

    def get_var(self, name: str) -> Any:
        """Same as ``state[name]``."""
        return self.stream_executor.get_var(name)

    def set_var(self, name: str, value: Any) -> None:
        """Set variable ``name`` (after pending expressions)."""
        self.stream_executor.sync()
        self.stream_executor._set_var(name, value)

    def get_meta_info(self, name: str) -> Any:
        """Meta info of variable ``name``: for ``gen`` the server's ``meta_info`` (finish reason, token
        counts, logprobs if asked); for ``select`` the scores (``normalized_prompt_logprobs``, ...)."""
        return self.stream_executor.get_meta_info(name)

    def __getitem__(self, name: str) -> Any:
        return self.get_var(name)

    def __setitem__(self, name: str, value: Any) -> None:
        self.set_var(name, value)

    def __contains__(self, name: str) -> bool:
        self.stream_executor.sync()
        return name in self.stream_executor.variables

    def text_iter(self, var_name: Optional[str] = None) -> Iterator[str]:
        """Yield the text as it is produced (with ``stream=True`` generation arrives in small chunks);
        only variable ``var_name``'s text if given. Ends when the program (or the variable) is done.

        Raises:
            Exception: the error that stopped the program.
        """
        return self.stream_executor.iter_chunks(var_name)

    async def text_async_iter(self, var_name: Optional[str] = None,
                              return_meta_data: bool = False) -> AsyncIterator[Any]:
        """Async version of :meth:`text_iter` (the blocking waits run in a worker thread).

        ``return_meta_data`` (SGLang's signature; only with ``var_name``): yield ``(text, meta_info)`` pairs. For a
        streamed ``gen`` each pair's meta_info carries in ``output_token_logprobs`` / ``output_top_logprobs`` /
        ``output_token_ids_logprobs`` only the tokens new since the previous pair, while ``completion_tokens`` and
        ``output_token_logprobs_length`` are running totals (``len(list)`` is the increase of ``completion_tokens``),
        whichever stream mode the server uses; every chunk is yielded once, never skipped when chunks come faster
        than the reader. Without ``var_name`` the text alone is yielded, as in SGLang.
        """
        it = self.stream_executor.iter_chunks(var_name, with_meta=return_meta_data)
        sentinel = object()
        while True:
            chunk = await asyncio.to_thread(next, it, sentinel)
            if chunk is sentinel:
                return
            yield chunk

    def __repr__(self) -> str:
        return f"ProgramState({self.text()!r})"


class ProgramStateGroup:
    """The forks of a state: index or iterate them, ``forks += expr`` appends to each,
    ``forks.join()`` merges them back.
    """

    def __init__(self, states: list[ProgramState], src_state: ProgramState) -> None:
        self.states = states
        self.src_state = src_state

    def __getitem__(self, i: int) -> ProgramState:
        return self.states[i]

    def __len__(self) -> int:
        return len(self.states)

    def __iter__(self) -> Iterator[ProgramState]:
        return iter(self.states)

    def __iadd__(self, other: Any) -> "ProgramStateGroup":
        """Append ``other`` to every fork, or ``other[i]`` to fork ``i`` when ``other`` is a list.

        Raises:
            ValueError: a list whose length differs from the number of forks.
        """
        if isinstance(other, list):
            if len(other) != len(self.states):
                raise ValueError(f"a list appended to {len(self.states)} forks needs {len(self.states)} "
                                 f"entries, got {len(other)}")
            for s, o in zip(self.states, other):
                s += o
        else:
            for s in self.states:
                s += other
        return self

    def join(self, mode: str = "gather_variable") -> None:
        """Wait for the forks and merge them into the source state.

        Modes:
            ``"gather_variable"``: every variable a fork set or changed becomes, in the source
            state, the list of its values across forks (None where a fork lacks it).
            ``"concate_and_append"``: the text each fork added is appended to the source state.

        Raises:
            ValueError: unknown ``mode``.
            Exception: the error that stopped a fork.
        """
        if mode not in ("gather_variable", "concate_and_append"):
            raise ValueError(f"join mode must be 'gather_variable' or 'concate_and_append', got {mode!r}")
        for s in self.states:
            s.stream_executor.sync()
            s.stream_executor.check_error()
        src = self.src_state
        if mode == "concate_and_append":
            for s in self.states:
                ex = s.stream_executor
                src += ex.text_[ex.fork_start:]
            src.sync()
            return
        src.stream_executor.sync()
        base = src.stream_executor.variables
        names: list[str] = []
        for s in self.states:
            for name, value in s.stream_executor.variables.items():
                if name not in names and (name not in base or base[name] is not value):
                    names.append(name)
        for name in names:
            values = [s.stream_executor.variables.get(name) for s in self.states]
            metas = [s.stream_executor.meta_info.get(name) for s in self.states]
            src.stream_executor._set_var(name, values, metas)
