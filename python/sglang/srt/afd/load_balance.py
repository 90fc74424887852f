"""Expert load balancing across FFN workers (MegaScale-Infer sec. 6, "Load balance").

Routers skew: a few hot experts receive most tokens, so the expert node holding them sets ``T_e`` for
everyone.  Given per-expert token counts ``c_e`` (collected from the routers by
:class:`ExpertLoadCollector`), ``N`` FFN workers with ``S`` expert slots each and a budget of ``R``
redundant replicas, we choose replicas and their workers to minimize ``max_j C_j``, where ``C_j`` is the
number of tokens worker ``j`` computes when each expert's tokens are split evenly over its replicas
(the assignment rule of :func:`assign_tokens`).

Greedy (:func:`greedy_placement`): replica counts by greedy apportionment (one more replica to the
expert with the largest ``c_e / r_e``; optimal for ``max_e c_e / r_e``), replicas packed largest share
first onto the least-loaded worker with a free slot (LPT), the best over budgets ``k <= R`` and an
incremental variant (replicate an expert of the hottest worker while that helps), then single-replica
moves/swaps off the hottest worker.  With one slot per worker (the paper's one-expert-per-node layout)
it is optimal; with more slots it is checked against exhaustive search in the tests.
"""

from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np


class ExpertLoadCollector:
    """Per-layer, per-expert token counts fed by the routers.

    The runtime calls :meth:`record` with each MoE layer's top-k ids; counting stays on the ids' device
    (``index_add_``: no host synchronization on GPU), and :meth:`counts` copies to the host between steps.

    Args:
        num_experts: routed experts per layer ``E``.
        num_layers: MoE layers tracked.
        decay: factor applied by :meth:`end_step` (1.0 = plain running sum; < 1 = exponential window).

    Raises:
        ValueError: non-positive sizes or ``decay`` outside (0, 1].
    """

    def __init__(self, num_experts: int, num_layers: int = 1, decay: float = 1.0):
        if num_experts <= 0 or num_layers <= 0:
            raise ValueError(f"num_experts={num_experts} and num_layers={num_layers} must be positive")
        if not 0 < decay <= 1:
            raise ValueError(f"decay={decay} must be in (0, 1]")
        self.num_experts, self.num_layers, self.decay = num_experts, num_layers, decay
        self._counts = None  # torch float64 [num_layers, num_experts] on the ids' device
        self.steps = 0

    def record(self, topk_ids, layer: int = 0) -> None:
        """Count one batch of routing decisions.

        Args:
            topk_ids: int tensor / array ``[num_tokens, top_k]`` (any device) of expert ids in
                ``[0, E)``; negative ids (padding, dropped tokens) are ignored.
            layer: MoE layer index in ``[0, num_layers)``.

        Raises:
            ValueError: bad layer, or (CPU only: a GPU check would synchronize) ids >= E.
        """
        import torch

        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer={layer} outside [0, {self.num_layers})")
        ids = torch.as_tensor(topk_ids).reshape(-1).long()
        if self._counts is None or self._counts.device != ids.device:
            prev = None if self._counts is None else self._counts.to(ids.device)
            self._counts = prev if prev is not None else torch.zeros(
                self.num_layers, self.num_experts, dtype=torch.float64, device=ids.device)
        if ids.device.type == "cpu" and ids.numel() and int(ids.max()) >= self.num_experts:
            raise ValueError(f"expert id {int(ids.max())} >= num_experts={self.num_experts}")
        valid = (ids >= 0).to(torch.float64)
        self._counts[layer].index_add_(0, ids.clamp(min=0), valid)

    def end_step(self) -> None:
        """Mark a scheduler step boundary (applies ``decay``)."""
        self.steps += 1
        if self._counts is not None and self.decay < 1:
            self._counts.mul_(self.decay)

    def counts(self) -> np.ndarray:
        """Host copy of the counts, float64 ``[num_layers, num_experts]`` (synchronizes on GPU)."""
        if self._counts is None:
            return np.zeros((self.num_layers, self.num_experts))
        return self._counts.detach().cpu().numpy().copy()

    def reset(self) -> None:
        """Forget all counts."""
        self._counts = None
        self.steps = 0


@dataclass(frozen=True)
class ExpertPlacement:
    """Where each expert's replicas live.

    Attributes:
        num_workers: FFN workers ``N``.
        replicas: ``replicas[e]`` = sorted worker ids holding a copy of expert ``e`` (>= 1 each).
    """

    num_workers: int
    replicas: tuple[tuple[int, ...], ...]

    def __post_init__(self):
        for e, ws in enumerate(self.replicas):
            if not ws or len(set(ws)) != len(ws) or min(ws) < 0 or max(ws) >= self.num_workers:
                raise ValueError(f"expert {e}: replica workers {ws} must be distinct ids in [0, {self.num_workers})")

    @property
    def num_experts(self) -> int:
        """Logical experts this placement covers (one entry of ``replicas`` each)."""
        return len(self.replicas)

    @property
    def num_replicas(self) -> np.ndarray:
        """int64 ``[E]``: replicas per expert."""
        return np.array([len(r) for r in self.replicas], dtype=np.int64)

    def worker_experts(self) -> list[list[int]]:
        """``[N]`` lists: the experts each worker holds (what it must load)."""
        out: list[list[int]] = [[] for _ in range(self.num_workers)]
        for e, ws in enumerate(self.replicas):
            for w in ws:
                out[w].append(e)
        return out

    def replica_table(self) -> np.ndarray:
        """int64 ``[E, max_replicas]``: worker of replica ``i`` of expert ``e``; -1 pads."""
        width = int(self.num_replicas.max())
        t = np.full((self.num_experts, width), -1, dtype=np.int64)
        for e, ws in enumerate(self.replicas):
            t[e, :len(ws)] = ws
        return t

    def moves_from(self, old: "ExpertPlacement") -> list[tuple[int, int]]:
        """``(expert, worker)`` copies this placement needs that ``old`` lacks (weights to load)."""
        return [(e, w) for e, ws in enumerate(self.replicas) for w in ws if w not in old.replicas[e]]


def static_placement(num_experts: int, num_workers: int) -> ExpertPlacement:
    """Plain expert parallelism: contiguous blocks of experts per worker, no redundancy. When ``num_workers`` does
    not divide ``num_experts`` the first ``num_experts % num_workers`` workers hold one expert more (e.g. 128 experts
    on 3 FFN workers: 43 / 43 / 42; the 1 attention + 3 FFN layout on 4 GPUs).

    Raises:
        ValueError: ``num_workers`` is not in ``[1, num_experts]`` (a worker would hold no expert).
    """
    if not 0 < num_workers <= num_experts:
        raise ValueError(f"num_workers={num_workers} must be in [1, num_experts={num_experts}]")
    per, extra = divmod(num_experts, num_workers)
    owner = [w for w in range(num_workers) for _ in range(per + (w < extra))]
    return ExpertPlacement(num_workers, tuple((w,) for w in owner))


def worker_loads(loads: Sequence[float], placement: ExpertPlacement) -> np.ndarray:
    """``C_j`` float64 ``[N]``: tokens per worker when each expert's tokens split evenly over its replicas."""
    c = np.zeros(placement.num_workers)
    for e, ws in enumerate(placement.replicas):
        for w in ws:
            c[w] += loads[e] / len(ws)
    return c


def max_load_ratio(loads: Sequence[float], placement: ExpertPlacement) -> float:
    """``max_j C_j / mean_j C_j`` (1.0 = perfectly balanced)."""
    c = worker_loads(loads, placement)
    return float(c.max() / c.mean()) if c.sum() > 0 else 1.0


def replica_counts(loads: Sequence[float], redundancy: int, max_replicas: int) -> np.ndarray:
    """Greedy apportionment: ``redundancy`` extra replicas, each to the expert with max ``c_e / r_e``.

    Minimizes ``max_e c_e / r_e`` subject to ``sum r_e = E + redundancy`` and ``r_e <= max_replicas``.
    """
    r = np.ones(len(loads), dtype=np.int64)
    heap = [(-float(c), e) for e, c in enumerate(loads)]
    heapq.heapify(heap)
    given = 0
    while given < redundancy and heap:
        _, e = heapq.heappop(heap)
        if r[e] >= max_replicas:
            continue
        r[e] += 1
        given += 1
        heapq.heappush(heap, (-float(loads[e]) / r[e], e))
    return r


def _check(loads, num_workers, redundancy, slots) -> int:
    n_exp = len(loads)
    if num_workers <= 0 or redundancy < 0:
        raise ValueError(f"num_workers={num_workers} must be > 0 and redundancy={redundancy} >= 0")
    if any(c < 0 for c in loads):
        raise ValueError("expert loads must be >= 0")
    slots = math.ceil((n_exp + redundancy) / num_workers) if slots is None else slots
    if slots * num_workers < n_exp + redundancy:
        raise ValueError(f"{num_workers} workers x {slots} slots cannot hold {n_exp} experts + {redundancy} "
                         f"replicas; raise slots_per_worker or lower redundancy")
    return slots


def _score(c: np.ndarray) -> tuple[float, int, float]:
    """Lexicographic objective: max load, how many workers sit at it, sum of squares."""
    top = float(c.max())
    return top, int(np.sum(c >= top - 1e-9 * max(top, 1.0))), float(np.dot(c, c))


def greedy_placement(loads: Sequence[float], num_workers: int, redundancy: int = 0,
                     slots_per_worker: Optional[int] = None, refine: bool = True) -> ExpertPlacement:
    """Place the experts plus up to ``redundancy`` hot-expert replicas on ``num_workers`` workers,
    minimizing ``max_j C_j`` (greedy; the objective is ``(max C, #workers at max, sum C^2)``).

    Candidates, the best of which is returned:

    * for each budget ``k = 0..R``: replica counts by greedy apportionment (:func:`replica_counts`), then
      the replicas by decreasing share onto the least-loaded worker with a free slot (LPT);
    * incremental: every expert once (LPT), then up to ``R`` times the single replica of an expert on the
      most loaded worker that most lowers the objective, stopping when none does;

    each followed (``refine``) by moves/swaps of single replicas off the most loaded worker.

    Args:
        loads: tokens per expert ``[E]`` (e.g. one row of :meth:`ExpertLoadCollector.counts`).
        num_workers: FFN workers ``N``.
        redundancy: at most this many extra replicas ``R`` (memory budget of hot-expert copies).
        slots_per_worker: experts a worker can hold; default ``ceil((E + R) / N)``.
        refine: run the move/swap pass.

    Raises:
        ValueError: negative loads/budget, or the slots cannot hold ``E + R`` replicas.
    """
    loads = [float(x) for x in loads]
    slots = _check(loads, num_workers, redundancy, slots_per_worker)
    cands = [_lpt(loads, replica_counts(loads, k, num_workers), num_workers, slots)
             for k in range(redundancy + 1)]
    cands.append(_incremental(loads, num_workers, redundancy, slots))
    best = None
    for held, c in cands:
        if refine:
            _refine(loads, held, c, slots)
        if best is None or _score(c) < _score(best[1]):
            best = (held, c)
    reps = [[] for _ in loads]
    for w, es in enumerate(best[0]):
        for e in es:
            reps[e].append(w)
    return ExpertPlacement(num_workers, tuple(tuple(sorted(ws)) for ws in reps))


def _lpt(loads, r, num_workers, slots):
    """Replicas (``r[e]`` of expert ``e``) by decreasing share onto the least-loaded eligible worker."""
    held: list[set[int]] = [set() for _ in range(num_workers)]
    c = np.zeros(num_workers)
    for share, e in sorted(((loads[e] / r[e], e) for e in range(len(loads)) for _ in range(r[e])), reverse=True):
        w = min((j for j in range(num_workers) if len(held[j]) < slots and e not in held[j]),
                key=lambda j: (c[j], len(held[j]), j))
        held[w].add(e)
        c[w] += share
    return held, c


def _incremental(loads, num_workers, redundancy, slots):
    held, c = _lpt(loads, np.ones(len(loads), dtype=np.int64), num_workers, slots)
    r = np.ones(len(loads), dtype=np.int64)
    for _ in range(redundancy):
        hot = int(np.argmax(c))
        cur, best = _score(c), None
        for e in held[hot]:
            owners = [j for j in range(num_workers) if e in held[j]]
            for w in range(num_workers):
                if e in held[w] or len(held[w]) >= slots:
                    continue
                trial = c.copy()
                trial[owners] -= loads[e] / r[e] - loads[e] / (r[e] + 1)
                trial[w] += loads[e] / (r[e] + 1)
                sc = _score(trial)
                if sc < cur and (best is None or sc < best[0]):
                    best = (sc, e, w, trial)
        if best is None:
            break
        _, e, w, c = best
        held[w].add(e)
        r[e] += 1
    return held, c


def _refine(loads, held, c, slots, max_iters: int = 1000) -> None:
    """Move or swap one replica off the most loaded worker while that lowers ``(max C, #at max, sum C^2)``."""
    r = np.zeros(len(loads), dtype=np.int64)
    for es in held:
        for e in es:
            r[e] += 1
    share = [loads[e] / r[e] if r[e] else 0.0 for e in range(len(loads))]
    for _ in range(max_iters):
        hi = int(np.argmax(c))
        cur, best = _score(c), None
        for w in range(len(held)):
            if w == hi:
                continue
            for e in held[hi]:
                if e in held[w]:
                    continue
                options = [None] if len(held[w]) < slots else []
                options += [f for f in held[w] if f not in held[hi]]
                for f in options:
                    delta = share[e] - (share[f] if f is not None else 0.0)
                    trial = c.copy()
                    trial[hi] -= delta
                    trial[w] += delta
                    sc = _score(trial)
                    if sc < cur and (best is None or sc < best[0]):
                        best = (sc, e, w, f, trial)
        if best is None:
            return
        _, e, w, f, trial = best
        c[:] = trial
        held[hi].remove(e)
        held[w].add(e)
        if f is not None:
            held[w].remove(f)
            held[hi].add(f)


def bruteforce_placement(loads: Sequence[float], num_workers: int, redundancy: int = 0,
                         slots_per_worker: Optional[int] = None) -> tuple[float, ExpertPlacement]:
    """Exhaustive optimum of ``max_j C_j`` over placements with at most ``redundancy`` extra replicas.

    Exponential (``(2^N - 1)^E`` subsets); for validating :func:`greedy_placement` on tiny cases.
    """
    loads = [float(c) for c in loads]
    slots = _check(loads, num_workers, redundancy, slots_per_worker)
    subsets = [s for k in range(1, num_workers + 1) for s in itertools.combinations(range(num_workers), k)]
    best = (math.inf, None)
    for combo in itertools.product(subsets, repeat=len(loads)):
        if sum(len(s) for s in combo) > len(loads) + redundancy:
            continue
        used = np.zeros(num_workers, dtype=np.int64)
        c = np.zeros(num_workers)
        for e, ws in enumerate(combo):
            for w in ws:
                used[w] += 1
                c[w] += loads[e] / len(ws)
        if used.max() > slots:
            continue
        if c.max() < best[0] - 1e-12:
            best = (float(c.max()), combo)
    return best[0], ExpertPlacement(num_workers, tuple(best[1]))


def assign_tokens(topk_ids, placement: ExpertPlacement):
    """The token-to-replica rule: the i-th (token, slot) routed to expert ``e`` in flattened order goes to
    replica ``i mod r_e`` (round robin), so each replica gets ``c_e / r_e`` tokens up to one.

    Args:
        topk_ids: int64 tensor ``[T, K]`` (any device) of expert ids in ``[0, E)``.
        placement: the current placement.

    Returns:
        ``(worker_ids, replica_ids)``: int64 tensors ``[T, K]`` on the ids' device: the FFN worker each
        (token, slot) is dispatched to, and which replica of its expert that is.
    """
    import torch

    ids = torch.as_tensor(topk_ids).long()
    flat = ids.reshape(-1)
    dev = flat.device
    nrep = torch.as_tensor(placement.num_replicas, device=dev)
    table = torch.as_tensor(placement.replica_table(), device=dev)
    order = torch.sort(flat, stable=True).indices
    sorted_e = flat[order]
    first = torch.searchsorted(sorted_e, sorted_e, right=False)
    rank = torch.empty_like(flat)
    rank[order] = torch.arange(flat.numel(), device=dev) - first
    replica = rank % nrep[flat]
    worker = table[flat, replica]
    return worker.reshape(ids.shape), replica.reshape(ids.shape)


class ExpertRebalancer:
    """Between-step rebalancing of one MoE layer's experts over FFN workers.

    ``maybe_rebalance`` recomputes the greedy placement from the collector's counts every ``interval``
    steps and adopts it when it lowers the max load ratio by more than ``min_gain``; the runtime then
    loads the returned ``(expert, worker)`` copies before the next step.
    """

    def __init__(self, placement: ExpertPlacement, redundancy: int, slots_per_worker: Optional[int] = None,
                 interval: int = 100, min_gain: float = 0.05):
        self.placement, self.redundancy, self.slots = placement, redundancy, slots_per_worker
        self.interval, self.min_gain = interval, min_gain

    def maybe_rebalance(self, loads: Sequence[float], step: int) -> Optional[list[tuple[int, int]]]:
        """New copies to load if the placement changed at this ``step``, else None."""
        if step % self.interval or not np.sum(loads):
            return None
        new = greedy_placement(loads, self.placement.num_workers, self.redundancy, self.slots)
        if max_load_ratio(loads, self.placement) - max_load_ratio(loads, new) <= self.min_gain:
            return None
        moves = new.moves_from(self.placement)
        self.placement = new
        return moves
