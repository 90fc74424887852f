"""Expert load balancing for AFD FFN workers (MegaScale-Infer sec. 6) on synthetic skewed (Zipf) routing."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from sglang.srt.afd.load_balance import (
    ExpertLoadCollector,
    ExpertPlacement,
    ExpertRebalancer,
    assign_tokens,
    bruteforce_placement,
    greedy_placement,
    max_load_ratio,
    replica_counts,
    static_placement,
    worker_loads,
)

logger = logging.getLogger(__name__)


def zipf_routing(num_tokens: int, num_experts: int, top_k: int, s: float, seed: int) -> torch.Tensor:
    """int64 ``[num_tokens, top_k]`` distinct experts per token, expert popularity ~ rank^-s (shuffled ids)."""
    g = torch.Generator().manual_seed(seed)
    probs = torch.arange(1, num_experts + 1, dtype=torch.float64) ** -s
    probs = probs[torch.randperm(num_experts, generator=g)]
    return torch.multinomial(probs.expand(num_tokens, -1), top_k, replacement=False, generator=g)


def test_collector_counts_per_layer_and_ignores_padding():
    col = ExpertLoadCollector(num_experts=8, num_layers=2)
    a = zipf_routing(100, 8, 2, 1.2, seed=0)
    b = zipf_routing(50, 8, 2, 1.2, seed=1)
    col.record(a, layer=0)
    col.record(b, layer=0)
    col.record(torch.tensor([[3, -1], [-1, -1]]), layer=1)
    got = col.counts()
    np.testing.assert_array_equal(got[0], np.bincount(torch.cat([a, b]).flatten().numpy(), minlength=8))
    np.testing.assert_array_equal(got[1], np.eye(8)[3])
    with pytest.raises(ValueError, match="expert id 8 >= num_experts=8"):
        col.record(torch.tensor([[8, 0]]))
    with pytest.raises(ValueError, match="layer=2"):
        col.record(a, layer=2)
    decayed = ExpertLoadCollector(8, decay=0.5)
    decayed.record(a)
    decayed.end_step()
    np.testing.assert_allclose(decayed.counts()[0], got[0] * 0 + np.bincount(a.flatten().numpy(), minlength=8) / 2)
    col.reset()
    assert col.counts().sum() == 0


def test_replica_counts_minimize_the_max_share():
    rng = np.random.default_rng(0)
    for _ in range(200):
        loads = rng.zipf(1.4, size=5).astype(float)
        extra = int(rng.integers(0, 4))
        r = replica_counts(loads, extra, max_replicas=4)
        assert r.sum() == 5 + extra and r.min() >= 1
        # exhaustive over all count vectors with the same budget
        best = min(max(loads / np.array(c)) for c in np.ndindex(*(4,) * 5)
                   if sum(np.array(c) + 1) == 5 + extra for c in [np.array(c) + 1])
        assert max(loads / r) == pytest.approx(best)


def test_greedy_equals_bruteforce_with_one_expert_per_worker():
    """The paper's one-expert-per-node layout: N = E + R workers of one slot; the greedy is exact."""
    rng = np.random.default_rng(1)
    for _ in range(60):
        n_exp, extra = int(rng.integers(2, 4)), int(rng.integers(0, 3))
        loads = rng.zipf(1.5, size=n_exp) * rng.integers(1, 50, size=n_exp)
        greedy = greedy_placement(loads, n_exp + extra, extra, slots_per_worker=1)
        best, _ = bruteforce_placement(loads, n_exp + extra, extra, slots_per_worker=1)
        assert worker_loads(loads, greedy).max() == pytest.approx(best)


def test_greedy_against_bruteforce_with_several_experts_per_worker():
    rng = np.random.default_rng(2)
    ratios = []
    for _ in range(150):
        n_exp, workers, extra = int(rng.integers(2, 6)), int(rng.integers(2, 4)), int(rng.integers(0, 3))
        slots = -(-(n_exp + extra) // workers)
        loads = rng.zipf(1.5, size=n_exp) * rng.integers(1, 50, size=n_exp)
        greedy = greedy_placement(loads, workers, extra, slots)
        assert all(len(es) <= slots for es in greedy.worker_experts())
        assert greedy.num_replicas.sum() <= n_exp + extra
        best, _ = bruteforce_placement(loads, workers, extra, slots)
        ratios.append(worker_loads(loads, greedy).max() / best)
    ratios = np.array(ratios)
    logger.info("greedy/optimal max load on tiny cases: equal in %d/%d, worst %.3f",
                int(np.sum(ratios < 1 + 1e-9)), len(ratios), ratios.max())
    assert ratios.min() >= 1 - 1e-9  # brute force is the optimum
    assert np.mean(ratios < 1 + 1e-9) >= 0.9 and ratios.max() <= 1.25


@pytest.mark.parametrize("skew,top_k,hot", [(1.0, 6, False), (1.2, 4, False), (1.5, 2, True)])
def test_zipf_routing_max_load_ratio_before_and_after(skew, top_k, hot, record_property):
    n_exp, workers, extra = 64, 8, 8
    ids = zipf_routing(4096, n_exp, top_k, skew, seed=3)
    col = ExpertLoadCollector(n_exp)
    col.record(ids)
    loads = col.counts()[0]
    before = max_load_ratio(loads, static_placement(n_exp, workers))
    no_copies = max_load_ratio(loads, greedy_placement(loads, workers, 0))
    placement = greedy_placement(loads, workers, extra)
    after = max_load_ratio(loads, placement)
    record_property("max_load_ratio", {"before": before, "greedy_no_redundancy": no_copies, "after": after})
    logger.info("zipf s=%.1f top-%d: max/mean worker load %.3f (static EP) -> %.3f (greedy, R=0) -> %.3f (R=%d)",
                skew, top_k, before, no_copies, after, extra)
    assert after < before and after <= no_copies + 1e-12
    assert after < 1.1
    floor = loads.max() / (loads.sum() / workers)  # no placement without copies beats the hottest expert
    assert no_copies >= floor - 1e-12
    if hot:  # the hottest expert alone overloads a worker: only redundant copies can fix it
        assert floor > 2 and after < floor / 2
    # the assignment rule realizes the modelled loads: every (token, slot) goes to a worker holding its
    # expert, and per-worker token counts match C_j up to one token per replica
    worker, replica = assign_tokens(ids, placement)
    table = placement.replica_table()
    assert np.all(table[ids.numpy(), replica.numpy()] == worker.numpy())
    counts = np.bincount(worker.flatten().numpy(), minlength=workers)
    np.testing.assert_allclose(counts, worker_loads(loads, placement), atol=placement.num_replicas.max())


def test_assignment_is_round_robin_per_expert():
    placement = ExpertPlacement(3, ((0, 2), (1,)))
    ids = torch.tensor([[0, 1], [0, 1], [0, 1], [1, 0]])
    worker, replica = assign_tokens(ids, placement)
    assert replica.tolist() == [[0, 0], [1, 0], [0, 0], [0, 1]]
    assert worker.tolist() == [[0, 1], [2, 1], [0, 1], [1, 2]]


@pytest.mark.parametrize("n_exp,workers,sizes", [(8, 3, [3, 3, 2]), (128, 3, [43, 43, 42]), (4, 3, [2, 1, 1]),
                                                 (8, 4, [2, 2, 2, 2]), (5, 5, [1] * 5)])
def test_static_placement_uneven_blocks(n_exp, workers, sizes):
    held = static_placement(n_exp, workers).worker_experts()
    assert [len(h) for h in held] == sizes
    assert sum(held, []) == list(range(n_exp))  # contiguous, each expert once


def test_rebalancer_and_validation():
    placement = static_placement(8, 4)
    reb = ExpertRebalancer(placement, redundancy=2, interval=10)
    skewed = np.array([900, 10, 10, 10, 10, 10, 10, 10], dtype=float)
    assert reb.maybe_rebalance(skewed, step=5) is None  # not a rebalance step
    moves = reb.maybe_rebalance(skewed, step=10)
    assert moves and all(w in reb.placement.replicas[e] for e, w in moves)
    assert reb.placement.num_replicas[0] == 3
    assert reb.maybe_rebalance(skewed, step=20) is None  # already balanced: no churn
    with pytest.raises(ValueError, match="cannot hold 8 experts \\+ 4 replicas"):
        greedy_placement(np.ones(8), 4, redundancy=4, slots_per_worker=2)
    with pytest.raises(ValueError, match="must be in \\[1, num_experts=8\\]"):
        static_placement(8, 9)
    with pytest.raises(ValueError, match="must be in"):
        static_placement(8, 0)
    with pytest.raises(ValueError, match="distinct ids"):
        ExpertPlacement(2, ((0, 0),))
