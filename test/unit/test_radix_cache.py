"""Tests of RadixCache and ChunkCache (sglang.srt.mem_cache), against real pools and allocators."""

import random
from dataclasses import dataclass, field
from typing import Any, List

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
from sglang.srt.mem_cache.chunk_cache import ChunkCache
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
from sglang.srt.mem_cache.radix_cache import RadixCache


@dataclass
class FakeReq:
    origin_input_ids: List[int]
    req_pool_idx: int = -1
    output_ids: List[int] = field(default_factory=list)
    kv_len: int = 0
    prefix_indices: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    last_node: Any = None

    def tokens(self):
        return self.origin_input_ids + self.output_ids


class Env:
    """A cache over a real ReqToTokenPool + allocator, driving requests like the scheduler does."""

    def __init__(self, page_size, num_pages, max_reqs=8, ctx=128, cache_cls=RadixCache, seed=0):
        self.P = page_size
        self.pool = ReqToTokenPool(max_reqs, ctx, "cpu")
        self.alloc = TokenToKVPoolAllocator(page_size * num_pages, page_size, "cpu")
        self.cache = cache_cls(self.pool, self.alloc)
        self.rng = random.Random(seed)
        self.live: List[FakeReq] = []
        self.evictions: List[tuple] = []  # (asked, freed) of evictions done by extend()

    def admit(self, tokens):
        idx = self.pool.alloc(1)
        if idx is None:
            return None
        m = self.cache.match_prefix(tokens)
        self.cache.inc_lock_ref(m.last_node)
        req = FakeReq(list(tokens), req_pool_idx=idx[0], kv_len=m.device_indices.numel(),
                      prefix_indices=m.device_indices, last_node=m.last_node)
        self.pool.write(req.req_pool_idx, 0, m.device_indices)
        self.live.append(req)
        return req

    def row(self, req):
        return self.pool.req_to_token[req.req_pool_idx, :req.kv_len].to(torch.int64)

    def extend(self, req, n):
        """Give ``req`` KV slots for ``n`` more tokens (generating outputs as needed); False if out of KV."""
        while len(req.tokens()) < req.kv_len + n:
            req.output_ids.append(self.rng.randint(1, 50))
        pre, seq = req.kv_len, req.kv_len + n
        last = int(self.pool.req_to_token[req.req_pool_idx, pre - 1]) if pre else -1
        for attempt in range(2):
            out = (self.alloc.alloc_decode([seq], [last]) if n == 1
                   else self.alloc.alloc_extend([pre], [seq], [last]))
            if out is not None:
                break
            if attempt == 0:
                self.evictions.append((n + self.P, self.cache.evict(n + self.P)))
        if out is None:
            return False
        assert out.numel() == n
        self.pool.write(req.req_pool_idx, pre, out)
        req.kv_len = seq
        return True

    def finish(self, req):
        self.cache.cache_finished_req(req)
        self.live.remove(req)

    def check_accounting(self):
        """Every usable page is exactly one of: free, held by the tree, owned by one live request."""
        P = self.P
        free = self.alloc.free_page_ids().tolist()
        held = self.cache.held_indices()
        tree_pages = torch.unique(held // P).tolist() if held.numel() else []
        assert held.numel() == self.cache.total_size() == len(tree_pages) * P
        req_pages = []
        for r in self.live:
            own = self.row(r)[len(r.prefix_indices):]
            req_pages += torch.unique(own // P).tolist() if own.numel() else []
        everything = free + tree_pages + req_pages
        assert len(everything) == len(set(everything)) == self.alloc.num_pages
        assert set(everything) == set(range(1, self.alloc.num_pages + 1))
        assert self.cache.evictable_size() + self.cache.protected_size() == self.cache.total_size()
        for r in self.live:  # a request's prefix is the start of its row
            assert torch.equal(self.row(r)[:len(r.prefix_indices)], r.prefix_indices)


def _slots(alloc, n):
    out = alloc.alloc(n)
    assert out is not None
    return out


# ---------------------------------------------------------------------------------------------- unit tests
def test_insert_match_split_page1():
    env = Env(1, 64)
    c = env.cache
    a = [5, 6, 7, 8, 9]
    va = _slots(env.alloc, 5)
    assert c.insert(a, va) == 0
    m = c.match_prefix([5, 6, 7, 1, 2])
    assert torch.equal(m.device_indices, va[:3])
    assert m.last_node.key == [5, 6, 7]  # split exactly at the match end
    assert [ch.key for ch in m.last_node.children.values()] == [[8, 9]]
    assert c.total_size() == 5
    b = [5, 6, 7, 3]
    vb = _slots(env.alloc, 4)
    assert c.insert(b, vb) == 3  # caller frees vb[:3] (duplicates)
    env.alloc.free(vb[:3])
    assert torch.equal(c.match_prefix(b).device_indices, torch.cat([va[:3], vb[3:]]))
    assert torch.equal(c.match_prefix(a + [1]).device_indices, va)
    assert c.match_prefix([6, 5]).device_indices.numel() == 0
    assert c.match_prefix([]).last_node is c.root_node
    assert c.evictable_size() == c.total_size() == 6
    with pytest.raises(ValueError, match="len"):
        c.insert([1, 2], va[:1])


def test_page_aligned_match_and_insert():
    env = Env(4, 32)
    c = env.cache
    key = [env.rng.randint(1, 9) for _ in range(10)]
    v = env.alloc.alloc_extend([0], [10], [-1])
    assert c.insert(key, v) == 0
    assert c.total_size() == 8  # the partial last page is not cached
    env.alloc.free(v[8:])
    assert torch.equal(c.match_prefix(key[:7] + [99]).device_indices, v[:4])
    assert torch.equal(c.match_prefix(key).device_indices, v[:8])
    other = key[:5] + [key[5] + 100] + key[6:]
    assert torch.equal(c.match_prefix(other).device_indices, v[:4])  # mismatch inside page 2
    w = env.alloc.alloc(8)
    assert c.insert(other[:8], w) == 4
    env.alloc.free(w[:4])
    assert torch.equal(c.match_prefix(other).device_indices, torch.cat([v[:4], w[4:]]))
    env.check_accounting()


def test_lru_eviction_order():
    env = Env(1, 64)
    c = env.cache
    seqs = {name: [base + i for i in range(n)] for name, base, n in (("a", 10, 3), ("b", 20, 4), ("c", 30, 5))}
    vals = {}
    for name, s in seqs.items():
        vals[name] = _slots(env.alloc, len(s))
        c.insert(s, vals[name])
    c.match_prefix(seqs["a"])  # a becomes most recent: LRU order is b, c, a
    free0 = env.alloc.available_size()
    assert c.evict(1) == 4
    assert c.match_prefix(seqs["b"]).device_indices.numel() == 0
    assert c.match_prefix(seqs["c"]).device_indices.numel() == 5  # refreshes c: order now a, c
    assert c.evict(3) == 3
    assert c.match_prefix(seqs["a"]).device_indices.numel() == 0
    assert env.alloc.available_size() == free0 + 7
    assert c.evict(100) == 5 and c.total_size() == 0
    assert c.evict(1) == 0


def test_evict_walks_up_to_parents():
    env = Env(1, 64)
    c = env.cache
    va = _slots(env.alloc, 4)
    c.insert([1, 2, 3, 4], va)
    vb = _slots(env.alloc, 4)
    assert c.insert([1, 2, 7, 8], vb) == 2
    env.alloc.free(vb[:2])
    assert c.total_size() == 6
    assert c.evict(6) == 6  # both leaves, then their freed-up parent [1, 2]
    assert c.total_size() == 0
    env.check_accounting()


def test_locks_protect_from_eviction():
    env = Env(1, 64)
    c = env.cache
    va, vb = _slots(env.alloc, 6), _slots(env.alloc, 3)
    c.insert([1, 2, 3, 4, 5, 6], va)
    c.insert([9, 8, 7], vb)
    node = c.match_prefix([1, 2, 3, 4, 5, 6]).last_node
    c.inc_lock_ref(node)
    c.inc_lock_ref(node)
    assert c.protected_size() == 6 and c.evictable_size() == 3
    m = c.match_prefix([1, 2, 3])  # split inside a locked node: both halves stay locked
    assert m.last_node.lock_ref == 2
    assert c.evict(100) == 3
    assert torch.equal(c.match_prefix([1, 2, 3, 4, 5, 6]).device_indices, va)
    c.dec_lock_ref(node)
    assert c.evict(100) == 0
    c.dec_lock_ref(node)
    assert c.protected_size() == 0 and c.evictable_size() == 6
    with pytest.raises(ValueError, match="not locked"):
        c.dec_lock_ref(node)
    assert c.evict(1) == 3  # the split left two nodes; the leaf goes first
    assert c.evict(1) == 3 and c.total_size() == 0


def test_reset_frees_everything_and_refuses_with_locks():
    env = Env(4, 16)
    c = env.cache
    v = env.alloc.alloc(12)
    c.insert(list(range(1, 13)), v)
    node = c.match_prefix(list(range(1, 9))).last_node
    c.inc_lock_ref(node)
    with pytest.raises(ValueError, match="locked"):
        c.reset()
    c.dec_lock_ref(node)
    c.reset()
    assert c.total_size() == 0 and env.alloc.available_size() == env.alloc.size


@pytest.mark.parametrize("page_size", [1, 4])
def test_chunked_prefill_then_finish(page_size):
    env = Env(page_size, 32, seed=page_size)
    c = env.cache
    prompt = [env.rng.randint(1, 50) for _ in range(11)]
    r = env.admit(prompt)
    assert r.kv_len == 0
    for chunk in (6, 5):
        assert env.extend(r, chunk)
        c.cache_unfinished_req(r)
        aligned = r.kv_len // page_size * page_size
        assert r.prefix_indices.numel() == aligned and r.last_node.lock_ref == 1
        assert torch.equal(c.match_prefix(prompt[:aligned]).device_indices, r.prefix_indices)
        assert c.protected_size() == aligned
        env.check_accounting()
    assert env.extend(r, 1)  # one decode step
    env.check_accounting()
    expect = env.row(r)[: r.kv_len // page_size * page_size]
    env.finish(r)
    assert r.last_node is None and r.prefix_indices.numel() == 0
    assert c.protected_size() == 0 and env.pool.available_size() == 8
    env.check_accounting()
    r2 = env.admit(r.tokens())
    assert torch.equal(r2.prefix_indices, expect)
    with pytest.raises(ValueError, match="already released"):
        c.cache_finished_req(r)


@pytest.mark.parametrize("page_size", [1, 4])
def test_duplicate_requests_free_duplicates(page_size):
    env = Env(page_size, 40, seed=10 + page_size)
    prompt = [env.rng.randint(1, 50) for _ in range(9)]
    r1, r2 = env.admit(prompt), env.admit(prompt)  # both miss: computed twice
    assert env.extend(r1, 9) and env.extend(r2, 9)
    env.check_accounting()
    before = env.alloc.available_size()
    env.finish(r1)
    env.check_accounting()
    kept = env.cache.total_size()
    assert kept == 9 // page_size * page_size
    env.finish(r2)  # all of r2's slots are duplicates or unaligned tail
    env.check_accounting()
    assert env.cache.total_size() == kept
    assert env.alloc.available_size() == before + 2 * (-(-9 // page_size) * page_size) - kept


def test_chunk_cache():
    env = Env(4, 16, cache_cls=ChunkCache)
    c = env.cache
    r = env.admit([3, 1, 4, 1, 5, 9])
    assert r.kv_len == 0 and r.last_node is None
    assert env.extend(r, 6)
    c.cache_unfinished_req(r)
    assert torch.equal(r.prefix_indices, env.row(r))
    assert c.match_prefix([3, 1, 4, 1, 5, 9]).device_indices.numel() == 0
    assert env.extend(r, 1)
    c.cache_finished_req(r)
    assert env.alloc.available_size() == env.alloc.size and env.pool.available_size() == 8
    assert c.evict(10) == 0 and c.total_size() == c.evictable_size() == c.protected_size() == 0


# ---------------------------------------------------------------------------------------------- property test
def _tree_pages(cache):
    """Reference view of the tree: {page-aligned token prefix: its last page's slots}."""
    P = cache.page_size
    out = {}
    stack = [(cache.root_node, ())]
    while stack:
        node, prefix = stack.pop()
        for ch in node.children.values():
            toks = prefix
            for j in range(0, len(ch.key), P):
                toks = toks + tuple(ch.key[j:j + P])
                out[toks] = tuple(ch.value[j:j + P].tolist())
            stack.append((ch, toks))
    return out


def _model_match(model, key, P):
    slots = []
    for j in range(P, len(key) + 1, P):
        page = model.get(tuple(key[:j]))
        if page is None:
            break
        slots.extend(page)
    return slots


def _model_insert(model, tokens, row, P):
    for j in range(P, len(tokens) // P * P + 1, P):
        model.setdefault(tuple(tokens[:j]), tuple(row[j - P:j].tolist()))


def _check_eviction(env, model, asked, freed):
    """Check one evict(asked) -> freed against the model before it; returns the model after it."""
    c, P = env.cache, env.P
    after = _tree_pages(c)
    assert all(model.get(k) == v for k, v in after.items())  # retained pages keep their slots
    assert all(k[:j] in after for k in after for j in range(P, len(k), P))  # only leaves went
    assert freed == (len(model) - len(after)) * P
    assert freed >= asked or c.evictable_size() == 0
    for r in env.live:  # locked prefixes survive
        assert _model_match(after, r.tokens()[:len(r.prefix_indices)], P) == r.prefix_indices.tolist()
    return after


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), page_size=st.sampled_from([1, 4]))
def test_property_random_interleavings(data, page_size):
    env = Env(page_size, 32 if page_size == 1 else 10, max_reqs=4, ctx=96,
              seed=data.draw(st.integers(0, 2**16)))
    c, P = env.cache, page_size
    model = {}
    seqs = []
    ops = data.draw(st.lists(st.sampled_from(["new", "extend", "extend", "unfinished", "finish", "evict", "match"]),
                             min_size=20, max_size=60))
    for op in ops:
        if op == "new":
            base = data.draw(st.sampled_from(seqs)) if seqs and data.draw(st.booleans()) else []
            cut = data.draw(st.integers(0, len(base)))
            tokens = base[:cut] + data.draw(st.lists(st.integers(1, 4), min_size=0 if cut else 1, max_size=12))
            expect = _model_match(model, tokens, P)
            r = env.admit(tokens)
            if r is not None:
                assert r.prefix_indices.tolist() == expect
                if expect:
                    event("admitted with a cached prefix")
                seqs.append(tokens)
        elif op in ("extend", "unfinished", "finish") and env.live:
            r = data.draw(st.sampled_from(env.live))
            if op == "extend":
                if not env.extend(r, data.draw(st.integers(1, 9))):
                    event("out of KV")
                for n, freed in env.evictions:
                    event("extend had to evict")
                    model = _check_eviction(env, model, n, freed)
                env.evictions.clear()
            else:
                _model_insert(model, r.tokens()[:r.kv_len], env.row(r), P)
                if op == "unfinished":
                    c.cache_unfinished_req(r)
                    assert r.prefix_indices.numel() == r.kv_len // P * P
                else:
                    seqs.append(r.tokens()[:r.kv_len])
                    env.finish(r)
                assert _tree_pages(c) == model
        elif op == "evict":
            n = data.draw(st.integers(0, 64))
            if c.protected_size():
                event("evict with locked nodes")
            model = _check_eviction(env, model, n, c.evict(n))
        elif op == "match":
            key = data.draw(st.sampled_from(seqs)) if seqs else []
            key = key[:data.draw(st.integers(0, len(key)))] + data.draw(st.lists(st.integers(1, 4), max_size=4))
            assert c.match_prefix(key).device_indices.tolist() == _model_match(model, key, P)
        env.check_accounting()
    for r in list(env.live):
        env.finish(r)
        env.check_accounting()
    assert c.protected_size() == 0
    c.reset()
    assert c.total_size() == 0
    assert env.alloc.available_size() == env.alloc.size
    assert env.pool.available_size() == env.pool.size
