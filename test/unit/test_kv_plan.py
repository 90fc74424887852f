"""KVDirect address arithmetic (sec. 4.1) and coalescing (sec. 4.2), property-tested against direct tensor
indexing: pages of one side copied by the planned byte ranges land exactly where indexing says, for page
sizes 1/4/16 on either side and prefill TP != decode TP (1->2, 2->1, 2->4, replicated heads)."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang.srt.disaggregation.transfer.base import ReadOp
from sglang.srt.disaggregation.transfer.kv_plan import (coalesce, coalesce_array, ops_to_array, pick_sources,
                                                        plan_kv_reads, plan_kv_reads_array, tp_head_range, with_tp)
from sglang.srt.mem_cache.kv_cache import KVCache

LAYERS, HEAD_DIM = 3, 4


def _pool(pages: int, page_size: int, heads: int, seed: int, dtype=torch.float32):
    kv = KVCache.create(max_total_tokens=pages * page_size, page_size=page_size, dtype=dtype, head_num=heads,
                        head_dim=HEAD_DIM, layer_num=LAYERS, req_rows=2, max_context_len=8, device="cpu")
    data = kv.token_to_kv_pool.kv_data
    data.copy_(torch.randn(data.shape, generator=torch.Generator().manual_seed(seed)).to(dtype))  # never zeros
    return kv, data


def _apply(ops):
    for o in ops:
        ctypes.memmove(o.local_addr, o.remote_addr, o.nbytes)


def _slots(pages, page_size, n):
    return [pages[t // page_size] * page_size + t % page_size for t in range(n)]


@settings(max_examples=40, deadline=None)
@given(data=st.data(), pr=st.sampled_from([1, 4, 16]), pl=st.sampled_from([1, 4, 16]))
def test_plan_equals_tensor_indexing(data, pr, pl):
    n_tok = data.draw(st.integers(1, 48), label="num_tokens")
    rkv, rt = _pool(64 // pr + 4, pr, heads=2, seed=pr)
    lkv, lt = _pool(64 // pl + 4, pl, heads=2, seed=100 + pl)
    rpages = data.draw(st.permutations(range(1, rkv.describe().num_pages)), label="rp")[: -(-n_tok // pr)]
    lpages = data.draw(st.permutations(range(1, lkv.describe().num_pages)), label="lp")[: -(-n_tok // pl)]
    before = lt.clone()
    ops = plan_kv_reads(rkv.describe(), lkv.describe(), rpages, lpages, num_tokens=n_tok)
    merged = coalesce(ops)
    assert len(merged) <= len(ops) and sum(o.nbytes for o in merged) == sum(o.nbytes for o in ops)
    assert sum(o.nbytes for o in ops) == LAYERS * 2 * n_tok * 2 * HEAD_DIM * 4
    _apply(data.draw(st.sampled_from([ops, merged]), label="which"))
    rs, ls = _slots(rpages, pr, n_tok), _slots(lpages, pl, n_tok)
    want = before.clone()
    want[:, :, ls] = rt[:, :, rs]
    assert torch.equal(lt, want)  # requested slots equal the source, every other byte untouched


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("total_heads,tp_p,tp_d", [(4, 1, 2), (4, 2, 1), (4, 2, 4), (2, 2, 4), (8, 2, 4)])
def test_heterogeneous_tp_reads_exact_heads(page_size, total_heads, tp_p, tp_d):
    """Each decode rank reads exactly its KV heads from the prefill rank(s) holding them, in place."""
    n_tok = 3 * page_size + 1
    gen = torch.Generator().manual_seed(total_heads * 10 + tp_p)
    full = torch.randn((LAYERS, 2, 8 * page_size, total_heads, HEAD_DIM), generator=gen)  # the model's KV
    rng = np.random.default_rng(page_size + tp_d)
    src_pages = (rng.permutation(np.arange(1, 8))[: -(-n_tok // page_size)]).tolist()
    prefill = []
    for r in range(tp_p):
        lo, hi = tp_head_range(total_heads, tp_p, r)
        kv, t = _pool(7, page_size, hi - lo, seed=r)  # 7 pages + the dummy page = full's 8 * page_size slots
        t.copy_(full[:, :, : t.shape[2], lo:hi])
        prefill.append((kv, with_tp(kv.describe(), r, tp_p, total_heads)))
    for d in range(tp_d):
        lo, hi = tp_head_range(total_heads, tp_d, d)
        kv, t = _pool(10, page_size, hi - lo, seed=50 + d)
        local = with_tp(kv.describe(), d, tp_d, total_heads)
        dst_pages = rng.permutation(np.arange(1, 11))[: len(src_pages)].tolist()
        before = t.clone()
        sources = pick_sources([p[1] for p in prefill], local)
        assert sum(h1 - h0 for _, (h0, h1) in sources) == hi - lo  # every owned head read exactly once
        for rank, heads in sources:
            ops = plan_kv_reads(prefill[rank][1], local, src_pages, dst_pages, num_tokens=n_tok, heads=heads)
            _apply(coalesce(ops))
        rs, ls = _slots(src_pages, page_size, n_tok), _slots(dst_pages, page_size, n_tok)
        want = before.clone()
        want[:, :, ls] = full[:, :, rs, lo:hi]
        assert torch.equal(t, want)


def test_posted_reads_count_and_block_granularity():
    """Contiguous pages on both sides coalesce to one read per (layer, K/V); a head subset is per token."""
    ps = 16
    rkv, _ = _pool(20, ps, heads=4, seed=1)
    lkv, _ = _pool(20, ps, heads=4, seed=2)
    r, l = rkv.describe(), lkv.describe()
    ops = plan_kv_reads(r, l, [3, 4, 5, 6], [10, 11, 12, 13])
    assert len(ops) == LAYERS * 2 * 4  # one read per block (page) before coalescing
    assert len(coalesce(ops)) == LAYERS * 2  # contiguous on both sides
    ops = plan_kv_reads(r, l, [3, 4, 5, 6], [10, 11, 13, 14])  # local break after the 2nd page
    assert len(coalesce(ops)) == LAYERS * 2 * 2
    sub = plan_kv_reads(with_tp(r, 0, 1, 4), with_tp(l, 0, 1, 4), [3], [10], heads=(1, 3))
    assert len(sub) == len(coalesce(sub)) == LAYERS * 2 * ps  # strided: heads of the next token are not adjacent
    assert all(o.nbytes == 2 * HEAD_DIM * 4 for o in sub)
    # different page sizes: 16 -> 4, contiguous local pages still coalesce per (layer, K/V)
    l4kv, _ = _pool(80, 4, heads=4, seed=3)
    ops = plan_kv_reads(r, l4kv.describe(), [3, 4], [8, 9, 10, 11, 12, 13, 14, 15])
    assert len(ops) == LAYERS * 2 * 8 and len(coalesce(ops)) == LAYERS * 2


def test_coalesce_rule():
    a = ReadOp(1000, 5000, 10)
    assert coalesce([a, ReadOp(1010, 5010, 6)]) == [ReadOp(1000, 5000, 16)]  # both contiguous
    assert len(coalesce([a, ReadOp(1010, 6000, 6)])) == 2  # remote contiguous only
    assert len(coalesce([a, ReadOp(2000, 5010, 6)])) == 2  # local contiguous only
    assert len(coalesce([ReadOp(1010, 5010, 6), a])) == 2  # order kept, no sorting
    assert coalesce([]) == []


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 3), st.integers(1, 4)), min_size=0, max_size=30))
def test_coalesce_preserves_byte_mapping(steps):
    """Random op streams: coalesce (list and array) maps exactly the same remote byte to the same local byte."""
    ops, r, l = [], 0, 10_000
    for dr, dl, n in steps:  # gaps of 0 keep a side contiguous
        r, l = r + dr, l + dl
        ops.append(ReadOp(r, l, n))
        r, l = r + n, l + n

    def mapping(os):
        return [(o.remote_addr + i, o.local_addr + i) for o in os for i in range(o.nbytes)]

    merged = coalesce(ops)
    assert mapping(merged) == mapping(ops)
    assert np.array_equal(coalesce_array(ops_to_array(ops)), ops_to_array(merged))
    for x, y in zip(merged, merged[1:]):  # maximal: no two neighbours are contiguous on both sides
        assert not (y.remote_addr == x.remote_addr + x.nbytes and y.local_addr == x.local_addr + x.nbytes)


def test_plan_rejects_bad_input():
    rkv, _ = _pool(8, 4, heads=2, seed=1)
    lkv, _ = _pool(8, 4, heads=2, seed=2)
    r, l = rkv.describe(), lkv.describe()
    with pytest.raises(ValueError, match="page ids"):
        plan_kv_reads(r, l, [99], [1])
    with pytest.raises(ValueError, match="pass num_tokens"):
        plan_kv_reads(r, l, [1, 2], [1])
    with pytest.raises(ValueError, match="tokens need"):
        plan_kv_reads(r, l, [1], [1], num_tokens=5)
    bkv, _ = _pool(8, 4, heads=2, seed=3, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="formats differ"):
        plan_kv_reads(r, bkv.describe(), [1], [1])
    with pytest.raises(ValueError, match="not divisible"):
        tp_head_range(6, 4, 0)
    with pytest.raises(ValueError, match="should hold"):
        with_tp(r, 0, 2, 8)
    assert plan_kv_reads_array(with_tp(r, 0, 2, 4), with_tp(l, 1, 2, 4), [1], [1]).shape == (0, 3)  # no shared heads
