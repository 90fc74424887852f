"""The attention side of attention/FFN disaggregation: MegaScale-Infer's ping-pong pipeline (Zhu et al. 2025,
sec. 4.1, Fig. 4) as an executor over the layer stages -- no model file changes.

The batch is split by requests into ``m`` micro-batches (:meth:`ForwardBatch.split_requests`). Per layer, each
micro-batch runs ``input_norm -> attention -> post_attention_norm -> moe_route`` here, then its gated tokens
(top-k ids and weights) are dispatched to the FFN workers owning those experts (M2N) and the next
micro-batch's attention starts at once; a micro-batch's results are received and combined (N2M,
``moe_combine``: weighted sum + shared expert + residual) just before its next layer. So while micro-batch
``i`` is on the FFN workers, micro-batches ``i+1..m-1`` compute attention -- the ping-pong::

    for layer l:
        for micro-batch i:
            if i has a layer l-1 in flight: receive its N_E results, moe_combine      (N2M)
            attention stages of layer l for i; moe_route; send to every FFN worker   (M2N)
    receive and combine the last layer of every micro-batch

Dense layers (Qwen2-MoE's ``mlp_only_layers``/``decoder_sparse_step``) run their MLP here. The pipeline
hides communication when ``m >= 2 (1 + Tc / Tf)`` (sec. 4.1, with Ta ~ Tf); the executor measures
``Ta`` (attention stages per micro-batch; CUDA events on a GPU: the stages' GPU time), ``Tf`` (expert compute,
reported by FFN workers, GPU time on a GPU) and ``Tc``
(``(round trip - Tf) / 2``, an upper bound when results wait in the inbox) and logs the bound against ``m``.

Device-driven steps (``--afd-transport cuda_push`` or ``cuda_push_ll``, :mod:`sglang.srt.afd.device_m2n`): one
``STEP`` host message per step, the per-layer dispatch / combine device to device without headers, so the whole
step is captured in one decode CUDA graph (``graph_captures_executor``; the graph runner calls
``before_graph_replay`` / ``after_graph_replay``); decode micro-batches are then slices of the batch
(``split_decode_requests``).

Tensor parallelism inside an attention worker: only TP rank 0 talks to FFN workers; other ranks contribute a
zero expert output, and the following norm's all-reduce (or ``moe_combine``'s) sums the full result.
Load balancing (sec. 6): router counts feed an :class:`~sglang.srt.afd.load_balance.ExpertRebalancer`;
between steps a new placement is sent to the FFN workers (``PLACE``), acknowledged, then used.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Optional

import numpy as np
import torch

from sglang.srt.afd.device_m2n import DeviceDispatch, capturing
from sglang.srt.afd.experts import moe_layer_specs
from sglang.srt.afd.load_balance import ExpertLoadCollector, ExpertRebalancer, assign_tokens, static_placement
from sglang.srt.afd.protocol import DEVICE_TRANSPORTS, DISPATCH, ERROR, PLACE, PLACED, RESULT, AfdTopology, \
    create_afd_transport, dispatch_layout, result_layout
from sglang.srt.forward_batch_info import ForwardBatch
from sglang.srt.layers.stages import LayerState
from sglang.srt.model_executor.executors.base import StagedExecutor

logger = logging.getLogger(__name__)

PRE_MOE = ("input_norm", "attention", "post_attention_norm", "moe_route")
LOG_EVERY_STEPS = 200


def refuse_dense(mc) -> list:
    """The MoE layer specs of ``mc``; ValueError naming the architecture for a dense model."""
    specs = moe_layer_specs(mc)
    if not specs:
        raise ValueError(f"--enable-afd needs a MoE model (Mixtral, Qwen2-MoE, Qwen3-MoE); {mc.architecture} at "
                         f"{mc.path} has no routed experts to put on FFN workers")
    return specs


class AfdExecutor(StagedExecutor):
    """See the module docstring.

    Args:
        mc: the model config (MoE; ValueError otherwise).
        topo: the :class:`AfdTopology`; index: this attention worker's index a.
        num_micro_batches: m (>= 1); device: the worker's device; tp_rank: rank inside the attention worker.
        alive: ``() -> bool`` liveness of the launcher (waits fail at once when False).
        redundant_experts: replicas beyond one per expert the rebalancer may place (0: static EP).
        rebalance_interval: steps between placement updates (0: never).
        device_m2n: device-driven steps (:mod:`sglang.srt.afd.device_m2n`: one ``STEP`` host message per step, the
            per-layer exchange device to device, the step CUDA-graph capturable: ``graph_captures_executor``);
            None: on when ``topo.transport`` is ``cuda_push`` / ``cuda_push_ll`` and rebalancing is off.
    Raises (from ``__init__``):
        ValueError: m < 1, a dense model, ``device_m2n=True`` with rebalancing or a host transport.
    Raises (from ``run``):
        RuntimeError: an FFN worker reported an error; TimeoutError/ConnectionError: an FFN worker did not
        answer (dead or gone) -- the scheduler fails the batch instead of hanging.
    """

    # an FFN worker that does not answer: the attention worker fails its requests (503), frees their KV, stays up
    recoverable_errors = (TimeoutError, ConnectionError)

    name = "afd"
    supports_kv_layer_listener = False

    def __init__(self, mc, topo: AfdTopology, index: int, num_micro_batches: int, device: torch.device,
                 tp_rank: int = 0, alive: Optional[Callable[[], bool]] = None, redundant_experts: int = 0,
                 rebalance_interval: int = 0, device_m2n: Optional[bool] = None):
        from sgl_kernel.m2n import M2NConfig, M2NEndpoint

        if num_micro_batches < 1:
            raise ValueError(f"--afd-micro-batches={num_micro_batches} must be >= 1")
        self.specs = refuse_dense(mc)
        self.topo, self.index, self.m = topo, index, num_micro_batches
        s0 = self.specs[0]
        self.num_experts, self.hidden, self.dtype = s0.num_experts, s0.hidden, mc.dtype
        self.placement = static_placement(self.num_experts, topo.num_ffn)
        self.version = 0
        self.ep = None
        if tp_rank == 0:
            self.ep = M2NEndpoint(
                M2NConfig(index, topo.addresses, topo.max_rows, device=str(device), timeout_s=topo.timeout_s),
                dispatch_layout(s0.hidden, s0.top_k, mc.dtype), recv_layout=result_layout(s0.hidden, mc.dtype),
                transport=create_afd_transport(topo.transport), alive=alive)
        if device_m2n and rebalance_interval > 0:
            raise ValueError("device-driven AFD steps route by the static placement: turn --afd-rebalance-interval off "
                             "or use a host transport")
        self.device_mode = (topo.transport in DEVICE_TRANSPORTS and rebalance_interval == 0 if device_m2n is None
                            else device_m2n)
        self.dev = DeviceDispatch(self.ep, topo, self.placement, self.num_experts) if (
            self.device_mode and self.ep is not None) else None
        self.collector = ExpertLoadCollector(self.num_experts, 1)
        self.rebalancer = None
        if rebalance_interval > 0:
            slots = -(-self.num_experts // topo.num_ffn) + redundant_experts  # the largest static block
            self.rebalancer = ExpertRebalancer(self.placement, redundant_experts, slots, rebalance_interval)
        self.step = 0
        self._stash: dict[tuple[int, int], list] = {}
        self._ta: list[float] = []
        self._tf: list[float] = []
        self._rtt: list[float] = []
        self._pending: dict[int, tuple] = {}
        self.last_constraint: Optional[dict] = None
        self.step_timer = None  # an afd.step_timing.StepTimer: Ta / round trip also inside a graph (opt-in)

    # ---- the pipeline: hooks of the staged skeleton ------------------------------------------------------------
    @property
    def graph_captures_executor(self) -> bool:
        """True when a decode CUDA graph must capture :meth:`run` itself (device-driven steps): the graph runner
        then calls :meth:`before_graph_replay` / :meth:`after_graph_replay` around each replay."""
        return self.device_mode

    def plan(self, fb: ForwardBatch) -> list[ForwardBatch]:
        """``min(m, batch_size)`` request micro-batches (device-driven: the step begins, see ``device_m2n``)."""
        m = min(self.m, fb.batch_size)
        if m > 1 and self.device_mode and fb.forward_mode.is_decode():  # views only: graph-capturable
            from sglang.srt.batch_split import split_decode_requests

            subs = split_decode_requests(fb, m)
        else:
            subs = fb.split_requests(m) if m > 1 else [fb]
        if self.dev is not None:
            self.dev.begin([int(sub.input_ids.shape[0]) for sub in subs], self.version)
        return subs

    def prepare_graph_capture(self) -> None:
        """Before the decode graphs are captured: wait until the FFN workers can be reached (device-driven)."""
        if self.dev is not None:
            self.dev.connect()

    def before_graph_replay(self, batch_size: int) -> None:
        """Before replaying the graph captured for ``batch_size`` tokens: announce the step to the FFN workers."""
        if self.dev is not None:
            self.dev.announce_batch(batch_size, self.version)

    def after_graph_replay(self) -> None:
        """After a replay: fail closed on a device wait that gave up or a short FFN answer (synchronizes)."""
        if self.dev is not None:
            self.dev.check()
        self.step += 1

    def run(self, model: Any, forward_batch: ForwardBatch) -> Any:
        """Forward ``forward_batch`` with remote experts (see the module docstring); between steps: the pipeline
        constraint log and load balancing."""
        self._pending = {}  # micro-batch -> its layer whose experts run remotely
        if self.step_timer is not None:
            self.step_timer.begin()
        out = super().run(model, forward_batch)
        if capturing():
            return out
        if self.dev is not None:
            self.dev.check()
        self.step += 1
        self._between_steps()
        return out

    def run_layer(self, index: int, layer: Any, states: list[LayerState], listener, forward_batch) -> None:
        """Per micro-batch: combine its previous layer's expert results (N2M), run this layer's attention stages
        and dispatch its gated tokens (M2N) -- or the whole layer here for a dense layer."""
        names = layer.stage_names()
        moe = "moe_route" in names
        for k, st in enumerate(states):
            if k in self._pending:
                self._finish(self._pending.pop(k), st)
            if not moe:
                for name in names:
                    layer.run_stage(name, st)
                continue
            t0 = None if capturing() else self._mark(st)
            timer = self.step_timer
            ta = timer.open("ta") if timer is not None else None
            for name in PRE_MOE:
                layer.run_stage(name, st)
            if t0 is not None:
                self._ta.append((t0, self._mark(st)))
            rtt = None
            if timer is not None:
                timer.close(ta)
                rtt = timer.open("rtt")
            self._pending[k] = (index, layer, self._dispatch(index, k, st), rtt)

    def finish(self, states: list[LayerState]) -> None:
        """Receive and combine the last MoE layer of every micro-batch."""
        for k, st in enumerate(states):
            if k in self._pending:
                self._finish(self._pending.pop(k), st)

    @staticmethod
    def _mark(st: LayerState):
        """A timestamp of the attention stages: a timed CUDA event recorded on the current stream for CUDA hidden
        states (Ta is then the GPU time of the stages, not the host time of their launches), else perf_counter."""
        x = st.hidden
        if isinstance(x, torch.Tensor) and x.is_cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    @staticmethod
    def _elapsed(t0, t1) -> float:
        """Seconds between two :meth:`_mark` stamps (for events: waits until the second has been reached)."""
        if isinstance(t0, float):
            return t1 - t0
        t1.synchronize()
        return t0.elapsed_time(t1) * 1e-3

    def _key(self, k: int) -> int:
        return (self.step << 8) | k

    def _dispatch(self, li: int, k: int, st: LayerState):
        """M2N: every FFN worker gets the micro-batch's ``n`` rows, the top-k weights of (token, slot) pairs
        routed elsewhere zeroed on the device. ``n`` (the micro-batch's token count) is known on the host, so no
        row selection is synchronized to the host (no ``nonzero``); the FFN worker skips zero-weight pairs'
        contributions. Returns ``(n, send time, key)``."""
        moe = st.moe
        if self.rebalancer is not None:  # the counts feed only the rebalancer (5 launches per layer otherwise)
            self.collector.record(moe.topk_ids, 0)
        if self.ep is None:
            return None
        n = moe.x.shape[0]
        if n > self.topo.max_rows:
            raise ValueError(f"a micro-batch of {n} tokens exceeds --afd-max-tokens={self.topo.max_rows}; raise it or "
                             "lower --chunked-prefill-size")
        x, ids = moe.x.contiguous(), moe.topk_ids.int().contiguous()
        weights = moe.topk_weights.float()
        if self.dev is not None:  # device-driven: no header, no host work per layer
            self.dev.dispatch(x, ids, weights.contiguous())
            return n, None, None
        worker = assign_tokens(moe.topk_ids, self.placement)[0] if self.topo.num_ffn > 1 else None
        t_send = time.perf_counter()
        for j in range(self.topo.num_ffn):
            w = weights if self.topo.num_ffn == 1 else torch.where(worker == j, weights, 0.0).contiguous()
            self.ep.send(self.topo.ffn_rank(j), [x, ids, w.contiguous()], (DISPATCH, li, self._key(k), self.version))
        return n, t_send, self._key(k)

    def _finish(self, pend: tuple, st: LayerState) -> None:
        """N2M: receive the N_E results of ``pend`` (``n`` rows each), sum them, run ``moe_combine``."""
        li, layer, sent, rtt = pend
        moe = st.moe
        out = None
        if sent is not None and self.dev is not None:
            out = self.dev.combine(sent[0])
        elif sent is not None:
            n, t_send, key = sent
            for reply in self._results(li, key):
                j = reply.src - self.topo.num_attention
                if reply.tensors[0].shape[0] != n:
                    raise RuntimeError(f"FFN worker {j} returned {reply.tensors[0].shape[0]} rows for layer {li}, "
                                       f"expected {n}")
                out = reply.tensors[0] if out is None else out + reply.tensors[0]  # replies are private copies
                self._tf.append(reply.meta[4] * 1e-6)
            self._rtt.append(time.perf_counter() - t_send)
        if rtt is not None:
            self.step_timer.close(rtt)
        if out is None:  # TP rank > 0: the following reduction sums rank 0's result
            out = torch.zeros_like(moe.x)
        moe.expert_out = out
        layer.run_stage("moe_combine", st)

    def _results(self, li: int, key: int) -> list:
        """The N_E RESULT messages of (layer, key), from the stash or the inbox (others are stashed, copied)."""
        want = (li, key)
        got = self._stash.pop(want, [])
        while len(got) < self.topo.num_ffn:
            msg = self.ep.recv()
            op = msg.meta[0]
            if op == ERROR:
                raise RuntimeError(f"FFN worker {msg.src - self.topo.num_attention} failed on layer {msg.meta[1]} "
                                   "(see its log)")
            if op != RESULT:
                raise RuntimeError(f"unexpected AFD op {op} from rank {msg.src} while waiting for results")
            if (msg.meta[1], msg.meta[2]) == want:
                msg.tensors = [t.clone() for t in msg.tensors]
                got.append(msg)
            else:
                msg.tensors = [t.clone() for t in msg.tensors]
                self._stash.setdefault((msg.meta[1], msg.meta[2]), []).append(msg)
        return got

    # ---- between steps: constraint log, load balancing -----------------------------------------------
    def _between_steps(self) -> None:
        for v in (self._ta, self._tf, self._rtt):  # keep the window pipeline_constraint reads
            del v[:-512]
        if self.ep is not None and self._tf and (self.step <= 3 or self.step % LOG_EVERY_STEPS == 0):
            self.last_constraint = self.pipeline_constraint()
            c = self.last_constraint
            logger.info("AFD ping-pong: Ta=%.3f ms, Tf=%.3f ms, Tc=%.3f ms -> m >= 2(1+Tc/Tf) = %.2f; m=%d (%s)",
                        c["ta_ms"], c["tf_ms"], c["tc_ms"], c["m_min"], self.m,
                        "communication hidden" if self.m >= c["m_min"] else "communication NOT hidden: raise m")
        if self.rebalancer is not None and self.ep is not None:
            self.collector.end_step()
            moves = self.rebalancer.maybe_rebalance(self.collector.counts().sum(0), self.step)
            if moves is not None:
                self.apply_placement(self.rebalancer.placement)

    def pipeline_constraint(self) -> dict:
        """Median ``ta_ms``, ``tf_ms``, ``tc_ms`` over recent steps and ``m_min = 2 (1 + Tc / Tf)`` (sec. 4.1)."""
        ta_s = [self._elapsed(t0, t1) for t0, t1 in self._ta[-512:]]  # waits for the last recorded events
        ta, tf, rtt = (float(np.median(v[-512:])) for v in (ta_s, self._tf, self._rtt))
        tc = max(0.0, (rtt - tf) / 2)
        return {"ta_ms": ta * 1e3, "tf_ms": tf * 1e3, "tc_ms": tc * 1e3, "m_min": 2 * (1 + tc / max(tf, 1e-9)),
                "m": self.m}

    def attention_ms(self) -> Optional[float]:
        """Median Ta (ms, attention stages of one layer and micro-batch) over recent eager steps; None before any
        (device-driven steps record Ta only eagerly: a graph replay has no per-layer events)."""
        if not self._ta:
            return None
        return float(np.median([self._elapsed(t0, t1) for t0, t1 in self._ta[-512:]])) * 1e3

    def reset_pipeline_stats(self) -> None:
        """Forget the Ta, Tf and round-trip samples (a benchmark starting a new configuration)."""
        self._ta, self._tf, self._rtt = [], [], []

    def apply_placement(self, placement) -> None:
        """Send every FFN worker its experts under ``placement``, wait for all acknowledgements, then route by it.

        Raises:
            RuntimeError: an FFN worker answered something else; TimeoutError/ConnectionError: it did not answer.
        """
        version = self.version + 1
        for j, experts in enumerate(placement.worker_experts()):
            n = len(experts)
            ids = torch.zeros(n, self.specs[0].top_k, dtype=torch.int32, device=self.ep.device)
            ids[:, 0] = torch.tensor(experts, dtype=torch.int32)
            self.ep.send(self.topo.ffn_rank(j), [torch.zeros(n, self.hidden, dtype=self.dtype, device=self.ep.device),
                                                 ids, torch.zeros(n, self.specs[0].top_k, device=self.ep.device)],
                         (PLACE, 0, 0, version))
        acks = 0
        while acks < self.topo.num_ffn:
            msg = self.ep.recv()
            if msg.meta[0] != PLACED or msg.meta[3] != version:
                raise RuntimeError(f"expected PLACED v{version}, got op {msg.meta[0]} v{msg.meta[3]}")
            acks += 1
        self.placement, self.version = placement, version
        logger.info("AFD placement v%d applied: %s", version, placement.worker_experts())

    def state(self) -> dict:
        """For ``/get_internal_state``: placement version and experts per FFN worker, the last constraint log."""
        return {"placement_version": self.version, "placement": self.placement.worker_experts(),
                "micro_batches": self.m, "pipeline": self.last_constraint}

    def close(self) -> None:
        """Close the M2N endpoint."""
        if self.ep is not None:
            self.ep.close()
