"""Paged KV slot allocator.

KV slots are handed out in whole pages of ``page_size`` tokens (PagedAttention, Kwon et al. 2023,
section 4.2). Page 0 (slots ``0 .. page_size-1``) is the reserved dummy page of ``MHATokenToKVPool``
and is never handed out; usable pages are ``1 .. num_pages``, i.e. slots
``page_size .. (num_pages + 1) * page_size - 1``.

A request's positions fill its last page before a fresh page is taken, so the slot of position
``p`` satisfies ``slot % page_size == p % page_size``.
"""

from __future__ import annotations

import logging
from typing import List, Optional, Sequence, Union

import torch

from sglang.srt.utils.tensor_transfer import host_to_device

logger = logging.getLogger(__name__)


class TokenToKVPoolAllocator:
    """Free-list allocator of KV slots in whole pages.

    The free list is an int64 CPU tensor of page ids; returned slot tensors are int64 on ``device``.

    Args:
        size: usable token slots; rounded down to a multiple of ``page_size`` (must leave >= 1 page).
        page_size: tokens per page, >= 1.
        device: device of the returned index tensors.

    Raises:
        ValueError: ``page_size < 1`` or ``size < page_size``.
    """

    def __init__(self, size: int, page_size: int, device: Union[str, torch.device]):
        if page_size < 1:
            raise ValueError(f"page_size={page_size} must be >= 1; pass --page-size 1 or larger")
        if size < page_size:
            raise ValueError(f"allocator size={size} holds no whole page of page_size={page_size}; give the KV pool more memory")
        self.page_size = page_size
        self.num_pages = size // page_size
        self.size = self.num_pages * page_size
        self.device = torch.device(device)
        self._page_offsets = torch.arange(page_size, dtype=torch.int64)
        self._free_pages = torch.empty(0, dtype=torch.int64)
        self._is_free = torch.zeros(self.num_pages + 1, dtype=torch.bool)
        self._group: Optional[List[torch.Tensor]] = None
        self.clear()

    # ---------------------------------------------------------------- state
    def clear(self) -> None:
        """Mark every usable page free (and drop any open free group)."""
        self._free_pages = torch.arange(1, self.num_pages + 1, dtype=torch.int64)
        self._is_free.fill_(True)
        self._is_free[0] = False
        self._group = None

    def available_size(self) -> int:
        """Free slots (tokens), always a multiple of ``page_size``."""
        return int(self._free_pages.numel()) * self.page_size

    def free_page_ids(self) -> torch.Tensor:
        """Copy of the free page ids (int64, CPU); for accounting checks and debugging."""
        return self._free_pages.clone()

    # ---------------------------------------------------------------- alloc
    def _take_pages(self, n: int) -> torch.Tensor:
        pages = self._free_pages[:n]
        self._free_pages = self._free_pages[n:]
        self._is_free[pages] = False
        return pages

    def _pages_to_slots(self, pages: torch.Tensor) -> torch.Tensor:
        return (pages[:, None] * self.page_size + self._page_offsets).reshape(-1)

    def alloc(self, need: int) -> Optional[torch.Tensor]:
        """Allocate ``need`` slots in fresh pages; int64 ``[need]`` on ``device`` or None (nothing taken).

        Raises:
            ValueError: ``need`` is negative, or not a multiple of ``page_size`` when ``page_size > 1``
                (use ``alloc_extend`` to continue partially filled pages).
        """
        if need < 0:
            raise ValueError(f"alloc(need={need}): need must be >= 0")
        if need % self.page_size != 0:
            raise ValueError(f"alloc(need={need}) must be a multiple of page_size={self.page_size}; use alloc_extend")
        n_pages = need // self.page_size
        if n_pages > self._free_pages.numel():
            return None
        pages = self._take_pages(n_pages)
        slots = pages if self.page_size == 1 else self._pages_to_slots(pages)
        return host_to_device(slots, self.device)

    def alloc_extend(self, prefix_lens: Sequence[int], seq_lens: Sequence[int],
                     last_locs: Sequence[int]) -> Optional[torch.Tensor]:
        """:meth:`alloc_extend_host` copied to ``device`` (asynchronously on CUDA; None when too few pages are free)."""
        out = self.alloc_extend_host(prefix_lens, seq_lens, last_locs)
        return None if out is None else host_to_device(out, self.device)

    def alloc_extend_host(self, prefix_lens: Sequence[int], seq_lens: Sequence[int],
                          last_locs: Sequence[int]) -> Optional[torch.Tensor]:
        """Slots for positions ``prefix_lens[i] .. seq_lens[i]-1`` of each request, concatenated in order.

        Positions that fall in the page holding position ``prefix_lens[i]-1`` continue it (slots
        ``last_locs[i]+1, ...``); the rest go to fresh pages.

        Args:
            prefix_lens: tokens each request already has KV slots for.
            seq_lens: tokens each request will have after this step (``>= prefix_lens[i]``).
            last_locs: slot of position ``prefix_lens[i]-1`` (ignored, conventionally -1, when 0).

        Returns:
            int64 ``[sum(seq_lens - prefix_lens)]`` on the CPU (:meth:`alloc_extend`: on ``device``), or None
            (nothing taken) when too few pages are free.

        Raises:
            ValueError: list lengths differ, ``seq_lens[i] < prefix_lens[i]``, or a ``last_locs[i]``
                is not the slot of position ``prefix_lens[i]-1`` modulo the page size.
        """
        n_req = len(prefix_lens)
        if len(seq_lens) != n_req or len(last_locs) != n_req:
            raise ValueError(f"alloc_extend: prefix_lens ({n_req}), seq_lens ({len(seq_lens)}) and last_locs "
                             f"({len(last_locs)}) must have the same length")
        P = self.page_size
        fresh_pages: List[int] = []
        cont: List[int] = []
        for pre, seq, last in zip(prefix_lens, seq_lens, last_locs):
            if seq < pre or pre < 0:
                raise ValueError(f"alloc_extend: seq_len={seq} must be >= prefix_len={pre} >= 0")
            n_cont = 0
            if pre % P != 0:
                if last < P or last % P != (pre - 1) % P:
                    raise ValueError(f"alloc_extend: last_loc={last} is not a valid slot for position {pre - 1} "
                                     f"with page_size={P}; pass req_to_token[req, prefix_len-1]")
                n_cont = min(seq - pre, P - pre % P)
            cont.append(n_cont)
            fresh_pages.append(-(-seq // P) - (-(-pre // P)))
        total_fresh = sum(fresh_pages)
        if total_fresh > self._free_pages.numel():
            return None
        pages = self._take_pages(total_fresh)
        if P == 1:
            return pages.clone()  # not a view of the free list
        parts: List[torch.Tensor] = []
        p0 = 0
        for i in range(n_req):
            if cont[i]:
                parts.append(torch.arange(last_locs[i] + 1, last_locs[i] + 1 + cont[i], dtype=torch.int64))
            n_fresh_tok = seq_lens[i] - prefix_lens[i] - cont[i]
            if n_fresh_tok:
                parts.append(self._pages_to_slots(pages[p0:p0 + fresh_pages[i]])[:n_fresh_tok])
            p0 += fresh_pages[i]
        return torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)

    def alloc_decode(self, seq_lens: Sequence[int], last_locs: Sequence[int]) -> Optional[torch.Tensor]:
        """One slot per request for position ``seq_lens[i]-1``; int64 ``[bs]`` on ``device`` or None.

        ``last_locs[i]`` is the slot of position ``seq_lens[i]-2`` (-1 when ``seq_lens[i] == 1``).

        Raises:
            ValueError: a ``seq_lens[i] < 1`` or the arguments are inconsistent (see ``alloc_extend``).
        """
        if any(s < 1 for s in seq_lens):
            raise ValueError(f"alloc_decode: every seq_len must be >= 1, got {list(seq_lens)}")
        return self.alloc_extend([s - 1 for s in seq_lens], seq_lens, last_locs)

    # ---------------------------------------------------------------- free
    def free_group_begin(self) -> None:
        """Start batching ``free`` calls; they take effect together at ``free_group_end``."""
        if self._group is None:
            self._group = []

    def free_group_end(self) -> None:
        """Apply the frees batched since ``free_group_begin`` (no-op if none is open)."""
        group, self._group = self._group, None
        if group:
            self.free(torch.cat(group))

    def free(self, indices: torch.Tensor) -> None:
        """Return the pages that the slots ``indices`` (any int dtype/device) belong to.

        In page mode the caller frees all slots of a page together; a page named by several slots
        is returned once.

        Raises:
            ValueError: a slot is outside the usable range, or its page is already free (double
                free); nothing is freed then. (Inside a free group the check runs at ``free_group_end``.)
        """
        if indices.numel() == 0:
            return
        if self._group is not None:
            self._group.append(indices.reshape(-1).to("cpu", torch.int64))
            return
        idx = indices.reshape(-1).to("cpu", torch.int64)
        pages = torch.unique(idx // self.page_size) if self.page_size > 1 else torch.unique(idx)
        lo, hi = int(pages[0]), int(pages[-1])
        if lo < 1 or hi > self.num_pages:
            raise ValueError(f"free: slot outside the usable range [{self.page_size}, {self.size + self.page_size}) "
                             f"(pages {lo}..{hi}); only free slots handed out by this allocator")
        if bool(self._is_free[pages].any()):
            bad = pages[self._is_free[pages]][:8].tolist()
            raise ValueError(f"free: page(s) {bad} (page_size={self.page_size}) are already free (double free)")
        self._is_free[pages] = True
        self._free_pages = torch.cat([self._free_pages, pages])
