"""Prefix cache that shares nothing (``--disable-radix-cache``).

Same interface as ``RadixCache`` so the scheduler needs no special case: nothing is ever matched,
inserted, locked or evicted; a finished request's slots go straight back to the allocator.
"""

from __future__ import annotations

import logging
from typing import Any, List

import torch

from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import BasePrefixCache, CacheReq, MatchResult
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

logger = logging.getLogger(__name__)


class ChunkCache(BasePrefixCache):
    """No-sharing cache. ``root_node`` and every ``last_node`` are None; locks are no-ops.

    Args:
        req_to_token_pool: the request -> slot map.
        token_to_kv_pool_allocator: where finished requests' slots are freed.
    """

    def __init__(self, req_to_token_pool: ReqToTokenPool, token_to_kv_pool_allocator: TokenToKVPoolAllocator):
        self.req_to_token_pool = req_to_token_pool
        self.token_to_kv_pool_allocator = token_to_kv_pool_allocator
        self.page_size = token_to_kv_pool_allocator.page_size
        self.device = req_to_token_pool.device
        self.root_node = None

    def match_prefix(self, key: List[int]) -> MatchResult:
        """Always the empty match: int64 ``[0]`` on the pool's device, ``last_node=None``."""
        return MatchResult(device_indices=torch.empty(0, dtype=torch.int64, device=self.device), last_node=None)

    def insert(self, key: List[int], value: torch.Tensor) -> int:
        """Stores nothing; returns 0 (the caller keeps ownership of ``value``)."""
        if len(key) != value.numel():
            raise ValueError(f"insert: len(key)={len(key)} != len(value)={value.numel()}")
        return 0

    def cache_finished_req(self, req: CacheReq) -> None:
        """Free ``req_to_token[req_pool_idx, :kv_len]`` and the request slot; clears ``prefix_indices``."""
        slots = self.req_to_token_pool.req_to_token[req.req_pool_idx, : req.kv_len]
        self.token_to_kv_pool_allocator.free(slots)
        self.req_to_token_pool.free(req.req_pool_idx)
        req.prefix_indices = torch.empty(0, dtype=torch.int64, device=self.device)
        req.last_node = None

    def cache_unfinished_req(self, req: CacheReq) -> None:
        """Set ``req.prefix_indices`` to the row's first ``kv_len`` slots (int64); nothing is shared."""
        row = self.req_to_token_pool.req_to_token[req.req_pool_idx, : req.kv_len]
        req.prefix_indices = row.to(torch.int64)
        req.last_node = None

    def evict(self, num_tokens: int) -> int:
        """Nothing is cached; returns 0."""
        return 0

    def inc_lock_ref(self, node: Any) -> None:
        """No-op."""

    def dec_lock_ref(self, node: Any) -> None:
        """No-op."""

    def evictable_size(self) -> int:
        """Always 0 (nothing is cached)."""
        return 0

    def protected_size(self) -> int:
        """Always 0 (nothing is cached)."""
        return 0

    def total_size(self) -> int:
        """Always 0 (nothing is cached)."""
        return 0

    def held_indices(self) -> torch.Tensor:
        """Always empty int64."""
        return torch.empty(0, dtype=torch.int64, device=self.device)

    def reset(self) -> None:
        """Nothing to free."""
