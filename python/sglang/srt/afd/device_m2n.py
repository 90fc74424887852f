"""Device-driven AFD steps: the attention worker's decode step as one CUDA graph, no host round trip per layer
(MegaScale-Infer, Zhu et al. 2025, sec. 4.1 ping-pong + sec. 5 M2N without host involvement per message).

Over a device-driven M2N transport (``cuda_push``: payload + a flag word carrying (sequence, rows), the receiver's
stream spins on the flag, see :mod:`sgl_kernel.m2n.cuda_push`; ``cuda_push_ll``: the same transport with the
low-latency protocol of :mod:`sgl_kernel.m2n.ll_kernels`, each 4-byte word sent with its tag in one 8-byte word)
a step exchanges one host message per FFN worker and step, the ``STEP`` announcement; everything per layer goes
device to device:

* attention worker ``a`` (host, before the step or the graph replay): ``STEP`` to every FFN worker ``j``, ``m`` rows
  whose ``topk_ids[:, 0]`` are the micro-batches' token counts ``n_0..n_{m-1}``;
* then, on the attention worker's stream (captured in its decode graph): per MoE layer ``l`` (model order) and
  micro-batch ``k``: ``send(host_header=False)`` of ``(x, topk_ids, topk_weights)`` (``n_k`` rows; the weights of
  pairs owned by another FFN worker zeroed) to each FFN worker, and, before layer ``l + 1`` of ``k``,
  ``recv_device`` of the ``N_E`` results (summed);
* FFN worker ``j`` (:class:`FfnDeviceSteps`, on the ``STEP``): the same (layer, micro-batch) order, per message
  ``recv_device(a)`` -> experts -> ``send(host_header=False)`` of ``n_k`` rows, all on its stream; on CUDA the whole
  step is one CUDA graph per ``(a, sizes)`` (eager the first time: Triton JIT and the peer mapping; captured the
  second; replayed after).

Both sides follow one fixed order, so no message needs a header: the device sequence counters pair them.
Fail closed, on the device: an FFN worker that finds a (token, slot) pair routed to an expert it does not hold
answers 0 rows; the attention side adds ``rows != n_k`` into an error word read after the step
(:meth:`DeviceDispatch.check`), and a wait that runs out (a dead peer) records the transport's error record, which
the same check raises as TimeoutError. Tokens are never returned from a step with a missing or short answer.
Limits: static expert placement (no ``PLACE`` rebalancing on this path); each attention worker's step is served
on its own (FFN-side aggregation across attention workers happens on the host path only).
"""

from __future__ import annotations

import logging
from typing import Optional, Sequence

import torch

from sglang.srt.afd.protocol import STEP

logger = logging.getLogger(__name__)


def capturing() -> bool:
    """True while the current CUDA stream is being captured into a graph (never on CPU)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


class DeviceDispatch:
    """The attention side of a device-driven step (see the module docstring).

    Args:
        ep: this attention worker's M2N endpoint (its transport must be device-driven).
        topo: the :class:`~sglang.srt.afd.protocol.AfdTopology`; placement: the static
            :class:`~sglang.srt.afd.load_balance.ExpertPlacement` (one replica per expert).
    Raises:
        ValueError: a host transport, or a placement with redundant replicas.
    """

    def __init__(self, ep, topo, placement, num_experts: int):
        if not ep.transport.device_driven:
            raise ValueError(f"device-driven AFD needs --afd-transport cuda_push or cuda_push_ll, not "
                             f"{ep.transport.name!r}")
        self.ep, self.topo = ep, topo
        self.worker_of: Optional[torch.Tensor] = None
        if topo.num_ffn > 1:
            table = torch.full((num_experts,), -1, dtype=torch.int64)
            for j, experts in enumerate(placement.worker_experts()):
                if (table[experts] >= 0).any():
                    raise ValueError("device-driven AFD routes by a static placement (one replica per expert); "
                                     "turn rebalancing / redundant experts off")
                table[experts] = j
            self.worker_of = table.to(ep.device)
        self.bad = torch.zeros(1, dtype=torch.int64, device=ep.device)  # short answers of this step (device)
        self.sizes_by_batch: dict[int, list[int]] = {}  # captured batch size -> micro-batch token counts

    def connect(self, patience: int = 10) -> None:
        """Block until every FFN worker's M2N handles arrived (before a graph capture: the capture's warm-up steps
        talk to them, and FFN workers publish their handles only once their experts are loaded). Tries ``patience``
        times the endpoint's timeout, then raises TimeoutError."""
        for j in range(self.topo.num_ffn):
            for attempt in range(patience):
                try:
                    self.ep.transport.connect(self.topo.ffn_rank(j))
                    break
                except TimeoutError:
                    if attempt == patience - 1:
                        raise
                    logger.info("waiting for FFN worker %d's M2N handles (still loading?)", j)

    def begin(self, sizes: Sequence[int], version: int) -> None:
        """Start a step of micro-batches of ``sizes`` tokens: clear the error word (stream-ordered, also in a graph);
        outside a capture, announce the step (a capture records the sizes for :meth:`announce_batch`)."""
        self.bad.zero_()
        if capturing():
            self.sizes_by_batch[int(sum(sizes))] = list(sizes)
        else:
            self.announce(sizes, version)

    def announce(self, sizes: Sequence[int], version: int) -> None:
        """Send the ``STEP`` host message (rows: ``topk_ids[:, 0]`` = the token counts) to every FFN worker."""
        m = len(sizes)
        top_k = self.ep.layout.columns[1][1]
        ids = torch.zeros(m, top_k, dtype=torch.int32)
        ids[:, 0] = torch.tensor(list(sizes), dtype=torch.int32)
        hidden = self.ep.layout.columns[0]
        x = torch.zeros(m, hidden[1], dtype=hidden[0], device=self.ep.device)
        w = torch.zeros(m, top_k, dtype=torch.float32, device=self.ep.device)
        ids = ids.to(self.ep.device)
        for j in range(self.topo.num_ffn):
            self.ep.send(self.topo.ffn_rank(j), [x, ids, w], (STEP, m, 0, version))

    def announce_batch(self, batch_size: int, version: int) -> None:
        """Announce a replay of the graph captured for ``batch_size`` tokens. Raises KeyError if none was."""
        self.announce(self.sizes_by_batch[batch_size], version)

    def dispatch(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> None:
        """M2N of one (layer, micro-batch): ``x [n, H]`` model dtype, ``ids [n, k]`` int32, ``weights [n, k]`` fp32 to
        every FFN worker, host-free (graph-capturable)."""
        for j in range(self.topo.num_ffn):
            w = weights if self.worker_of is None else torch.where(self.worker_of[ids.long()] == j, weights, 0.0)
            self.ep.send(self.topo.ffn_rank(j), [x, ids, w.contiguous()], host_header=False)

    def combine(self, n: int) -> torch.Tensor:
        """N2M of the oldest outstanding (layer, micro-batch): the sum of the ``N_E`` results, ``[n, H]``; a result
        of another row count adds 1 to the error word."""
        out = None
        for j in range(self.topo.num_ffn):
            dm = self.ep.recv_device(self.topo.ffn_rank(j))
            self.bad.add_((dm.rows != n).long())
            part = dm.tensors[0][:n]
            out = part.clone() if out is None else out + part  # the receive buffer is reused by the next receive
        return out

    def check(self) -> None:
        """After a step (synchronizes): TimeoutError when a device wait gave up (an FFN worker dead or stalled);
        RuntimeError when an FFN worker answered short (it refused a pair it does not hold: see its log)."""
        self.ep.check()
        bad = int(self.bad.item())
        if bad:
            raise RuntimeError(f"AFD: {bad} FFN answers of this step had the wrong row count (an FFN worker refused "
                               "tokens routed to experts it does not hold, or failed); the step's tokens are discarded")


class FfnDeviceSteps:
    """The FFN side of device-driven steps (see the module docstring): one step of attention worker ``src`` per
    ``STEP`` message, replayed as a CUDA graph per ``(src, sizes)`` from its second occurrence on CUDA.

    Args:
        server: the :class:`~sglang.srt.afd.ffn_worker.FfnServer` (endpoint, shards, MoE layer specs, device).
    """

    def __init__(self, server):
        self.server = server
        self.seen: set = set()
        self.no_graph: set = set()  # keys whose capture failed: served eagerly from then on
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self.pool = None
        self.timer = None  # an afd.step_timing.StepTimer: Tf per step, also inside the graph (opt-in)
        self.timer_pairs: dict[tuple, dict] = {}  # step key -> its stamps (a replay re-records the captured ones)
        self.tf_ms: dict[tuple, list] = {}  # step key -> per-step median Tf (ms) collected while timer is set

    def run(self, src: int, sizes: Sequence[int]) -> None:
        """Serve one step of ``src`` with micro-batches of ``sizes`` tokens, then :meth:`M2NEndpoint.check` (a
        synchronization per step; TimeoutError when ``src`` stopped sending)."""
        key = (src, tuple(int(n) for n in sizes))
        s = self.server
        graph = self.graphs.get(key)
        if graph is None and s.device.type == "cuda" and key in self.seen and key not in self.no_graph:
            graph = self._capture(key)
        if graph is not None:
            graph.replay()
        else:
            self._body(*key)
            self.seen.add(key)
        s.ep.check()
        if self.timer is not None and key in self.timer_pairs:
            self._collect(key)

    def _collect(self, key: tuple) -> None:
        """Tf of the step just served into :attr:`tf_ms` (timing is an extra: a failure logs and turns it off)."""
        try:
            self.timer.pairs = self.timer_pairs[key]
            self.timer.collect()
        except Exception as e:  # e.g. a driver without timed events in graphs
            logger.warning("FFN worker %d: step timing off (%s: %s)", self.server.index, type(e).__name__, e)
            self.timer = None
            return
        self.tf_ms.setdefault(key, []).extend(self.timer.samples.pop("tf", []))

    def _capture(self, key: tuple):
        """The step's CUDA graph (None, logged, if capture fails: the step then runs eagerly). A capture that fails
        with step timing on is tried once more without it (timing is an extra, the graph is not)."""
        for attempt in range(2):
            try:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool):
                    self._body(*key)
                break
            except Exception as e:  # capture is best effort: the eager step is the same sequence
                err = e
                torch.cuda.synchronize(self.server.device)
                if attempt == 0 and self.timer is not None:
                    logger.warning("FFN worker %d: capture with step timing failed (%s: %s); timing off",
                                   self.server.index, type(e).__name__, e)
                    self.timer = None
                    continue
                graph = None
                break
        if graph is None:
            e = err
            logger.warning("FFN worker %d: CUDA graph capture of step %s failed (%s: %s); serving eagerly",
                           self.server.index, key, type(e).__name__, e)
            self.no_graph.add(key)
            return None
        self.pool = graph.pool()
        self.graphs[key] = graph
        logger.info("FFN worker %d: captured the device step of attention rank %d, micro-batches %s", self.server.index,
                    key[0], list(key[1]))
        return graph

    def _body(self, src: int, sizes: tuple) -> None:
        s = self.server
        ep = s.ep
        timer = self.timer
        if timer is not None:
            timer.begin()
        for spec in s.specs:
            shard = s.shards[spec.layer]
            for n in sizes:
                dm = ep.recv_device(src)
                x, ids, w = (t[:n] for t in dm.tensors)
                tf = timer.open("tf") if timer is not None else None
                out, ok = shard.compute_device(x, ids, w)
                if tf is not None:
                    timer.close(tf)
                rows = torch.where(ok & (dm.rows == n), dm.rows, torch.zeros_like(dm.rows))
                ep.send(src, [out], host_header=False, rows=rows)
        if timer is not None:
            self.timer_pairs[(src, tuple(sizes))] = timer.pairs
