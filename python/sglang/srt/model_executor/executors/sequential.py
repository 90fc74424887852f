"""The default executor: the model's own forward, every layer in order on the whole batch; with a
:class:`~sglang.srt.model_executor.executors.base.KVLayerListener` that wants the batch, the same layers run
stage by stage (the staged-model contract) and the listener hears of each layer's KV right after its
attention stage."""

from __future__ import annotations

from typing import Any

from sglang.srt.forward_batch_info import ForwardBatch
from sglang.srt.layers.stages import LayerState
from sglang.srt.model_executor.executors.base import KVLayerListener, ModelExecutor


def run_staged_with_listener(model: Any, forward_batch: ForwardBatch, listener: KVLayerListener) -> Any:
    """Forward ``forward_batch`` (attention metadata already built) stage by stage, calling
    ``listener.on_layer_kv_written(i, forward_batch)`` after layer ``i``'s ``attention`` stage and
    ``listener.on_forward_done(forward_batch)`` at the end (also when a stage raised, which propagates).
    Equals ``model(input_ids, positions, forward_batch)`` (the staged contract runs the same ops in the same
    order); returns the model's ``LogitsProcessorOutput``."""
    try:
        st = LayerState(model.embed(forward_batch.input_ids), None, forward_batch.positions, forward_batch)
        for i, layer in enumerate(model.decoder_layers):
            for stage in layer.stage_names():
                layer.run_stage(stage, st)
                if stage == "attention":
                    listener.on_layer_kv_written(i, forward_batch)
        return model.compute_logits(model.final_norm(st.hidden, st.residual), forward_batch)
    finally:
        listener.on_forward_done(forward_batch)


class SequentialExecutor(ModelExecutor):
    """Today's path: attention metadata for the whole batch, then ``model(input_ids, positions, batch)``.

    This is also what decode CUDA graphs capture (:mod:`~sglang.srt.model_executor.cuda_graph_runner`).
    With an active KV layer listener the layers run stage by stage instead (:func:`run_staged_with_listener`).
    """

    name = "sequential"
    supports_kv_layer_listener = True

    def run(self, model: Any, forward_batch: ForwardBatch) -> Any:
        """Forward the whole batch (see :class:`~sglang.srt.model_executor.executors.base.ModelExecutor`)."""
        forward_batch.attn_backend.init_forward_metadata(forward_batch)
        listener = self.active_listener(forward_batch) if self.kv_layer_listener is not None else None
        if listener is not None:
            return run_staged_with_listener(model, forward_batch, listener)
        return model(forward_batch.input_ids, forward_batch.positions, forward_batch)
