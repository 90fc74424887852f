"""Qwen3 dense decoder (Qwen Team, "Qwen3 Technical Report", 2025, sec. 2): Llama with per-head
RMSNorm of q and k before RoPE (QK-Norm) and no q/k/v bias."""

from __future__ import annotations

from typing import Any

from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    """:class:`LlamaForCausalLM` with ``q_norm``/``k_norm`` ([head_dim] weights) and ``attention_bias`` (default off)."""

    def attention_options(self, config: ModelConfig) -> dict[str, Any]:
        """Qwen3 attention: per-head q/k RMSNorm, bias from ``attention_bias`` (default none)."""
        bias = bool(config.get("attention_bias", False))
        return dict(qkv_bias=bias, o_bias=bias, qk_norm=True, **self._tp())


EntryClass = Qwen3ForCausalLM
