"""A thread-safe, bounded cache of grammar compilations running on a small thread pool.

Compilation of a JSON schema or a large EBNF grammar can take from milliseconds to seconds;
the scheduler must not stall on it. :class:`CompileCache` starts each distinct compilation
once on a ``ThreadPoolExecutor`` and hands every requester the same ``Future``; later
requests for the same key get the already-resolved future. Failed compilations are cached
too (their future raises), so a bad spec is not recompiled for each request.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Generic, Hashable, TypeVar

logger = logging.getLogger(__name__)

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class CompileCache(Generic[K, V]):
    """Futures of ``compile_fn(key)`` keyed by ``key``, least-recently-used eviction.

    Args:
        compile_fn: builds the value for a key (runs on a pool thread; may raise).
        num_threads: pool size (>= 1).
        max_entries: most keys kept (>= 1); evicting a pending entry does not cancel it
            (its requesters still hold the future).
    Raises:
        ValueError: num_threads or max_entries < 1.
    """

    def __init__(self, compile_fn: Callable[[K], V], num_threads: int = 2, max_entries: int = 1024) -> None:
        if num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {num_threads}")
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        self._compile_fn = compile_fn
        self._max_entries = max_entries
        self._lock = threading.Lock()
        self._entries: "OrderedDict[K, Future[V]]" = OrderedDict()
        self._pool = ThreadPoolExecutor(max_workers=num_threads, thread_name_prefix="grammar-compile")
        self.hits = 0
        self.misses = 0

    def get(self, key: K) -> "Future[V]":
        """The (possibly already resolved) future of ``compile_fn(key)``; never blocks on compilation."""
        with self._lock:
            fut = self._entries.get(key)
            if fut is not None:
                self._entries.move_to_end(key)
                self.hits += 1
                return fut
            self.misses += 1
            fut = self._pool.submit(self._compile_fn, key)
            self._entries[key] = fut
            while len(self._entries) > self._max_entries:
                self._entries.popitem(last=False)
            return fut

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def __contains__(self, key: K) -> bool:
        with self._lock:
            return key in self._entries

    def clear(self) -> None:
        """Forget every entry (pending compilations finish for their current requesters)."""
        with self._lock:
            self._entries.clear()

    def shutdown(self) -> None:
        """Stop the pool; pending compilations are cancelled (idempotent)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
