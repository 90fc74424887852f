"""``Scheduler.fail_all`` after a forward that raised (AFD: an FFN worker did not answer; the attention worker's
``SchedulerProcess._step`` calls it): every request ends with a 503 abort and the whole KV pool is free, with overlap
scheduling off and on (the ``overlap`` fixture of test_scheduler.py) and page sizes 1 and 4."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_scheduler import make, overlap, submit  # noqa: E402,F401  (overlap: the autouse sync/overlap fixture)


@pytest.mark.parametrize("page_size", [1, 4])
def test_fail_all_after_a_failed_forward_frees_every_slot(page_size):
    """Requests decoding, one chunked mid-prompt and one waiting when the forward raises -> ``fail_all``: each ends
    with a 503 abort, the pool and the request rows are entirely free and the prefix cache is reset (nothing of the
    failed forward cached); the scheduler stays usable for control calls (flush)."""
    s, runner = make(max_total_tokens=512, page_size=page_size, chunked_prefill_size=16)
    submit(s, "long", list(range(3, 43)), max_new_tokens=50)  # 40 prompt tokens: 3 chunks
    for i in range(3):
        submit(s, f"r{i}", [5 + i] * 7, max_new_tokens=50)
    for _ in range(3):
        s.step()
    submit(s, "late", [9] * 5, max_new_tokens=50)
    assert s.running or s.chunked_req is not None

    def dead_ffn(batch):
        raise TimeoutError("FFN worker 1 did not answer within 15 s")

    runner.forward = dead_ffn
    with pytest.raises(TimeoutError):
        for _ in range(5):
            s.step()
            s.sync()
    s.fail_all("the AFD forward failed", 503)
    fin = {rid: fr for o in s.collect_outputs() for rid, fr in zip(o.rids, o.finished_reasons)}
    assert set(fin) == {"long", "r0", "r1", "r2", "late"}, fin
    assert all(fr["type"] == "abort" and fr["status_code"] == 503 for fr in fin.values()), fin
    assert not s.has_work() and not s.running and s.chunked_req is None and not s.waiting
    assert s.tree_cache.evictable_size() == 0 and s.tree_cache.protected_size() == 0
    assert runner.allocator.available_size() == runner.max_total_tokens - runner.max_total_tokens % page_size
    assert runner.req_to_token_pool.available_size() == runner.max_running_requests + 1
    assert s.flush_cache()[0] and s.collect_outputs() == []
