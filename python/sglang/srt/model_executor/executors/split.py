"""Executors over sub-batches: the stages of each layer run interleaved over token splits or request
micro-batches (on one stream here; overlapped executors such as TokenWeave's add streams and events on
top of the same schedule).

Schedule, per layer and per stage, sub-batch by sub-batch in order::

    for layer in model.decoder_layers:
        for stage in layer.stage_names():
            for sub in sub_batches:          # split 1, split 2, ...
                layer.run_stage(stage, state[sub])

so a later token split's attention always runs after the earlier split's attention of the same layer
has written its KV (a request straddling the cut reads it), and collectives are issued in the same
order on every TP rank. The embedding runs once on the parent batch (sub-batches start from views of it);
final hidden states are concatenated in token order and the final norm and logits run once on the parent
batch (executors may override :meth:`SubBatchExecutor.final_hidden`, e.g. a final norm per sub-batch).
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch

from sglang.srt.forward_batch_info import ForwardBatch
from sglang.srt.layers.stages import LayerState
from sglang.srt.model_executor.executors.base import ModelExecutor
from sglang.srt.model_executor.executors.sequential import SequentialExecutor


class SubBatchExecutor(ModelExecutor):
    """Runs a batch as the sub-batches ``plan(forward_batch)`` returns (one sub-batch: sequential).

    Subclasses override :meth:`plan` (which sub-batches) and may override :meth:`run_stage` (where a
    stage runs).
    """

    name = "sub_batch"
    supports_kv_layer_listener = True

    def __init__(self) -> None:
        self._sequential = SequentialExecutor()

    def set_kv_layer_listener(self, listener) -> None:
        """Register a KV layer listener (see the base class); unsplit batches hand it to the sequential path."""
        super().set_kv_layer_listener(listener)
        self._sequential.set_kv_layer_listener(listener)

    def plan(self, forward_batch: ForwardBatch) -> list[ForwardBatch]:
        """The sub-batches, in token order, covering every token of ``forward_batch`` exactly once."""
        return [forward_batch]

    def run_stage(self, layer: Any, stage: str, state: LayerState) -> None:
        """Run one stage of one sub-batch (default: on the current stream)."""
        layer.run_stage(stage, state)

    def finish(self, states: list[LayerState]) -> None:
        """Called after the last layer, before the sub-batches' outputs are concatenated (default: nothing;
        stream-based executors make the current stream wait for every sub-batch here)."""

    def run(self, model: Any, forward_batch: ForwardBatch) -> Any:
        """Forward ``forward_batch`` as its planned sub-batches (see the module docstring)."""
        subs = self.plan(forward_batch)
        if len(subs) <= 1:
            return self._sequential.run(model, forward_batch)
        listener = self.active_listener(forward_batch) if self.kv_layer_listener is not None else None
        for sub in subs:
            sub.attn_backend.init_forward_metadata(sub)
        try:
            states = [LayerState(h, None, s.positions, s) for h, s in zip(self.embed(model, forward_batch, subs), subs)]
            for i, layer in enumerate(model.decoder_layers):
                for stage in layer.stage_names():
                    for st in states:
                        self.run_stage(layer, stage, st)
                    if listener is not None and stage == "attention":  # every sub-batch stored layer i's KV
                        listener.on_layer_kv_written(i, forward_batch)
            hidden = self.final_hidden(model, states)
        finally:
            if listener is not None:
                listener.on_forward_done(forward_batch)
        return model.compute_logits(hidden, forward_batch)

    @staticmethod
    def embed(model: Any, forward_batch: ForwardBatch, subs: list[ForwardBatch]) -> list[torch.Tensor]:
        """Every sub-batch's input embeddings ``[T_i, H]``: views of ONE embedding of the whole batch, so a
        TP-sharded vocabulary runs one all-reduce per forward, not one per sub-batch (sub-batches are
        contiguous token ranges of ``forward_batch``, see :mod:`sglang.srt.batch_split`)."""
        if any(getattr(s, "token_range", None) is None for s in subs):  # not cut by batch_split: embed each
            return [model.embed(s.input_ids) for s in subs]
        emb = model.embed(forward_batch.input_ids)
        parent = getattr(forward_batch, "token_range", None)
        base = parent[0] if parent is not None else 0
        return [emb[s.token_range[0] - base:s.token_range[1] - base] for s in subs]

    def final_hidden(self, model: Any, states: list[LayerState]) -> torch.Tensor:
        """The final normed hidden states ``[N, H]`` in token order (default: :meth:`finish`, then the
        sub-batches' hidden and residual concatenated and the final norm run once)."""
        self.finish(states)
        hidden = torch.cat([st.hidden for st in states])
        residual = torch.cat([st.residual for st in states])
        return model.final_norm(hidden, residual)


class TokenSplitExecutor(SubBatchExecutor):
    """Two token splits at ``boundary(num_tokens)`` (TokenWeave's split, Gond et al. 2025, sec. 3.1).

    Args:
        boundary: ``num_tokens -> cut`` (None: half, rounded down). A cut outside ``[1, N-1]`` runs the
            batch unsplit.
    """

    name = "token_split"

    def __init__(self, boundary: Optional[Callable[[int], int]] = None):
        super().__init__()
        self.boundary = boundary or (lambda n: n // 2)

    def plan(self, forward_batch: ForwardBatch) -> list[ForwardBatch]:
        """``[prefix split, suffix split]``, or ``[forward_batch]`` when the cut leaves one side empty."""
        n = forward_batch.num_tokens
        cut = int(self.boundary(n))
        if not 1 <= cut <= n - 1:
            return [forward_batch]
        return list(forward_batch.split_tokens(cut))


class MicroBatchExecutor(SubBatchExecutor):
    """``num_micro_batches`` request micro-batches (MegaScale-Infer's m, Zhu et al. 2025, sec. 4.1); batches
    with fewer requests use one micro-batch per request.

    Raises:
        ValueError: ``num_micro_batches < 1``.
    """

    name = "micro_batch"

    def __init__(self, num_micro_batches: int):
        super().__init__()
        if num_micro_batches < 1:
            raise ValueError(f"num_micro_batches={num_micro_batches} must be >= 1")
        self.num_micro_batches = num_micro_batches

    def plan(self, forward_batch: ForwardBatch) -> list[ForwardBatch]:
        """``min(m, batch_size)`` micro-batches of near-equal request counts."""
        m = min(self.num_micro_batches, forward_batch.batch_size)
        return forward_batch.split_requests(m) if m > 1 else [forward_batch]


def token_boundaries(n: int) -> Sequence[int]:
    """Every valid token cut of an ``n``-token batch (``1 .. n-1``), for tests and sweeps."""
    return range(1, n)
