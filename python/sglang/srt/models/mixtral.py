"""Mixtral sparse-MoE decoder (Jiang et al., "Mixtral of Experts", 2024, sec. 2.1) and the MoE block the
Qwen MoE models reuse.

Attention is Llama's; every layer's MLP is a :class:`~sglang.srt.layers.moe.sparse_moe_block.SparseMoeBlock`
(router -> top-k experts, optionally plus a sigmoid-gated shared expert), whose stages executors can run apart.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.layers.moe.sparse_moe_block import SparseMoeBlock
from sglang.srt.models.llama import LlamaForCausalLM


def num_experts_of(config: ModelConfig) -> int:
    """Expert count (``num_local_experts`` or ``num_experts``); raises ValueError when neither is set."""
    n = config.get("num_local_experts") or config.get("num_experts")
    if not n:
        raise ValueError(f"{config.path}: MoE config has neither num_local_experts nor num_experts")
    return int(n)


class MixtralForCausalLM(LlamaForCausalLM):
    """Mixtral: Llama attention, every MLP a top-k MoE with renormalized weights. Same API as :class:`LlamaForCausalLM`.

    HF expert tensors ``block_sparse_moe.experts.{e}.w1/w3/w2`` load into ``mlp.experts.w13_weight/w2_weight``.
    """

    expert_weight_names = {"w1": "w1", "w3": "w3", "w2": "w2"}
    name_renames = ((".block_sparse_moe.", ".mlp."),)

    def attention_options(self, config: ModelConfig) -> dict[str, Any]:
        """Mixtral attention: no q/k/v/o bias, no q/k norm."""
        return dict(qkv_bias=False, o_bias=False, qk_norm=False, **self._tp())

    def make_mlp(self, config: ModelConfig, layer_id: int) -> nn.Module:
        """Every layer's MLP is a sparse MoE block with renormalized top-k weights and no shared expert."""
        return self.make_moe(config, int(config.get("intermediate_size")), renormalize=True, shared=0)

    def make_moe(self, config: ModelConfig, intermediate: int, renormalize: bool, shared: int) -> SparseMoeBlock:
        """A :class:`SparseMoeBlock` sized from ``config`` (``num_experts_per_tok`` experts per token)."""
        return SparseMoeBlock(config.hidden_size, num_experts_of(config), int(config.get("num_experts_per_tok", 2)),
                              intermediate, renormalize, config.dtype, shared, config.get("hidden_act", "silu"),
                              ep_size=self.ep_size, **self._tp())


EntryClass = MixtralForCausalLM
