"""Architecture name (HF ``config.json`` ``architectures[0]``) -> model class, imported lazily."""

from __future__ import annotations

import importlib
import logging

logger = logging.getLogger(__name__)

_MODELS: dict[str, str] = {
    "LlamaForCausalLM": "sglang.srt.models.llama:LlamaForCausalLM",
    "Qwen2ForCausalLM": "sglang.srt.models.qwen2:Qwen2ForCausalLM",
    "Qwen3ForCausalLM": "sglang.srt.models.qwen3:Qwen3ForCausalLM",
    "MixtralForCausalLM": "sglang.srt.models.mixtral:MixtralForCausalLM",
    "Qwen2MoeForCausalLM": "sglang.srt.models.qwen2_moe:Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM": "sglang.srt.models.qwen3_moe:Qwen3MoeForCausalLM",
}

SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(sorted(_MODELS))


def get_model_class(architecture: str) -> type:
    """The model class for ``architecture`` (e.g. "LlamaForCausalLM"), imported on first use.

    Raises:
        ValueError: unknown architecture (the message lists the supported ones).
    """
    if architecture not in _MODELS:
        raise ValueError(f"architecture {architecture!r} is not supported; supported architectures: "
                         f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    module, cls = _MODELS[architecture].split(":")
    return getattr(importlib.import_module(module), cls)
