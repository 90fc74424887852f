"""Radix-tree prefix cache with LRU eviction and reference-counted locks.

RadixAttention (Zheng et al. 2024, "SGLang: Efficient Execution of Structured Language Model
Programs", section 3): a radix tree maps token sequences to the KV slots that hold them; requests
sharing a prefix reuse its slots; unlocked leaves are evicted least-recently-used first.

Every edge holds a page-aligned run of tokens (a multiple of ``page_size``), so a node's slots are
whole pages and can be freed independently. Children are keyed by their first page of tokens.
"""

from __future__ import annotations

import heapq
import itertools
import logging
from typing import Dict, Hashable, List, Optional

import torch

from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import BasePrefixCache, CacheReq, MatchResult
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

logger = logging.getLogger(__name__)


class TreeNode:
    """One edge of the radix tree (tokens ``key``, KV slots ``value``: int64 ``[len(key)]``).

    ``lock_ref`` counts the requests pinning this node (through it or a descendant);
    ``last_access`` is the cache's logical clock at the last match/insert through it.
    """

    __slots__ = ("children", "parent", "key", "value", "lock_ref", "last_access", "node_id")

    def __init__(self, node_id: int, parent: Optional["TreeNode"], key: List[int], value: torch.Tensor):
        self.children: Dict[Hashable, TreeNode] = {}
        self.parent = parent
        self.key = key
        self.value = value
        self.lock_ref = 0
        self.last_access = 0
        self.node_id = node_id

    def __repr__(self) -> str:
        return f"TreeNode(id={self.node_id}, len={len(self.key)}, lock={self.lock_ref}, t={self.last_access})"


class RadixCache(BasePrefixCache):
    """Radix prefix cache over a ``ReqToTokenPool`` and a ``TokenToKVPoolAllocator``.

    Args:
        req_to_token_pool: the request -> slot map (its device is the device of returned indices).
        token_to_kv_pool_allocator: where evicted and duplicate slots are freed; its ``page_size``
            is the cache's page size.

    Contracts of each method: see ``BasePrefixCache``.
    """

    def __init__(self, req_to_token_pool: ReqToTokenPool, token_to_kv_pool_allocator: TokenToKVPoolAllocator):
        self.req_to_token_pool = req_to_token_pool
        self.token_to_kv_pool_allocator = token_to_kv_pool_allocator
        self.page_size = token_to_kv_pool_allocator.page_size
        self.device = req_to_token_pool.device
        self._ids = itertools.count()
        self._clock = itertools.count(1)
        self.root_node = self._new_node(None, [], self._empty())
        self._evictable = 0
        self._protected = 0

    # ---------------------------------------------------------------- helpers
    def _empty(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.int64, device=self.device)

    def _new_node(self, parent: Optional[TreeNode], key: List[int], value: torch.Tensor) -> TreeNode:
        return TreeNode(next(self._ids), parent, key, value)

    def _child_key(self, key: List[int]) -> Hashable:
        return key[0] if self.page_size == 1 else tuple(key[: self.page_size])

    def _match_len(self, a: List[int], b: List[int]) -> int:
        """Length of the common prefix of ``a`` and ``b``, rounded down to a page."""
        n = min(len(a), len(b))
        if self.page_size == 1:
            i = 0
            while i < n and a[i] == b[i]:
                i += 1
            return i
        P = self.page_size
        i = 0
        while i + P <= n and a[i:i + P] == b[i:i + P]:
            i += P
        return i

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        """Split ``child`` after its first ``n`` tokens; returns the new upper node."""
        parent = child.parent
        upper = self._new_node(parent, child.key[:n], child.value[:n])
        upper.lock_ref = child.lock_ref
        upper.last_access = child.last_access
        parent.children[self._child_key(upper.key)] = upper
        child.key = child.key[n:]
        child.value = child.value[n:]
        child.parent = upper
        upper.children[self._child_key(child.key)] = child
        return upper

    def _nodes(self) -> List[TreeNode]:
        """All non-root nodes (DFS order)."""
        out: List[TreeNode] = []
        stack = list(self.root_node.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    def _req_tokens_and_slots(self, req: CacheReq):
        ids = list(req.origin_input_ids) + list(req.output_ids)
        kv_len = req.kv_len
        if kv_len > len(ids):
            raise ValueError(f"req.kv_len={kv_len} exceeds its {len(ids)} tokens (origin_input_ids + output_ids)")
        n_prefix = len(req.prefix_indices)
        if n_prefix > kv_len:
            raise ValueError(f"len(req.prefix_indices)={n_prefix} exceeds req.kv_len={kv_len}")
        slots = self.req_to_token_pool.req_to_token[req.req_pool_idx, :kv_len].to(torch.int64)
        return ids[:kv_len], slots, n_prefix

    # ---------------------------------------------------------------- match / insert
    def match_prefix(self, key: List[int]) -> MatchResult:
        """See ``BasePrefixCache.match_prefix``; returns int64 slots on the request pool's device."""
        t = next(self._clock)
        key = list(key[: len(key) // self.page_size * self.page_size])
        node = self.root_node
        node.last_access = t
        values: List[torch.Tensor] = []
        while key:
            child = node.children.get(self._child_key(key))
            if child is None:
                break
            child.last_access = t
            n = self._match_len(child.key, key)
            if n < len(child.key):
                node = self._split(child, n)
                values.append(node.value)
                break
            values.append(child.value)
            node = child
            key = key[n:]
        indices = torch.cat(values) if values else self._empty()
        return MatchResult(device_indices=indices, last_node=node)

    def cached_prefix_len(self, key: List[int]) -> int:
        """Tokens of ``key`` (page-aligned) the tree holds now, without touching it: no node split, no access-time
        update (:meth:`match_prefix` does both). Used to check that inserting a request's tokens would share no slot
        with another request's (so its slot map stays as it is)."""
        key = list(key[: len(key) // self.page_size * self.page_size])
        node, n_total = self.root_node, 0
        while key:
            child = node.children.get(self._child_key(key))
            if child is None:
                break
            n = self._match_len(child.key, key)
            n_total += n
            if n < len(child.key):
                break
            node, key = child, key[n:]
        return n_total

    def insert(self, key: List[int], value: torch.Tensor) -> int:
        """See ``BasePrefixCache.insert``."""
        if len(key) != value.numel():
            raise ValueError(f"insert: len(key)={len(key)} != len(value)={value.numel()}")
        L = len(key) // self.page_size * self.page_size
        key = list(key[:L])
        value = value.reshape(-1)[:L]
        t = next(self._clock)
        node = self.root_node
        node.last_access = t
        prefix = 0
        while key:
            child = node.children.get(self._child_key(key))
            if child is None:
                break
            child.last_access = t
            n = self._match_len(child.key, key)
            if n < len(child.key):
                child = self._split(child, n)
            prefix += n
            key = key[n:]
            value = value[n:]
            node = child
        if key:
            leaf = self._new_node(node, key, value.to(device=self.device, dtype=torch.int64).clone())
            leaf.last_access = t
            node.children[self._child_key(key)] = leaf
            self._evictable += len(key)
        return prefix

    # ---------------------------------------------------------------- requests
    def cache_finished_req(self, req: CacheReq) -> None:
        """See ``BasePrefixCache.cache_finished_req``.

        Raises:
            ValueError: the request was already released (``last_node`` is None) or its fields disagree.
        """
        if req.last_node is None:
            raise ValueError("cache_finished_req: req.last_node is None (request already released?)")
        ids, slots, n_prefix = self._req_tokens_and_slots(req)
        L = len(ids) // self.page_size * self.page_size
        new_prefix = self.insert(ids[:L], slots[:L])
        if new_prefix < n_prefix:
            raise ValueError(f"cache_finished_req: tree matched {new_prefix} tokens < the {n_prefix} the request "
                             "holds; req.prefix_indices does not match its tokens")
        to_free = torch.cat([slots[n_prefix:new_prefix], slots[L:]])
        self.token_to_kv_pool_allocator.free(to_free)
        self.dec_lock_ref(req.last_node)
        self.req_to_token_pool.free(req.req_pool_idx)
        req.prefix_indices = self._empty()
        req.last_node = None

    def cache_unfinished_req(self, req: CacheReq) -> None:
        """See ``BasePrefixCache.cache_unfinished_req``.

        Raises:
            ValueError: ``last_node`` is None or the request's fields disagree.
        """
        if req.last_node is None:
            raise ValueError("cache_unfinished_req: req.last_node is None; lock the matched node at admission")
        ids, slots, n_prefix = self._req_tokens_and_slots(req)
        L = len(ids) // self.page_size * self.page_size
        new_prefix = self.insert(ids[:L], slots[:L])
        if new_prefix < n_prefix:
            raise ValueError(f"cache_unfinished_req: tree matched {new_prefix} tokens < the {n_prefix} the "
                             "request holds; req.prefix_indices does not match its tokens")
        self.token_to_kv_pool_allocator.free(slots[n_prefix:new_prefix])
        match = self.match_prefix(ids[:L])
        new_indices = match.device_indices
        if new_indices.numel() != L:  # cannot happen: we just inserted ids[:L]
            raise RuntimeError(f"cache_unfinished_req: re-match found {new_indices.numel()} of {L} tokens")
        self.req_to_token_pool.write(req.req_pool_idx, n_prefix, new_indices[n_prefix:])
        self.inc_lock_ref(match.last_node)
        self.dec_lock_ref(req.last_node)
        req.prefix_indices = new_indices
        req.last_node = match.last_node

    # ---------------------------------------------------------------- eviction / locks
    def evict(self, num_tokens: int) -> int:
        """See ``BasePrefixCache.evict``; frees whole nodes, so it may free more than ``num_tokens``."""
        if num_tokens <= 0:
            return 0
        heap = [(n.last_access, n.node_id, n) for n in self._nodes() if not n.children and n.lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        victims: List[torch.Tensor] = []
        while freed < num_tokens and heap:
            _, _, node = heapq.heappop(heap)
            victims.append(node.value)
            freed += len(node.key)
            self._evictable -= len(node.key)
            parent = node.parent
            del parent.children[self._child_key(node.key)]
            node.parent = None
            if parent is not self.root_node and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, parent.node_id, parent))
        if victims:
            self.token_to_kv_pool_allocator.free(torch.cat(victims))
        return freed

    def inc_lock_ref(self, node: TreeNode) -> None:
        """See ``BasePrefixCache.inc_lock_ref`` (locking the root is a no-op).

        Raises:
            ValueError: ``node`` is None.
        """
        if node is None:
            raise ValueError("inc_lock_ref(None): pass the MatchResult.last_node to lock")
        while node is not self.root_node:
            if node.lock_ref == 0:
                self._evictable -= len(node.key)
                self._protected += len(node.key)
            node.lock_ref += 1
            node = node.parent

    def dec_lock_ref(self, node: TreeNode) -> None:
        """See ``BasePrefixCache.dec_lock_ref`` (unlocking the root is a no-op)."""
        if node is None:
            raise ValueError("dec_lock_ref(None): pass the node given to inc_lock_ref")
        if node is not self.root_node and node.lock_ref <= 0:
            raise ValueError(f"dec_lock_ref: {node!r} is not locked (unbalanced unlock)")
        while node is not self.root_node:
            if node.lock_ref == 1:
                self._protected -= len(node.key)
                self._evictable += len(node.key)
            node.lock_ref -= 1
            node = node.parent

    # ---------------------------------------------------------------- sizes
    def evictable_size(self) -> int:
        """Tokens held by unlocked nodes (evictable)."""
        return self._evictable

    def protected_size(self) -> int:
        """Tokens held by locked nodes (in use by running requests)."""
        return self._protected

    def total_size(self) -> int:
        """Tokens held by the tree, counted by walking it."""
        return sum(len(n.key) for n in self._nodes())

    def held_indices(self) -> torch.Tensor:
        """int64 slots held by the tree (any order); for accounting checks and debugging."""
        vals = [n.value for n in self._nodes()]
        return torch.cat(vals) if vals else self._empty()

    def reset(self) -> None:
        """See ``BasePrefixCache.reset``.

        Raises:
            ValueError: some node is still locked by a running request (finish or retract it first).
        """
        if self._protected:
            raise ValueError(f"reset: {self._protected} cached tokens are locked by running requests; "
                             "release them (cache_finished_req) before resetting the cache")
        held = self.held_indices()
        if held.numel():
            self.token_to_kv_pool_allocator.free(held)
        self.root_node = self._new_node(None, [], self._empty())
        self._evictable = 0
        self._protected = 0
