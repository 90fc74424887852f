"""Sequence-parallel executor: the residual stream stays token-sharded across TP ranks, column-parallel linears
all-gather their input and row-parallel linears reduce-scatter their output (Korthikanti et al. 2022, sec. 4.2.2),
so Triton-distributed AG-GEMM / GEMM-RS (``--enable-tdist-overlap``) can overlap the communication with the GEMMs
(Zheng et al., "Triton-distributed", 2025, sec. 3.2-3.3).

Per batch of T tokens (``rows = split_rows(T, tp)``): embed, keep this rank's rows; every layer's stages run as
usual, but inside :func:`sequence_parallel_mode` the column/row-parallel linears take their ``forward_gathered`` /
``forward_scattered`` path and the residual norms run locally (their fused all-reduce is detached: the inputs are
already complete rows); after the final norm the rows are all-gathered and the logits computed on the full batch.
Results equal the sequential executor's up to floating-point reassociation. Dense decoders only (an MoE layer's
experts would need the tokens gathered first): ValueError otherwise.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Sequence

from sglang.srt.distributed.sequence_parallel import SequenceParallelOps, create_sequence_parallel_ops, split_rows
from sglang.srt.forward_batch_info import ForwardBatch
from sglang.srt.layers.layernorm import RMSNorm
from sglang.srt.layers.linear import (ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear,
                                      RowParallelLinear)
from sglang.srt.layers.stages import LayerState
from sglang.srt.model_executor.executors.base import ModelExecutor

_SP_LINEARS = (ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear)


@contextlib.contextmanager
def sequence_parallel_mode(layers: Any, sp_ops: SequenceParallelOps, rows: Sequence[int]) -> Iterator[None]:
    """Within the block, every column/row-parallel linear under ``layers`` (a module) runs its sequence-parallel
    form with ``rows`` and every residual RMSNorm runs without its communicator; restored on exit (also on error)."""
    linears = [m for m in layers.modules() if isinstance(m, _SP_LINEARS)]
    norms = [m for m in layers.modules() if isinstance(m, RMSNorm) and m.comm is not None]
    saved = [m.comm for m in norms]
    try:
        for m in linears:
            m.sequence_parallel = (sp_ops, tuple(rows))
        for m in norms:
            m.comm = None
        yield
    finally:
        for m in linears:
            m.sequence_parallel = None
        for m, c in zip(norms, saved):
            m.comm = c


class SequenceParallelExecutor(ModelExecutor):
    """Runs dense decoders with a token-sharded residual (module docstring).

    Args: sp_ops: the rank's :class:`SequenceParallelOps` (torch collectives, or Triton-distributed fused
    kernels); it also all-gathers the final rows (``gather_rows``).
    """

    name = "sequence_parallel"
    supports_kv_layer_listener = True

    def __init__(self, sp_ops: SequenceParallelOps):
        self.sp_ops = sp_ops

    def run(self, model: Any, forward_batch: ForwardBatch) -> Any:
        """Forward ``forward_batch`` with the sequence-parallel layout; returns the model's LogitsProcessorOutput.
        Raises ValueError for a model with MoE layers."""
        layers = model.decoder_layers
        if any(getattr(layer, "is_moe", False) for layer in layers):
            raise ValueError("the sequence-parallel executor (--enable-tdist-overlap) supports dense decoders only; "
                             "this model has MoE layers: run without --enable-tdist-overlap")
        forward_batch.attn_backend.init_forward_metadata(forward_batch)
        ops = self.sp_ops
        total = forward_batch.input_ids.shape[0]
        rows = split_rows(total, ops.world_size)
        start = sum(rows[: ops.rank])
        hidden = model.embed(forward_batch.input_ids)[start: start + rows[ops.rank]]
        st = LayerState(hidden, None, forward_batch.positions, forward_batch)
        listener = self.active_listener(forward_batch) if self.kv_layer_listener is not None else None
        try:
            with sequence_parallel_mode(model, ops, rows):
                for i, layer in enumerate(layers):
                    for stage in layer.stage_names():
                        layer.run_stage(stage, st)
                        if listener is not None and stage == "attention":  # attention saw every token's K/V
                            listener.on_layer_kv_written(i, forward_batch)
                normed = model.final_norm(st.hidden, st.residual)
        finally:
            if listener is not None:
                listener.on_forward_done(forward_batch)
        full = ops.gather_rows(normed, rows)
        return model.compute_logits(full, forward_batch)


def create_sequence_parallel_executor(model: Any, parallel_state: Any, server_args: Any) -> SequenceParallelExecutor:
    """The executor for ``--enable-tdist-overlap`` (logged): fused Triton-distributed ops on CUDA with TP > 1, torch
    collectives otherwise. The fused buffers hold ``--chunked-prefill-size`` (default 8192) + ``--max-running-requests``
    (default 256) tokens; larger batches use the torch ops (logged once). Raises ValueError for MoE models."""
    if any(getattr(layer, "is_moe", False) for layer in model.decoder_layers):
        raise ValueError("--enable-tdist-overlap supports dense decoders only; this model has MoE layers")
    chunk = server_args.chunked_prefill_size if (server_args.chunked_prefill_size or 0) > 0 else 8192
    max_tokens = chunk + (server_args.max_running_requests or 256)
    return SequenceParallelExecutor(create_sequence_parallel_ops(parallel_state, True, max_tokens))
