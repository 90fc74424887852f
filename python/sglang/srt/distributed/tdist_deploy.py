"""Triton-distributed overlap's deployment surface (see :mod:`sglang.srt.deployment.techniques`):
``--enable-tdist-overlap`` gives every scheduler worker the sequence-parallel executor (``tdist_sp``) whose
column/row-parallel linears run as AG-GEMM / GEMM-RS (Zheng et al., "Triton-distributed", 2025, sec. 3.2-3.3)."""

from __future__ import annotations

from typing import Any

from sglang.srt.deployment.plan import ExecutorSpec
from sglang.srt.deployment.techniques import require_package

NAME = "tdist"


def enabled(args: Any) -> bool:
    """``--enable-tdist-overlap``."""
    return bool(args.enable_tdist_overlap)


def validate(args: Any) -> None:
    """Triton must be installed; AFD (MoE attention workers, remote experts) cannot be combined.

    Raises:
        ValueError: ``--enable-afd`` too (both flags named).
        MissingPackageError: ``triton`` is not installed.
    """
    if args.enable_afd:
        raise ValueError("--enable-tdist-overlap and --enable-afd cannot be combined (the sequence-parallel executor "
                         "runs dense decoders; AFD's attention workers send MoE layers to FFN workers); drop one")
    require_package("--enable-tdist-overlap", "triton", "pip install triton")


def executor(args: Any) -> ExecutorSpec:
    """The ``tdist_sp`` executor."""
    return ExecutorSpec("tdist_sp")


def make_executor(spec: ExecutorSpec, ctx: Any):
    """The :class:`~sglang.srt.model_executor.executors.sequence_parallel.SequenceParallelExecutor` of the worker of
    ``ctx`` (fused ops on CUDA with TP > 1, torch collectives otherwise; batches below its ``min_tokens`` run the
    sequential executor). Raises ValueError for MoE models."""
    from sglang.srt.model_executor.executors.sequence_parallel import create_sequence_parallel_executor

    return create_sequence_parallel_executor(ctx.model, ctx.parallel_state, ctx.args)
