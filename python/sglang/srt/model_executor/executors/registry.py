"""The executor registry: the one way executors are made.

A worker's :class:`~sglang.srt.deployment.plan.ExecutorSpec` names a registered executor; :func:`build_executor`
makes it for the worker described by an :class:`ExecutorContext`. The generic executors are classes built from the
spec's options; technique executors are registered by name as ``"module:function"`` factories
(``make_executor(spec, ctx)`` of the technique package), imported only when used, so this package imports no
technique.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable, Optional

from sglang.srt.model_executor.executors.base import ModelExecutor
from sglang.srt.model_executor.executors.sequential import SequentialExecutor
from sglang.srt.model_executor.executors.split import MicroBatchExecutor, TokenSplitExecutor

_EXECUTORS: dict[str, Any] = {
    "sequential": SequentialExecutor,
    "token_split": TokenSplitExecutor,
    "micro_batch": MicroBatchExecutor,
    # technique executors (Gond et al. 2025; Zheng et al. 2025; Zhu et al. 2025): factories make_executor(spec, ctx)
    "tokenweave": "sglang.srt.tokenweave.deploy:make_executor",
    "tdist_sp": "sglang.srt.distributed.tdist_deploy:make_executor",
    "afd": "sglang.srt.afd.deploy:make_executor",
    # two-batch overlap (DeepSeek-V3 report sec. 3.4; SGLang's --enable-two-batch-overlap)
    "two_batch_overlap": "sglang.srt.two_batch_overlap.deploy:make_executor",
}


@dataclass(frozen=True)
class ExecutorContext:
    """What a technique executor may need from its worker.

    Attributes:
        worker: the worker's :class:`~sglang.srt.deployment.plan.WorkerSpec` (role, group, rank, wiring).
        model: the loaded model (``decoder_layers``); model_config: its ModelConfig.
        device: the worker's ``torch.device``; tp_size / parallel_state: its TP group (None for one rank).
        args: the frozen ServerArgs (sizing flags).
        alive: the launcher's liveness (``ParentWatch.parent_alive``), for executors waiting on remote peers.
    """

    worker: Any = None
    model: Any = None
    model_config: Any = None
    device: Any = None
    tp_size: int = 1
    parallel_state: Any = None
    args: Any = None
    alive: Optional[Callable[[], bool]] = None


def register_executor(name: str, factory: Any) -> None:
    """Register ``factory`` (a ModelExecutor class taking the spec's options, or a ``"module:function"`` /
    callable ``(spec, ctx) -> ModelExecutor``) as ``name``. Raises ValueError when ``name`` is taken."""
    if name in _EXECUTORS:
        raise ValueError(f"executor {name!r} is already registered")
    _EXECUTORS[name] = factory


def build_executor(spec: Any, ctx: Optional[ExecutorContext] = None) -> ModelExecutor:
    """The executor ``spec`` (an :class:`~sglang.srt.deployment.plan.ExecutorSpec`) names, for the worker of ``ctx``.

    Raises:
        ValueError: unknown name (the message lists the registered ones), or the technique's own refusal.
    """
    if spec.name not in _EXECUTORS:
        raise ValueError(f"unknown executor {spec.name!r}; choose one of {sorted(_EXECUTORS)}")
    factory = _EXECUTORS[spec.name]
    if isinstance(factory, type):
        return factory(**spec.opts())
    if isinstance(factory, str):
        module, _, fn = factory.partition(":")
        factory = getattr(importlib.import_module(module), fn)
    return factory(spec, ctx or ExecutorContext())


def create_executor(name: str = "sequential", **options: Any) -> ModelExecutor:
    """The generic executor registered as ``name``, built with ``options`` (tests and benchmarks).

    Raises:
        ValueError: unknown name (the message lists the known ones).
    """
    from sglang.srt.deployment.plan import ExecutorSpec

    return build_executor(ExecutorSpec.of(name, **options))


def registered_executors() -> list[str]:
    """The registered names, sorted."""
    return sorted(_EXECUTORS)
