"""Our six decoders vs HF transformers: last-token logits (prefill, decode, batched, mixed) and greedy text."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
transformers = pytest.importorskip("transformers")

from model_harness import ModelHarness, randomize_weights  # noqa: E402
from sglang.srt.configs.model_config import ModelConfig  # noqa: E402
from sglang.srt.forward_batch_info import ForwardMode  # noqa: E402
from sglang.srt.model_loader.loader import load_model  # noqa: E402

DATA = os.path.normpath(os.path.join(os.path.dirname(__file__), "..", "..", "..", "shared", "data", "models"))
VOCAB = 128
TOL = 1e-4
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6)

# name -> (HF config class, HF model class, extra config fields)
CASES = {
    "llama_llama3_tied": ("LlamaConfig", "LlamaForCausalLM",
                          dict(tie_word_embeddings=True, rope_parameters=LLAMA3_ROPE)),
    "llama_bias_linear_untied": ("LlamaConfig", "LlamaForCausalLM",
                                 dict(tie_word_embeddings=False, attention_bias=True, mlp_bias=True,
                                      rope_parameters={"rope_type": "linear", "rope_theta": 500.0, "factor": 2.0})),
    "qwen2_tied": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(tie_word_embeddings=False, head_dim=32)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2)),
    "qwen2_moe_shared": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                         dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                              shared_expert_intermediate_size=48, norm_topk_prob=False, mlp_only_layers=[1])),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                       decoder_sparse_step=1)),
}




@pytest.fixture(scope="module", params=sorted(CASES))
def pair(request, tmp_path_factory):
    cfg_cls, model_cls, extra = CASES[request.param]
    cfg = getattr(transformers, cfg_cls)(**COMMON, **extra)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = getattr(transformers, model_cls)(cfg).float().eval()
    randomize_weights(hf, seed=sum(map(ord, request.param)))
    path = str(tmp_path_factory.mktemp(request.param))
    hf.save_pretrained(path)
    config = ModelConfig.from_path(path)
    assert config.architecture == model_cls and config.dtype == torch.float32
    ours = load_model(config, "auto", "cpu")
    return request.param, hf, ours, config


def _hf_last(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0, -1].float()


def _check(hf, harness, rids, logits):
    for i, rid in enumerate(rids):
        ref = _hf_last(hf, harness.tokens(rid))
        assert ref.abs().max() > 0.1, "reference logits are too small for a meaningful check"
        diff = (logits[i] - ref).abs().max().item()
        assert diff < TOL, f"request {rid}: max |ours - HF| = {diff:.3g}"


def test_prefill_then_decode(pair):
    name, hf, ours, config = pair
    gen = torch.Generator().manual_seed(1)
    h = ModelHarness(ours, config)
    logits = h.step([("a", torch.randint(0, VOCAB, (11,), generator=gen).tolist())])
    assert h.last_mode == ForwardMode.EXTEND and logits.shape == (1, VOCAB) and logits.dtype == torch.float32
    _check(hf, h, ["a"], logits)
    for _ in range(4):
        logits = h.step([("a", [int(logits[0].argmax())])])
        assert h.last_mode == ForwardMode.DECODE
        _check(hf, h, ["a"], logits)


def test_batched_prefill_then_batched_decode(pair):
    name, hf, ours, config = pair
    gen = torch.Generator().manual_seed(2)
    h = ModelHarness(ours, config)
    items = [(r, torch.randint(0, VOCAB, (n,), generator=gen).tolist()) for r, n in (("a", 5), ("b", 13), ("c", 2))]
    logits = h.step(items)
    _check(hf, h, "abc", logits)
    for _ in range(2):
        logits = h.step([(r, [int(torch.randint(0, VOCAB, (1,), generator=gen))]) for r in "abc"])
        assert h.last_mode == ForwardMode.DECODE
        _check(hf, h, "abc", logits)


def test_mixed_extend_and_decode(pair):
    name, hf, ours, config = pair
    gen = torch.Generator().manual_seed(3)
    rand = lambda n: torch.randint(0, VOCAB, (n,), generator=gen).tolist()  # noqa: E731
    h = ModelHarness(ours, config)
    h.step([("a", rand(6)), ("b", rand(4)), ("c", rand(9))])
    # a extends its cached prefix by a chunk, b and c decode, d is a fresh prefill
    logits = h.step([("b", rand(1)), ("a", rand(5)), ("c", rand(1)), ("d", rand(3))])
    assert h.last_mode == ForwardMode.MIXED
    _check(hf, h, "bacd", logits)


def _stories(name: str) -> str:
    path = os.path.join(DATA, name)
    if not os.path.isfile(os.path.join(path, "model.safetensors")):
        pytest.skip(f"real checkpoint {path} is absent (shared test data not checked out beside the repo)")
    return path


@pytest.mark.parametrize("name", ["stories260K", "stories260K-moe"])
def test_real_checkpoint_greedy_matches_hf(name):
    path = _stories(name)
    tok = transformers.AutoTokenizer.from_pretrained(path)
    prompt = tok("Once upon a time")["input_ids"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=30, do_sample=False)[0, len(prompt):].tolist()
    assert len(ref) >= 20, "HF stopped early; the comparison would be too short"
    config = ModelConfig.from_path(path)
    ours = load_model(config, "auto", "cpu")
    h = ModelHarness(ours, config)
    out, logits = [], h.step([("r", prompt)])
    for _ in range(30):
        out.append(int(logits[0].argmax()))
        logits = h.step([("r", [out[-1]])])
    assert out[:len(ref)] == ref, f"ours: {tok.decode(out)!r}\nHF:   {tok.decode(ref)!r}"
    assert "Lily" in tok.decode(out)
