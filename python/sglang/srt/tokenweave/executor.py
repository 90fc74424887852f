"""TokenWeave's executor (Gond et al. 2025, sec. 3.1.2, Fig. 8): two wave-aware token splits whose
AllReduce + RMSNorm run on a communication stream while the other split computes.

Per layer, stage by stage, split by split (the :class:`SubBatchExecutor` schedule); on CUDA every norm+comm
stage is issued on the communication stream and every compute stage (attention, MLP / MoE) on the
compute stream, each waiting only on the previous stage *of its own split* through CUDA events (no host
synchronization). The resulting overlap::

    compute: attn(A)  attn(B)         mlp(A)         mlp(B)          attn(A, next layer) ...
    comm   :          norm(A)         norm(B)        norm(A, next)   norm(B, next) ...

The suffix split's attention is issued after the prefix split's on the same compute stream, so a
request straddling the cut reads the prefix split's KV of that layer. Batches below
``--tokenweave-min-tokens`` and decode batches run the sequential executor (and its CUDA graphs).
On CPU there are no streams: the same schedule runs in order, which is what the CPU tests compare.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, Optional

import torch

from sglang.srt.forward_batch_info import ForwardBatch
from sglang.srt.layers.stages import DENSE_STAGES, NORM_STAGES, LayerState
from sglang.srt.model_executor.executors.split import SubBatchExecutor
from sglang.srt.tokenweave.carveout import GemmCarveout
from sglang.srt.tokenweave.overlap import WIDTH_GEMMS, layer_overlap, width_sms
from sglang.srt.tokenweave.planner import DEFAULT_MAX_SKEW, GemmShape, plan_split

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TokenWeaveConfig:
    """``--tokenweave-min-tokens`` (batches with fewer new tokens run unsplit; >= 2), ``--tokenweave-comm-sms``
    (SM budget of the overlapped communication kernel; None: tw-comm's default), the layer's GEMM output
    widths for the planner, the device's GEMM wave model, and ``gemm_carveout``: SMs the split forward's GEMMs
    leave free for the communication kernel (:class:`~sglang.srt.tokenweave.carveout.GemmCarveout`; None: the
    communication kernel's CTA budget, 0: GEMMs use every SM). ``sharded_residual`` (the default; False with
    ``--tokenweave-full-residual``): a split forward's fused AllReduce + add + RMSNorm calls keep the residual
    sharded (each rank reads and updates only its ``owned_range`` rows of each split's residual and all-gathers the
    normed rows; TokenWeave sec. 3-4), when the communicator supports it (``supports_sharded_residual``;
    :meth:`TokenWeaveExecutor.check_model` refuses a model whose norms do not share one communicator). The two
    flags are validated once, by ``ServerArgs``; raises ValueError when the GEMM widths are missing or the carveout
    is negative. ``split_skew``: how far (fraction of the batch) the planner's cut may be from the half
    (:func:`~sglang.srt.tokenweave.planner.plan_split`'s ``max_skew``; None: the unbounded legacy search, which cut
    4096 tokens 384 + 3712 on 116 SMs and left the big split's AllReduce unhidden); raises ValueError
    outside ``[0, 0.5]``. ``carveout_scope``: which GEMMs the carveout caps: ``"all"`` (every GEMM of the split
    forward, logits included; the default until a GPU A/B shows ``"overlap"`` wins) or ``"overlap"`` (only the GEMMs
    that run beside the other split's AllReduce in the executor's schedule,
    :func:`~sglang.srt.tokenweave.overlap.layer_overlap`; the others and the planner's wave model of them get every
    SM); raises ValueError for another value."""

    min_tokens: int = 1024
    comm_sms: Optional[int] = None
    gemm_widths: tuple[int, ...] = ()
    gemm_shape: GemmShape = GemmShape()
    gemm_carveout: Optional[int] = None
    sharded_residual: bool = True
    split_skew: Optional[float] = DEFAULT_MAX_SKEW
    carveout_scope: str = "all"

    def __post_init__(self) -> None:
        _check_scope(self.carveout_scope)
        if not self.gemm_widths:
            raise ValueError("TokenWeaveConfig needs the layer's GEMM widths (layer_gemm_widths)")
        if self.gemm_carveout is not None and self.gemm_carveout < 0:
            raise ValueError(f"TokenWeaveConfig.gemm_carveout={self.gemm_carveout} must be >= 0 (0: no carveout)")
        _check_skew(self.split_skew)

    def carveout_sms(self) -> int:
        """The SMs the split forward's GEMMs leave to the communication kernel: ``gemm_carveout``, else the
        communication kernel's CTA budget (``comm_sms``, else tw-comm's overlap default of 16)."""
        if self.gemm_carveout is not None:
            return self.gemm_carveout
        if self.comm_sms is not None:
            return self.comm_sms
        from sglang.srt.distributed.tw_comm import TwCommConfig

        return TwCommConfig.overlap_sms


class TokenWeaveExecutor(SubBatchExecutor):
    """Two token splits overlapped over a compute and a communication stream (see the module docstring).

    Args:
        config: :class:`TokenWeaveConfig`.
        device: the model's device (streams are created on CUDA devices only).
    """

    name = "tokenweave"

    def __init__(self, config: TokenWeaveConfig, device: torch.device):
        super().__init__()
        self.config = config
        self.device = torch.device(device)
        # high priority: the communication kernel's few CTAs get scheduled as soon as they are ready instead of
        # queueing behind the other split's GEMM waves (TokenWeave sec. 3.2)
        self.comm_stream = (torch.cuda.Stream(self.device, priority=torch.cuda.Stream.priority_range()[1])
                            if self.device.type == "cuda" else None)
        self._logged: set[tuple[int, bool]] = set()
        self._events: dict[int, Any] = {}  # per split: its last stage's event (re-recorded, never re-created)
        self._pool: list[Any] = []  # the events, one per split, reused across stages and forwards
        self._hold: dict[int, list[tuple]] = {}  # per split: the last two stages' (hidden, residual) (_on_stream)
        self._plans: dict[int, Any] = {}  # planner result per token count (a pure function of T)
        self._split_skew = config.split_skew
        self._compute: Optional[Any] = None  # the compute (current) stream of the forward in flight
        self._final: Optional[torch.Tensor] = None  # the split forward's output [T, H] (embed_states)
        self._rows: list[tuple[int, int]] = []  # each split's rows of it
        self._checked_model: Optional[int] = None  # id() of the model check_model last accepted
        # carveout_scope "overlap": per (id(layer), split, stage) the id()s of the GEMM modules to cap, the forward
        # hooks that cap them, the set of the compute stage running now, whether a cap is entered
        self._scope = config.carveout_scope
        self._caps: dict[tuple[int, int, str], frozenset[int]] = {}
        self._caps_model: Optional[int] = None
        self._hooks: list[Any] = []
        self._cap_now: frozenset[int] = frozenset()
        self._capping = False
        self._split_index: dict[int, int] = {}  # id(state) -> split index, set by embed_states
        self.set_gemm_carveout(min(config.carveout_sms(), config.gemm_shape.num_sms - 1))  # a small wave model

    @property
    def sharded_residual(self) -> bool:
        """The residual mode this executor runs (``config.sharded_residual``; ``ModelExecutor.sharded_residual``)."""
        return self.config.sharded_residual

    def set_gemm_carveout(self, sms: int) -> None:
        """Leave ``sms`` SMs free of GEMMs during split forwards (0: none), and plan splits for the SMs left; for
        benchmarks and tuning. Raises ValueError when ``sms`` is not in ``[0, num_sms)``."""
        shape = self.config.gemm_shape
        self._carveout = GemmCarveout(sms, shape.num_sms, self.device)
        # the planner's wave model counts only the SMs the GEMMs keep (TokenWeave sec. 3.1.1 with sec. 3.2's split
        # of the SMs), per GEMM when only the overlapped ones are capped; cached plans were made for another count
        self._plan_sms: Optional[tuple[int, ...]] = None
        if self._scope == "overlap" and len(self.config.gemm_widths) == len(WIDTH_GEMMS):
            self._plan_shape = shape
            self._plan_sms = width_sms(layer_overlap(DENSE_STAGES), shape.num_sms, sms)
        else:  # "all" (or widths the dense table does not describe: all capped, the conservative model); MoE
            # models' widths are planned as their dense equivalent's (gemm_widths_of)
            self._plan_shape = dataclasses.replace(shape, num_sms=shape.num_sms - sms)
        self._plans = {}

    def set_carveout_scope(self, scope: str) -> None:
        """Cap every GEMM of a split forward (``"all"``) or only those beside a comm (``"overlap"``), see
        :class:`TokenWeaveConfig`; for benchmarks (the selective-carveout A/B). Re-plans splits. Raises
        ValueError for another scope."""
        _check_scope(scope)
        self._scope = scope
        if scope == "all":
            self._remove_caps()
        self.set_gemm_carveout(self._carveout.carveout)

    def set_split_skew(self, skew: Optional[float]) -> None:
        """Plan later splits with ``skew`` as the planner's ``max_skew`` (None: the unbounded legacy search); for
        benchmarks (the old-vs-new split A/B). Raises ValueError outside ``[0, 0.5]``."""
        _check_skew(skew)
        self._split_skew = skew
        self._plans = {}

    def check_model(self, model: Any) -> None:
        """With the sharded residual, refuse a model whose fused norms do not share one communicator (fail closed).

        A split forward keeps the residual sharded only when every norm that gets a residual (each decoder layer's
        ``input_norm`` / ``post_attention_norm``, ``layer.norm_module``) and the final norm (``model.model.norm``)
        run the same communicator's residual-sharded call: a norm whose communicator cannot shard (or a final norm
        that falls back to ``model.final_norm``) would read the residual rows another rank owns, which hold stale
        values, and return wrong logits. Every norm of the models here shares the TP communicator; this check keeps
        a future model from breaking that silently. Called by the executor factory once the model is loaded, and
        before a model's first split forward. No-op with the full residual or when no norm's communicator can
        shard (nothing is sharded then).

        Raises:
            ValueError: the norms have different communicators and one of them can shard; the message names the
                norm and the fix (``--tokenweave-full-residual``).
        """
        if not self.config.sharded_residual:
            return
        final = getattr(getattr(model, "model", None), "norm", None)
        norms = [(f"layer {i} {stage}", layer.norm_module(stage)) for i, layer in enumerate(model.decoder_layers)
                 for stage in NORM_STAGES]
        norms.append(("the final norm (model.model.norm)", final))
        comms = [(where, getattr(norm, "comm", None)) for where, norm in norms]
        first_where, first = comms[0]
        odd = next(((w, c) for w, c in comms if c is not first), None)
        if odd is not None and any(_shards(c) for _, c in comms):
            raise ValueError(
                f"TokenWeave's sharded residual needs one communicator for every fused norm, but {odd[0]} uses "
                f"{type(odd[1]).__name__} and {first_where} uses {type(first).__name__}: a norm that does not make "
                "the same residual-sharded call would read residual rows this rank does not own. Start the server "
                "with --tokenweave-full-residual (or build the model with one TP communicator for all its norms)")
        self._checked_model = id(model)

    # ---- which sub-batches ------------------------------------------------------------------------------
    def plan(self, forward_batch: ForwardBatch) -> list[ForwardBatch]:
        """Two planner-chosen splits, or the whole batch (decode, or fewer than ``min_tokens`` tokens)."""
        n = forward_batch.num_tokens
        if forward_batch.forward_mode.is_decode() or n < self.config.min_tokens:
            self._log_once(n, None)
            return [forward_batch]
        plan = self._plans.get(n)
        if plan is None:
            plan = plan_split(n, self.config.gemm_widths, self._plan_shape, self._split_skew, self._plan_sms)
            if len(self._plans) < 65536:
                self._plans[n] = plan
        self._log_once(n, plan)
        return list(forward_batch.split_tokens(plan.prefix))

    def _log_once(self, n: int, plan) -> None:
        """Log the decision for an ``n``-token batch the first time it is made (a size can be both a decode
        batch, unsplit, and a prefill batch, split: each decision is logged once)."""
        key = (n, plan is None)
        if key in self._logged or len(self._logged) > 4096:
            return
        self._logged.add(key)
        if plan is None:
            logger.info("TokenWeave: %d tokens run unsplit (below --tokenweave-min-tokens=%d or decode)", n,
                        self.config.min_tokens)
        else:
            logger.info("TokenWeave: %d tokens split %d + %d (%d extra GEMM waves over %d unsplit)", n, plan.prefix,
                        plan.suffix, plan.extra_waves, plan.unsplit_waves)

    # ---- where each stage runs --------------------------------------------------------------------------
    def run(self, model: Any, forward_batch: ForwardBatch) -> Any:
        """Forward the batch as :meth:`plan` splits it (:meth:`run_subs`)."""
        return self.run_subs(model, forward_batch, self.plan(forward_batch))

    def run_subs(self, model: Any, forward_batch: ForwardBatch, subs: list[ForwardBatch]) -> Any:
        """Forward ``forward_batch`` as the sub-batches ``subs`` (from :meth:`plan`; one: the sequential executor),
        per-split final norms (:meth:`final_hidden`); on CUDA the compute stream waits for every split's last
        event before the result is returned.

        Split from :meth:`run` so that the planning (host-to-device copies of the splits' request metadata) can
        happen outside a CUDA-graph capture: a prefill of fixed sub-batches issues no host synchronization and no
        host-to-device copy here, so ``run_subs`` of planned sub-batches can be captured (benchmarks graph the
        split forward per token count; see ``benchmark/tokenweave/layer_graph.py``)."""
        if len(subs) <= 1:
            return self._sequential.run(model, forward_batch)
        if self.config.sharded_residual and self._checked_model != id(model):
            self.check_model(model)
        listener = self.active_listener(forward_batch) if self.kv_layer_listener is not None else None
        if self.comm_stream is None:
            return self.run_layers(model, forward_batch, subs, listener)
        self._events, self._hold = {}, {}
        self._compute = torch.cuda.current_stream(self.device)  # looked up once per forward, not per stage
        try:
            return self.run_layers(model, forward_batch, subs, listener)
        finally:
            self._compute = None

    def run_layers(self, model: Any, forward_batch: ForwardBatch, subs: list[ForwardBatch], listener) -> Any:
        """The split forward (:meth:`SubBatchExecutor.run_layers`) with the GEMMs capped to the SMs the overlapped
        communication kernel leaves free (``config.carveout_sms()``): all of them (scope ``"all"``), or only those
        beside a comm (``"overlap"``, :meth:`_install_caps`); the cap is lifted on return or error."""
        if self._scope == "all":
            with self._carveout:
                return super().run_layers(model, forward_batch, subs, listener)
        self._install_caps(model)
        try:
            return super().run_layers(model, forward_batch, subs, listener)
        finally:
            self._cap_now = frozenset()
            if self._capping:  # a capped GEMM raised: its forward hook did not run
                self._capping = False
                self._carveout.__exit__(None, None, None)

    def _install_caps(self, model: Any) -> None:
        """Scope ``"overlap"``: forward pre/post hooks on the GEMM modules :func:`layer_overlap` names for each
        decoder layer (paths of :data:`~sglang.srt.tokenweave.overlap.STAGE_GEMMS`; a path the layer lacks is
        skipped), entering / leaving the carveout around a GEMM when :meth:`run_stage` runs a (split, stage) that
        lists it. Once per model; the hooks are no-ops outside those stages (unsplit forwards)."""
        if self._caps_model == id(model):
            return
        self._remove_caps()
        per_stages: dict[tuple[str, ...], frozenset] = {}
        caps: dict[tuple[int, int, str], set[int]] = {}
        hooked: set[int] = set()
        for layer in model.decoder_layers:
            stages = tuple(layer.stage_names())
            ovl = per_stages.setdefault(stages, layer_overlap(stages))
            for split, stage, path in sorted(ovl):
                try:
                    mod = layer.get_submodule(path)
                except AttributeError:
                    continue
                caps.setdefault((id(layer), split, stage), set()).add(id(mod))
                if id(mod) not in hooked:  # one pair of hooks per module, whichever splits cap it
                    hooked.add(id(mod))
                    self._hooks += [mod.register_forward_pre_hook(self._cap_enter),
                                    mod.register_forward_hook(self._cap_exit)]
        self._caps = {k: frozenset(v) for k, v in caps.items()}
        self._caps_model = id(model)

    def _remove_caps(self) -> None:
        """Remove :meth:`_install_caps`'s hooks."""
        for h in self._hooks:
            h.remove()
        self._hooks, self._caps, self._caps_model = [], {}, None

    def _cap_enter(self, module: Any, args: Any) -> None:
        """Forward pre-hook: enter the carveout when ``module`` is a GEMM to cap in the stage running now."""
        if id(module) in self._cap_now and not self._capping:
            self._carveout.__enter__()
            self._capping = True

    def _cap_exit(self, module: Any, args: Any, output: Any) -> None:
        """Forward hook: leave the carveout entered by :meth:`_cap_enter`."""
        if self._capping:
            self._capping = False
            self._carveout.__exit__(None, None, None)

    def finish(self, states: list[LayerState]) -> None:
        """Nothing: the skeleton calls this before :meth:`final_hidden`, whose per-split final norms still run on
        the communication stream; :meth:`_join` runs once after them."""

    def _join(self, states: list[LayerState]) -> None:
        """Make the compute stream wait for every split's last stage before the result is read."""
        if self.comm_stream is None:
            return
        cur = torch.cuda.current_stream(self.device)
        for st in states:
            ev = self._events.pop(id(st), None)
            if ev is not None:
                cur.wait_event(ev)
            if self._final is None and st.hidden is not None and st.hidden.is_cuda:
                # the normed split was allocated on the communication stream and is read by the compute stream's
                # cat; the only record_stream per split per forward
                st.hidden.record_stream(cur)
        self._hold = {}  # the compute stream now waits for every communication stage: held inputs may be reused

    def run_stage(self, layer: Any, stage: str, state: LayerState) -> None:
        """Norm+comm stages on the communication stream (fused AllReduce + add + RMSNorm with the overlap SM
        budget), compute stages on the current stream; each waits on its split's previous stage."""
        comm_stage = stage in NORM_STAGES and state.residual is not None
        if comm_stage:
            self._on_stream(True, state, lambda overlap: self._norm_comm(layer.norm_module(stage), state, overlap,
                                                                         lambda: layer.run_stage(stage, state),
                                                                         sharded=self.config.sharded_residual))
        elif not self._caps:
            self._on_stream(False, state, lambda overlap: layer.run_stage(stage, state))
        else:  # scope "overlap": the hooks cap this (split, stage)'s overlapped GEMMs
            self._cap_now = self._caps.get((id(layer), self._split_index.get(id(state), -1), stage), frozenset())
            try:
                self._on_stream(False, state, lambda overlap: layer.run_stage(stage, state))
            finally:
                self._cap_now = frozenset()

    def embed_states(self, model: Any, forward_batch: ForwardBatch, subs: list[ForwardBatch]) -> list[LayerState]:
        """The splits' states from one embedding (:meth:`SubBatchExecutor.embed_states`); on CUDA also the
        forward's output ``[T, H]``, allocated here on the compute stream before any communication-stream work of
        this forward (so no block the compute stream still uses can be handed to it), into whose row ranges the
        per-split final norms write (:meth:`final_hidden`: no concatenation)."""
        states = super().embed_states(model, forward_batch, subs)
        self._split_index = {id(st): i for i, st in enumerate(states)}
        self._final = None
        norm = getattr(getattr(model, "model", None), "norm", None)
        if (self.comm_stream is not None and getattr(getattr(norm, "comm", None), "supports_out", False)
                and all(getattr(s, "token_range", None) is not None for s in subs)):
            emb = states[0].hidden
            self._final = emb.new_empty((forward_batch.num_tokens, emb.shape[-1]))
            base = forward_batch.token_range[0] if forward_batch.token_range is not None else 0
            self._rows = [(s.token_range[0] - base, s.token_range[1] - base) for s in subs]
        return states

    def final_hidden(self, model: Any, states: list[LayerState]) -> torch.Tensor:
        """The final norm per split (its fused AllReduce on the communication stream, so the prefix split's
        overlaps the suffix split's last MLP), written into the split's rows of the output allocated by
        :meth:`embed_states` (else one concatenation of the normed halves): no concatenation of the partial sums
        and residuals and no unsplit all-reduce on the compute stream."""
        norm = getattr(getattr(model, "model", None), "norm", None)
        fused = getattr(norm, "comm", None) is not None and norm.comm.supports_overlap
        final_out = self._final
        for i, st in enumerate(states):
            def final(overlap, st=st, i=i):
                if fused:  # the last split's final norm overlaps nothing: it may use every SM
                    out = None if final_out is None else final_out[self._rows[i][0]:self._rows[i][1]]
                    self._norm_comm(norm, st, overlap and st is not states[-1], None, out,
                                    sharded=self.config.sharded_residual)
                else:  # no overlap-capable fused norm: the model's final norm of this split, on the compute stream
                    st.hidden = model.final_norm(st.hidden, st.residual)
            self._on_stream(fused, st, final)
        self._join(states)
        self._final = None
        if final_out is not None and fused:
            return final_out
        return torch.cat([st.hidden for st in states])

    def _on_stream(self, comm_stage: bool, state: LayerState, fn) -> None:
        """Run ``fn(overlap)`` for ``state``'s split: on CUDA on the communication stream (``comm_stage``) or the
        compute stream, after the split's previous stage's event, re-recording the split's one event; on CPU in
        order (``overlap=False``).

        No ``record_stream`` per stage (each costs an allocator event and later ``cudaEventQuery`` polls): a
        stage's outputs (hidden, residual) are read by the split's next stage, possibly on the other stream, and
        the stage after that waits (through the split's event chain) for that read, so holding each split's last
        two (hidden, residual) pairs keeps the caching allocator from handing a block back to its stream while the
        other stream still reads it. ``_join`` drops the holds after the compute stream has waited for every
        split."""
        if self.comm_stream is None:
            fn(False)
            return
        compute = self._compute if self._compute is not None else torch.cuda.current_stream(self.device)
        stream = self.comm_stream if comm_stage else compute
        key = id(state)
        ev = self._events.get(key)
        if ev is not None:
            stream.wait_event(ev)
        else:
            if stream is not compute:
                stream.wait_stream(compute)  # the split's inputs were produced on the compute stream
            ev = self._event(len(self._events))
        if comm_stage:  # set_stream, not the torch.cuda.stream context (fewer host calls per stage)
            torch.cuda.set_stream(stream)
            try:
                fn(comm_stage)
            finally:
                torch.cuda.set_stream(compute)
        else:  # already the current stream: no stream switch (host cost per stage)
            fn(comm_stage)
        ev.record(stream)  # a wait enqueued earlier keeps the previous record: re-recording is safe
        self._events[key] = ev
        hold = self._hold.setdefault(key, [])
        hold.append((state.hidden, state.residual))  # a replaced residual (fallback norms) is held the same way
        if len(hold) > 2:
            del hold[0]

    def _event(self, i: int) -> Any:
        """The ``i``-th split's reusable event (created once)."""
        while len(self._pool) <= i:
            self._pool.append(torch.cuda.Event())
        return self._pool[i]

    @staticmethod
    def _norm_comm(norm: Any, state: LayerState, overlap: bool, fallback, out: Optional[torch.Tensor] = None,
                   sharded: bool = False) -> None:
        """``state.hidden, state.residual =`` the norm's fused AllReduce + add + RMSNorm (``overlap``: the
        communicator's overlap SM budget; ``out``: where the normed rows go, ``[T_split, H]``; ``sharded``: keep the
        residual sharded when the communicator can -- consistent within a split forward, whose every norm with a
        residual and final norm come here with the same split row count), or ``fallback()`` when its communicator
        cannot overlap (then no call of the forward is sharded: the communicator is the same for all norms, which
        :meth:`check_model` enforces)."""
        comm = norm.comm
        if comm is not None and comm.supports_overlap:
            kw = {} if out is None else {"out": out}
            if sharded and getattr(comm, "supports_sharded_residual", False):
                kw["residual_sharded"] = True
            state.hidden, state.residual = comm.all_reduce_add_rmsnorm(state.hidden, state.residual, norm.weight,
                                                                       norm.eps, overlap=overlap, **kw)
        else:
            fallback()


def _check_skew(skew: Optional[float]) -> None:
    """Raise ValueError unless ``skew`` is None or in ``[0, 0.5]`` (a split skew, see :class:`TokenWeaveConfig`)."""
    if skew is not None and not 0.0 <= skew <= 0.5:
        raise ValueError(f"TokenWeave split_skew={skew} must be in [0, 0.5] (fraction of the batch the cut may be "
                         "from its half) or None (unbounded)")


def _check_scope(scope: str) -> None:
    """Raise ValueError unless ``scope`` is a carveout scope (see :class:`TokenWeaveConfig`)."""
    if scope not in ("all", "overlap"):
        raise ValueError(f"TokenWeave carveout_scope={scope!r} must be 'all' (cap every GEMM of a split forward) or "
                         "'overlap' (only the GEMMs beside a comm)")


def _shards(comm: Any) -> bool:
    """Whether a norm with communicator ``comm`` makes TokenWeave's residual-sharded call (:meth:`_norm_comm`)."""
    return comm is not None and bool(getattr(comm, "supports_overlap", False)) and \
        bool(getattr(comm, "supports_sharded_residual", False))
