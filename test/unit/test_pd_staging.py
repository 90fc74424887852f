"""Staged pull for heterogeneous TP (``sglang.srt.disaggregation.staging``), without servers: whole prefill rows read
into a staging chunk (executed with ctypes memmove between real KV pools) and unstaged equal direct tensor indexing
for any TP split / page size / slot lists; the READs of contiguous prefill slots coalesce to one per (layer, K/V,
staged source) where the strided plan needs one per token; the staging allocator is first-fit, refuses when full,
and every decode rank reserves the same bytes per room (lockstep)."""

from __future__ import annotations

import ctypes

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang.srt.disaggregation.slot_plan import assign_sources, kv_head_range
from sglang.srt.disaggregation.staging import StagingArea, Stager, room_staging_bytes
from sglang.srt.disaggregation.transfer.base import MemRegion
from sglang.srt.disaggregation.transfer.kv_plan import coalesce_array
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

LAYERS, HEADS, HD = 3, 4, 8


class _Backend:
    """Records registrations (the only backend call staging makes)."""

    def __init__(self):
        self.regions: list[MemRegion] = []

    def register(self, regions):
        self.regions.extend(regions)


LAYOUTS = ("layer_major", "token_major")


def _pool(tp: int, page: int, slots: int = 64, layout: str = "layer_major", dtype=torch.float32,
          scales=None) -> MHATokenToKVPool:
    return MHATokenToKVPool(slots, page, dtype, HEADS // tp if tp <= HEADS else 1, HD, LAYERS, "cpu", layout, scales)


def _infos(pools, tp: int) -> list[dict]:
    return [{"rank": r, "head_lo": kv_head_range(r, tp, HEADS)[0], "head_hi": kv_head_range(r, tp, HEADS)[1],
             "kv": p.describe().to_dict()} for r, p in enumerate(pools)]


def _run(p_tp, d_tp, p_page, d_page, src_slots, dst_slots, full, p_layout="layer_major", d_layout="layer_major",
         dtype=torch.float32, scales=None):
    """Stage + unstage on every decode rank; returns (decode pools, READs after coalescing per decode rank)."""
    src_pools = [_pool(p_tp, p_page, layout=p_layout, dtype=dtype, scales=scales) for _ in range(p_tp)]
    dst_pools = [_pool(d_tp, d_page, layout=d_layout, dtype=dtype, scales=scales) for _ in range(d_tp)]
    for r, pool in enumerate(src_pools):
        lo, hi = kv_head_range(r, p_tp, HEADS)
        pool.kv_layer_view[:, :, src_slots] = full[:, :, :, lo:hi]
    src, dst = _infos(src_pools, p_tp), _infos(dst_pools, d_tp)
    reads = []
    for d, dpool in enumerate(dst_pools):
        dh = (dst[d]["head_lo"], dst[d]["head_hi"])
        stager = Stager(_Backend(), dpool.describe(), dh, dst, capacity=1 << 20)
        ok, chunk = stager.reserve(7, src, len(src_slots))
        assert ok
        staged, n = [], 0
        for info, heads in assign_sources(src, dh):
            rows = coalesce_array(stager.plan(chunk, staged, info, heads, src_slots, dst_slots))
            n += len(rows)
            for s_addr, d_addr, nbytes in rows.tolist():
                ctypes.memmove(d_addr, s_addr, nbytes)
        stager.unstage(dpool.kv_layer_view, chunk, staged, torch.tensor(dst_slots))
        reads.append(n)
    return dst_pools, reads


@settings(max_examples=30, deadline=None)
@given(p_tp=st.sampled_from([1, 2, 4, 8]), d_tp=st.sampled_from([1, 2, 4, 8]), p_page=st.sampled_from([1, 16]),
       d_page=st.sampled_from([1, 16]), n=st.integers(1, 30), seed=st.integers(0, 1000),
       p_layout=st.sampled_from(LAYOUTS), d_layout=st.sampled_from(LAYOUTS))
def test_staged_equals_direct_indexing(p_tp, d_tp, p_page, d_page, n, seed, p_layout, d_layout):
    g = torch.Generator().manual_seed(seed)
    full = torch.randn(LAYERS, 2, n, HEADS, HD, generator=g)
    src_slots = (torch.randperm(60, generator=g)[:n] + p_page).tolist()
    dst_slots = (torch.randperm(60, generator=g)[:n] + d_page).tolist()
    pools, _ = _run(p_tp, d_tp, p_page, d_page, src_slots, dst_slots, full, p_layout, d_layout)
    for d, pool in enumerate(pools):
        lo, hi = kv_head_range(d, d_tp, HEADS)
        torch.testing.assert_close(pool.kv_layer_view[:, :, dst_slots], full[:, :, :, lo:hi], rtol=0, atol=0)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("p_tp,d_tp,sources", [(1, 2, 1), (2, 1, 2), (1, 4, 1), (2, 4, 1)])
def test_contiguous_prefill_slots_coalesce(p_tp, d_tp, sources, layout):
    """TP 1 -> TP 2 with 20 consecutive prefill slots and scattered decode slots: one READ per (layer, K/V) per
    decode rank and staged source (the strided plan had one per (layer, K/V, token)); a token-major source is
    staged in its own order: one READ per staged source, covering every layer."""
    n = 20
    full = torch.randn(LAYERS, 2, n, HEADS, HD)
    pools, reads = _run(p_tp, d_tp, 1, 16, list(range(1, n + 1)), list(range(63, 63 - 3 * n, -3)), full, layout,
                        layout)
    assert reads == [(LAYERS * 2 if layout == "layer_major" else 1) * sources] * d_tp
    for d, pool in enumerate(pools):
        lo, hi = kv_head_range(d, d_tp, HEADS)
        torch.testing.assert_close(pool.kv_layer_view[:, :, list(range(63, 63 - 3 * n, -3))], full[:, :, :, lo:hi],
                                   rtol=0, atol=0)


@pytest.mark.parametrize("p_tp,d_tp", [(1, 2), (2, 1), (2, 4)])
def test_staged_fp8_pools_move_their_bytes(p_tp, d_tp):
    """FP8 KV (one byte per element, per-layer scales in the descriptors): the staging chunk carries the source's
    format, so staged pulls between TP sizes plan and move exactly the source bytes."""
    from sglang.srt.mem_cache.kv_quant import KVScales

    n = 11
    full = torch.randint(0, 126, (LAYERS, 2, n, HEADS, HD), dtype=torch.uint8)  # any FP8 byte but NaN
    scales = KVScales((0.5, 0.25, 0.125), (1.0, 2.0, 4.0), "checkpoint")
    dst_slots = list(range(40, 40 + 2 * n, 2))
    pools, reads = _run(p_tp, d_tp, 1, 16, list(range(1, n + 1)), dst_slots, full, dtype=torch.float8_e4m3fn,
                        scales=scales)
    assert all(r > 0 for r in reads)
    for d, pool in enumerate(pools):
        lo, hi = kv_head_range(d, d_tp, HEADS)
        assert torch.equal(pool.kv_layer_view[:, :, dst_slots], full[:, :, :, lo:hi])


def test_same_heads_need_no_staging():
    pools = [_pool(2, 1) for _ in range(2)]
    infos = _infos(pools, 2)
    assert room_staging_bytes(infos, infos, 10) == 0  # TP 2 -> TP 2: the rows are the moved heads
    one = _infos([_pool(1, 1)], 1)
    per_row = HEADS * HD * 4
    assert room_staging_bytes(one, infos, 10) == LAYERS * 2 * 10 * per_row  # same bytes on both decode ranks
    stager = Stager(_Backend(), pools[0].describe(), (0, 2), infos, capacity=per_row)
    assert stager.reserve(1, one, 10) == (True, None)  # larger than the whole area: strided reads, no chunk


def test_area_first_fit_full_and_reuse():
    b = _Backend()
    area = StagingArea(b, 4096, "cpu")
    assert len(b.regions) == 1 and b.regions[0].nbytes == 4096 and b.regions[0].addr == area.base_address
    a, c = area.alloc(1000), area.alloc(2000)
    assert (a, c) == (0, 1024)
    assert area.alloc(2000) is None  # 1024 bytes left
    area.free(a, 1000)
    assert area.alloc(1024) == 0  # reclaimed at the next alloc
    area.free(0, 1024)
    area.free(c, 2000)
    assert area.alloc(4096) == 0  # neighbours merged
    with pytest.raises(ValueError):
        StagingArea(b, 0, "cpu")
