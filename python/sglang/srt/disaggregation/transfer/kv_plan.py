"""Tensor-centric address arithmetic and block coalescing (KVDirect, Chen et al. 2024, sec. 4.1-4.2).

``TRANSFER(remote pages -> local pages)`` becomes byte ranges by index x stride on both sides' published
:class:`~sglang.srt.mem_cache.kv_descriptor.KVRegionDescriptor` (Fig. 5), with no round trip to the
prefill worker per block. The mapping is token-level, so the two sides may use different page sizes,
and head-level, so a decode TP rank reads exactly the KV heads it owns from each prefill TP rank through
strided ranges: no staging buffer and no re-layout kernel (prefill TP != decode TP).

Two granularities:

* :func:`plan_kv_reads` returns one :class:`ReadOp` per *block*: the largest run of tokens of one
  (layer, K/V) that stays in one remote page and one local page and is contiguous on both sides (one
  page when all heads move; one token when a head subset moves, since heads of the next token are not
  adjacent).
* :func:`coalesce` merges consecutive ops when **both** the remote and the local ranges are contiguous
  (sec. 4.2), which is what turns thousands of 4 KB reads into a few large ones when pages were allocated
  contiguously.

The ``*_array`` variants work on ``int64`` numpy arrays ``[N, 3] = (remote_addr, local_addr, nbytes)``
for large plans; the list versions wrap them.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Iterable, Optional, Sequence

import numpy as np

from sglang.srt.disaggregation.transfer.base import ReadOp
from sglang.srt.mem_cache.kv_descriptor import KVRegionDescriptor, check_same_format


def tp_head_range(total_kv_heads: int, tp_size: int, tp_rank: int) -> tuple[int, int]:
    """Global KV-head range ``[lo, hi)`` held by ``tp_rank`` under SGLang's sharding rule.

    ``total_kv_heads >= tp_size``: each rank holds ``total_kv_heads // tp_size`` consecutive heads (must
    divide). Otherwise heads are replicated: rank ``r`` holds the single head ``r * total_kv_heads //
    tp_size``.

    Raises:
        ValueError: non-positive sizes, rank out of range, or heads not divisible by ``tp_size``.
    """
    if total_kv_heads <= 0 or tp_size <= 0 or not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_head_range: total_kv_heads={total_kv_heads}, tp_size={tp_size}, "
                         f"tp_rank={tp_rank} must satisfy heads > 0 and 0 <= rank < tp_size")
    if total_kv_heads >= tp_size:
        if total_kv_heads % tp_size:
            raise ValueError(f"total_kv_heads={total_kv_heads} is not divisible by tp_size={tp_size}")
        per = total_kv_heads // tp_size
        return tp_rank * per, (tp_rank + 1) * per
    h = tp_rank * total_kv_heads // tp_size
    return h, h + 1


def with_tp(desc: KVRegionDescriptor, tp_rank: int, tp_size: int, total_kv_heads: int) -> KVRegionDescriptor:
    """``desc`` annotated with the global heads its TP rank holds (``head_offset``, ``total_heads``).

    Raises:
        ValueError: the region's head count differs from what the rank should hold.
    """
    lo, hi = tp_head_range(total_kv_heads, tp_size, tp_rank)
    if desc.size("head") != hi - lo:
        raise ValueError(f"TP rank {tp_rank}/{tp_size} should hold {hi - lo} of {total_kv_heads} KV heads, but "
                         f"its region has {desc.size('head')}")
    return replace(desc, head_offset=lo, total_heads=total_kv_heads)


def pick_sources(remotes: Sequence[KVRegionDescriptor], local: KVRegionDescriptor
                 ) -> list[tuple[int, tuple[int, int]]]:
    """Which remote (prefill) ranks a local (decode) rank reads, and which global heads from each.

    Args:
        remotes: the descriptors of all prefill TP ranks, index = rank (annotated, see :func:`with_tp`).
        local: this decode rank's descriptor.
    Returns:
        ``[(remote_rank, (head_lo, head_hi)), ...]`` covering the local heads exactly once (a head
        replicated on several prefill ranks is read from the first that holds it).
    Raises:
        ValueError: model head counts differ, or some local head is held by no remote rank.
    """
    lo, hi = local.global_heads
    out: list[tuple[int, tuple[int, int]]] = []
    h = lo
    while h < hi:
        for rank, r in enumerate(remotes):
            if r.model_heads != local.model_heads:
                raise ValueError(f"prefill rank {rank} has {r.model_heads} model KV heads, decode {local.model_heads}")
            rlo, rhi = r.global_heads
            if rlo <= h < rhi:
                end = min(rhi, hi)
                if out and out[-1][0] == rank and out[-1][1][1] == h:
                    out[-1] = (rank, (out[-1][1][0], end))
                else:
                    out.append((rank, (h, end)))
                h = end
                break
        else:
            raise ValueError(f"KV head {h} is held by no prefill rank")
    return out


def _slots(pages: Sequence[int], page_size: int, num_tokens: int, num_pages: int, side: str) -> np.ndarray:
    p = np.asarray(pages, dtype=np.int64).reshape(-1)
    if p.size and (p.min() < 0 or p.max() >= num_pages):
        raise ValueError(f"{side} page ids must lie in [0, {num_pages}); got min {p.min()}, max {p.max()}")
    if num_tokens > p.size * page_size:
        raise ValueError(f"{num_tokens} tokens need {-(-num_tokens // page_size)} {side} pages of {page_size}, "
                         f"got {p.size}")
    t = np.arange(num_tokens, dtype=np.int64)
    return p[t // page_size] * page_size + t % page_size


def _check_pair(remote: KVRegionDescriptor, local: KVRegionDescriptor) -> None:
    for d in (remote, local):
        if d.stride_bytes("head_dim") != d.itemsize or d.stride_bytes("head") != d.size("head_dim") * d.itemsize:
            raise ValueError("plan_kv_reads needs (head, head_dim) dense in each slot on both sides")
    check_same_format(remote, local, "remote", "local")  # dtype, element size, FP8 scales (no conversion on the wire)
    if remote.size("head_dim") != local.size("head_dim") or remote.size("layer") != local.size("layer"):
        raise ValueError(f"head_dim/layers differ: remote {remote.size('head_dim')}/{remote.size('layer')}, local "
                         f"{local.size('head_dim')}/{local.size('layer')}")
    if remote.model_heads != local.model_heads:
        raise ValueError(f"model KV heads differ: remote {remote.model_heads}, local {local.model_heads}")


def plan_kv_reads_array(remote: KVRegionDescriptor, local: KVRegionDescriptor, remote_pages: Sequence[int],
                        local_pages: Sequence[int], num_tokens: Optional[int] = None,
                        layers: Optional[Iterable[int]] = None, heads: Optional[tuple[int, int]] = None
                        ) -> np.ndarray:
    """Per-block ops as ``int64 [N, 3] = (remote_addr, local_addr, nbytes)`` (see :func:`plan_kv_reads`)."""
    _check_pair(remote, local)
    if num_tokens is None:
        nr, nl = len(remote_pages) * remote.page_size, len(local_pages) * local.page_size
        if nr != nl:
            raise ValueError(f"remote pages hold {nr} tokens, local pages {nl}; pass num_tokens")
        num_tokens = nr
    if num_tokens < 0:
        raise ValueError(f"num_tokens={num_tokens} must be >= 0")
    if heads is None:
        heads = (max(remote.global_heads[0], local.global_heads[0]), min(remote.global_heads[1],
                                                                          local.global_heads[1]))
    h_lo, h_hi = heads
    if h_lo >= h_hi or num_tokens == 0:
        return np.zeros((0, 3), dtype=np.int64)
    for d, side in ((remote, "remote"), (local, "local")):
        if not (d.global_heads[0] <= h_lo and h_hi <= d.global_heads[1]):
            raise ValueError(f"heads [{h_lo}, {h_hi}) are not all held by the {side} region {d.global_heads}")
    layer_ids = np.arange(remote.size("layer")) if layers is None else np.asarray(list(layers), dtype=np.int64)
    if layer_ids.size and (layer_ids.min() < 0 or layer_ids.max() >= remote.size("layer")):
        raise ValueError(f"layers must lie in [0, {remote.size('layer')})")
    rs = _slots(remote_pages, remote.page_size, num_tokens, remote.num_pages, "remote")
    ls = _slots(local_pages, local.page_size, num_tokens, local.num_pages, "local")
    nbytes = (h_hi - h_lo) * remote.stride_bytes("head")

    def addrs(d: KVRegionDescriptor, slots: np.ndarray) -> np.ndarray:  # [L, 2, T]
        base = d.base_address + (h_lo - d.head_offset) * d.stride_bytes("head")
        lay = layer_ids[:, None, None] * d.stride_bytes("layer")
        kv = np.arange(2, dtype=np.int64)[None, :, None] * d.stride_bytes("kv")
        return base + lay + kv + slots[None, None, :] * d.stride_bytes("slot")

    ra, la = addrs(remote, rs).reshape(-1, num_tokens), addrs(local, ls).reshape(-1, num_tokens)
    t = np.arange(num_tokens)
    page_edge = (t % remote.page_size == 0) | (t % local.page_size == 0)  # a block never crosses a page
    start = np.empty(ra.shape, dtype=bool)
    start[:, 0] = True
    start[:, 1:] = page_edge[None, 1:] | (ra[:, 1:] != ra[:, :-1] + nbytes) | (la[:, 1:] != la[:, :-1] + nbytes)
    return _runs(ra.reshape(-1), la.reshape(-1), np.full(ra.size, nbytes, np.int64), start.reshape(-1))


def _runs(ra: np.ndarray, la: np.ndarray, nb: np.ndarray, start: np.ndarray) -> np.ndarray:
    idx = np.flatnonzero(start)
    sizes = np.add.reduceat(nb, idx) if idx.size else np.zeros(0, np.int64)
    return np.stack([ra[idx], la[idx], sizes], axis=1).astype(np.int64)


def plan_kv_reads(remote: KVRegionDescriptor, local: KVRegionDescriptor, remote_pages: Sequence[int],
                  local_pages: Sequence[int], num_tokens: Optional[int] = None,
                  layers: Optional[Iterable[int]] = None, heads: Optional[tuple[int, int]] = None
                  ) -> list[ReadOp]:
    """Byte ranges that copy a request's KV from ``remote`` pages into ``local`` pages, one op per block.

    Token ``t`` (``0 <= t < num_tokens``) lives in remote slot ``remote_pages[t // Pr] * Pr + t % Pr`` and
    local slot ``local_pages[t // Pl] * Pl + t % Pl`` (``Pr``, ``Pl``: the two page sizes). For each
    layer in ``layers``, K then V, and each token, the global KV heads ``heads`` are copied; heads are
    translated into each side's local head index with its ``head_offset``. Ops come in (layer, K/V,
    token) order, ready for :func:`coalesce`.

    Args:
        remote, local: region descriptors (same dtype, head_dim, layers and model KV heads).
        remote_pages, local_pages: page ids in token order (``int``; page 0 is the pool's dummy page).
        num_tokens: tokens to move (default: all slots of the pages; required when the counts differ,
            e.g. a partial last page).
        layers: layer ids (default all). heads: global ``[lo, hi)`` (default: the heads both hold).
    Returns:
        ``list[ReadOp]`` (empty when the two regions share no heads).
    Raises:
        ValueError: incompatible layouts, pages/layers/heads out of range, too few pages.
    """
    arr = plan_kv_reads_array(remote, local, remote_pages, local_pages, num_tokens, layers, heads)
    return ops_from_array(arr)


def ops_from_array(arr: np.ndarray) -> list[ReadOp]:
    """``[N, 3]`` int array -> ``list[ReadOp]``."""
    return [ReadOp(int(r), int(l), int(n)) for r, l, n in arr.tolist()]


def ops_to_array(ops: Sequence[ReadOp]) -> np.ndarray:
    """``list[ReadOp]`` -> ``int64 [N, 3]``."""
    return np.array([(o.remote_addr, o.local_addr, o.nbytes) for o in ops], dtype=np.int64).reshape(-1, 3)


def coalesce_array(arr: np.ndarray) -> np.ndarray:
    """:func:`coalesce` on an ``[N, 3]`` array (vectorized)."""
    arr = np.asarray(arr, dtype=np.int64).reshape(-1, 3)
    if len(arr) <= 1:
        return arr.copy()
    ra, la, nb = arr[:, 0], arr[:, 1], arr[:, 2]
    start = np.ones(len(arr), dtype=bool)
    start[1:] = (ra[1:] != ra[:-1] + nb[:-1]) | (la[1:] != la[:-1] + nb[:-1])
    return _runs(ra, la, nb, start)


def coalesce(ops: Sequence[ReadOp]) -> list[ReadOp]:
    """Merge consecutive ops when **both** the remote and the local ranges are contiguous (KVDirect sec.
    4.2): op ``b`` joins the run ending with ``a`` iff ``b.remote_addr == a.remote_addr + a.nbytes`` and
    ``b.local_addr == a.local_addr + a.nbytes``. Order is kept (no sorting), so the result moves exactly
    the same bytes to the same places; ``len(result) <= len(ops)``.
    """
    out: list[ReadOp] = []
    for op in ops:
        if out:
            a = out[-1]
            if op.remote_addr == a.remote_addr + a.nbytes and op.local_addr == a.local_addr + a.nbytes:
                out[-1] = ReadOp(a.remote_addr, a.local_addr, a.nbytes + op.nbytes)
                continue
        out.append(op)
    return out
