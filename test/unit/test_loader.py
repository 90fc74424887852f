"""Model loading: safetensors (single file, sharded index, dtype cast), clear errors, and dummy weights."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
safetensors_torch = pytest.importorskip("safetensors.torch")

from model_harness import ModelHarness  # noqa: E402
from sglang.srt.configs.model_config import ModelConfig  # noqa: E402
from sglang.srt.layers.layernorm import RMSNorm  # noqa: E402
from sglang.srt.model_loader.loader import load_model  # noqa: E402
from sglang.srt.models.registry import SUPPORTED_ARCHITECTURES, get_model_class  # noqa: E402

LLAMA_CFG = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=32, intermediate_size=48,
                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
                 max_position_embeddings=128, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
                 torch_dtype="float32")
QWEN3_MOE_CFG = dict(LLAMA_CFG, architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", num_experts=4,
                     num_experts_per_tok=2, moe_intermediate_size=16, head_dim=16, norm_topk_prob=True)


def _hf_state(cfg: dict, seed: int) -> dict[str, torch.Tensor]:
    """A complete random Llama checkpoint in HF tensor names (no transformers needed)."""
    g = torch.Generator().manual_seed(seed)
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hd = h // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * hd
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,), "lm_head.weight": (v, h)}
    for n in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{n}."
        shapes.update({p + "self_attn.q_proj.weight": (h, h), p + "self_attn.k_proj.weight": (kv, h),
                       p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, h),
                       p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                       p + "mlp.down_proj.weight": (h, i), p + "input_layernorm.weight": (h,),
                       p + "post_attention_layernorm.weight": (h,)})
    return {k: torch.randn(s, generator=g) * 0.3 for k, s in shapes.items()}


def _write(path, cfg: dict, state: dict | None = None) -> str:
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    if state is not None:
        safetensors_torch.save_file(state, os.path.join(path, "model.safetensors"))
    return str(path)


def test_loads_all_tensors_and_casts_dtype(tmp_path):
    state = _hf_state(LLAMA_CFG, 0)
    path = _write(tmp_path, LLAMA_CFG, state)
    model = load_model(ModelConfig.from_path(path), "safetensors", "cpu")
    assert not model.training
    layer = model.model.layers[1]
    q, k, v = (state[f"model.layers.1.self_attn.{n}_proj.weight"] for n in "qkv")
    assert torch.equal(layer.self_attn.qkv_proj.weight, torch.cat([q, k, v]))
    assert torch.equal(layer.mlp.gate_up_proj.weight, torch.cat([state["model.layers.1.mlp.gate_proj.weight"],
                                                                 state["model.layers.1.mlp.up_proj.weight"]]))
    assert torch.equal(model.lm_head.weight, state["lm_head.weight"])
    bf = load_model(ModelConfig.from_path(path, dtype="bfloat16"), "auto", "cpu")
    assert all(p.dtype == torch.bfloat16 for p in bf.parameters())
    assert torch.equal(bf.model.norm.weight, state["model.norm.weight"].bfloat16())


def test_sharded_index_equals_single_file(tmp_path):
    state = _hf_state(LLAMA_CFG, 1)
    names = sorted(state)
    path = _write(tmp_path / "sharded", LLAMA_CFG)
    weight_map = {}
    for part, chunk in enumerate((names[::2], names[1::2])):
        file = f"model-0000{part + 1}-of-00002.safetensors"
        safetensors_torch.save_file({n: state[n] for n in chunk}, os.path.join(path, file))
        weight_map.update({n: file for n in chunk})
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    sharded = load_model(ModelConfig.from_path(path), "auto", "cpu")
    single = load_model(ModelConfig.from_path(_write(tmp_path / "single", LLAMA_CFG, state)), "auto", "cpu")
    for (n1, p1), (n2, p2) in zip(sharded.state_dict().items(), single.state_dict().items()):
        assert n1 == n2 and torch.equal(p1, p2), n1
    os.remove(os.path.join(path, "model-00002-of-00002.safetensors"))
    with pytest.raises(ValueError, match="model-00002-of-00002.safetensors"):
        load_model(ModelConfig.from_path(path), "auto", "cpu")


def test_empty_folder(tmp_path):
    path = _write(tmp_path, LLAMA_CFG)
    with pytest.raises(ValueError, match=r"no \*\.safetensors in .*use --load-format dummy"):
        load_model(ModelConfig.from_path(path), "auto", "cpu")


def test_corrupt_file(tmp_path):
    path = _write(tmp_path, LLAMA_CFG)
    with open(os.path.join(path, "model.safetensors"), "wb") as f:
        f.write(os.urandom(200))
    with pytest.raises(ValueError, match="model.safetensors"):
        load_model(ModelConfig.from_path(path), "auto", "cpu")


def test_missing_unexpected_and_misshapen_tensors(tmp_path):
    state = _hf_state(LLAMA_CFG, 2)
    missing = dict(state)
    del missing["model.layers.1.self_attn.k_proj.weight"], missing["model.norm.weight"]
    with pytest.raises(ValueError, match=r"missing.*model\.layers\.1\.self_attn\.k_proj\.weight") as e:
        load_model(ModelConfig.from_path(_write(tmp_path / "m", LLAMA_CFG, missing)), "auto", "cpu")
    assert "model.norm.weight" in str(e.value) and "v_proj" not in str(e.value)
    extra = dict(state, **{"model.layers.0.mlp.foo.weight": torch.randn(3)})
    with pytest.raises(ValueError, match=r"unexpected.*model\.layers\.0\.mlp\.foo\.weight"):
        load_model(ModelConfig.from_path(_write(tmp_path / "u", LLAMA_CFG, extra)), "auto", "cpu")
    bad = dict(state, **{"model.layers.0.mlp.down_proj.weight": torch.randn(5, 5)})
    with pytest.raises(ValueError, match="shape"):
        load_model(ModelConfig.from_path(_write(tmp_path / "s", LLAMA_CFG, bad)), "auto", "cpu")


def test_unknown_architecture_and_format(tmp_path):
    path = _write(tmp_path, dict(LLAMA_CFG, architectures=["FooForCausalLM"]), _hf_state(LLAMA_CFG, 3))
    with pytest.raises(ValueError, match="'FooForCausalLM' is not supported.*LlamaForCausalLM"):
        load_model(ModelConfig.from_path(path), "auto", "cpu")
    with pytest.raises(ValueError, match="Qwen3MoeForCausalLM"):
        get_model_class("GPT2LMHeadModel")
    assert set(SUPPORTED_ARCHITECTURES) == {"LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                                            "MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"}
    with pytest.raises(ValueError, match="load-format='pt'"):
        load_model(ModelConfig.from_path(path), "pt", "cpu")


@pytest.mark.parametrize("cfg", [LLAMA_CFG, QWEN3_MOE_CFG], ids=["llama", "qwen3_moe"])
def test_dummy_weights_deterministic(tmp_path, cfg):
    config = ModelConfig.from_path(_write(tmp_path, cfg))  # no weight files needed
    a, b = load_model(config, "dummy", "cpu"), load_model(config, "dummy", "cpu")
    other = load_model(config, "dummy", "cpu", seed=7)
    norms = {id(m.weight) for m in a.modules() if isinstance(m, RMSNorm)}
    assert norms
    for (name, pa), pb, po in zip(a.named_parameters(), b.parameters(), other.parameters()):
        assert torch.equal(pa, pb), name
        if id(pa) in norms:
            assert torch.all(pa == 1.0), name
        else:
            assert pa.abs().max() <= 1e-3 and pa.std() > 0 and not torch.equal(pa, po), name
    logits = ModelHarness(a, config).step([("r", [1, 5, 9]), ("s", [2])])
    assert logits.shape == (2, config.vocab_size) and torch.isfinite(logits).all()


CONFIGS = os.path.normpath(os.path.join(os.path.dirname(__file__), "..", "..", "..", "shared", "data", "configs"))


def test_real_configs_build_with_hf_parameter_counts():
    """Every real config builds on the meta device with exactly HF's parameter count (shapes, MoE, tying)."""
    transformers = pytest.importorskip("transformers")
    if not os.path.isdir(CONFIGS):
        pytest.skip(f"real configs {CONFIGS} are absent (shared test data not checked out beside the repo)")
    names = sorted(os.listdir(CONFIGS))
    assert names
    for name in names:
        path = os.path.join(CONFIGS, name)
        config = ModelConfig.from_path(path, dtype="bfloat16")
        with torch.device("meta"):
            ours = get_model_class(config.architecture)(config)
            hf = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(path))
        assert all(p.dtype == torch.bfloat16 for p in ours.parameters())
        assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in hf.parameters()), name
