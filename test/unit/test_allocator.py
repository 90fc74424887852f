"""Tests of the paged KV slot allocator (sglang.srt.mem_cache.allocator)."""

import random

import pytest
import torch

from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator

PAGE_SIZES = [1, 4, 16]


def _usable_slots(alloc):
    return set(range(alloc.page_size, (alloc.num_pages + 1) * alloc.page_size))


def _free_slots(alloc):
    pages = alloc.free_page_ids()
    return {int(p) * alloc.page_size + o for p in pages for o in range(alloc.page_size)}


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_size_rounding_and_initial_state(page_size):
    rng = random.Random(page_size)
    size = page_size * rng.randint(3, 20) + rng.randint(0, page_size - 1)
    a = TokenToKVPoolAllocator(size, page_size, "cpu")
    assert a.size == size // page_size * page_size
    assert a.available_size() == a.size
    assert _free_slots(a) == _usable_slots(a)  # dummy page 0 never free


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_alloc_free_round_trip(page_size):
    rng = random.Random(100 + page_size)
    a = TokenToKVPoolAllocator(page_size * 32, page_size, "cpu")
    held = []
    for _ in range(60):
        if held and rng.random() < 0.4:
            a.free(held.pop(rng.randrange(len(held))))
        else:
            got = a.alloc(page_size * rng.randint(1, 5))
            if got is not None:
                assert got.dtype == torch.int64
                held.append(got)
        taken = [int(x) for t in held for x in t]
        assert len(taken) == len(set(taken))
        assert set(taken).isdisjoint(_free_slots(a))
        assert set(taken) | _free_slots(a) == _usable_slots(a)
        assert a.available_size() == a.size - len(taken)
    for t in held:
        a.free(t)
    assert a.available_size() == a.size


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_exhaustion_returns_none_and_takes_nothing(page_size):
    a = TokenToKVPoolAllocator(page_size * 5, page_size, "cpu")
    first = a.alloc(page_size * 3)
    assert first is not None
    before = a.available_size()
    assert a.alloc(page_size * 3) is None
    assert a.alloc_extend([0, 0], [page_size + 1, page_size], [-1, -1]) is None  # needs 3 pages, 2 free
    assert a.available_size() == before
    rest = a.alloc(before)
    assert rest is not None and a.available_size() == 0
    assert a.alloc_decode([1], [-1]) is None
    a.free(torch.cat([first, rest]))
    assert a.available_size() == a.size


def test_alloc_rejects_partial_pages():
    a = TokenToKVPoolAllocator(64, 4, "cpu")
    with pytest.raises(ValueError, match="multiple of page_size"):
        a.alloc(3)
    with pytest.raises(ValueError):
        a.alloc(-1)


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_double_free_raises(page_size):
    a = TokenToKVPoolAllocator(page_size * 8, page_size, "cpu")
    got = a.alloc(page_size * 2)
    a.free(got)
    avail = a.available_size()
    with pytest.raises(ValueError, match="double free"):
        a.free(got[:1])
    assert a.available_size() == avail
    with pytest.raises(ValueError, match="usable range"):
        a.free(torch.tensor([0]))  # the dummy page


@pytest.mark.parametrize("page_size", [4, 16])
def test_page_freed_once_for_several_slots(page_size):
    a = TokenToKVPoolAllocator(page_size * 4, page_size, "cpu")
    got = a.alloc(page_size)
    a.free(got[torch.randperm(page_size)[:3]])  # three slots of one page -> one page back
    assert a.available_size() == a.size


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_alloc_extend_and_decode_continue_pages(page_size):
    """Simulate requests growing by random chunks; slot % page == position % page, pages never shared."""
    rng = random.Random(7 * page_size)
    a = TokenToKVPoolAllocator(page_size * 200 + 2000, page_size, "cpu")
    rows = [[] for _ in range(5)]
    for step in range(40):
        reqs = rng.sample(range(5), rng.randint(1, 5))
        pre = [len(rows[r]) for r in reqs]
        if step % 2:
            seq = [p + 1 for p in pre]
            last = [rows[r][-1] if rows[r] else -1 for r in reqs]
            out = a.alloc_decode(seq, last)
        else:
            seq = [p + rng.randint(0, 2 * page_size + 3) for p in pre]
            last = [rows[r][-1] if rows[r] else -1 for r in reqs]
            out = a.alloc_extend(pre, seq, last)
        assert out is not None and out.dtype == torch.int64
        assert out.numel() == sum(s - p for s, p in zip(seq, pre))
        off = 0
        for r, p, s in zip(reqs, pre, seq):
            rows[r].extend(int(x) for x in out[off:off + s - p])
            off += s - p
    all_slots = [x for row in rows for x in row]
    assert len(all_slots) == len(set(all_slots))
    owner = {}
    for r, row in enumerate(rows):
        for pos, slot in enumerate(row):
            assert slot % page_size == pos % page_size
            assert slot >= page_size
            assert owner.setdefault(slot // page_size, r) == r  # a page belongs to one request
    used_pages = sum(-(-len(row) // page_size) for row in rows)
    assert a.available_size() == a.size - used_pages * page_size
    for row in rows:
        if row:
            a.free(torch.tensor(row))
    assert a.available_size() == a.size


def test_alloc_extend_validates_arguments():
    a = TokenToKVPoolAllocator(64, 4, "cpu")
    with pytest.raises(ValueError, match="same length"):
        a.alloc_extend([0], [1, 2], [-1])
    with pytest.raises(ValueError, match=">= prefix_len"):
        a.alloc_extend([3], [2], [6])
    with pytest.raises(ValueError, match="last_loc"):
        a.alloc_extend([3], [5], [8])  # slot 8 holds position 0 mod 4, not position 2
    with pytest.raises(ValueError, match=">= 1"):
        a.alloc_decode([0], [-1])


@pytest.mark.parametrize("page_size", [1, 4])
def test_free_group_batches(page_size):
    a = TokenToKVPoolAllocator(page_size * 10, page_size, "cpu")
    x, y = a.alloc(page_size * 2), a.alloc(page_size * 3)
    a.free_group_begin()
    a.free(x)
    a.free(y)
    assert a.available_size() == page_size * 5
    a.free_group_end()
    assert a.available_size() == a.size


def test_clear_resets():
    a = TokenToKVPoolAllocator(40, 4, "cpu")
    a.alloc(16)
    a.clear()
    assert a.available_size() == 40
    assert _free_slots(a) == _usable_slots(a)


def test_constructor_validates():
    with pytest.raises(ValueError):
        TokenToKVPoolAllocator(10, 0, "cpu")
    with pytest.raises(ValueError):
        TokenToKVPoolAllocator(3, 4, "cpu")
