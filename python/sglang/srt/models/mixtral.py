"""Mixtral sparse-MoE decoder (Jiang et al., "Mixtral of Experts", 2024, sec. 2.1) and the MoE block the
Qwen MoE models reuse.

Attention is Llama's; every layer's MLP is a :class:`SparseMoeBlock` (router ->
top-k experts, optionally plus a sigmoid-gated shared expert).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.layers.linear import ReplicatedLinear
from sglang.srt.layers.moe.fused_moe import FusedMoE
from sglang.srt.models.llama import LlamaForCausalLM, LlamaMLP


class SparseMoeBlock(nn.Module):
    """Router (``gate``: [E, H]) + :class:`FusedMoE` ``experts`` (+ optional ``shared_expert``).

    ``forward(x [N, H]) -> [N, H]``: ``experts(x, gate(x))`` plus, when a shared
    expert exists, ``sigmoid(shared_expert_gate(x)) * shared_expert(x)`` (Qwen2-MoE).
    With ``reduce_results=False`` both terms are TP partial sums (the gate scale is replicated, so
    the sum stays linear) and the following norm reduces them.
    """

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int, renormalize: bool,
                 params_dtype: Optional[torch.dtype], shared_intermediate_size: int = 0, hidden_act: str = "silu",
                 tp_rank: int = 0, tp_size: int = 1, comm: Any = None, reduce_results: bool = True,
                 ep_size: int = 1):
        super().__init__()
        self.gate = ReplicatedLinear(hidden_size, num_experts, bias=False, params_dtype=params_dtype)
        self.experts = FusedMoE(num_experts, top_k, hidden_size, intermediate_size, renormalize, params_dtype,
                                tp_rank, tp_size, comm=comm, reduce_results=reduce_results, ep_size=ep_size)
        self.shared_expert = self.shared_expert_gate = None
        if shared_intermediate_size > 0:
            self.shared_expert = LlamaMLP(hidden_size, shared_intermediate_size, False, hidden_act, params_dtype,
                                          tp_rank, tp_size, comm, reduce_results)
            self.shared_expert_gate = ReplicatedLinear(hidden_size, 1, bias=False, params_dtype=params_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x ``[N, H]`` -> ``[N, H]``: routed experts plus the gated shared expert if any (see the class docstring)."""
        out = self.experts(x, self.gate(x))
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


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
