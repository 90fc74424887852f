"""DP attention with an all-to-all MoE token dispatcher (``--moe-a2a-backend nccl|tdist``).

With DP attention each rank's tokens are its own (no attention TP), so an all-to-all dispatcher sends them straight to
the experts' owners and combines them back: no all-gather, no reduce-scatter (the dispatcher's ``local`` token
scope). The dispatcher and its MoE stages live in ``sglang.srt.layers.moe.token_dispatcher`` (contract: ``base.py``)
and ``sglang.srt.layers.moe.ep_a2a``; this module is the seam DP attention drives them through:

* the DP worker builds the dispatcher itself over its DP world's EP group (:func:`install`; the plan gives DP workers
  no generic ``MoeA2aSpec``, see ``deploy.moe_a2a``), with the ``local`` scope;
* the mode of every MoE layer of a forward is the one every rank agreed on (``DpGlobalStep.moe_dispatch_mode``:
  low-latency only when every rank replays the same decode CUDA graph, normal otherwise), set on the batch as
  ``moe_dispatch_mode``;
* an idle rank runs the blocks' four stages on zero tokens (the dispatcher's idle contract: ``T = 0``).

Without that package in the build, DP attention refuses an all-to-all backend before any process starts
(``deploy.validate``) and runs the all-gather EP of :mod:`.moe`.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any, Optional

DISPATCHER_MODULES = ("sglang.srt.layers.moe.token_dispatcher", "sglang.srt.layers.moe.ep_a2a",
                      "sglang.srt.expert_parallel.install")


@dataclass(frozen=True)
class LocalScopeA2a:
    """What the dispatcher install reads of a worker's MoE all-to-all spec: the backend, the ``local`` token scope
    (each DP rank dispatches all its own tokens) and the low-latency buffer sets."""

    backend: str
    token_scope: str = "local"
    max_inflight: int = 2


def _found(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def a2a_available(backend: str) -> tuple[bool, str]:
    """Whether DP attention can run the MoE layers through the all-to-all dispatcher ``backend``: ``(ok, why not)``.
    Nothing is imported."""
    missing = [m for m in DISPATCHER_MODULES if not _found(m)]
    if missing:
        return False, f"the all-to-all token dispatcher ({', '.join(missing)}) is not in this build"
    return True, ""


def install(model: Any, backend: str, parallel_state: Any, args: Any, device: Any, max_running: int) -> Optional[Any]:
    """Build this DP rank's dispatcher of ``backend`` over the DP world's EP group and install it on every MoE block
    (collective over the EP group; every rank calls it). Returns the dispatcher (close it at shutdown), None for
    ``none``.

    Raises:
        ValueError: from the install (no MoE layer, experts split below whole, no EP group).
    """
    if backend == "none":
        return None
    from sglang.srt.expert_parallel.install import install_moe_a2a

    return install_moe_a2a(model, LocalScopeA2a(backend), parallel_state, args, device, max_running)


def run_idle_stages(block: Any, x: Any, mode: str) -> None:
    """An idle rank's pass through one MoE block with an all-to-all installed: route, dispatch (``T = 0``), the local
    experts on the rows other ranks sent, combine, in the agreed ``mode``."""
    from sglang.srt.layers.stages import MoeState

    moe = MoeState()
    moe.dispatch_mode = mode
    block.route(x, moe)
    block.dispatch(moe)
    block.run_experts(moe)
    block.combine(moe)
