"""Tests of ReqToTokenPool and MHATokenToKVPool (sglang.srt.mem_cache.memory_pool)."""

import random

import pytest
import torch

from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool


def test_req_to_token_pool_alloc_free():
    rng = random.Random(3)
    pool = ReqToTokenPool(8, 32, "cpu")
    assert pool.req_to_token.shape == (8, 32) and pool.req_to_token.dtype == torch.int32
    held = set()
    for _ in range(50):
        if held and rng.random() < 0.5:
            i = rng.choice(sorted(held))
            pool.free(i)
            held.remove(i)
        else:
            n = rng.randint(1, 3)
            got = pool.alloc(n)
            if n > 8 - len(held):
                assert got is None
            else:
                assert len(got) == n and not set(got) & held
                held |= set(got)
        assert pool.available_size() == 8 - len(held)
    pool.free(sorted(held))
    assert pool.available_size() == 8


def test_req_to_token_pool_double_free_and_range():
    pool = ReqToTokenPool(4, 16, "cpu")
    a, b = pool.alloc(2)
    pool.free(a)
    with pytest.raises(ValueError, match="double free"):
        pool.free(a)
    with pytest.raises(ValueError, match="double free"):
        pool.free([b, b])
    assert pool.available_size() == 3  # the failed call freed nothing
    with pytest.raises(ValueError, match="out of range"):
        pool.free(4)
    with pytest.raises(ValueError):
        ReqToTokenPool(0, 16, "cpu")


def test_req_to_token_pool_write():
    pool = ReqToTokenPool(2, 16, "cpu")
    vals = torch.randint(1, 1000, (5,), dtype=torch.int64)
    pool.write(1, 3, vals)
    assert torch.equal(pool.req_to_token[1, 3:8], vals.to(torch.int32))
    with pytest.raises(ValueError, match="max_context_len"):
        pool.write(1, 14, vals)


@pytest.mark.parametrize("layout", ["layer_major", "token_major"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("page_size", [1, 4])
def test_kv_pool_set_get(dtype, page_size, layout):
    torch.manual_seed(0)
    H, D, L, size = 3, 8, 2, 24
    pool = MHATokenToKVPool(size, page_size, dtype, H, D, L, "cpu", layout)
    assert pool.get_key_buffer(0).shape == (size + page_size, H, D)
    ref_k = {l: {} for l in range(L)}
    for layer in range(L):
        loc = torch.randperm(size)[:7] + page_size
        k = torch.randn(7, H, D, dtype=torch.float64)
        v = torch.randn(7, H, D, dtype=torch.float64)
        pool.set_kv_buffer(layer, loc, k, v)
        kb, vb = pool.get_kv_buffer(layer)
        assert kb.dtype == dtype
        torch.testing.assert_close(kb[loc], k.to(dtype))
        torch.testing.assert_close(vb[loc], v.to(dtype))
        ref_k[layer] = (loc, k.to(dtype))
    # layers are independent buffers
    loc0, k0 = ref_k[0]
    torch.testing.assert_close(pool.get_key_buffer(0)[loc0], k0)
    torch.testing.assert_close(pool.kv_layer_view[0, 0, loc0], k0)  # the [layer, K/V, slot, ...] view of any layout
    with pytest.raises(ValueError):
        pool.set_kv_buffer(0, torch.tensor([page_size]), torch.randn(1, H, D + 1), torch.randn(1, H, D + 1))
    with pytest.raises(ValueError):
        pool.get_key_buffer(L)


@pytest.mark.skipif(not hasattr(torch, "float8_e4m3fn"), reason="torch build has no float8_e4m3fn")
@pytest.mark.parametrize("layout", ["layer_major", "token_major"])
def test_kv_pool_fp8_storage(layout):
    pool = MHATokenToKVPool(8, 1, torch.float8_e4m3fn, 2, 4, 2, "cpu", layout)
    k = torch.randn(3, 2, 4)
    v = torch.randn(3, 2, 4)
    loc = torch.tensor([1, 5, 7])
    pool.set_kv_buffer(0, loc, k, v)
    kb = pool.get_key_buffer(0)
    assert kb.dtype == torch.float8_e4m3fn
    torch.testing.assert_close(kb[loc].float(), k.to(torch.float8_e4m3fn).float())


def test_sizes():
    H, D, L = 4, 16, 3
    for dtype, layout in ((torch.float16, "layer_major"), (torch.float32, "layer_major"),
                          (torch.float16, "token_major")):
        pool = MHATokenToKVPool(10, 2, dtype, H, D, L, "cpu", layout)
        bpt = MHATokenToKVPool.bytes_per_token(H, D, L, dtype)
        elem = torch.tensor([], dtype=dtype).element_size()
        assert bpt == 2 * H * D * L * elem
        assert pool.kv_size_bytes() == bpt * (10 + 2)
    with pytest.raises(ValueError):
        MHATokenToKVPool(10, 0, torch.float16, H, D, L, "cpu")


@pytest.mark.parametrize("lens_kind", ["decode", "extend"])
def test_write_batch_equals_per_row_writes(lens_kind):
    gen = torch.Generator().manual_seed(7 if lens_kind == "decode" else 8)
    size, ctx = 9, 40
    a, b = ReqToTokenPool(size, ctx, "cpu"), ReqToTokenPool(size, ctx, "cpu")
    fill = torch.randint(1, 10_000, (size, ctx), generator=gen, dtype=torch.int32)
    a.req_to_token.copy_(fill)
    b.req_to_token.copy_(fill)
    rows = torch.randperm(size, generator=gen)[:6].tolist()
    if lens_kind == "decode":
        lens = [1] * len(rows)
    else:
        lens = torch.randint(0, 8, (len(rows),), generator=gen).tolist()
    starts = [int(torch.randint(0, ctx - ln + 1, (1,), generator=gen)) for ln in lens]
    values = torch.randint(1, 1 << 20, (sum(lens),), generator=gen, dtype=torch.int64)
    a.write_batch(rows, starts, lens, values)
    off = 0
    for r, st, ln in zip(rows, starts, lens):
        b.write(r, st, values[off:off + ln])
        off += ln
    assert torch.equal(a.req_to_token, b.req_to_token)
    assert not torch.equal(a.req_to_token, fill)  # something was written


def test_write_batch_rejects_bad_arguments():
    pool = ReqToTokenPool(4, 16, "cpu")
    with pytest.raises(ValueError, match="same length"):
        pool.write_batch([0, 1], [0], [1, 1], torch.arange(2))
    with pytest.raises(ValueError, match="values for sum"):
        pool.write_batch([0, 1], [0, 0], [2, 2], torch.arange(3))
    with pytest.raises(ValueError, match="max_context_len"):
        pool.write_batch([0], [10], [7], torch.arange(7))


def test_host_to_device_on_cpu_keeps_values_and_casts():
    from sglang.srt.utils.tensor_transfer import host_to_device, ints_to_device

    x = torch.randint(-5, 5, (3, 4), generator=torch.Generator().manual_seed(3))
    y = host_to_device(x, "cpu", torch.int32)
    assert y.dtype == torch.int32 and torch.equal(y.to(torch.int64), x)
    assert ints_to_device([3, -1, 7], "cpu").tolist() == [3, -1, 7]


@pytest.mark.parametrize("bs", [1, 3, 8])
def test_columns_to_device_packed_equals_separate(bs):
    """The packed one-copy transfer of the sampling columns (used on CUDA) gives the same dtypes, shapes and values
    as separate tensors, for odd batch sizes too (alignment of the int64 / float32 / bool views)."""
    from sglang.srt.utils.tensor_transfer import columns_to_device

    rnd = torch.Generator().manual_seed(bs)
    cols = [(torch.rand(bs, generator=rnd).tolist(), torch.float32),
            (torch.randint(1, 128256, (bs,), generator=rnd).tolist(), torch.int64),
            ((torch.rand(bs, generator=rnd) > 0.5).tolist(), torch.bool),
            (torch.rand(bs, generator=rnd).tolist(), torch.float32),
            (torch.randint(-5, 5, (bs + 1,), generator=rnd).tolist(), torch.int32)]
    packed = columns_to_device(cols, "cpu", pack=True)
    plain = columns_to_device(cols, "cpu")
    for a, b, (vals, dt) in zip(packed, plain, cols):
        assert a.dtype == b.dtype == dt and a.shape == b.shape == (len(vals),)
        assert torch.equal(a, b) and a.tolist() == torch.tensor(vals, dtype=dt).tolist()
    assert len({t.untyped_storage().data_ptr() for t in packed}) == 1  # one buffer, one copy
