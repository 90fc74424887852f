"""Qwen2-MoE / Qwen1.5-MoE decoder (Qwen Team, "Qwen2 Technical Report", 2024, sec. 2.2.2): fine-grained
experts plus a shared expert scaled by ``sigmoid(shared_expert_gate(x))``.

Layer ``i`` is sparse when ``i not in mlp_only_layers`` and
``(i + 1) % decoder_sparse_step == 0``; otherwise it has a dense MLP of
``intermediate_size``. Top-k weights are renormalized only when ``norm_topk_prob``.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.models.llama import LlamaMLP
from sglang.srt.models.mixtral import MixtralForCausalLM, num_experts_of


class Qwen2MoeForCausalLM(MixtralForCausalLM):
    """Qwen2-MoE (same API as :class:`~sglang.srt.models.llama.LlamaForCausalLM`).

    HF tensors ``mlp.experts.{e}.gate_proj/up_proj/down_proj``, ``mlp.gate``,
    ``mlp.shared_expert.*`` and ``mlp.shared_expert_gate`` are loaded.
    """

    expert_weight_names = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
    name_renames = ()

    def attention_options(self, config: ModelConfig) -> dict[str, Any]:
        """Qwen2 attention: q/k/v bias (``qkv_bias``, default on), no o bias, no q/k norm."""
        return dict(qkv_bias=bool(config.get("qkv_bias", True)), o_bias=False, qk_norm=False, **self._tp())

    def shared_expert_size(self, config: ModelConfig) -> int:
        """Intermediate size of the shared expert (0: none)."""
        return int(config.get("shared_expert_intermediate_size", 0) or 0)

    def make_mlp(self, config: ModelConfig, layer_id: int) -> nn.Module:
        """A sparse MoE block on layers selected by ``decoder_sparse_step`` and not in ``mlp_only_layers`` (with the
        shared expert if any), else a dense LlamaMLP."""
        step = int(config.get("decoder_sparse_step", 1) or 1)
        sparse = layer_id not in (config.get("mlp_only_layers") or []) and num_experts_of(config) > 0 \
            and (layer_id + 1) % step == 0
        if not sparse:
            return LlamaMLP(config.hidden_size, int(config.get("intermediate_size")), False,
                            config.get("hidden_act", "silu"), config.dtype, **self._tp())
        return self.make_moe(config, int(config.get("moe_intermediate_size")),
                             renormalize=bool(config.get("norm_topk_prob", False)),
                             shared=self.shared_expert_size(config))


EntryClass = Qwen2MoeForCausalLM
