"""Executors: how a model's layer stages run over a batch (see :mod:`.base` for the contract).

The registry (:mod:`.registry`) is the one way executors are made: ``build_executor(spec, ctx)`` for a worker's
``ExecutorSpec``; ``create_executor(name, **options)``: ``sequential`` (default), ``token_split`` (``boundary``: a
function of the token count), ``micro_batch`` (``num_micro_batches``). Technique executors (``tokenweave``,
``tdist_sp``, ``afd``) are registered there as lazily imported factories; model files never import this package.
"""

from __future__ import annotations

from sglang.srt.model_executor.executors.base import KVLayerListener, ModelExecutor, StagedExecutor
from sglang.srt.model_executor.executors.sequential import SequentialExecutor
from sglang.srt.model_executor.executors.registry import (
    ExecutorContext,
    build_executor,
    create_executor,
    register_executor,
)
from sglang.srt.model_executor.executors.split import MicroBatchExecutor, SubBatchExecutor, TokenSplitExecutor

__all__ = ["KVLayerListener", "ModelExecutor", "StagedExecutor", "SequentialExecutor", "SubBatchExecutor",
           "TokenSplitExecutor", "MicroBatchExecutor", "create_executor", "ExecutorContext", "build_executor",
           "register_executor"]
