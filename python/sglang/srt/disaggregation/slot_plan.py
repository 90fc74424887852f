"""Which bytes move for one request: (prefill rank, decode rank) pairs, their shared KV heads, and the byte
ranges of every (layer, K/V, token) by index x stride arithmetic on the two sides' published
:class:`~sglang.srt.mem_cache.kv_descriptor.KVRegionDescriptor` (KVDirect sec. 4.1, Fig. 5).

Requests are addressed by *token slots*, not pages: the prefill side publishes the slot of each prompt
position and the decode side has its own slots, so the two sides may use different page sizes (a page
is just a run of consecutive slots; runs that are contiguous on both sides merge into one range, sec. 4.2).
Heterogeneous TP: each side's rank holds a range of global KV heads; a decode rank reads exactly the
heads it holds from every prefill rank holding some of them (strided ranges, no staging buffer, no
re-layout). Pure Python, no torch.
"""

from __future__ import annotations

from typing import Sequence

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


def plan_slot_copies(src: KVRegionDescriptor, src_heads: tuple[int, int], src_slots: Sequence[int],
                     dst: KVRegionDescriptor, dst_heads: tuple[int, int], dst_slots: Sequence[int]
                     ) -> list[tuple[int, int, int]]:
    """Byte copies ``[(src_addr, dst_addr, nbytes), ...]`` that move the KV of every layer, K and V, of the
    tokens at ``src_slots[i] -> dst_slots[i]``, for the global KV heads both sides hold.

    ``src_heads`` / ``dst_heads``: global head ranges ``[lo, hi)`` of the two regions (local head 0 is
    global head ``lo``). Copies are emitted layer-major (all of layer 0 first, which push mode writes as
    soon as that layer is done), then K/V, then token order, and merged when both the source and the
    destination continue the previous copy (KVDirect sec. 4.2's rule). Empty when the head ranges do not
    overlap.

    Raises:
        ValueError: mismatched slot lists, a different layer count / head_dim / dtype on the two sides,
            or a slot outside a region.
    """
    if len(src_slots) != len(dst_slots):
        raise ValueError(f"src_slots ({len(src_slots)}) and dst_slots ({len(dst_slots)}) must have the same length")
    for d in ("layer", "kv", "head_dim"):
        if src.size(d) != dst.size(d):
            raise ValueError(f"KV regions differ in {d}: {src.size(d)} vs {dst.size(d)}")
    if src.itemsize != dst.itemsize or src.dtype != dst.dtype:
        raise ValueError(f"KV dtypes differ: {src.dtype} vs {dst.dtype}")
    lo, hi = max(src_heads[0], dst_heads[0]), min(src_heads[1], dst_heads[1])
    if lo >= hi or not src_slots:
        return []
    nbytes = (hi - lo) * src.stride_bytes("head")
    if src.stride_bytes("head_dim") != src.itemsize or src.stride_bytes("head") != src.size("head_dim") * src.itemsize:
        raise ValueError("the source region's (head, head_dim) is not dense")
    s_slot, d_slot = src.stride_bytes("slot"), dst.stride_bytes("slot")
    n_src, n_dst = src.size("slot"), dst.size("slot")
    for a, b in zip(src_slots, dst_slots):
        if not (0 <= a < n_src and 0 <= b < n_dst):
            raise ValueError(f"slot pair ({a}, {b}) outside the regions ({n_src}, {n_dst} slots)")
    out: list[tuple[int, int, int]] = []
    for layer in range(src.size("layer")):
        for kv in range(2):
            s0 = src.base_address + layer * src.stride_bytes("layer") + kv * src.stride_bytes("kv") \
                + (lo - src_heads[0]) * src.stride_bytes("head")
            d0 = dst.base_address + layer * dst.stride_bytes("layer") + kv * dst.stride_bytes("kv") \
                + (lo - dst_heads[0]) * dst.stride_bytes("head")
            for a, b in zip(src_slots, dst_slots):
                sa, da = s0 + a * s_slot, d0 + b * d_slot
                if out and out[-1][0] + out[-1][2] == sa and out[-1][1] + out[-1][2] == da:
                    out[-1] = (out[-1][0], out[-1][1], out[-1][2] + nbytes)
                else:
                    out.append((sa, da, nbytes))
    return out


def copies_by_layer(copies: Sequence[tuple[int, int, int]], desc: KVRegionDescriptor, side: int = 0
                    ) -> list[list[tuple[int, int, int]]]:
    """Split copies from :func:`plan_slot_copies` per layer of ``desc`` (the region of element ``side`` of
    each copy: 0 = source, 1 = destination). A merged copy never spans two layers when a layer's K/V of all
    slots is not adjacent to the next layer's; copies are assigned by their start address."""
    per = desc.stride_bytes("layer")
    out: list[list[tuple[int, int, int]]] = [[] for _ in range(desc.size("layer"))]
    for c in copies:
        layer = min((c[side] - desc.base_address) // per, desc.size("layer") - 1)
        out[layer].append(c)
    return out
