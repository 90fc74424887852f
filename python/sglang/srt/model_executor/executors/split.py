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

from sglang.srt.forward_batch_info import ForwardBatch
from sglang.srt.layers.stages import LayerState
from sglang.srt.model_executor.executors.base import StagedExecutor
from sglang.srt.model_executor.executors.sequential import SequentialExecutor


class SubBatchExecutor(StagedExecutor):
    """Runs a batch as the sub-batches ``plan(forward_batch)`` returns (one sub-batch: the sequential executor,
    i.e. the model's own forward).

    Subclasses override :meth:`plan` (which sub-batches) and may override :meth:`run_stage` (where a
    stage runs) and :meth:`finish`; the skeleton is :class:`StagedExecutor`'s.
    """

    name = "sub_batch"

    def __init__(self) -> None:
        self._sequential = SequentialExecutor()

    def set_kv_layer_listener(self, listener) -> None:
        """Register a KV layer listener (see the base class); unsplit batches hand it to the sequential path."""
        super().set_kv_layer_listener(listener)
        self._sequential.set_kv_layer_listener(listener)

    def run(self, model: Any, forward_batch: ForwardBatch) -> Any:
        """Forward ``forward_batch`` as its planned sub-batches (see the module docstring)."""
        subs = self.plan(forward_batch)
        if len(subs) <= 1:
            return self._sequential.run(model, forward_batch)
        listener = self.active_listener(forward_batch) if self.kv_layer_listener is not None else None
        return self.run_layers(model, forward_batch, subs, listener)

    def embed_states(self, model: Any, forward_batch: ForwardBatch, subs: list[ForwardBatch]) -> list[LayerState]:
        """Every sub-batch's layer state from views of ONE embedding of the whole batch ``[T_i, H]``, so a
        TP-sharded vocabulary runs one all-reduce per forward, not one per sub-batch (sub-batches are
        contiguous token ranges of ``forward_batch``, see :mod:`sglang.srt.batch_split`)."""
        if any(getattr(s, "token_range", None) is None for s in subs):  # not cut by batch_split: embed each
            return super().embed_states(model, forward_batch, subs)
        emb = model.embed(forward_batch.input_ids)
        parent = getattr(forward_batch, "token_range", None)
        base = parent[0] if parent is not None else 0
        return [LayerState(emb[s.token_range[0] - base:s.token_range[1] - base], None, s.positions, s)
                for s in subs]


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
