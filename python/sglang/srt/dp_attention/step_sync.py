"""The per-step agreement of the DP-attention ranks (SGLang's MLP sync of ``global_num_tokens`` before each forward).

With MoE layers every forward is a collective over the DP ranks, so every rank must run a forward at the same step,
with or without work of its own. Each scheduler step, after its scheduler picked its batch (or none), every rank
reports ``[new tokens, has work, graph batch]`` in one CPU (gloo) all-gather on a group of its own
(:class:`DpStepSync`); :func:`decide` turns the reports into the same :class:`DpGlobalStep` on every rank:

* nobody has tokens: no forward anywhere (and when nobody has work either, the loops may block on their sockets:
  they stop spinning; a request sent to one rank wakes the others, see the router);
* somebody has tokens: every rank runs a forward; a rank without a batch runs an idle one (``ForwardMode.IDLE``);
* every rank's batch is a decode that fits a captured CUDA graph (or it is idle): every rank replays the graph of the
  same padded size (the captured size of the largest decode batch), idle ranks with padding rows only; otherwise
  every rank runs eagerly and the MoE all-gathers pad to the largest token count;
* with an all-to-all dispatcher (``--moe-a2a-backend``), the dispatch mode of every MoE layer: low-latency when no
  rank runs a prefill or mixed batch (every batch is a decode, or idle) and the largest decode fits the low-latency
  capacity (SGLang resolves DeepEP's ``auto`` mode the same way, from whether any DP rank has an extend batch);
  normal otherwise. A graph replay always qualifies (its padded size is at most the capacity).

Reports are int64 ``[tokens, has_work, graph_bs, split_ok, decode]`` with ``graph_bs`` = the batch size when the
rank's batch could replay a CUDA graph, 0 when the rank has no batch, -1 when it must run eagerly; ``split_ok``: the
rank's executor would cut its batch into micro-batches (two-batch overlap); ``decode``: its batch is a decode batch.
The step splits only when every rank's does (:attr:`DpGlobalStep.split_all`), so every rank runs the same number of
micro-batches, hence of MoE collectives; an idle rank never splits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch

NO_GRAPH = -1


@dataclass(frozen=True)
class DpRankReport:
    """One rank's report for this step.

    Attributes:
        num_tokens: new tokens of its batch (0: no batch).
        has_work: it holds requests (waiting, running, chunked, in flight), batch or not.
        graph_bs: its decode batch size when that batch may replay a CUDA graph; 0 without a batch;
            :data:`NO_GRAPH` (-1) when it must run eagerly (prefill, mixed, too large, input logprobs).
        split_ok: its executor would cut its batch into micro-batches (False without a batch or a splitting
            executor).
        decode: its batch is a decode batch (one new token per request; False without a batch).
    """

    num_tokens: int
    has_work: bool
    graph_bs: int
    split_ok: bool = False
    decode: bool = False

    def encode(self) -> list[int]:
        """The int64 row sent in the all-gather."""
        return [int(self.num_tokens), int(self.has_work), int(self.graph_bs), int(self.split_ok), int(self.decode)]


@dataclass(frozen=True)
class DpGlobalStep:
    """What every rank does this step (identical on every rank).

    Attributes:
        num_tokens: new tokens per DP rank, in rank order.
        any_work: some rank holds requests (loops must not block on their sockets).
        graph_bs: the padded decode batch every rank replays (0: eager forwards).
        split_all: every rank cuts its batch into micro-batches (two-batch overlap on for this step everywhere);
            a splitting executor under DP attention follows it instead of its local choice.
        low_latency: every rank's MoE all-to-all runs in low-latency mode (see :attr:`moe_dispatch_mode`).
    """

    num_tokens: tuple
    any_work: bool
    graph_bs: int = 0
    split_all: bool = False
    low_latency: bool = False

    @property
    def runs_forward(self) -> bool:
        """Some rank has tokens: every rank runs a forward (idle ones an idle forward)."""
        return any(self.num_tokens)

    @property
    def moe_dispatch_mode(self) -> str:
        """The all-to-all mode of this step's MoE layers (``--moe-a2a-backend``), the same on every rank:
        ``low_latency`` when every rank replays the same decode CUDA graph (fixed shapes, no host sync) or, eagerly,
        when no rank has a prefill or mixed batch and every decode fits the low-latency capacity
        (:attr:`low_latency`); else ``normal`` (variable counts, a count exchange first)."""
        return "low_latency" if self.graph_bs or self.low_latency else "normal"

    @property
    def rows_per_rank(self) -> int:
        """Rows per rank of this step's MoE all-gathers: the graph batch in a replay, else the largest token count
        (at least 1)."""
        return self.graph_bs or max(max(self.num_tokens, default=0), 1)


def decide(reports: Sequence[DpRankReport], graph_size: Optional[Callable[[int], Optional[int]]] = None,
           low_latency_capacity: Optional[int] = None) -> DpGlobalStep:
    """The step every rank takes from all ranks' reports (pure; see the module docstring).

    Args:
        reports: one per DP rank, in rank order.
        graph_size: the padded captured batch for a decode batch of ``bs`` rows, None when no graph fits (None
            itself: no CUDA graphs; every rank must pass the same, see ``ModelRunner`` graph agreement).
        low_latency_capacity: the all-to-all dispatcher's low-latency tokens per rank (the same on every rank);
            None: no dispatcher, eager steps never pick low-latency.
    """
    tokens = tuple(int(r.num_tokens) for r in reports)
    any_work = any(r.has_work for r in reports) or any(tokens)
    graph_bs = 0
    if graph_size is not None and any(tokens) and all(r.graph_bs != NO_GRAPH for r in reports):
        largest = max(r.graph_bs for r in reports)
        graph_bs = graph_size(largest) or 0
    split_all = bool(reports) and all(r.split_ok for r in reports)
    low_latency = bool(low_latency_capacity and any(tokens) and max(tokens) <= low_latency_capacity
                       and all(r.decode or r.num_tokens == 0 for r in reports))
    return DpGlobalStep(tokens, any_work, graph_bs, split_all, low_latency)


class DpStepSync:
    """The per-step all-gather of :class:`DpRankReport` s (see the module docstring).

    Args:
        dp_rank / dp_size: this rank and the DP size.
        group: a gloo process group over the DP ranks used by nothing else (the model's collectives may run at the
            same time on the overlap worker's thread); None with ``exchange``.
        exchange: test seam: ``(this rank's int64 row) -> [row per rank]`` instead of torch.distributed.
        graph_size: see :func:`decide` (the worker's CUDA-graph runner; None without graphs).
        low_latency_capacity: see :func:`decide` (the worker's all-to-all dispatcher; None without one).
    Raises (from :meth:`agree`):
        RuntimeError: a peer left (gloo reports the closed connection at once; a stalled peer ends at the
            collective timeout or, sooner, at ``--watchdog-timeout``).
    """

    def __init__(self, dp_rank: int, dp_size: int, group: Any = None,
                 exchange: Optional[Callable[[list], list]] = None,
                 graph_size: Optional[Callable[[int], Optional[int]]] = None,
                 low_latency_capacity: Optional[int] = None):
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"DpStepSync: dp_rank={dp_rank} outside [0, {dp_size})")
        if group is None and exchange is None:
            raise ValueError("DpStepSync needs a process group or an exchange function")
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.group, self._exchange, self.graph_size = group, exchange, graph_size
        self.low_latency_capacity = low_latency_capacity
        self.last: Optional[DpGlobalStep] = None
        self.steps = 0
        self.idle_forwards = 0

    def _all_gather(self, mine: list) -> list:
        if self._exchange is not None:
            return [list(r) for r in self._exchange(mine)]
        import torch.distributed as dist

        out = [torch.empty(len(mine), dtype=torch.int64) for _ in range(self.dp_size)]
        dist.all_gather(out, torch.tensor(mine, dtype=torch.int64), group=self.group)
        return [t.tolist() for t in out]

    def agree(self, report: DpRankReport) -> DpGlobalStep:
        """Exchange this rank's report and return the step every rank takes (also kept as :attr:`last`)."""
        rows = self._all_gather(report.encode())
        if len(rows) != self.dp_size:
            raise RuntimeError(f"DP step agreement: {len(rows)} reports for {self.dp_size} ranks")
        step = decide([DpRankReport(int(t), bool(w), int(g), bool(sp), bool(d)) for t, w, g, sp, d in rows],
                      self.graph_size, self.low_latency_capacity)
        self.last = step
        self.steps += 1
        return step

    @property
    def peers_busy(self) -> bool:
        """The last agreement saw work on some rank (this rank's loop must keep stepping, not block)."""
        return self.last is not None and self.last.any_work
