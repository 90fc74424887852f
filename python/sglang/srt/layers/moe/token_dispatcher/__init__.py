"""Expert parallelism by all-to-all: the token dispatcher contract (:mod:`.base`) and its backends.

``create_token_dispatcher(backend, config, group)`` builds one rank's long-lived dispatcher: ``nccl``
(:mod:`.nccl`: ``torch.distributed.all_to_all_single``; gloo on CPU) or ``tdist`` (:mod:`.tdist`: the
Triton-distributed low-latency all-to-all of ``sgl_kernel.tdist``, imported only when chosen).
"""

from __future__ import annotations

from typing import Any

from sglang.srt.layers.moe.token_dispatcher.base import (
    A2A_BACKENDS,
    CombineHandle,
    DispatcherConfig,
    DispatchHandle,
    DispatchMode,
    TokenDispatcher,
)

__all__ = ["A2A_BACKENDS", "CombineHandle", "DispatcherConfig", "DispatchHandle", "DispatchMode", "TokenDispatcher",
           "create_token_dispatcher", "dispatcher_class"]


def dispatcher_class(backend: str) -> type:
    """The :class:`TokenDispatcher` subclass of ``backend`` (``nccl`` | ``tdist``; the tdist one imports
    ``sgl_kernel.tdist``). Raises ValueError for another name."""
    if backend == "nccl":
        from sglang.srt.layers.moe.token_dispatcher.nccl import NcclTokenDispatcher

        return NcclTokenDispatcher
    if backend == "tdist":
        from sglang.srt.layers.moe.token_dispatcher.tdist import TdistTokenDispatcher

        return TdistTokenDispatcher
    raise ValueError(f"--moe-a2a-backend={backend!r}: choose one of {('none',) + A2A_BACKENDS}")


def create_token_dispatcher(backend: str, config: DispatcherConfig, group: Any) -> TokenDispatcher:
    """One rank's dispatcher of ``backend`` over the EP process group ``group`` (collective where the backend
    exchanges buffers). Raises ValueError for an unknown backend or inconsistent sizes."""
    return dispatcher_class(backend)(config, group)
