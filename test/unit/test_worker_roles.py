"""Role-aware workers: what each role loads (weight filter over the real MoE checkpoint) and allocates."""

from __future__ import annotations

import pytest
import torch

from conftest import shared_path

from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.model_executor.model_runner import ModelRunner
from sglang.srt.deployment.plan import WorkerRole
from sglang.srt.model_executor.worker_builder import is_routed_expert_weight, role_spec
from sglang.srt.server_args import ServerArgs


def test_role_specs():
    assert role_spec("aggregated").holds_kv and role_spec("aggregated").weight_filter is None
    assert role_spec(WorkerRole.PREFILL).publishes_kv and not role_spec("decode").publishes_kv
    assert not role_spec("ffn").holds_kv and role_spec("attention").holds_kv
    assert is_routed_expert_weight("model.layers.3.block_sparse_moe.experts.2.w1.weight")
    assert is_routed_expert_weight("model.layers.0.mlp.experts.11.down_proj.weight")
    assert not is_routed_expert_weight("model.layers.0.mlp.shared_expert.down_proj.weight")
    assert not is_routed_expert_weight("model.layers.0.block_sparse_moe.gate.weight")
    with pytest.raises(ValueError, match="unknown worker role"):
        role_spec("router")


def test_roles_load_their_part_of_the_moe_checkpoint():
    path = shared_path("models", "stories260K-moe")
    mc = ModelConfig.from_path(path)
    args = ServerArgs(model_path=path, device="cpu", max_total_tokens=256)
    full = ModelRunner(mc, args, "cpu")
    attn = ModelRunner(mc, args, "cpu", role="attention")
    ffn = ModelRunner(mc, args, "cpu", role="ffn")
    p_full = dict(full.model.named_parameters())
    for name, p in attn.model.named_parameters():
        if ".experts." not in name:
            assert torch.equal(p, p_full[name]), name  # attention holds every non-expert weight
    for name, p in ffn.model.named_parameters():
        if ".experts." in name:
            assert torch.equal(p, p_full[name]), name  # FFN holds every routed expert
    assert attn.kv_cache is not None and attn.max_total_tokens == 256
    assert ffn.kv_cache is None and ffn.max_total_tokens == 0 and ffn.token_to_kv_pool is None
    with pytest.raises(ValueError, match="no KV cache"):
        ffn.forward(None)
    d = attn.kv_cache.describe()
    assert d.shape == (mc.num_hidden_layers, 2, 256 + 1, mc.num_key_value_heads, mc.head_dim)
