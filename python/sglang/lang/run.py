"""Run programs: :func:`run_program` (one, optionally streaming) and :func:`run_program_batch` (many).

The process-wide default backend (``sgl.set_default_backend``) is the one piece of global state of
the frontend, as SGLang's API requires; it is only read when a run names no backend.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import os
import threading
from typing import Any, Sequence, Union

from sglang.lang.interpreter import StreamExecutor
from sglang.lang.ir import SglFunction, SglSamplingParams
from sglang.lang.state import ProgramState

logger = logging.getLogger(__name__)

_default_backend_lock = threading.Lock()
_default_backend: list[Any] = [None]


def set_default_backend(backend: Any) -> None:
    """Use ``backend`` for runs that name none (a :class:`~sglang.lang.runtime.Runtime` means its endpoint).

    Raises:
        TypeError: ``backend`` is not a backend (or a Runtime).
    """
    from sglang.lang.backend.base_backend import BaseBackend

    resolved = getattr(backend, "endpoint", backend)
    if not isinstance(resolved, BaseBackend):
        raise TypeError(f"set_default_backend needs a backend such as sgl.RuntimeEndpoint(url), "
                        f"got {type(backend).__name__}")
    with _default_backend_lock:
        _default_backend[0] = resolved


def get_default_backend() -> Any:
    """The backend set with :func:`set_default_backend`, or None."""
    with _default_backend_lock:
        return _default_backend[0]


def resolve_backend(backend: Any) -> Any:
    """``backend`` (a Runtime's endpoint for a Runtime), else the default backend.

    Raises:
        ValueError: neither is set.
    """
    if backend is None:
        backend = get_default_backend()
    backend = getattr(backend, "endpoint", backend)
    if backend is None:
        raise ValueError("no backend: pass backend=sgl.RuntimeEndpoint(url) to run(), or call "
                         "sgl.set_default_backend(...) first")
    return backend


def _run_internal(state: ProgramState, program: SglFunction, args: Sequence[Any], kwargs: dict[str, Any]) -> None:
    ex = state.stream_executor
    try:
        state.ret_value = program.func(state, *args, **kwargs)
    except BaseException as e:  # noqa: BLE001 - recorded, re-raised by the caller
        ex.set_error(e)
    finally:
        ex.end()


def run_program(program: SglFunction, backend: Any, args: Sequence[Any], kwargs: dict[str, Any],
                default_sampling_params: SglSamplingParams, stream: bool = False,
                use_thread: bool = True, raise_errors: bool = True) -> ProgramState:
    """Run ``program`` once.

    Args:
        program: the program.
        backend: a backend, a Runtime, or None for the default backend.
        args / kwargs: the program's arguments (after the state).
        default_sampling_params: defaults for every ``gen``.
        stream: run in a background thread with streaming generation and return at once.
        use_thread: execute expressions in a worker thread (concurrent with the program's Python code).
        raise_errors: re-raise a failure of a non-streaming run (False: leave it in ``state.error()``).

    Raises:
        ValueError / TypeError: no backend, arguments that do not fit the program.
        Exception: the program's or the backend's error (non-streaming runs with ``raise_errors``).
    """
    backend = resolve_backend(backend)
    program.check_arguments(args, kwargs)
    ex = StreamExecutor(backend, kwargs, default_sampling_params, stream=stream, use_thread=use_thread)
    state = ProgramState(ex)
    if stream:
        t = threading.Thread(target=_run_internal, args=(state, program, args, kwargs), daemon=True,
                             name="sgl-program")
        t.start()
        return state
    _run_internal(state, program, args, kwargs)
    if raise_errors:
        ex.check_error()
    return state


def _num_threads(num_threads: Union[str, int], batch_size: int) -> int:
    if num_threads == "auto":
        n = max(96, (os.cpu_count() or 1) * 16)
    elif isinstance(num_threads, int) and not isinstance(num_threads, bool) and num_threads >= 1:
        n = num_threads
    else:
        raise ValueError(f"num_threads must be 'auto' or an integer >= 1, got {num_threads!r}")
    return max(1, min(n, batch_size))


def run_program_batch(program: SglFunction, backend: Any, batch_arguments: Sequence[dict[str, Any]],
                      default_sampling_params: SglSamplingParams, num_threads: Union[str, int] = "auto",
                      progress_bar: bool = False, generator_style: bool = False):
    """Run ``program`` once per keyword-argument dict, concurrently; states in input order.

    A failing program does not stop the batch: its state carries ``error()`` (also logged).
    Returns a list of :class:`ProgramState`; with ``generator_style`` an iterator that yields each
    state (in input order) as soon as it and all before it are done, as SGLang's does.

    Raises:
        ValueError: ``batch_arguments`` is not a list of dicts, bad ``num_threads``, no backend.
        TypeError: an entry's arguments do not fit the program.
    """
    if not isinstance(batch_arguments, (list, tuple)) or not all(isinstance(a, dict) for a in batch_arguments):
        raise ValueError("run_batch needs a list of keyword-argument dicts, e.g. [{'question': 'a'}, ...]")
    backend = resolve_backend(backend)
    for a in batch_arguments:
        program.check_arguments((), {**program.bind_arguments, **a})
    n = _num_threads(num_threads, len(batch_arguments))
    bar = None
    if progress_bar:
        try:
            from tqdm import tqdm

            bar = tqdm(total=len(batch_arguments))
        except ImportError:
            logger.warning("progress_bar=True needs tqdm (pip install tqdm); running without a progress bar")

    def one(kwargs: dict[str, Any]) -> ProgramState:
        """Run the program for one argument set (errors are logged and kept in the state, not raised)."""
        state = run_program(program, backend, (), {**program.bind_arguments, **kwargs}, default_sampling_params,
                            raise_errors=False)
        if state.error() is not None:
            logger.warning("program %s failed for arguments %s: %r", program.__name__, kwargs, state.error())
        if bar is not None:
            bar.update(1)
        return state

    def iterate():
        """Yield the states in input order while the pool runs them."""
        try:
            if n == 1:
                for a in batch_arguments:
                    yield one(a)
                return
            with cf.ThreadPoolExecutor(n, thread_name_prefix="sgl-batch") as pool:
                yield from pool.map(one, batch_arguments)
        finally:
            if bar is not None:
                bar.close()

    return iterate() if generator_style else list(iterate())
