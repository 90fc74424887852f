"""Executors: how a model's layer stages run over a batch (see :mod:`.base` for the contract).

``create_executor(name, **options)``: ``sequential`` (default), ``token_split`` (``boundary``: a function
of the token count), ``micro_batch`` (``num_micro_batches``). Technique executors (TokenWeave,
MegaScale-Infer) register here too; model files never import this package.
"""

from __future__ import annotations

from sglang.srt.model_executor.executors.base import KVLayerListener, ModelExecutor, StagedExecutor
from sglang.srt.model_executor.executors.sequential import SequentialExecutor
from sglang.srt.model_executor.executors.split import MicroBatchExecutor, SubBatchExecutor, TokenSplitExecutor

_EXECUTORS = {
    "sequential": SequentialExecutor,
    "token_split": TokenSplitExecutor,
    "micro_batch": MicroBatchExecutor,
}


def create_executor(name: str = "sequential", **options) -> ModelExecutor:
    """The executor registered as ``name``, built with ``options``.

    Raises:
        ValueError: unknown name (the message lists the known ones).
    """
    if name not in _EXECUTORS:
        raise ValueError(f"unknown executor {name!r}; choose one of {sorted(_EXECUTORS)}")
    return _EXECUTORS[name](**options)


__all__ = ["KVLayerListener", "ModelExecutor", "StagedExecutor", "SequentialExecutor", "SubBatchExecutor",
           "TokenSplitExecutor", "MicroBatchExecutor", "create_executor"]
