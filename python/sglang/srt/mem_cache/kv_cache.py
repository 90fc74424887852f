"""The one owner of a worker's KV memory: request rows, the KV region, the page allocator and the prefix cache.

The scheduler talks only to a :class:`KVCache` (never to the pools or the allocator directly), so a
role that holds KV differently (a decode worker receiving pulled KV, an attention worker of an
attention/FFN split) changes one object, not the scheduler. Peers read the KV region through
:meth:`KVCache.describe` (KVDirect's tensor-centric metadata).

Accounting invariant: ``available_size() + prefix_cache.total_size() + (KV held by running requests)
== max_total_tokens``; when nothing runs and the prefix cache is flushed, all KV is free again.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Optional, Sequence, Union

import torch

from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import BasePrefixCache
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from sglang.srt.utils.tensor_transfer import host_to_device

if TYPE_CHECKING:
    from sglang.srt.mem_cache.kv_descriptor import KVRegionDescriptor
    from sglang.srt.mem_cache.kv_quant import KVScales

logger = logging.getLogger(__name__)


class KVCache:
    """Request rows (``ReqToTokenPool``), the KV region (``MHATokenToKVPool``, may be None for workers
    that keep no KV, e.g. scheduler tests), the page allocator and the prefix cache.

    Args:
        req_to_token_pool: request row -> KV slot map.
        token_to_kv_pool: the KV region (or None).
        allocator: page allocator over the region's slots.
        disable_radix_cache: True: a :class:`~sglang.srt.mem_cache.chunk_cache.ChunkCache` (no sharing),
            else a :class:`~sglang.srt.mem_cache.radix_cache.RadixCache` (``--disable-radix-cache``).
    """

    def __init__(self, req_to_token_pool: ReqToTokenPool, token_to_kv_pool: Optional[MHATokenToKVPool],
                 allocator: TokenToKVPoolAllocator, disable_radix_cache: bool = False):
        from sglang.srt.mem_cache.chunk_cache import ChunkCache
        from sglang.srt.mem_cache.radix_cache import RadixCache

        self.req_to_token_pool = req_to_token_pool
        self.token_to_kv_pool = token_to_kv_pool
        self.allocator = allocator
        self.page_size = allocator.page_size
        cache_cls = ChunkCache if disable_radix_cache else RadixCache
        self.prefix_cache: BasePrefixCache = cache_cls(req_to_token_pool, allocator)

    @classmethod
    def create(cls, *, max_total_tokens: int, page_size: int, dtype: torch.dtype, head_num: int, head_dim: int,
               layer_num: int, req_rows: int, max_context_len: int, device: Union[str, torch.device],
               disable_radix_cache: bool = False, layout: str = "layer_major",
               scales: Optional["KVScales"] = None) -> "KVCache":
        """Allocate the pools for ``max_total_tokens`` KV slots of ``layer_num`` layers x ``head_num`` heads x
        ``head_dim`` in ``dtype`` on ``device``, plus ``req_rows`` request rows of ``max_context_len`` positions.
        ``layout``: the KV region's storage order (``"layer_major"`` or ``"token_major"``, see
        :class:`~sglang.srt.mem_cache.memory_pool.MHATokenToKVPool`). ``scales``: per-layer K/V scales of an FP8
        ``dtype`` (``--kv-cache-dtype fp8_*``; None: 1.0).

        Raises:
            ValueError: a non-positive size, an unknown layout or scales that do not fit (from the pools).
        """
        r2t = ReqToTokenPool(req_rows, max_context_len, device)
        pool = MHATokenToKVPool(max_total_tokens, page_size, dtype, head_num, head_dim, layer_num, device, layout,
                                scales)
        return cls(r2t, pool, TokenToKVPoolAllocator(max_total_tokens, page_size, device), disable_radix_cache)

    # ---- capacity ------------------------------------------------------------------------------------
    @property
    def max_total_tokens(self) -> int:
        """Usable KV slots (whole pages)."""
        return self.allocator.size

    def available_size(self) -> int:
        """Free KV slots (tokens) in the allocator."""
        return self.allocator.available_size()

    def evictable_size(self) -> int:
        """KV slots the prefix cache holds unlocked (reclaimable by :meth:`evict`)."""
        return self.prefix_cache.evictable_size()

    def evict(self, num_tokens: int) -> int:
        """Evict at least ``num_tokens`` unlocked prefix-cache slots if possible; returns the number freed."""
        return self.prefix_cache.evict(num_tokens)

    # ---- request rows --------------------------------------------------------------------------------
    def alloc_req_slot(self) -> Optional[int]:
        """A free request row, or None when all are taken."""
        rows = self.req_to_token_pool.alloc(1)
        return None if rows is None else rows[0]

    def free_req_slot(self, row: int) -> None:
        """Return a request row (ValueError on a double free)."""
        self.req_to_token_pool.free(row)

    def set_prefix(self, row: int, slots: torch.Tensor) -> None:
        """Point positions ``0 .. len(slots)-1`` of ``row`` at the cached ``slots`` (a prefix-cache hit)."""
        if len(slots):
            self.req_to_token_pool.write(row, 0, slots)

    def slots_of(self, row: int, start: int, end: int) -> torch.Tensor:
        """KV slots of positions ``[start, end)`` of ``row`` (int32, a view on the pool's device)."""
        return self.req_to_token_pool.req_to_token[row, start:end]

    def last_slots(self, rows: Sequence[int], positions: Sequence[int]) -> list[int]:
        """Slot of each ``(rows[i], positions[i])``, one gather and one device-to-host copy for all."""
        r2t = self.req_to_token_pool.req_to_token
        r = torch.tensor(list(rows), dtype=torch.int64, device=r2t.device)
        c = torch.tensor(list(positions), dtype=torch.int64, device=r2t.device)
        return r2t[r, c].tolist()

    # ---- KV slots ------------------------------------------------------------------------------------
    def alloc_extend(self, rows: Sequence[int], prefix_lens: Sequence[int], seq_lens: Sequence[int],
                     last_locs: Sequence[int]) -> Optional[torch.Tensor]:
        """Slots for positions ``prefix_lens[i] .. seq_lens[i]-1`` of every request (continuing a partly filled
        last page at ``last_locs[i]``, -1: none), recorded in their rows; evicts prefix-cache entries once if
        the allocator is short. Returns int64 ``[sum(seq - prefix)]`` on the pool device, or None (nothing
        taken)."""
        got = self.alloc_extend_with_host(rows, prefix_lens, seq_lens, last_locs)
        return None if got is None else got[0]

    def alloc_extend_with_host(self, rows: Sequence[int], prefix_lens: Sequence[int], seq_lens: Sequence[int],
                               last_locs: Sequence[int]) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """:meth:`alloc_extend`, also returning the same slots on the CPU: ``(on the pool device, on the CPU)``,
        int64 ``[sum(seq - prefix)]`` each, or None. The CPU copy is known without waiting for the device (on CUDA
        the device copy is queued behind the work already on the stream, e.g. a running forward)."""
        for attempt in range(2):
            host = self.allocator.alloc_extend_host(prefix_lens, seq_lens, last_locs)
            if host is not None:
                loc = host_to_device(host, self.allocator.device)
                self.req_to_token_pool.write_batch(list(rows), list(prefix_lens),
                                                   [s - p for p, s in zip(prefix_lens, seq_lens)], loc)
                return loc, host
            if attempt == 0:
                self.evict(sum(seq_lens) - sum(prefix_lens) + self.page_size * len(rows))
        return None

    def free_slots(self, slots: torch.Tensor) -> None:
        """Return KV slots to the allocator (whole pages are freed when all their slots are)."""
        self.allocator.free(slots)

    # ---- peers ---------------------------------------------------------------------------------------
    def describe(self) -> "KVRegionDescriptor":
        """The KV region's tensor-centric metadata (see :meth:`MHATokenToKVPool.describe`).

        Raises:
            ValueError: this cache holds no KV region.
        """
        if self.token_to_kv_pool is None:
            raise ValueError("this KVCache holds no KV region (token_to_kv_pool is None)")
        return self.token_to_kv_pool.describe()

    def reset(self) -> None:
        """Flush the prefix cache (callers ensure nothing runs)."""
        self.prefix_cache.reset()
