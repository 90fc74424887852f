"""The executor contract: how a model's layers run over one :class:`~sglang.srt.forward_batch_info.ForwardBatch`.

``ModelRunner.forward`` builds the batch and hands it to its executor; the executor decides how the
decoder layers' stages (:mod:`sglang.srt.layers.stages`) are scheduled -- in order on one batch (the
default), interleaved over token splits (TokenWeave), over request micro-batches (MegaScale-Infer's
ping-pong pipeline), on which streams and with which transports. Executors work on any model that
offers the staged-model contract below, so a technique never edits a model file.

Staged-model contract (every ``*ForCausalLM`` in ``sglang.srt.models`` implements it)::

    model(input_ids, positions, forward_batch) -> LogitsProcessorOutput   # the plain forward
    model.embed(input_ids [T]) -> hidden [T, H]
    model.decoder_layers -> sequence of layers with stage_names() and run_stage(name, LayerState)
    model.final_norm(hidden [T, H], residual [T, H]) -> [T, H]
    model.compute_logits(hidden [N, H], forward_batch) -> LogitsProcessorOutput

:class:`StagedExecutor` writes the staged skeleton (embed -> layers -> final norm -> logits) once; the
executors specialize its hooks (which sub-batches, where a stage runs, what a layer does, how the final
hidden states are assembled).
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from typing import Any, ContextManager, Optional

import torch

from sglang.srt.forward_batch_info import ForwardBatch
from sglang.srt.layers.stages import LayerState


class KVLayerListener(ABC):
    """Told, layer by layer, when a forward's KV is stored (the per-layer seam of layerwise KV transfer:
    prefill/decode disaggregation's push mode writes layer ``l`` to the decode side while layers ``> l`` run,
    as SGLang's and vLLM's layerwise KV connectors do).

    Contract with the executors that support it (``ModelExecutor.supports_kv_layer_listener``):

    * ``wants(forward_batch)`` is asked once per eager forward, before anything runs; False (or no listener
      registered) runs the forward exactly as without a listener, so an idle listener costs one call.
    * ``on_layer_kv_written(layer_id, forward_batch)`` is called on the host thread that runs the forward,
      right after layer ``layer_id``'s attention stage was issued for every token of ``forward_batch`` (all
      sub-batches). ``layer_id`` is the decoder layer's index, which is its KV cache layer. On CUDA the KV store
      is only *enqueued* on the current stream at that point: a listener must not read the KV from the host
      before an event recorded on the current stream (``torch.cuda.current_stream()``) completes, and must not
      synchronize the host per layer (record the event, let another thread wait on it).
    * ``on_forward_done(forward_batch)`` is called once after the last layer (also when the forward raised:
      then fewer than ``num_layers`` layer calls were made, which the listener treats as a failure).

    Decode CUDA graph replays never run the executor and never call a listener.
    """

    def wants(self, forward_batch: ForwardBatch) -> bool:
        """Whether this forward needs per-layer calls (default True). Must be cheap and must not sync."""
        return True

    @abstractmethod
    def on_layer_kv_written(self, layer_id: int, forward_batch: ForwardBatch) -> None:
        """Layer ``layer_id``'s KV of every token of ``forward_batch`` is stored (enqueued, on CUDA)."""

    @abstractmethod
    def on_forward_done(self, forward_batch: ForwardBatch) -> None:
        """The forward of ``forward_batch`` issued its last layer (or raised)."""


class ModelExecutor(ABC):
    """Runs a model over one batch. Stateless between batches except for long-lived resources (streams,
    workspaces) created in ``__init__``; one executor per model runner.

    ``run(model, forward_batch)`` builds the batch's attention metadata (on the batch or its
    sub-batches) and returns the model's ``LogitsProcessorOutput`` for ``forward_batch``; the result
    must equal the sequential executor's up to floating-point reassociation.
    """

    name = "abstract"
    supports_kv_layer_listener = False  # executors that call a KVLayerListener set this True
    # errors of ``run`` after which the worker survives: the scheduler fails every request it holds and frees
    # their KV instead of exiting (a remote peer, e.g. an AFD FFN worker, is gone); empty: every error ends it
    recoverable_errors: tuple = ()
    # whether split forwards keep the residual sharded over the TP ranks between layers (TokenWeave's executor
    # reports its resolved mode; reported at startup as ``tokenweave_sharded_residual_resolved``)
    sharded_residual: bool = False
    kv_layer_listener: Optional[KVLayerListener] = None

    def set_kv_layer_listener(self, listener: Optional[KVLayerListener]) -> None:
        """Register ``listener`` (None removes it) for the following forwards.

        Raises:
            ValueError: this executor does not call listeners (``supports_kv_layer_listener`` False).
        """
        if listener is not None and not self.supports_kv_layer_listener:
            raise ValueError(f"the {self.name!r} executor does not support KV layer listeners "
                             "(layerwise KV transfer); use the sequential executor")
        self.kv_layer_listener = listener

    def active_listener(self, forward_batch: ForwardBatch) -> Optional[KVLayerListener]:
        """The registered listener when it wants ``forward_batch``'s layers, else None (the plain path)."""
        listener = self.kv_layer_listener
        if listener is None or not listener.wants(forward_batch):
            return None
        return listener

    @abstractmethod
    def run(self, model: Any, forward_batch: ForwardBatch) -> Any:
        """Forward ``forward_batch`` through ``model``; returns its ``LogitsProcessorOutput``."""


class StagedExecutor(ModelExecutor):
    """The staged forward, written once (template method :meth:`run_layers`)::

        sub-batches = plan(batch)                     # hook; each gets its attention metadata
        with forward_scope(model, batch):             # hook (e.g. the sequence-parallel layout)
            states = embed_states(model, batch, subs) # hook; default: [embed(model, sub) ...], one per sub-batch
            for i, layer in enumerate(model.decoder_layers):
                run_layer(i, layer, states, listener) # hook; default: stage by stage, sub-batch by sub-batch
            finish(states)                            # hook (e.g. wait for other streams / remote results)
            hidden = final_hidden(model, states)      # hook; default: concatenate, model.final_norm
        return model.compute_logits(hidden, batch)

    A registered :class:`KVLayerListener` that wants the batch hears ``on_layer_kv_written(i)`` after layer
    ``i``'s ``attention`` stage ran for every sub-batch and ``on_forward_done`` once after the last layer (also
    when a stage raised, which propagates). Stateless between batches like every executor.
    """

    name = "staged"
    supports_kv_layer_listener = True

    # ---- hooks ---------------------------------------------------------------------------------------------
    def plan(self, forward_batch: ForwardBatch) -> list[ForwardBatch]:
        """The sub-batches, in token order, covering every token of ``forward_batch`` exactly once (default:
        the batch itself)."""
        return [forward_batch]

    def forward_scope(self, model: Any, forward_batch: ForwardBatch) -> ContextManager:
        """A context entered around the layers and the final norm (default: none)."""
        return contextlib.nullcontext()

    def embed(self, model: Any, sub: ForwardBatch) -> LayerState:
        """The layer state of one sub-batch before the first layer: ``hidden = model.embed(input_ids)`` ``[T, H]``,
        no residual yet."""
        return LayerState(model.embed(sub.input_ids), None, sub.positions, sub)

    def embed_states(self, model: Any, forward_batch: ForwardBatch, subs: list[ForwardBatch]) -> list[LayerState]:
        """The layer states of all sub-batches before the first layer, in token order (default: :meth:`embed` of
        each; an executor may embed ``forward_batch`` once and hand out views)."""
        return [self.embed(model, sub) for sub in subs]

    def run_layer(self, index: int, layer: Any, states: list[LayerState], listener: Optional[KVLayerListener],
                  forward_batch: ForwardBatch) -> None:
        """Run decoder layer ``index`` over every sub-batch: stage by stage, and within a stage sub-batch by
        sub-batch in order (a later token split's attention reads the earlier split's KV of the same layer;
        collectives are issued in the same order on every rank); tell ``listener`` after ``attention``."""
        for stage in layer.stage_names():
            for st in states:
                self.run_stage(layer, stage, st)
            if listener is not None and stage == "attention":  # every sub-batch stored layer index's KV
                listener.on_layer_kv_written(index, forward_batch)

    def run_stage(self, layer: Any, stage: str, state: LayerState) -> None:
        """Run one stage of one sub-batch (default: on the current stream)."""
        layer.run_stage(stage, state)

    def finish(self, states: list[LayerState]) -> None:
        """Called after the last layer, before the final hidden states are assembled (default: nothing)."""

    def final_hidden(self, model: Any, states: list[LayerState]) -> torch.Tensor:
        """``model.final_norm`` of the sub-batches' hidden states and residuals, concatenated in token order:
        ``[T, H]``."""
        if len(states) == 1:
            return model.final_norm(states[0].hidden, states[0].residual)
        hidden = torch.cat([st.hidden for st in states])
        residual = torch.cat([st.residual for st in states])
        return model.final_norm(hidden, residual)

    # ---- the template --------------------------------------------------------------------------------------
    def run(self, model: Any, forward_batch: ForwardBatch) -> Any:
        """Forward ``forward_batch`` as :meth:`plan` splits it (see the class docstring)."""
        listener = self.active_listener(forward_batch) if self.kv_layer_listener is not None else None
        return self.run_layers(model, forward_batch, self.plan(forward_batch), listener)

    def run_layers(self, model: Any, forward_batch: ForwardBatch, subs: list[ForwardBatch],
                   listener: Optional[KVLayerListener]) -> Any:
        """The skeleton over the sub-batches ``subs`` of ``forward_batch`` (``listener``: the active listener or
        None, asked once by the caller); returns the model's ``LogitsProcessorOutput``."""
        for sub in subs:
            sub.attn_backend.init_forward_metadata(sub)
        with self.forward_scope(model, forward_batch):
            try:
                states = self.embed_states(model, forward_batch, subs)
                for i, layer in enumerate(model.decoder_layers):
                    self.run_layer(i, layer, states, listener, forward_batch)
                self.finish(states)
            finally:
                if listener is not None:
                    listener.on_forward_done(forward_batch)
            hidden = self.final_hidden(model, states)
        return model.compute_logits(hidden, forward_batch)
