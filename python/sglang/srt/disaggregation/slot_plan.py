"""Which bytes move for one request: (prefill rank, decode rank) pairs, their shared KV heads, and the byte
ranges of every (layer, K/V, token) by index x stride arithmetic on the two sides' published
:class:`~sglang.srt.mem_cache.kv_descriptor.KVRegionDescriptor` (KVDirect sec. 4.1, Fig. 5).

Requests are addressed by *token slots*, not pages: the prefill side publishes the slot of each prompt
position and the decode side has its own slots, so the two sides may use different page sizes (a page
is just a run of consecutive slots; runs that are contiguous on both sides merge into one range, sec. 4.2).
Heterogeneous TP: each side's rank holds a range of global KV heads; a decode rank reads exactly the
heads it holds from every prefill rank holding some of them (strided ranges, no staging buffer, no
re-layout). numpy only, no torch.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from sglang.srt.mem_cache.kv_descriptor import KVRegionDescriptor


def kv_head_range(rank: int, tp_size: int, total_kv_heads: int) -> tuple[int, int]:
    """Global KV heads ``[lo, hi)`` that TP rank ``rank`` of ``tp_size`` holds (the layout of
    :class:`~sglang.srt.layers.linear.QKVParallelLinear`: ``total/tp`` consecutive heads each, or one
    replicated head ``rank // (tp / total)`` when ``tp > total``).

    Raises:
        ValueError: ``rank`` outside ``[0, tp_size)`` or sizes that do not divide.
    """
    if not 0 <= rank < tp_size:
        raise ValueError(f"rank {rank} outside [0, {tp_size})")
    if tp_size <= total_kv_heads:
        if total_kv_heads % tp_size:
            raise ValueError(f"{total_kv_heads} KV heads do not split over tp_size={tp_size}")
        per = total_kv_heads // tp_size
        return rank * per, (rank + 1) * per
    if tp_size % total_kv_heads:
        raise ValueError(f"tp_size={tp_size} is not a multiple of the {total_kv_heads} KV heads")
    h = rank // (tp_size // total_kv_heads)
    return h, h + 1


def assign_sources(src_ranks: Sequence[dict], dst_heads: tuple[int, int]) -> list[tuple[dict, tuple[int, int]]]:
    """Which source ranks provide which of the global KV heads ``dst_heads``: each head from the first rank (in
    rank order) holding it, so a head replicated on several source ranks (TP > KV heads) moves once.

    Args:
        src_ranks: rank infos with ``"rank"``, ``"head_lo"``, ``"head_hi"`` (as the bootstrap route lists them).
    Returns:
        ``[(rank_info, (lo, hi)), ...]`` covering ``dst_heads`` exactly once.
    Raises:
        ValueError: some head is held by no source rank.
    """
    out: list[tuple[dict, tuple[int, int]]] = []
    h, hi = dst_heads
    ranks = sorted(src_ranks, key=lambda i: i["rank"])
    while h < hi:
        for info in ranks:
            if info["head_lo"] <= h < info["head_hi"]:
                end = min(info["head_hi"], hi)
                out.append((info, (h, end)))
                h = end
                break
        else:
            raise ValueError(f"KV head {h} is held by no source rank")
    return out


def readers_of(src_rank: int, src_ranks: Sequence[dict], dst_ranks: Sequence[dict]) -> list[dict]:
    """The destination ranks that read (pull) some KV heads from source rank ``src_rank``, by the same
    :func:`assign_sources` choice the readers make (so a replicated head's second holder is read by nobody).
    The prefill side uses it to know whose COMPLETE it waits for before releasing a request's KV.

    Args:
        src_rank: the source (prefill) rank; src_ranks / dst_ranks: rank infos with ``"rank"``, ``"head_lo"``,
            ``"head_hi"`` (and whatever else, returned unchanged).
    Raises:
        ValueError: some destination head is held by no source rank.
    """
    return [d for d in dst_ranks
            if any(info["rank"] == src_rank for info, _ in assign_sources(src_ranks, (d["head_lo"], d["head_hi"])))]


def plan_slot_copies(src: KVRegionDescriptor, src_heads: tuple[int, int], src_slots: Sequence[int],
                     dst: KVRegionDescriptor, dst_heads: tuple[int, int], dst_slots: Sequence[int],
                     heads: Optional[tuple[int, int]] = None, coalesce: bool = True) -> np.ndarray:
    """Byte copies ``int64 [N, 3] = (src_addr, dst_addr, nbytes)`` that move the KV of every layer, K and V, of
    the tokens at ``src_slots[i] -> dst_slots[i]``, for the global KV heads both sides hold.

    ``src_heads`` / ``dst_heads``: global head ranges ``[lo, hi)`` of the two regions (local head 0 is
    global head ``lo``); ``heads``: move only these global heads (default: all both hold). Rows are layer-major (all of layer 0 first, which push mode writes first), then
    K/V, then token order, and merged by :func:`~sglang.srt.disaggregation.transfer.kv_plan.coalesce_array`
    when both the source and the destination continue the previous copy (KVDirect sec. 4.2's rule);
    ``coalesce=False`` keeps one row per (layer, K/V, run of tokens whose slots continue on both sides and whose
    copied bytes fill the slot rows on both sides), else per (layer, K/V, token); the pull path hands those rows to
    the :class:`~sglang.srt.disaggregation.transfer.queue.TransferQueue`, which coalesces the rest when it pops them.
    Merging token runs before building the rows (O(tokens), not O(layers x tokens)) gives the same copies as
    coalescing the per-token rows: for a 1024-token Llama-3.1-8B prompt 64 rows instead of 65,536 rows coalesced
    (~3 ms of host time per request on the decode side's hand-off, issue 24).
    Vectorized (numpy): thousands of tokens x layers cost milliseconds. Empty ``[0, 3]`` when the head
    ranges do not overlap. For a read, pass the rows as ``(remote, local, nbytes)``; for a write, swap the
    first two columns.

    Raises:
        ValueError: mismatched slot lists, a different layer count / head_dim / dtype on the two sides,
            a non-dense (head, head_dim) layout, or a slot outside a region.
    """
    from sglang.srt.disaggregation.transfer.kv_plan import coalesce_array

    if len(src_slots) != len(dst_slots):
        raise ValueError(f"src_slots ({len(src_slots)}) and dst_slots ({len(dst_slots)}) must have the same length")
    for d in ("layer", "kv", "head_dim"):
        if src.size(d) != dst.size(d):
            raise ValueError(f"KV regions differ in {d}: {src.size(d)} vs {dst.size(d)}")
    if src.itemsize != dst.itemsize or src.dtype != dst.dtype:
        raise ValueError(f"KV dtypes differ: {src.dtype} vs {dst.dtype}")
    for d in (src, dst):
        if d.stride_bytes("head_dim") != d.itemsize or d.stride_bytes("head") != d.size("head_dim") * d.itemsize:
            raise ValueError("plan_slot_copies needs (head, head_dim) dense in each slot on both sides")
    lo, hi = max(src_heads[0], dst_heads[0]), min(src_heads[1], dst_heads[1])
    if heads is not None:
        lo, hi = max(lo, heads[0]), min(hi, heads[1])
    if lo >= hi or len(src_slots) == 0:
        return np.zeros((0, 3), dtype=np.int64)
    ss = np.asarray(src_slots, dtype=np.int64)
    ds = np.asarray(dst_slots, dtype=np.int64)
    for arr, d, side in ((ss, src, "source"), (ds, dst, "destination")):
        if arr.min() < 0 or arr.max() >= d.size("slot"):
            raise ValueError(f"{side} slots must lie in [0, {d.size('slot')}); got [{arr.min()}, {arr.max()}]")
    layers = np.arange(src.size("layer"), dtype=np.int64)
    nbytes = (hi - lo) * src.stride_bytes("head")
    ss, ds, sizes = _token_runs(ss, ds, nbytes, src.stride_bytes("slot"), dst.stride_bytes("slot"))

    def addrs(d: KVRegionDescriptor, heads_lo: int, slots: np.ndarray) -> np.ndarray:  # [L * 2 * runs]
        base = d.base_address + (lo - heads_lo) * d.stride_bytes("head")
        return (base + layers[:, None, None] * d.stride_bytes("layer")
                + np.arange(2, dtype=np.int64)[None, :, None] * d.stride_bytes("kv")
                + slots[None, None, :] * d.stride_bytes("slot")).reshape(-1)

    rows = np.stack([addrs(src, src_heads[0], ss), addrs(dst, dst_heads[0], ds),
                     np.tile(sizes, len(layers) * 2)], axis=1)
    return coalesce_array(rows) if coalesce else rows


def _token_runs(ss: np.ndarray, ds: np.ndarray, nbytes: int, src_slot_stride: int,
                dst_slot_stride: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(first source slot, first destination slot, bytes)`` per run of tokens ``i`` whose slots continue on both
    sides (``ss[i] == ss[i-1] + 1`` and ``ds[i] == ds[i-1] + 1``), ``int64 [runs]`` each. Runs merge only where one
    token's ``nbytes`` fill a whole slot row on both sides (else consecutive tokens leave gaps): then one token per
    run, ``nbytes`` each."""
    if nbytes != src_slot_stride or nbytes != dst_slot_stride or len(ss) <= 1:
        return ss, ds, np.full(len(ss), nbytes, dtype=np.int64)
    start = np.ones(len(ss), dtype=bool)
    start[1:] = (ss[1:] != ss[:-1] + 1) | (ds[1:] != ds[:-1] + 1)
    first = np.flatnonzero(start)
    lengths = np.diff(np.append(first, len(ss)))
    return ss[first], ds[first], lengths.astype(np.int64) * nbytes


def copies_by_layer(copies: np.ndarray, desc: KVRegionDescriptor, side: int = 0) -> list[np.ndarray]:
    """Split the rows of :func:`plan_slot_copies` per layer of ``desc`` (the region of column ``side``:
    0 = source, 1 = destination), by each row's start address."""
    per = desc.stride_bytes("layer")
    layer = np.minimum((copies[:, side] - desc.base_address) // per, desc.size("layer") - 1)
    return [copies[layer == i] for i in range(desc.size("layer"))]
