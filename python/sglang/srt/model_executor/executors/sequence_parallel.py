"""Sequence-parallel executor: the residual stream stays token-sharded across TP ranks, column-parallel linears
all-gather their input and row-parallel linears reduce-scatter their output (Korthikanti et al. 2022, sec. 4.2.2),
so Triton-distributed AG-GEMM / GEMM-RS (``--enable-tdist-overlap``) can overlap the communication with the GEMMs
(Zheng et al., "Triton-distributed", 2025, sec. 3.2-3.3).

Per batch of T tokens (``rows = split_rows(T, tp)``): embed, keep this rank's rows; every layer's stages run as
usual, but while the model's :class:`~sglang.srt.distributed.sequence_parallel.SequenceParallelLayout` is active the
column/row-parallel linears take their ``forward_gathered`` / ``forward_scattered`` path and the residual norms run
locally (their fused all-reduce is skipped: the inputs are already complete rows); after the final norm the rows are
all-gathered and the logits computed on the full batch. The layout is installed on the model's modules once (the
first forward of a model); a forward only sets its rows. Results equal the sequential executor's up to
floating-point reassociation. Dense decoders only (an MoE layer's experts would need the tokens gathered first):
ValueError otherwise.

The layout pays only where the fused ops beat NCCL: a forward of fewer than ``min_tokens`` tokens runs the plain
sequential executor instead (the path without the flag: the model's all-reduce). :func:`auto_min_tokens` derives
that threshold once per worker from the calibration table the fused ops use (:mod:`.sequence_parallel_select`).
"""

from __future__ import annotations

import logging
import weakref
from typing import Any, ContextManager, Optional

import torch

from sglang.srt.distributed.sequence_parallel import SequenceParallelLayout, SequenceParallelOps, \
    create_sequence_parallel_ops, split_rows
from sglang.srt.forward_batch_info import ForwardBatch
from sglang.srt.layers.layernorm import RMSNorm
from sglang.srt.layers.linear import (ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear,
                                      RowParallelLinear)
from sglang.srt.layers.stages import LayerState
from sglang.srt.model_executor.executors.base import ModelExecutor, StagedExecutor
from sglang.srt.model_executor.executors.sequence_parallel_select import auto_min_tokens
from sglang.srt.model_executor.executors.sequential import SequentialExecutor

logger = logging.getLogger(__name__)
_SP_LINEARS = (ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear)


def install_sequence_parallel_layout(model: Any, layout: SequenceParallelLayout) -> int:
    """Give every column/row-parallel linear and every residual RMSNorm (one with a communicator) under ``model``
    (a module) a reference to ``layout``; returns how many modules got it. Done once per model: a forward then only
    activates the layout (:meth:`SequenceParallelLayout.active`)."""
    mods = [m for m in model.modules()
            if isinstance(m, _SP_LINEARS) or (isinstance(m, RMSNorm) and m.comm is not None)]
    for m in mods:
        m.sequence_parallel = layout
    return len(mods)


class SequenceParallelExecutor(StagedExecutor):
    """Runs dense decoders with a token-sharded residual (module docstring): the
    :class:`~sglang.srt.model_executor.executors.base.StagedExecutor` skeleton with this rank's rows embedded, the
    layout active around the layers and the final norm, and the final rows all-gathered.

    Args: sp_ops: the rank's :class:`SequenceParallelOps` (torch collectives, or Triton-distributed fused
    kernels); it also all-gathers the final rows (``gather_rows``). min_tokens: forwards of fewer tokens (the
    batch's ``input_ids`` length, equal on every TP rank) run ``fallback`` instead (0: every forward runs the
    layout). fallback: the executor of those forwards (default a :class:`SequentialExecutor`; the installed layout
    is inactive there, so the modules take their plain all-reduce path). Raises ValueError on min_tokens < 0.
    """

    name = "sequence_parallel"

    def __init__(self, sp_ops: SequenceParallelOps, min_tokens: int = 0, fallback: Optional[ModelExecutor] = None):
        if min_tokens < 0:
            raise ValueError(f"min_tokens={min_tokens} must be >= 0 (0: the layout for every forward)")
        self.sp_ops, self.min_tokens = sp_ops, int(min_tokens)
        self.fallback = fallback if fallback is not None else SequentialExecutor()
        self.layout = SequenceParallelLayout(sp_ops)
        self._installed: "weakref.WeakSet[Any]" = weakref.WeakSet()  # models whose modules hold self.layout
        self.last_executor = ""  # name of the executor the latest forward ran (tests, benchmarks)

    def select(self, num_tokens: int) -> ModelExecutor:
        """The executor a forward of ``num_tokens`` tokens runs: ``fallback`` below :attr:`min_tokens`, else self.
        A function of values shared by the TP ranks, so every rank picks the same one."""
        return self.fallback if num_tokens < self.min_tokens else self

    def run(self, model: Any, forward_batch: ForwardBatch) -> Any:
        """Forward ``forward_batch`` with the sequence-parallel layout (or through ``fallback`` below
        ``min_tokens``); returns the model's LogitsProcessorOutput. Raises ValueError for a model with MoE layers."""
        chosen = self.select(int(forward_batch.input_ids.shape[0]))
        self.last_executor = chosen.name
        if chosen is not self:
            chosen.kv_layer_listener = self.kv_layer_listener
            return chosen.run(model, forward_batch)
        if model not in self._installed:
            if any(getattr(layer, "is_moe", False) for layer in model.decoder_layers):
                raise ValueError("the sequence-parallel executor (--enable-tdist-overlap) supports dense decoders "
                                 "only; this model has MoE layers: run without --enable-tdist-overlap")
            install_sequence_parallel_layout(model, self.layout)
            self._installed.add(model)
        return super().run(model, forward_batch)

    def forward_scope(self, model: Any, forward_batch: ForwardBatch) -> ContextManager:
        """The layout, active with this batch's per-rank rows."""
        return self.layout.active(split_rows(forward_batch.input_ids.shape[0], self.sp_ops.world_size))

    def embed(self, model: Any, sub: ForwardBatch) -> LayerState:
        """This rank's rows of the embedding: ``[rows[rank], H]``."""
        rows, rank = self.layout.rows, self.sp_ops.rank
        start = sum(rows[:rank])
        hidden = model.embed(sub.input_ids)[start: start + rows[rank]]
        return LayerState(hidden, None, sub.positions, sub)

    def final_hidden(self, model: Any, states: list[LayerState]) -> torch.Tensor:
        """The final norm of this rank's rows, all-gathered: ``[T, H]``."""
        return self.sp_ops.gather_rows(super().final_hidden(model, states), self.layout.rows)


def create_sequence_parallel_executor(model: Any, parallel_state: Any, server_args: Any) -> SequenceParallelExecutor:
    """The executor for ``--enable-tdist-overlap`` (logged): fused Triton-distributed ops on CUDA with TP > 1, torch
    collectives otherwise. The fused buffers hold ``--chunked-prefill-size`` (default 8192) + ``--max-running-requests``
    (default 256) tokens; larger batches use the torch ops (logged once). Forwards below ``min_tokens`` run the
    sequential executor: ``--tdist-overlap-min-tokens`` when set, else :func:`auto_min_tokens` of the ops' calibration
    table (logged once, rank 0). Raises ValueError for MoE models."""
    if any(getattr(layer, "is_moe", False) for layer in model.decoder_layers):
        raise ValueError("--enable-tdist-overlap supports dense decoders only; this model has MoE layers")
    chunk = server_args.chunked_prefill_size if (server_args.chunked_prefill_size or 0) > 0 else 8192
    max_tokens = chunk + (server_args.max_running_requests or 256)
    ops = create_sequence_parallel_ops(parallel_state, True, max_tokens)
    min_tokens = getattr(server_args, "tdist_overlap_min_tokens", None)
    if min_tokens is None:
        min_tokens = auto_min_tokens(model, ops)
    else:
        logger.info("[rank %d] tdist overlap: sequence-parallel layout for forwards of >= %d tokens "
                    "(--tdist-overlap-min-tokens)", ops.rank, min_tokens)
    return SequenceParallelExecutor(ops, min_tokens)
