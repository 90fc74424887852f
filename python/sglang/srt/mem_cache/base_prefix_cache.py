"""Interface of the prefix caches (radix tree, and the no-sharing chunk cache).

The prefix cache owns KV slots of token sequences that finished (or partially finished) requests
left behind, so later requests with the same prefix skip recomputing it (RadixAttention, Zheng et
al. 2024, "SGLang: Efficient Execution of Structured Language Model Programs", section 3).

Ownership of KV slots: every usable slot is at any time exactly one of
(a) free in the allocator, (b) held by the cache's tree, (c) owned by one running request
(``req_to_token[req.req_pool_idx, len(req.prefix_indices):req.kv_len]``, plus in page mode the
unfilled rest of the request's last page). Slots in ``req.prefix_indices`` belong to the tree; the
request only holds a lock on them.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, List, Protocol

import torch


class CacheReq(Protocol):
    """What a prefix cache needs from the scheduler's ``Req`` (duck-typed).

    Attributes:
        req_pool_idx: row of ``ReqToTokenPool.req_to_token`` this request holds.
        origin_input_ids: prompt token ids.
        output_ids: generated token ids so far.
        kv_len: positions ``[0, kv_len)`` of the row hold valid KV slots for tokens
            ``(origin_input_ids + output_ids)[:kv_len]``.
        prefix_indices: int64 ``[n]`` slots of the prefix held from the tree (equal to
            ``req_to_token[req_pool_idx, :n]``); set by the cache.
        last_node: the node the request holds a lock on; set by the cache (the scheduler sets it to
            the ``MatchResult.last_node`` it locked at admission).
    """

    req_pool_idx: int
    origin_input_ids: List[int]
    output_ids: List[int]
    kv_len: int
    prefix_indices: torch.Tensor
    last_node: Any


@dataclass(frozen=True)
class MatchResult:
    """Result of ``match_prefix``.

    Attributes:
        device_indices: int64 ``[m]`` KV slots of the matched prefix (``m`` a multiple of page_size),
            on the request pool's device.
        last_node: the deepest matched node; pass to ``inc_lock_ref`` to pin the prefix.
    """

    device_indices: torch.Tensor
    last_node: Any


class BasePrefixCache(abc.ABC):
    """Contracts shared by ``RadixCache`` and ``ChunkCache``."""

    @abc.abstractmethod
    def match_prefix(self, key: List[int]) -> MatchResult:
        """Longest cached prefix of ``key`` whose length is a multiple of page_size.

        Refreshes the LRU access time of the matched nodes, and splits a node when the match ends
        inside it so that ``last_node`` covers exactly the match. Takes no lock: the scheduler calls
        ``inc_lock_ref(result.last_node)`` when it admits the request.
        """

    @abc.abstractmethod
    def insert(self, key: List[int], value: torch.Tensor) -> int:
        """Insert the page-aligned prefix of ``key`` with its KV slots ``value`` (int64 ``[len(key)]``).

        Returns how many leading tokens of ``key`` were already in the tree; for those the tree keeps
        its own slots, so the caller must free ``value[k:returned]`` where ``k`` is how many leading
        slots of ``value`` already came from the tree. Slots of new tokens pass to the tree.

        Raises:
            ValueError: ``len(value) != len(key)``.
        """

    @abc.abstractmethod
    def cache_finished_req(self, req: CacheReq) -> None:
        """Hand a finished (or retracted) request's KV to the cache and release it.

        Inserts ``(origin_input_ids + output_ids)[:kv_len]`` with ``req_to_token[req_pool_idx, :kv_len]``,
        frees duplicate slots and (page mode) the non-page-aligned tail, drops the request's lock and
        frees its request slot. Afterwards the request owns nothing (``last_node`` is None).
        """

    @abc.abstractmethod
    def cache_unfinished_req(self, req: CacheReq) -> None:
        """Share a still-running request's KV so far (after a prefill chunk).

        Inserts the page-aligned ``(origin_input_ids + output_ids)[:kv_len]``, frees duplicates,
        rewrites ``req_to_token[req_pool_idx, :L]`` with the tree's slots, moves the lock to the new
        last node and sets ``req.prefix_indices`` (length ``L``, ``kv_len`` rounded down to a page)
        and ``req.last_node``. The request keeps its request slot, ``kv_len`` and its unaligned tail.
        """

    @abc.abstractmethod
    def evict(self, num_tokens: int) -> int:
        """Free least-recently-used unlocked leaves until ``num_tokens`` slots went back to the
        allocator or nothing evictable remains; returns the number of slots freed."""

    @abc.abstractmethod
    def inc_lock_ref(self, node: Any) -> None:
        """Lock ``node`` and its ancestors; a locked node is never evicted."""

    @abc.abstractmethod
    def dec_lock_ref(self, node: Any) -> None:
        """Undo one ``inc_lock_ref(node)``.

        Raises:
            ValueError: the node is not locked (unbalanced unlock).
        """

    @abc.abstractmethod
    def evictable_size(self) -> int:
        """Tokens held by the tree in unlocked nodes."""

    @abc.abstractmethod
    def protected_size(self) -> int:
        """Tokens held by the tree in locked nodes."""

    @abc.abstractmethod
    def total_size(self) -> int:
        """All tokens held by the tree (``evictable_size() + protected_size()``)."""

    @abc.abstractmethod
    def reset(self) -> None:
        """Free every slot the tree holds back to the allocator and empty the tree."""
