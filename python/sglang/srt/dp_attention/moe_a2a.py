"""DP attention with an all-to-all MoE token dispatcher (``--moe-a2a-backend nccl|tdist``).

With DP attention each rank's tokens are its own (no attention TP), so an all-to-all dispatcher sends them straight to
the experts' owners and combines them back: no all-gather, no reduce-scatter (the dispatcher's ``local`` token
scope). The dispatcher and its MoE stages live in ``sglang.srt.layers.moe.token_dispatcher`` (contract: ``base.py``)
and ``sglang.srt.layers.moe.ep_a2a``; this module is the seam DP attention drives them through:

* the plan gives a DP worker the expert-parallel technique's :class:`~sglang.srt.deployment.plan.MoeA2aSpec` with the
  scope turned to ``local`` (``deploy.moe_a2a``, which runs after ``expert_parallel.deploy.moe_a2a``); the DP rank
  builds the dispatcher over its DP world's EP group (:func:`install`);
* the mode of every MoE layer of a forward is the one every rank agreed on (``DpGlobalStep.moe_dispatch_mode``:
  low-latency when no rank has a prefill or mixed batch and every decode fits the low-latency capacity, as every
  decode graph replay does; normal otherwise), set on the batch as ``moe_dispatch_mode`` (two-batch overlap's
  sub-batches inherit it);
* an idle rank runs the blocks' four stages on zero tokens (:func:`run_idle_stages`; the dispatcher's idle contract:
  ``T = 0``).
"""

from __future__ import annotations

from typing import Any, Optional

LOCAL_SCOPE = "local"


def install(model: Any, spec: Any, parallel_state: Any, args: Any, device: Any, max_running: int) -> Optional[Any]:
    """Build this DP rank's dispatcher for ``spec`` (a :class:`~sglang.srt.deployment.plan.MoeA2aSpec` with the
    ``local`` scope) over the DP world's EP group and install it on every MoE block (collective over the EP group;
    every rank calls it). Returns the dispatcher (close it at shutdown), None for ``spec`` None.

    Raises:
        ValueError: ``spec.token_scope`` is not ``local`` (each DP rank's tokens are its own: a ``tp_slice`` scope
            would drop all but 1/dp of them), or from the install (no MoE layer, experts split below whole, no EP
            group).
    """
    if spec is None:
        return None
    if spec.token_scope != LOCAL_SCOPE:
        raise ValueError(f"DP attention dispatches each rank's own tokens: the MoE all-to-all needs token scope "
                         f"{LOCAL_SCOPE!r}, the plan gave {spec.token_scope!r}")
    from sglang.srt.expert_parallel.install import install_moe_a2a

    return install_moe_a2a(model, spec, parallel_state, args, device, max_running)


def run_idle_stages(block: Any, x: Any, mode: str) -> None:
    """An idle rank's pass through one MoE block with an all-to-all installed: route, dispatch (``T = 0``), the local
    experts on the rows other ranks sent, combine, in the agreed ``mode`` (``"normal"`` / ``"low_latency"``).
    ``x``: ``[0, hidden]`` in the model dtype on the rank's device."""
    from sglang.srt.layers.stages import MoeState

    moe = MoeState()
    moe.dispatch_mode = mode
    block.route(x, moe)
    block.dispatch(moe)
    block.run_experts(moe)
    block.combine(moe)
