"""Staged pull for heterogeneous TP (KVDirect, Chen et al. 2024, sec. 4.1-4.2, with prefill TP != decode TP).

With the layer-major KV pool (``[layer, K/V, slot, head, head_dim]``; token-major pools likewise have a slot's
heads dense), when a decode rank holds a different head
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
from sglang.srt.mem_cache.memory_pool import LAYER_VIEW_DIMS

logger = logging.getLogger(__name__)

DEFAULT_STAGING_BYTES = 1 << 30  # at most 1 GiB per decode rank, and at most a quarter of its KV region


def needs_staging(src_heads: tuple[int, int], dst_heads: tuple[int, int], heads: tuple[int, int]) -> bool:
    """True when moving global heads ``heads`` from a source rank holding ``src_heads`` to a destination rank
    holding ``dst_heads`` is strided on some side (the moved heads are not the whole slot row on both sides)."""
    return heads != src_heads or heads != dst_heads


def row_bytes(src: KVRegionDescriptor) -> int:
    """Bytes of one (layer, K/V, token) row of ``src`` (all its heads, any storage order); 0 when a row's
    ``(head, head_dim)`` are not dense (then staging is not used)."""
    row = src.size("head") * src.stride_bytes("head")
    item = src.itemsize
    dense = src.stride_bytes("head_dim") == item and src.stride_bytes("head") == src.size("head_dim") * item
    return row if dense else 0


def _dense_strides(dims: Sequence[str], extent: dict) -> tuple[int, ...]:
    """Row-major element strides of a dense tensor with dims ``dims`` (outermost first) of sizes ``extent``."""
    out, step = [], 1
    for d in reversed(dims):
        out.append(step)
        step *= extent[d]
    return tuple(reversed(out))


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
    """READ rows ``int64 [N, 3] = (remote, local, nbytes)`` of the whole source rows of ``src_slots`` into a staging
    chunk at ``stage_addr``, laid out dense in the **source's** storage order (``src.dims``, slot extent
    ``len(src_slots)``): a whole source row fills a staging row and the staging side is always contiguous, so
    :func:`plan_slot_copies` merges each run of consecutive prefill slots (layer-major source: one row per
    (layer, K/V, run); token-major source: one row per run)."""
    t = len(src_slots)
    extent = {d: src.size(d) for d in src.dims}
    extent["slot"] = t
    stage = KVRegionDescriptor(base_address=stage_addr, device=src.device, dtype=src.dtype, itemsize=src.itemsize,
                               dims=src.dims, shape=tuple(extent[d] for d in src.dims),
                               strides=_dense_strides(src.dims, extent), page_size=1,
                               k_scales=src.k_scales, v_scales=src.v_scales)  # the source's bytes, its format
    return plan_slot_copies(src, src_heads, src_slots, stage, src_heads, range(t), coalesce=False)


def unstage(kv_layer_view: torch.Tensor, area: StagingArea, offset: int, num_tokens: int, src_heads: tuple[int, int],
            heads: tuple[int, int], dst_heads: tuple[int, int], loc: torch.Tensor,
            stage_dims: Sequence[str] = LAYER_VIEW_DIMS) -> None:
    """Copy the global heads ``heads`` of a staged chunk into the decode KV slots ``loc`` (on the current stream).

    Args:
        kv_layer_view: the decode pool's ``kv_layer_view``, ``[layer, 2, slots, local heads, head_dim]`` whatever
            its storage order (its device and dtype; a strided view is fine).
        area / offset: the staging chunk holding ``num_tokens`` tokens of ``source heads``, dense in the order
            ``stage_dims`` (the source region's dims, see :func:`plan_staged_reads`).
        src_heads / dst_heads: global head ranges the source / this rank hold; heads: the ones to copy.
        loc: ``int64 [num_tokens]`` decode slots, on ``kv_layer_view``'s device.
    """
    n_layers, _, _, _, hd = kv_layer_view.shape
    extent = {"layer": n_layers, "kv": 2, "slot": num_tokens, "head": src_heads[1] - src_heads[0], "head_dim": hd}
    count = int(np.prod([extent[d] for d in stage_dims]))
    esz = kv_layer_view.element_size()
    staged = area.buf[offset:offset + count * esz].view(kv_layer_view.dtype).view([extent[d] for d in stage_dims])
    staged = staged.permute([list(stage_dims).index(d) for d in LAYER_VIEW_DIMS])  # [layer, 2, token, heads, hd]
    part = staged[:, :, :, heads[0] - src_heads[0]:heads[1] - src_heads[0]]
    dst = kv_layer_view[:, :, :, heads[0] - dst_heads[0]:heads[1] - dst_heads[0]]
    dst.index_copy_(2, loc.to(kv_layer_view.device), part)


class Stager:
    """The decode rank's staged-pull bookkeeping (one per :class:`~sglang.srt.disaggregation.decode.DecodeConnector`):
    the lazily created :class:`StagingArea` and, per room, its chunk ``(offset, nbytes)`` and the staged sources
    ``[(chunk offset, source heads, moved heads, bytes, source dims)]``.

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
        staged.append((off, src_heads, heads, src.size("layer") * 2 * len(src_slots) * row_bytes(src), src.dims))
        return plan_staged_reads(src, src_heads, src_slots, self.area.base_address + off)

    def unstage(self, kv_layer_view: torch.Tensor, chunk: Optional[tuple[int, int]], staged: list,
                loc: torch.Tensor) -> None:
        """Copy this rank's heads of every staged source into ``loc`` (:func:`unstage`; ``kv_layer_view``: the pool's
        ``[layer, 2, slot, head, head_dim]`` view), then free the chunk."""
        for off, src_heads, heads, _, dims in staged:
            unstage(kv_layer_view, self.area, off, len(loc), src_heads, heads, self.heads, loc, dims)
        self.free(chunk)

    def free(self, chunk: Optional[tuple[int, int]]) -> None:
        """Give a room's chunk back (None: nothing)."""
        if chunk is not None:
            self.area.free(*chunk)
