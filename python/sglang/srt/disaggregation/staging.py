"""Staged pull for heterogeneous TP (KVDirect, Chen et al. 2024, sec. 4.1-4.2, with prefill TP != decode TP).

The KV pool is token-major (``[layer, K/V, slot, head, head_dim]``): when a decode rank holds a different head
range than the prefill rank it reads from (e.g. prefill TP 1 -> decode TP 2: each decode rank holds half of the
heads), the bytes it needs are one short piece per (layer, K/V, token), strided on at least one side, and no two
pieces coalesce: 131,072 READs of 1 KiB for a 1024-token Llama-3.1-8B prompt (measured: 1.4 s per request on
H200, against 2.2 ms for the 64 coalesced READs of TP 1 -> TP 1).

Staged pull reads the source rank's **whole token rows** (all the heads it holds, contiguous over runs of
consecutive prefill slots, so the :class:`~sglang.srt.disaggregation.transfer.queue.TransferQueue` coalesces them
into one READ per (layer, K/V, slot run), like TP 1 -> TP 1) into a registered staging area on the decode rank's
device, then one ``index_copy_`` per source moves the decode rank's heads into its KV slots on that device
(:func:`unstage`). The price: up to ``source heads / needed heads`` times the bytes on the link (2x for TP 1 -> TP
2), and staging memory (``StagingArea``, :data:`DEFAULT_STAGING_BYTES`). Requests too large for the whole area
fall back to the strided reads (correct, slow).

Lockstep: every decode rank allocates the same number of staging bytes per room (the maximum over the ranks, see
:func:`room_staging_bytes`) at the same step and frees at agreed steps, so the allocators stay identical and a
rank never waits for staging while another posts.
"""

from __future__ import annotations

import logging
from typing import Optional, Sequence

import numpy as np
import torch

from sglang.srt.disaggregation.slot_plan import assign_sources, plan_slot_copies
from sglang.srt.mem_cache.kv_descriptor import KVRegionDescriptor

logger = logging.getLogger(__name__)

DEFAULT_STAGING_BYTES = 1 << 30  # at most 1 GiB per decode rank, and at most a quarter of its KV region


def needs_staging(src_heads: tuple[int, int], dst_heads: tuple[int, int], heads: tuple[int, int]) -> bool:
    """True when moving global heads ``heads`` from a source rank holding ``src_heads`` to a destination rank
    holding ``dst_heads`` is strided on some side (the moved heads are not the whole slot row on both sides)."""
    return heads != src_heads or heads != dst_heads


def row_bytes(src: KVRegionDescriptor) -> int:
    """Bytes of one (layer, K/V, token) row of ``src`` (all its heads); 0 when its rows are not dense (then
    staging is not used)."""
    row = src.size("head") * src.stride_bytes("head")
    return row if src.stride_bytes("slot") == row else 0


def room_staging_bytes(src_ranks: Sequence[dict], dst_ranks: Sequence[dict], num_tokens: int) -> int:
    """Staging bytes one room takes on **every** decode rank: the maximum over the decode ranks of the bytes of
    the whole source rows each stages (the same number on each rank keeps their allocators in lockstep).

    Args:
        src_ranks / dst_ranks: rank infos (``"rank"``, ``"head_lo"``, ``"head_hi"``, ``"kv"`` descriptor dict).
        num_tokens: prompt tokens of the room.
    Returns:
        bytes (0: no decode rank stages).
    """
    best = 0
    for d in dst_ranks:
        dh = (d["head_lo"], d["head_hi"])
        need = 0
        for info, heads in assign_sources(src_ranks, dh):
            src = KVRegionDescriptor.from_dict(info["kv"])
            if needs_staging((info["head_lo"], info["head_hi"]), dh, heads) and row_bytes(src):
                need += src.size("layer") * 2 * num_tokens * row_bytes(src)
        best = max(best, need)
    return best


class StagingArea:
    """A registered byte area on the decode rank's KV device, handed out first-fit in aligned chunks.

    Args:
        backend: the rank's transfer backend (the area is registered with it on creation).
        nbytes: capacity (> 0); device: the KV region's device (``"cpu"`` or ``"cuda:N"``).
    Raises:
        ValueError: non-positive capacity; the backend's error if registration fails.
    """

    ALIGN = 256

    def __init__(self, backend, nbytes: int, device: str):
        from sglang.srt.disaggregation.transfer.base import MemRegion

        if nbytes <= 0:
            raise ValueError(f"staging area size must be positive, got {nbytes}")
        self.buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self.capacity = nbytes
        self.free_list: list[tuple[int, int]] = [(0, nbytes)]  # (offset, size), sorted by offset
        self.pending: list[tuple[int, int, Optional[torch.cuda.Event]]] = []  # freed, waiting for their copy
        backend.register([MemRegion(addr=self.buf.data_ptr(), nbytes=nbytes, device=str(self.buf.device))])
        logger.info("staging area for heterogeneous-TP pulls: %.1f MiB on %s", nbytes / 2**20, device)

    @property
    def base_address(self) -> int:
        """Device address (bytes) of the staging buffer's first byte; offsets from :meth:`alloc` are relative to it."""
        return self.buf.data_ptr()

    def alloc(self, nbytes: int) -> Optional[int]:
        """Offset of a free chunk of ``nbytes`` (rounded up to ``ALIGN``), or None when none is free now."""
        self._reclaim()
        n = -(-nbytes // self.ALIGN) * self.ALIGN
        for i, (off, size) in enumerate(self.free_list):
            if size >= n:
                self.free_list[i:i + 1] = [(off + n, size - n)] if size > n else []
                return off
        return None

    def free(self, offset: int, nbytes: int) -> None:
        """Give a chunk back once the copies queued on the current stream so far (its :func:`unstage`) ran."""
        ev = None
        if self.buf.is_cuda:
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(self.buf.device))
        self.pending.append((offset, -(-nbytes // self.ALIGN) * self.ALIGN, ev))

    def _reclaim(self) -> None:
        # every rank reclaims every pending chunk at the same step (event.synchronize waits, never skips), so the
        # free lists stay identical across decode ranks
        for off, n, ev in self.pending:
            if ev is not None:
                ev.synchronize()
            self.free_list.append((off, n))
        self.pending.clear()
        self.free_list.sort()
        merged: list[tuple[int, int]] = []
        for off, n in self.free_list:
            if merged and merged[-1][0] + merged[-1][1] == off:
                merged[-1] = (merged[-1][0], merged[-1][1] + n)
            else:
                merged.append((off, n))
        self.free_list = merged


def plan_staged_reads(src: KVRegionDescriptor, src_heads: tuple[int, int], src_slots: Sequence[int],
                      stage_addr: int) -> np.ndarray:
    """READ rows ``int64 [L * 2 * T, 3] = (remote, local, nbytes)`` of the whole source rows of ``src_slots`` into
    a staging chunk at ``stage_addr`` laid out ``[layer, K/V, token, source head, head_dim]`` (dense), one row per
    (layer, K/V, run of consecutive prefill slots), layer-major: a whole source row fills a staging slot and the
    staging side is always contiguous, so :func:`plan_slot_copies` merges each run (``L * 2 * runs`` rows)."""
    t, nh = len(src_slots), src.size("head")
    shape = (src.size("layer"), 2, t, nh, src.size("head_dim"))
    strides = (2 * t * nh * shape[4], t * nh * shape[4], nh * shape[4], shape[4], 1)
    stage = KVRegionDescriptor(base_address=stage_addr, device=src.device, dtype=src.dtype, itemsize=src.itemsize,
                               dims=("layer", "kv", "slot", "head", "head_dim"), shape=shape, strides=strides,
                               page_size=1)
    return plan_slot_copies(src, src_heads, src_slots, stage, src_heads, range(t), coalesce=False)


def unstage(kv_data: torch.Tensor, area: StagingArea, offset: int, num_tokens: int, src_heads: tuple[int, int],
            heads: tuple[int, int], dst_heads: tuple[int, int], loc: torch.Tensor) -> None:
    """Copy the global heads ``heads`` of a staged chunk into the decode KV slots ``loc`` (on the current stream).

    Args:
        kv_data: the decode pool's ``[layer, 2, slots, local heads, head_dim]`` tensor (its device and dtype).
        area / offset: the staging chunk holding ``[layer, 2, num_tokens, source heads, head_dim]``.
        src_heads / dst_heads: global head ranges the source / this rank hold; heads: the ones to copy.
        loc: ``int64 [num_tokens]`` decode slots, on ``kv_data``'s device.
    """
    n_layers, _, _, _, hd = kv_data.shape
    nh_src = src_heads[1] - src_heads[0]
    count = n_layers * 2 * num_tokens * nh_src * hd
    esz = kv_data.element_size()
    staged = area.buf[offset:offset + count * esz].view(kv_data.dtype).view(n_layers, 2, num_tokens, nh_src, hd)
    part = staged[:, :, :, heads[0] - src_heads[0]:heads[1] - src_heads[0]]
    dst = kv_data[:, :, :, heads[0] - dst_heads[0]:heads[1] - dst_heads[0]]
    dst.index_copy_(2, loc.to(kv_data.device), part)


class Stager:
    """The decode rank's staged-pull bookkeeping (one per :class:`~sglang.srt.disaggregation.decode.DecodeConnector`):
    the lazily created :class:`StagingArea` and, per room, its chunk ``(offset, nbytes)`` and the staged sources
    ``[(chunk offset, source heads, moved heads, bytes)]``.

    Args:
        backend: the rank's transfer backend; desc: the rank's KV region; heads: global heads this rank holds;
        ranks: every decode rank's info (``"head_lo"``, ``"head_hi"``); capacity: staging bytes (default
        ``min(DEFAULT_STAGING_BYTES, desc.nbytes // 4)``).
    """

    def __init__(self, backend, desc: KVRegionDescriptor, heads: tuple[int, int], ranks: Sequence[dict],
                 capacity: Optional[int] = None):
        self.backend, self.desc, self.heads, self.ranks = backend, desc, heads, ranks
        self.capacity = capacity if capacity is not None else min(DEFAULT_STAGING_BYTES, desc.nbytes // 4)
        self.area: Optional[StagingArea] = None

    def reserve(self, room: int, src_ranks: Sequence[dict], num_tokens: int) -> tuple[bool, Optional[tuple[int, int]]]:
        """``(may post, chunk)``: a chunk taken, or no chunk needed (``(True, None)``: no rank stages, or the room
        is larger than the whole area and reads strided), or ``(False, None)``: the area is full now (retry)."""
        need = room_staging_bytes(src_ranks, self.ranks, num_tokens)
        if need == 0 or need > self.capacity:
            if need:
                logger.warning("room %d needs %d staging bytes > %d: strided reads", room, need, self.capacity)
            return True, None
        if self.area is None:
            self.area = StagingArea(self.backend, self.capacity, self.desc.device)
        off = self.area.alloc(need)
        return (off is not None), (None if off is None else (off, need))

    def plan(self, chunk: Optional[tuple[int, int]], staged: list, info: dict, heads: tuple[int, int],
             src_slots: Sequence[int], dst_slots: Sequence[int]) -> np.ndarray:
        """READ rows for one source rank ``info`` and the global ``heads`` it provides: whole rows into the
        room's chunk (appending to ``staged``) when staging applies, else the strided rows straight into the KV
        slots ``dst_slots``."""
        src = KVRegionDescriptor.from_dict(info["kv"])
        src_heads = (info["head_lo"], info["head_hi"])
        if chunk is None or not needs_staging(src_heads, self.heads, heads) or not row_bytes(src):
            return plan_slot_copies(src, src_heads, src_slots, self.desc, self.heads, dst_slots, heads=heads,
                                    coalesce=False)
        off = chunk[0] + sum(e[3] for e in staged)  # sources one after the other in the chunk
        staged.append((off, src_heads, heads, src.size("layer") * 2 * len(src_slots) * row_bytes(src)))
        return plan_staged_reads(src, src_heads, src_slots, self.area.base_address + off)

    def unstage(self, kv_data: torch.Tensor, chunk: Optional[tuple[int, int]], staged: list,
                loc: torch.Tensor) -> None:
        """Copy this rank's heads of every staged source into ``loc`` (:func:`unstage`), then free the chunk."""
        for off, src_heads, heads, _ in staged:
            unstage(kv_data, self.area, off, len(loc), src_heads, heads, self.heads, loc)
        self.free(chunk)

    def free(self, chunk: Optional[tuple[int, int]]) -> None:
        """Give a room's chunk back (None: nothing)."""
        if chunk is not None:
            self.area.free(*chunk)
