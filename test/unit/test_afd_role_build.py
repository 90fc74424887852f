"""Role-aware model construction: an attention worker builds no routed-expert parameter, an
FFN worker no attention and no KV cache -- on the real stories260K-moe checkpoint (CPU), and for the big MoE
configs (Qwen3-30B-A3B, Mixtral-8x7B, dummy) on the ``meta`` device with byte counts computed from config.json."""

from __future__ import annotations

import json
import os

import pytest
import torch

from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.model_executor.worker_builder import is_routed_expert_param, role_spec
from sglang.srt.model_loader.loader import load_model
from sglang.srt.model_loader.role_build import held_param_bytes, param_bytes

DATA = os.path.join(os.path.dirname(__file__), "..", "..", "..", "shared", "data")
MOE = os.path.join(DATA, "models", "stories260K-moe")
BIG = {"qwen3": os.path.join(DATA, "configs", "Qwen--Qwen3-30B-A3B"),
       "mixtral": os.path.join(DATA, "configs", "mistralai--Mixtral-8x7B-v0.1")}


def _expected_bytes(path: str, elem: int) -> tuple[int, int]:
    """(attention-role bytes, expert bytes) of a Qwen3-MoE / Mixtral config of ``elem``-byte parameters, from
    config.json alone."""
    c = json.load(open(os.path.join(path, "config.json")))
    h, v, n = c["hidden_size"], c["vocab_size"], c["num_hidden_layers"]
    nh, nkv = c["num_attention_heads"], c["num_key_value_heads"]
    hd = c.get("head_dim") or h // nh
    e = c.get("num_experts") or c["num_local_experts"]
    inter = c.get("moe_intermediate_size") or c["intermediate_size"]
    per_layer = h * nh * hd + 2 * h * nkv * hd + nh * hd * h + 2 * h + e * h  # qkv, o, 2 norms, router
    if c["model_type"] == "qwen3_moe":
        per_layer += 2 * hd  # q_norm, k_norm
    attn = v * h * (1 if c.get("tie_word_embeddings") else 2) + n * per_layer + h
    return elem * attn, elem * n * e * 3 * h * inter


@pytest.mark.parametrize("which", ["qwen3", "mixtral"])
def test_big_moe_builds_per_role_on_meta_without_memory(which):
    if not os.path.isdir(BIG[which]):
        pytest.skip(f"{BIG[which]} missing")
    mc = ModelConfig.from_path(BIG[which], 4096, dtype="bfloat16")
    want_attn, want_experts = _expected_bytes(BIG[which], 2)
    for role, want in (("attention", want_attn), ("ffn", want_experts)):
        spec = role_spec(role)
        model = load_model(mc, "dummy", "meta", holds_param=spec.holds_param)
        assert all(p.is_meta for p in model.parameters()), role
        assert all(b.is_meta for b in model.buffers()), role
        assert held_param_bytes(model, spec.holds_param) == want, role
    assert want_attn + want_experts == param_bytes(model, include_meta=True)


def _moe_config() -> ModelConfig:
    if not os.path.isdir(MOE):
        pytest.skip("stories260K-moe missing")
    return ModelConfig.from_path(MOE)


def test_attention_worker_holds_no_expert_bytes_ffn_no_attention():
    mc = _moe_config()
    full = load_model(mc, "auto", "cpu")
    experts = sum(p.numel() * p.element_size() for n, p in full.named_parameters() if is_routed_expert_param(n))
    assert experts > 0
    attn = load_model(mc, "auto", "cpu", weight_filter=role_spec("attention").weight_filter,
                      holds_param=role_spec("attention").holds_param)
    for n, p in attn.named_parameters():
        assert p.is_meta == is_routed_expert_param(n), n
    assert param_bytes(attn) == param_bytes(full) - experts
    # the held parameters equal the colocated model's, and RoPE's buffer was rebuilt on the device
    held = dict(attn.named_parameters())
    for n, p in full.named_parameters():
        if not is_routed_expert_param(n):
            assert torch.equal(held[n], p), n
    for (n, b), (_, b_full) in zip(attn.named_buffers(), full.named_buffers()):
        assert not b.is_meta and torch.equal(b, b_full), n
    ffn = load_model(mc, "auto", "cpu", weight_filter=role_spec("ffn").weight_filter,
                     holds_param=role_spec("ffn").holds_param)
    assert param_bytes(ffn) == experts
    assert all(p.is_meta != is_routed_expert_param(n) for n, p in ffn.named_parameters())


def test_model_runner_logs_role_bytes_ffn_has_no_kv():
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.server_args import ServerArgs

    mc = _moe_config()
    args = ServerArgs(model_path=MOE, device="cpu", max_total_tokens=256, max_running_requests=4)
    attn = ModelRunner(mc, args, "cpu", role="attention")
    ffn = ModelRunner(mc, args, "cpu", role="ffn")
    agg = ModelRunner(mc, args, "cpu")
    experts = sum(p.numel() * p.element_size() for n, p in agg.model.named_parameters() if is_routed_expert_param(n))
    assert attn.param_bytes == agg.param_bytes - experts and attn.kv_bytes == agg.kv_bytes > 0
    assert ffn.param_bytes == experts and ffn.kv_bytes == 0 and ffn.kv_cache is None
