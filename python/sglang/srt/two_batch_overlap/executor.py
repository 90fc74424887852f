"""Two-batch overlap's executor: each forward batch runs as two micro-batches whose layer stages interleave, so that
one micro-batch's communication runs on a communication stream while the other computes.

Technique: DeepSeek-V3 technical report (2024), sec. 3.4 (dual micro-batch overlap: the all-to-all of one
micro-batch hidden under the attention / experts of the other); SGLang's ``--enable-two-batch-overlap`` (LMSYS blog
"Deploying DeepSeek with PD Disaggregation and Large-scale Expert Parallelism", 2025); vLLM's dual-batch overlap
(``--enable-dbo``, docs/design/dbo.md). Built on the stage contract (:mod:`sglang.srt.layers.stages`) and the
sub-batch schedule (:class:`~sglang.srt.model_executor.executors.split.SubBatchExecutor`): per layer, stage by stage,
micro-batch A then B. A stage *communicates* when it is a norm stage with a fused all-reduce (TP attention, and the
all-reduce expert parallelism whose MoE output is a partial sum until the next norm) or the dispatch / combine of an
MoE block whose token dispatcher moves tokens between ranks (all-to-all expert parallelism). On CUDA communicating
stages run on the communication stream and the others on the compute (current) stream; each stage waits only for
the previous stage of its own micro-batch (CUDA events, no host synchronization). With the all-to-all::

    compute: attn A | attn B | route A | route B | experts A | experts B |          | attn A' ...
    comm   :        | norm A | norm B  | disp A  | disp B    | comb A    | comb B   | norm A' ...
                      ^ A's communication overlaps B's compute, and back

Every rank issues its collectives in the same order (one communication stream, the same deterministic split). On
CPU there are no streams: the same schedule runs in order on one stream, which is what the CPU tests compare
token for token with the unsplit forward. Batches the split rules (:mod:`.split`) cannot cut, or smaller than the
auto-off threshold (:mod:`.auto_off`), run the sequential executor unchanged.

CUDA graphs: decode graphs capture this executor (``graph_captures_executor``) only when the threshold lets some
graphed decode batch split (``min_tokens <= graph_max_bs``, e.g. forced on); each padded batch size then captures
the schedule the eager path would run for it (views-only split, no host copies). Otherwise the graphs capture the
plain forward, as without two-batch overlap: graphed decode batches are at most ``--cuda-graph-max-bs`` tokens, the
size where the overlap loses (SGLang: -27% at 32 tokens per GPU).
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from sglang.srt.forward_batch_info import ForwardBatch, ForwardMode
from sglang.srt.layers.stages import NORM_STAGES, LayerState
from sglang.srt.model_executor.executors.split import SubBatchExecutor
from sglang.srt.two_batch_overlap.auto_off import Threshold, TBO_OFF
from sglang.srt.two_batch_overlap.split import (
    DEFAULT_TOKEN_DISTRIBUTION_THRESHOLD,
    MicroBatchSplit,
    check_threshold,
    plan_micro_batches,
)

logger = logging.getLogger(__name__)

MOE_COMM_STAGES = ("moe_dispatch", "moe_combine")


@dataclass(frozen=True)
class TboConfig:
    """Two-batch overlap's settings (frozen; built from the flags by :mod:`.deploy`).

    Attributes:
        token_distribution_threshold: ``--tbo-token-distribution-threshold`` (see :mod:`.split`), in ``[0, 0.5]``.
        threshold: the auto-off :class:`~sglang.srt.two_batch_overlap.auto_off.Threshold` (``min_tokens``: batches
            with fewer new tokens on this rank run unsplit).
        graph_max_bs: the largest decode batch captured in a CUDA graph (0: no graphs).
    Raises:
        ValueError: a threshold outside ``[0, 0.5]`` or ``min_tokens < 2``.
    """

    token_distribution_threshold: float = DEFAULT_TOKEN_DISTRIBUTION_THRESHOLD
    threshold: Threshold = Threshold(TBO_OFF, False, "default")
    graph_max_bs: int = 0

    def __post_init__(self) -> None:
        check_threshold(self.token_distribution_threshold)
        if self.threshold.min_tokens < 2:
            raise ValueError(f"two-batch overlap min_tokens={self.threshold.min_tokens} must be >= 2")

    @property
    def min_tokens(self) -> int:
        """Batches with fewer new tokens on this rank run unsplit."""
        return self.threshold.min_tokens


def moe_block_communicates(mlp: Any) -> bool:
    """Whether an MoE block's dispatch / combine stages move tokens between ranks: the block has an all-to-all
    runner (``mlp.a2a``, expert parallelism by all-to-all, ``--moe-a2a-backend nccl|tdist``) that does not declare
    ``communicates = False``. The all-reduce expert parallelism has none (dispatch is a no-op; its all-reduce is the
    next norm's)."""
    a2a = getattr(mlp, "a2a", None)
    return a2a is not None and bool(getattr(a2a, "communicates", True))


class _DecisionLog:
    """Logs the executor's on/off choice: at INFO the first time each (choice, batch kind, reason) takes effect, at
    DEBUG when the choice changes again later (a server alternating prefill and decode does not flood its log).
    ``quiet`` (ranks other than 0, whose choice is the same): DEBUG only."""

    def __init__(self, quiet: bool = False) -> None:
        self.last: Optional[bool] = None
        self.seen: set = set()
        self.quiet = quiet

    def note(self, on: bool, kind: str, reason: str, text: Callable[[], str]) -> None:
        """Record the choice ``on`` for a batch of ``kind`` (decode / extend / mixed) for ``reason``."""
        changed, self.last = on != self.last, on
        if not changed:
            return
        key = (on, kind, reason)
        level = logging.DEBUG if self.quiet or key in self.seen or len(self.seen) > 64 else logging.INFO
        self.seen.add(key)
        if logger.isEnabledFor(level):
            logger.log(level, "two-batch overlap %s", text())


class TwoBatchOverlapExecutor(SubBatchExecutor):
    """Two micro-batches per forward, interleaved stage by stage over a compute and a communication stream (see the
    module docstring).

    Args:
        config: :class:`TboConfig`.
        device: the model's ``torch.device`` (the communication stream is created on CUDA devices only).
        rank: this worker's rank in its group (the choice is logged at INFO on rank 0 only).
    """

    name = "two_batch_overlap"

    def __init__(self, config: TboConfig, device: Any, rank: int = 0):
        super().__init__()
        self.config = config
        self.device = torch.device(device)
        self.comm_stream = (torch.cuda.Stream(self.device, priority=torch.cuda.Stream.priority_range()[1])
                            if self.device.type == "cuda" else None)
        self._log = _DecisionLog(quiet=rank != 0)
        self.last_split: Optional[MicroBatchSplit] = None  # the split of the latest forward (None: unsplit)
        self._comm_of: Any = weakref.WeakKeyDictionary()  # layer -> its communicating stages
        self._model_comm: Any = weakref.WeakKeyDictionary()  # model -> whether any stage communicates
        self._streams = False  # this forward runs on two streams
        self._compute: Any = None  # the compute (current) stream of the forward in flight
        self._events: dict[int, Any] = {}  # id(state) -> its micro-batch's reusable event
        self._pool: list = []
        self._last: dict[int, Any] = {}  # id(state) -> the stream of its previous stage
        self._held: dict[int, list] = {}  # id(state) -> [(objects dropped from the state, stream still to wait)]

    # ---- DP attention ----------------------------------------------------------------------------------------
    def dp_split_ok(self, batch: Any) -> bool:
        """Whether this executor would cut a scheduler batch (``ScheduleBatch``: ``forward_mode``, ``reqs[i].
        extend_len``) into two micro-batches: the rank's report in DP attention's per-step agreement, which splits a
        step only when every rank would (an idle rank never does), so every rank runs the same collectives. The
        same rules as :meth:`decide`, without logging."""
        lens = [int(r.extend_len) for r in batch.reqs]
        mode = batch.forward_mode
        if mode == ForwardMode.IDLE or sum(lens) < max(2, self.config.min_tokens):
            return False
        return plan_micro_batches(mode.is_decode(), lens, self.config.token_distribution_threshold) is not None

    @property
    def graph_captures_executor(self) -> bool:
        """True when decode CUDA graphs must capture this executor: some graphed decode batch splits."""
        return self.comm_stream is not None and 2 <= self.config.min_tokens <= self.config.graph_max_bs

    def before_graph_replay(self, batch_size: int) -> None:
        """Nothing to announce before a replay (the graph holds the whole schedule)."""

    def after_graph_replay(self) -> None:
        """Nothing to check after a replay."""

    # ---- which micro-batches -------------------------------------------------------------------------------
    def decide(self, forward_batch: ForwardBatch) -> Optional[MicroBatchSplit]:
        """The two-micro-batch split of ``forward_batch``, or None to run it unsplit (the rules of :mod:`.split`,
        the auto-off threshold; under DP attention the step's agreement ``forward_batch.dp_step.split_all``, which
        every rank follows); logs the choice (:class:`_DecisionLog`).

        Raises:
            RuntimeError: the DP ranks agreed to split but this rank's batch would not be split (a reporting bug;
                failing beats running different collectives on different ranks)."""
        fb = forward_batch
        mode = fb.forward_mode
        n = fb.num_tokens
        kind = "decode" if mode.is_decode() else "mixed" if mode == ForwardMode.MIXED else "extend"
        split = None
        if mode != ForwardMode.IDLE and n >= 2:
            split = plan_micro_batches(mode.is_decode(), fb.extend_lens_cpu, self.config.token_distribution_threshold)
        below = n < self.config.min_tokens
        on = split is not None and not below
        step = getattr(fb, "dp_step", None)  # DP attention: the step every rank agreed on (dp_split_ok's reports)
        if step is not None:
            agreed = bool(getattr(step, "split_all", False))
            if agreed and not on:
                raise RuntimeError(f"two-batch overlap: the DP ranks agreed to split, but this rank's {n}-token {kind} "
                                   "batch would run unsplit (dp_split_ok and decide disagree)")
            on = agreed
        reason = "split" if on else "uncuttable" if split is None else "below" if below else "ranks"
        thr = self.config.threshold

        def text() -> str:
            if on:
                return f"on: {n}-token {kind} batch split {split.describe()}"
            if reason == "below":
                return (f"off: {n}-token {kind} batch is below the threshold ({thr.describe()}); pass "
                        "--tbo-min-tokens to change it")
            if reason == "uncuttable":
                return f"off: the {n}-token {kind} batch cannot be cut into two micro-batches"
            return f"off: another DP rank's batch runs unsplit ({n}-token {kind} batch here)"

        self._log.note(on, kind, reason, text)
        self.last_split = split if on else None
        return self.last_split

    def plan(self, forward_batch: ForwardBatch) -> list[ForwardBatch]:
        """``[A, B]`` as :meth:`decide` cuts the batch, or ``[forward_batch]``. Decode batches are cut by views
        (:func:`~sglang.srt.batch_split.split_decode_requests`: no host-to-device copy, CUDA-graph capturable),
        others by :meth:`ForwardBatch.split_tokens` (a request may straddle the cut)."""
        split = self.decide(forward_batch)
        if split is None:
            return [forward_batch]
        if forward_batch.forward_mode.is_decode():
            from sglang.srt.batch_split import split_decode_requests

            subs = split_decode_requests(forward_batch, 2)  # A takes ceil(bs / 2), as split_decode
            if subs[0].num_tokens != split.token_cut:
                raise AssertionError(f"decode split {subs[0].num_tokens} != planned {split.token_cut}")
            return subs
        return list(forward_batch.split_tokens(split.token_cut))

    # ---- the forward ---------------------------------------------------------------------------------------
    def run(self, model: Any, forward_batch: ForwardBatch) -> Any:
        """Forward ``forward_batch`` as :meth:`plan` cuts it: unsplit through the sequential executor, else the
        interleaved schedule (on two streams on CUDA when the model has communicating stages)."""
        subs = self.plan(forward_batch)
        if len(subs) <= 1:
            return self._sequential.run(model, forward_batch)
        listener = self.active_listener(forward_batch) if self.kv_layer_listener is not None else None
        self._streams = self.comm_stream is not None and self._has_comm(model)
        if not self._streams:
            return self.run_layers(model, forward_batch, subs, listener)
        self._compute = torch.cuda.current_stream(self.device)
        try:
            return self.run_layers(model, forward_batch, subs, listener)
        finally:
            self._join()
            self._streams, self._compute = False, None

    def embed_states(self, model: Any, forward_batch: ForwardBatch, subs: list[ForwardBatch]) -> list[LayerState]:
        """The micro-batches' states from one embedding (:meth:`SubBatchExecutor.embed_states`); on two streams the
        communication stream then waits for everything the compute stream issued so far (metadata, embedding)."""
        states = super().embed_states(model, forward_batch, subs)
        if self._streams:
            self.comm_stream.wait_stream(self._compute)
            while len(self._pool) < len(states):
                self._pool.append(torch.cuda.Event())
            self._events = {id(st): self._pool[i] for i, st in enumerate(states)}
            self._last, self._held = {}, {id(st): [] for st in states}
        return states

    def run_stage(self, layer: Any, stage: str, state: LayerState) -> None:
        """Run one stage of one micro-batch: communicating stages on the communication stream, the others on the
        compute stream, each after its micro-batch's previous stage (on CPU, or without communicating stages: in
        order on the current stream)."""
        if not self._streams:
            layer.run_stage(stage, state)
            return
        comm = stage in self._comm_stages(layer) and (stage not in NORM_STAGES or state.residual is not None)
        compute = self._compute
        stream = self.comm_stream if comm else compute
        key = id(state)
        prev = self._last.get(key)
        if prev is not None and prev is not stream:
            stream.wait_event(self._events[key])
        before = _refs(state)
        if comm:
            torch.cuda.set_stream(stream)
            try:
                layer.run_stage(stage, state)
            finally:
                torch.cuda.set_stream(compute)
        else:
            layer.run_stage(stage, state)
        self._events[key].record(stream)
        self._last[key] = stream
        self._hold(key, stream, before, state)

    def finish(self, states: list[LayerState]) -> None:
        """After the last layer: the compute stream waits for both micro-batches (:meth:`_join`)."""
        if self._streams:
            self._join()

    # ---- streams and memory --------------------------------------------------------------------------------
    def _hold(self, key: int, stream: Any, before: list, state: LayerState) -> None:
        """Keep the objects a stage dropped from its micro-batch's state alive until both streams are ordered after
        that stage, so the caching allocator cannot hand their memory to new work on either stream while the stage
        (or an earlier reader) may still run: the stage's own stream is ordered after it at once, the other stream
        once a later stage of the same micro-batch runs there (it waited for the chain). Cheaper than a
        ``record_stream`` per tensor per stage; :meth:`_join` drops the rest."""
        held = self._held[key]
        if held:
            held[:] = [h for h in held if h[1] is not stream]
        after = {id(o) for o in _refs(state)}
        dropped = [o for o in before if id(o) not in after]
        if dropped:
            held.append((dropped, compute_or_comm(stream, self._compute, self.comm_stream)))

    def _join(self) -> None:
        """The compute stream waits for every micro-batch's last stage; then held objects may be freed (the next
        forward's communication stream waits for the compute stream before its first stage)."""
        compute = self._compute
        if compute is None:
            return
        for key, ev in self._events.items():
            if self._last.get(key) is not None and self._last[key] is not compute:
                compute.wait_event(ev)
        self._last, self._held, self._events = {}, {}, {}

    def _comm_stages(self, layer: Any) -> frozenset:
        """The stages of ``layer`` that communicate (see the module docstring), cached per layer (weakly: a layer
        that is gone cannot hand its entry to a new object with the same ``id``)."""
        stages = self._comm_of.get(layer)
        if stages is None:
            names = tuple(layer.stage_names())
            out = set()
            if hasattr(layer, "norm_module"):
                out |= {s for s in NORM_STAGES if s in names and getattr(layer.norm_module(s), "comm", None) is not None}
            if MOE_COMM_STAGES[0] in names and moe_block_communicates(getattr(layer, "mlp", None)):
                out |= set(MOE_COMM_STAGES)
            stages = self._comm_of[layer] = frozenset(out)
        return stages

    def has_communication(self, model: Any) -> bool:
        """Whether any stage of ``model`` communicates (see the module docstring): without, the two micro-batches
        have nothing to overlap."""
        return self._has_comm(model)

    def _has_comm(self, model: Any) -> bool:
        """Whether any stage of ``model`` communicates (else the schedule stays on one stream), cached per model."""
        known = self._model_comm.get(model)
        if known is None:
            known = self._model_comm[model] = any(self._comm_stages(layer) for layer in model.decoder_layers)
        return known


def compute_or_comm(stream: Any, compute: Any, comm: Any) -> Any:
    """The other stream of the pair: ``comm`` when ``stream`` is ``compute``, else ``compute``."""
    return comm if stream is compute else compute


def _refs(state: LayerState) -> list:
    """The objects a micro-batch's state references between stages (tensors, a dispatcher's handle)."""
    m = state.moe
    return [o for o in (state.hidden, state.residual, m.x, m.topk_weights, m.topk_ids, m.expert_out, m.dispatched)
            if o is not None]
