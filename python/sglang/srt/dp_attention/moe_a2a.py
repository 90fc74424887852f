"""The seam between DP attention and an all-to-all MoE token dispatcher (``--moe-a2a-backend nccl|tdist``).

With DP attention each rank's tokens are its own (no attention TP), so an all-to-all dispatcher sends them straight to
the experts' owners and combines them back: no all-gather, no reduce-scatter. The dispatcher lives in
``sglang.srt.layers.moe.token_dispatcher`` (its contract: ``base.py``); until this build has it, DP attention refuses
an all-to-all backend before any process starts (``deploy.validate``) and runs the all-gather EP of :mod:`.moe`.
"""

from __future__ import annotations

import importlib.util

DISPATCHER_MODULE = "sglang.srt.layers.moe.token_dispatcher"


def a2a_available(backend: str) -> tuple[bool, str]:
    """Whether DP attention can run the MoE layers through the all-to-all dispatcher ``backend``: ``(ok, why not)``.
    Nothing is imported."""
    try:
        found = importlib.util.find_spec(DISPATCHER_MODULE) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        return False, f"the all-to-all token dispatcher ({DISPATCHER_MODULE}) is not in this build"
    return False, f"DP attention does not drive the {backend!r} all-to-all dispatcher yet"
