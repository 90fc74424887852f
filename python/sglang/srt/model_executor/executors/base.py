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
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from sglang.srt.forward_batch_info import ForwardBatch


class ModelExecutor(ABC):
    """Runs a model over one batch. Stateless between batches except for long-lived resources (streams,
    workspaces) created in ``__init__``; one executor per model runner.

    ``run(model, forward_batch)`` builds the batch's attention metadata (on the batch or its
    sub-batches) and returns the model's ``LogitsProcessorOutput`` for ``forward_batch``; the result
    must equal the sequential executor's up to floating-point reassociation.
    """

    name = "abstract"

    @abstractmethod
    def run(self, model: Any, forward_batch: ForwardBatch) -> Any:
        """Forward ``forward_batch`` through ``model``; returns its ``LogitsProcessorOutput``."""
