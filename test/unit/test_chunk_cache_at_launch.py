"""Overlap scheduling with non-final prefill chunks cached at launch: the next batch is built without waiting for the
chunk's result (no sync), outputs and the cache equal the old behaviour (``SGLANG_CHUNK_CACHE_AT_LAUNCH=0``) and
overlap off, and a chunk whose tokens another request already put in the tree waits for its result as before. The
radix cache's read-only prefix probe matches ``match_prefix`` without changing the tree."""

from __future__ import annotations

import os
import random
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_overlap_schedule import kv_all_returned, make, run_all, submit, workload  # noqa: E402

from sglang.srt.managers.scheduler import Scheduler  # noqa: E402
from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool  # noqa: E402
from sglang.srt.mem_cache.radix_cache import RadixCache  # noqa: E402


def _count_syncs(monkeypatch) -> list:
    """Record every in-flight batch the scheduler waited for before building the next one."""
    waits = []
    orig = Scheduler._needs_result_first

    def spy(self, batch):
        need = orig(self, batch)
        if need:
            waits.append(batch.forward_index)
        return need

    monkeypatch.setattr(Scheduler, "_needs_result_first", spy)
    return waits


def _long_prompts(s, n: int, seed: int) -> None:
    rng = random.Random(seed)
    for i in range(n):  # distinct prompts of 20..90 tokens: most span several 16-token chunks
        submit(s, f"c{i}", [rng.randrange(3, 500) for _ in range(rng.randrange(20, 90))],
               max_new_tokens=rng.randrange(1, 12), ignore_eos=True)


@pytest.mark.parametrize("page_size", [1, 4])
def test_chunks_cached_at_launch_need_no_sync_and_change_nothing(monkeypatch, page_size):
    results, waits = {}, {}
    for mode in ("off", "overlap_old", "overlap_new"):
        monkeypatch.setenv("SGLANG_CHUNK_CACHE_AT_LAUNCH", "0" if mode == "overlap_old" else "1")
        w = _count_syncs(monkeypatch)
        s, runner = make(mode != "off", page_size=page_size, chunked_prefill_size=16, max_total_tokens=2048)
        try:
            _long_prompts(s, 10, seed=page_size)
            results[mode] = run_all(s)
            assert kv_all_returned(s, runner)
        finally:
            s.close()
        waits[mode] = len(w)
    assert results["overlap_new"] == results["off"] == results["overlap_old"]
    assert waits["overlap_old"] > 5  # every launched non-final chunk made the old loop wait
    assert waits["overlap_new"] == 0


def test_shared_prefixes_outputs_match(monkeypatch):
    """Requests with common prefixes (the workload of the overlap equality test) at chunk size 16: at-launch caching
    gives the same outputs as overlap off."""
    monkeypatch.setenv("SGLANG_CHUNK_CACHE_AT_LAUNCH", "1")
    results = {}
    for overlap in (False, True):
        s, runner = make(overlap, chunked_prefill_size=16, max_total_tokens=1024)
        try:
            workload(random.Random(4), s, 24)
            results[overlap] = run_all(s)
            assert kv_all_returned(s, runner)
        finally:
            s.close()
    for rid in results[False]:
        assert results[True][rid]["ids"] == results[False][rid]["ids"], rid
    assert len(results[True]) == 24


def test_chunk_with_tokens_already_in_tree_is_not_cached_at_launch():
    """``_cache_chunk_now`` refuses (and leaves the tree alone) when the tree holds more of the request's tokens than
    its own prefix (another request inserted them: caching now would free this request's duplicate slots and
    rewrite its slot map under the running forward); it caches when the tree holds exactly the request's prefix."""
    from types import SimpleNamespace

    class Tree:
        def __init__(self, held):
            self.held, self.cached = held, []

        def cached_prefix_len(self, key):
            return min(self.held, len(key))

        def cache_unfinished_req(self, req):
            self.cached.append(req)

    s, _ = make(True)
    try:
        req = SimpleNamespace(kv_len=48, fill_ids=list(range(60)), prefix_indices=torch.arange(16))
        s.tree_cache = Tree(held=32)  # someone else's 16 tokens beyond the request's own prefix
        assert s._cache_chunk_now(req) is False and s.tree_cache.cached == []
        s.tree_cache = Tree(held=16)  # exactly the request's own prefix
        assert s._cache_chunk_now(req) is True and s.tree_cache.cached == [req]
    finally:
        s.close()


def test_bad_switch_value_raises(monkeypatch):
    monkeypatch.setenv("SGLANG_CHUNK_CACHE_AT_LAUNCH", "yes")
    with pytest.raises(ValueError, match="SGLANG_CHUNK_CACHE_AT_LAUNCH"):
        make(True)


@pytest.mark.parametrize("page_size", [1, 2])
def test_cached_prefix_len_is_a_read_only_match(page_size):
    gen = torch.Generator().manual_seed(page_size)
    alloc = TokenToKVPoolAllocator(512, page_size, "cpu")
    tree = RadixCache(ReqToTokenPool(4, 64, "cpu"), alloc)
    rng = random.Random(page_size)
    base = [rng.randrange(100) for _ in range(24)]
    for n, tail in ((24, []), (10, [7, 7, 7, 7]), (16, [1, 2])):
        key = base[:n] + tail
        key = key[: len(key) // page_size * page_size]
        tree.insert(key, alloc.alloc(len(key)))
    for _ in range(30):
        probe = base[: rng.randrange(0, 30)] + [rng.randrange(100) for _ in range(rng.randrange(0, 5))]
        nodes_before = [(id(nd), list(nd.key), nd.last_access) for nd in tree._nodes()]
        got = tree.cached_prefix_len(probe)
        assert [(id(nd), list(nd.key), nd.last_access) for nd in tree._nodes()] == nodes_before
        assert got == len(tree.match_prefix(probe).device_indices)
    del gen
