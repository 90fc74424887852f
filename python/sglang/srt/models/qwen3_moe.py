"""Qwen3-MoE decoder (Qwen Team, "Qwen3 Technical Report", 2025, sec. 2): Qwen3 attention (per-head
q/k RMSNorm, no bias) with Qwen2-MoE's layer layout and no shared expert."""

from __future__ import annotations

from typing import Any

from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.models.qwen2_moe import Qwen2MoeForCausalLM


class Qwen3MoeForCausalLM(Qwen2MoeForCausalLM):
    """Qwen3-MoE (same API as :class:`~sglang.srt.models.llama.LlamaForCausalLM`)."""

    def attention_options(self, config: ModelConfig) -> dict[str, Any]:
        """Qwen3 attention: per-head q/k RMSNorm, bias from ``attention_bias`` (default none)."""
        bias = bool(config.get("attention_bias", False))
        return dict(qkv_bias=bias, o_bias=bias, qk_norm=True, **self._tp())

    def shared_expert_size(self, config: ModelConfig) -> int:
        """Always 0: Qwen3-MoE has no shared expert."""
        return 0


EntryClass = Qwen3MoeForCausalLM
