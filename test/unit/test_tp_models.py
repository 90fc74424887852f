"""TP=2/4 logits equal TP=1 logits (fp32) on random configs of every architecture, on gloo ranks (CPU).

Checkpoints are random HF models (transformers) saved to safetensors; every rank loads its shards
(lazily) and runs the same prefill / mixed / decode steps; rank 0's logits (all ranks' logits, in fact)
must match the single-process model's to ~1e-5.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
transformers = pytest.importorskip("transformers")

from model_harness import randomize_weights  # noqa: E402
from tp_worker import run_steps, spawn_ranks, tp_models_logits  # noqa: E402
from sglang.srt.configs.model_config import ModelConfig  # noqa: E402
from sglang.srt.model_loader.loader import load_model  # noqa: E402

COMMON = dict(vocab_size=130, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6)
CASES = {
    "llama_tied": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=True)),
    "llama_bias_untied": ("LlamaConfig", "LlamaForCausalLM",
                          dict(tie_word_embeddings=False, attention_bias=True, mlp_bias=True)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=False)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(tie_word_embeddings=False, head_dim=32)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2)),
    "qwen2_moe_shared": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                         dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                              shared_expert_intermediate_size=48, norm_topk_prob=False, mlp_only_layers=[1])),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                       decoder_sparse_step=1)),
}
ATOL, RTOL = 2e-5, 1e-5


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    seed = int.from_bytes(os.urandom(2), "little")
    paths = {}
    for name, (cfg_cls, model_cls, extra) in CASES.items():
        cfg = getattr(transformers, cfg_cls)(**COMMON, **extra)
        torch.manual_seed(seed)
        hf = getattr(transformers, model_cls)(cfg).float().eval()
        randomize_weights(hf, seed + sum(map(ord, name)))
        path = str(tmp_path_factory.mktemp(name))
        hf.save_pretrained(path)
        paths[name] = path
    return paths


def _reference(path: str) -> list[torch.Tensor]:
    config = ModelConfig.from_path(path)
    return run_steps(load_model(config, "auto", "cpu"), config, 1)


def _compare(jobs, checkpoints, results):
    refs = {}
    for i, (name, ep) in enumerate(jobs):
        ref = refs.get(name) or refs.setdefault(name, _reference(checkpoints[name]))
        for rank, per_rank in enumerate(results):
            for step, (got, want) in enumerate(zip(per_rank[i], ref)):
                assert got.shape == want.shape, (name, rank, step)
                torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL,
                                           msg=lambda m: f"{name} (ep {ep}) rank {rank} step {step}: {m}")


def test_tp2_every_architecture_and_expert_parallel(checkpoints):
    """All seven configs at tp 2; the MoE ones also with ep 2 (experts split, whole intermediate dim)."""
    jobs = [(n, 1) for n in sorted(CASES)] + [("mixtral", 2), ("qwen2_moe_shared", 2)]
    results = spawn_ranks(tp_models_logits, 2, [(checkpoints[n], ep) for n, ep in jobs])
    _compare(jobs, checkpoints, results)


def test_tp4_replicated_kv_heads_and_ep(checkpoints):
    """tp 4 > 2 KV heads: each KV head lives on two ranks; qwen3_moe with ep 2 x moe-tp 2."""
    jobs = [("llama_bias_untied", 1), ("qwen3_moe", 2)]
    results = spawn_ranks(tp_models_logits, 4, [(checkpoints[n], ep) for n, ep in jobs])
    _compare(jobs, checkpoints, results)
