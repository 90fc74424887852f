"""The default executor: the model's own forward, every layer in order on the whole batch."""

from __future__ import annotations

from typing import Any

from sglang.srt.forward_batch_info import ForwardBatch
from sglang.srt.model_executor.executors.base import ModelExecutor


class SequentialExecutor(ModelExecutor):
    """Today's path: attention metadata for the whole batch, then ``model(input_ids, positions, batch)``.

    This is also what decode CUDA graphs capture (:mod:`~sglang.srt.model_executor.cuda_graph_runner`).
    """

    name = "sequential"

    def run(self, model: Any, forward_batch: ForwardBatch) -> Any:
        """Forward the whole batch (see :class:`~sglang.srt.model_executor.executors.base.ModelExecutor`)."""
        forward_batch.attn_backend.init_forward_metadata(forward_batch)
        return model(forward_batch.input_ids, forward_batch.positions, forward_batch)
