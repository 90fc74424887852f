"""Mixture-of-experts layers: top-k routing (:mod:`.router`) and the expert layer (:mod:`.fused_moe`)."""

from sglang.srt.layers.moe.fused_moe import FusedMoE, fused_moe_ref
from sglang.srt.layers.moe.router import select_experts

__all__ = ["FusedMoE", "fused_moe_ref", "select_experts"]
