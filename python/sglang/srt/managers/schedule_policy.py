"""Which waiting requests to prefill next, and how many tokens a step may take.

Policies (``--schedule-policy``):
    fcfs: arrival order.
    lpm: longest cached prefix first (more reuse of the radix cache); falls
        back to fcfs when the queue is long, since matching every request
        every step costs O(queue * prompt).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from sglang.srt.managers.schedule_batch import Req

LPM_MAX_QUEUE = 128
"""Queue length above which ``lpm`` ordering falls back to fcfs."""


def order_waiting_queue(policy: str, waiting: list[Req], tree_cache) -> list[Req]:
    """Return ``waiting`` in the order the policy admits them (stable; the input is not modified).

    Raises:
        ValueError: unknown policy name.
    """
    if policy == "fcfs" or (policy == "lpm" and len(waiting) > LPM_MAX_QUEUE):
        return sorted(waiting, key=lambda r: r.arrival_time)
    if policy == "lpm":
        lens = {id(r): len(tree_cache.match_prefix(r.fill_ids[: r.max_prefix_len()]).device_indices) for r in waiting}
        return sorted(waiting, key=lambda r: (-lens[id(r)], r.arrival_time))
    raise ValueError(f"unknown schedule policy {policy!r}; use fcfs or lpm")


@dataclass
class PrefillBudget:
    """Token budgets of one step's prefill admission.

    Attributes:
        step_tokens: new prompt tokens this step may compute (chunked prefill
            size minus the decode tokens already in the step, or max_prefill_tokens).
        kv_tokens: KV slots still free for admission after reserving room for
            the running requests' future decode tokens.
        new_reqs: how many more requests may run at once.
        chunk: whether a request may be split (chunked prefill enabled).
    """

    step_tokens: int
    kv_tokens: int
    new_reqs: int
    chunk: bool
    page_size: int = 1

    def take(self, want: int, reserve: int) -> Optional[int]:
        """How many of ``want`` prompt tokens to admit now (None: none, stop admitting).

        ``reserve`` is the KV this request will need later for its output tokens.
        """
        if self.new_reqs <= 0 or self.step_tokens <= 0:
            return None
        n = want
        if n > self.step_tokens:
            if not self.chunk:
                return None
            n = self.step_tokens - self.step_tokens % self.page_size if self.step_tokens >= self.page_size else 0
            if n <= 0:
                return None
            reserve = 0  # a chunked request reserves for its output only with its last chunk
        if n + reserve > self.kv_tokens:
            return None
        self.step_tokens -= n
        self.kv_tokens -= n + reserve
        self.new_reqs -= 1
        return n
