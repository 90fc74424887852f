"""The default executor: the model's own forward, every layer in order on the whole batch; with a
:class:`~sglang.srt.model_executor.executors.base.KVLayerListener` that wants the batch, the same layers run
stage by stage (the :class:`~sglang.srt.model_executor.executors.base.StagedExecutor` skeleton) and the listener
hears of each layer's KV right after its attention stage."""

from __future__ import annotations

from typing import Any

from sglang.srt.forward_batch_info import ForwardBatch
from sglang.srt.model_executor.executors.base import StagedExecutor


class SequentialExecutor(StagedExecutor):
    """Today's path: attention metadata for the whole batch, then ``model(input_ids, positions, batch)``.

    This is also what decode CUDA graphs capture (:mod:`~sglang.srt.model_executor.cuda_graph_runner`).
    With an active KV layer listener the layers run stage by stage instead (the staged skeleton on one
    sub-batch, which runs the same ops in the same order as the model's forward).
    """

    name = "sequential"

    def run(self, model: Any, forward_batch: ForwardBatch) -> Any:
        """Forward the whole batch (see :class:`~sglang.srt.model_executor.executors.base.ModelExecutor`)."""
        listener = self.active_listener(forward_batch) if self.kv_layer_listener is not None else None
        if listener is not None:
            return self.run_layers(model, forward_batch, [forward_batch], listener)
        forward_batch.attn_backend.init_forward_metadata(forward_batch)
        return model(forward_batch.input_ids, forward_batch.positions, forward_batch)
