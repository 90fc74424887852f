"""Qwen2 / Qwen2.5 decoder (Qwen Team, "Qwen2 Technical Report", 2024, sec. 2.1): Llama with a bias on q/k/v."""

from __future__ import annotations

from typing import Any

from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    """:class:`LlamaForCausalLM` with ``qkv_proj`` bias and no ``o_proj`` bias (same API)."""

    def attention_options(self, config: ModelConfig) -> dict[str, Any]:
        """Qwen2 attention: q/k/v bias, no o bias, no q/k norm."""
        return dict(qkv_bias=True, o_bias=False, qk_norm=False, **self._tp())


EntryClass = Qwen2ForCausalLM
