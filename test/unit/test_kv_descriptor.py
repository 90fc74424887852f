"""KVCache.describe(): bytes read by address arithmetic from the descriptor alone equal direct tensor indexing
(KVDirect's tensor-centric metadata, sec. 4.1), for random (page, layer, K/V, head range), page sizes 1 and 16,
several dtypes; plus the KVCache contract the scheduler relies on."""

from __future__ import annotations

import ctypes
import random

import pytest
import torch

from sglang.srt.mem_cache.kv_cache import KVCache
from sglang.srt.mem_cache.kv_descriptor import KVRegionDescriptor
from sglang.srt.mem_cache.memory_pool import KV_LAYOUTS


def _read(addr: int, n: int) -> bytes:
    return ctypes.string_at(addr, n)


@pytest.mark.parametrize("layout", ["layer_major", "token_major"])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_descriptor_round_trip(page_size, dtype, layout):
    kv = KVCache.create(max_total_tokens=12 * page_size, page_size=page_size, dtype=dtype, head_num=5, head_dim=8,
                        layer_num=3, req_rows=4, max_context_len=64, device="cpu", layout=layout)
    pool = kv.token_to_kv_pool
    gen = torch.Generator().manual_seed(page_size)
    pool.kv_data.copy_(torch.randn(pool.kv_data.shape, generator=gen).to(dtype))  # fresh random, never zeros
    desc = KVRegionDescriptor.from_dict(kv.describe().to_dict())  # as a peer receives it
    assert desc.dims == KV_LAYOUTS[layout] and desc.num_pages == 13
    rng = random.Random(page_size * 7 + desc.itemsize)
    for _ in range(200):
        page, layer, which = rng.randrange(desc.num_pages), rng.randrange(3), rng.randrange(2)
        lo = rng.randrange(5)
        hi = rng.randrange(lo + 1, 6)
        got = b"".join(_read(a, n) for a, n in desc.block_ranges(page, layer, which, lo, hi))
        buf = pool.get_key_buffer(layer) if which == 0 else pool.get_value_buffer(layer)
        want = buf[page * page_size:(page + 1) * page_size, lo:hi].contiguous()
        assert got == want.view(torch.uint8).numpy().tobytes()
    full = desc.block_ranges(3, 1, 0)
    if layout == "layer_major":  # a whole page of one (layer, K/V) is one read
        assert len(full) == 1 and full[0][1] == page_size * 5 * 8 * desc.itemsize
    else:  # token-major: one range per slot of that (layer, K/V); a slot's layers are adjacent instead
        assert len(full) == page_size and desc.stride_bytes("slot") == 3 * 2 * 5 * 8 * desc.itemsize
    slot = rng.randrange(desc.size("slot"))
    addr = desc.element_address(layer=2, kv=1, slot=slot, head=4, head_dim=7)
    assert _read(addr, desc.itemsize) == pool.get_value_buffer(2)[slot, 4, 7:8].view(torch.uint8).numpy().tobytes()


def test_descriptor_rejects_bad_input():
    kv = KVCache.create(max_total_tokens=32, page_size=16, dtype=torch.float32, head_num=2, head_dim=4, layer_num=1,
                        req_rows=2, max_context_len=8, device="cpu")
    desc = kv.describe()
    with pytest.raises(ValueError, match="head range"):
        desc.block_ranges(0, 0, 0, 1, 1)
    with pytest.raises(ValueError, match="page"):
        desc.block_ranges(desc.num_pages, 0, 0)
    with pytest.raises(ValueError, match="layer=1"):
        desc.element_address(layer=1, kv=0, slot=0, head=0, head_dim=0)
    with pytest.raises(ValueError, match="malformed"):
        KVRegionDescriptor.from_dict({"dims": []})
    with pytest.raises(ValueError, match="same length"):
        KVRegionDescriptor(0, "cpu", "float32", 4, ("layer",), (1, 2), (2, 1), 1)


def test_kv_region_is_one_contiguous_tensor():
    kv = KVCache.create(max_total_tokens=64, page_size=4, dtype=torch.float16, head_num=2, head_dim=8, layer_num=4,
                        req_rows=2, max_context_len=8, device="cpu")
    pool = kv.token_to_kv_pool
    assert pool.kv_data.is_contiguous() and pool.kv_size_bytes() == kv.describe().nbytes
    for layer in range(4):
        k, v = pool.get_kv_buffer(layer)
        assert k.is_contiguous() and v.is_contiguous()
        assert k.data_ptr() == pool.kv_data[layer, 0].data_ptr() and v.data_ptr() == pool.kv_data[layer, 1].data_ptr()
    tok = KVCache.create(max_total_tokens=64, page_size=4, dtype=torch.float16, head_num=2, head_dim=8, layer_num=4,
                         req_rows=2, max_context_len=8, device="cpu", layout="token_major").token_to_kv_pool
    assert tok.kv_data.is_contiguous() and tok.kv_data.shape == (68, 4, 2, 2, 8)  # [slot, layer, K/V, head, dim]
    for layer in range(4):
        k, v = tok.get_kv_buffer(layer)
        assert k.shape == (68, 2, 8) and k.stride() == (4 * 2 * 2 * 8, 8, 1) and not k.is_contiguous()
        assert k.data_ptr() == tok.kv_data[0, layer, 0].data_ptr()
        assert v.data_ptr() == tok.kv_data[0, layer, 1].data_ptr()
    with pytest.raises(ValueError, match="layout"):
        KVCache.create(max_total_tokens=64, page_size=4, dtype=torch.float16, head_num=2, head_dim=8, layer_num=4,
                       req_rows=2, max_context_len=8, device="cpu", layout="slot_major")


def test_kv_cache_alloc_free_and_accounting():
    kv = KVCache.create(max_total_tokens=64, page_size=4, dtype=torch.float32, head_num=1, head_dim=2, layer_num=1,
                        req_rows=3, max_context_len=32, device="cpu")
    total = kv.max_total_tokens
    row = kv.alloc_req_slot()
    loc = kv.alloc_extend([row], [0], [10], [-1])
    assert loc is not None and loc.numel() == 10 and torch.equal(kv.slots_of(row, 0, 10).long(), loc)
    assert kv.available_size() == total - 12  # 3 pages
    loc2 = kv.alloc_extend([row], [10], [11], kv.last_slots([row], [9]))
    assert int(loc2[0]) == int(loc[-1]) + 1  # continues the partly filled page
    assert kv.alloc_extend([row], [11], [11 + total], kv.last_slots([row], [10])) is None
    assert kv.available_size() == total - 12
    row2 = kv.alloc_req_slot()  # the decode side's allocation: the same slots on the device and on the host
    loc3, host = kv.alloc_extend_with_host([row2], [0], [5], [-1])
    assert host.device.type == "cpu" and torch.equal(loc3.cpu(), host)
    assert torch.equal(kv.slots_of(row2, 0, 5).long(), host)
    assert not set(host.tolist()) & set(kv.slots_of(row, 0, 11).tolist())
    assert kv.alloc_extend_with_host([row2], [5], [5 + total], kv.last_slots([row2], [4])) is None
    kv.free_slots(host)
    kv.free_req_slot(row2)
    assert kv.available_size() == total - 12
    kv.free_slots(kv.slots_of(row, 0, 11))
    kv.free_req_slot(row)
    assert kv.available_size() == total
    with pytest.raises(ValueError, match="double free"):
        kv.free_req_slot(row)
