"""The embedded default model: a tiny Llama with seeded random weights, built locally.

``python -m sglang.launch_server`` with no ``--model-path`` serves it, so a
fresh machine needs no download. Its weights are random (seed 0): the text it
writes is **not meaningful**; it exists to exercise the whole serving stack.
The tokenizer is byte-level (256 byte tokens + Llama-3 style special tokens,
no merges) with a Llama-3 style chat template. Everything is deterministic:
two builds produce identical files.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile

logger = logging.getLogger(__name__)

VERSION = "v1"
SPECIAL_TOKENS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] + '<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 344,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "hidden_act": "silu",
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
    "vocab_size": 264,
    "bos_token_id": 256,
    "eos_token_id": [257, 260],
    "torch_dtype": "float32",
}


def default_cache_dir() -> str:
    """Where the default model is materialized (``$SGLANG_TW_CACHE`` or ``~/.cache/sglang-tw``)."""
    root = os.environ.get("SGLANG_TW_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "sglang-tw")
    return os.path.join(root, f"tiny-random-llama-{VERSION}")


def _build_tokenizer(out_dir: str) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    for i, t in enumerate(SPECIAL_TOKENS):
        vocab[t] = len(alphabet) + i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    bos = SPECIAL_TOKENS[0]
    tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A $B",
                                                       special_tokens=[(bos, vocab[bos])])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token="<|eot_id|>",
                                   pad_token="<|end_of_text|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)


def _build_weights(out_dir: str) -> None:
    import torch
    from safetensors.torch import save_file

    c = CONFIG
    g = torch.Generator().manual_seed(0)
    h, inter, hd = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    nh, nkv = c["num_attention_heads"], c["num_key_value_heads"]

    def rnd(*shape):
        """A random float32 tensor of ``shape`` (std 0.08, from the seeded generator)."""
        return (torch.randn(*shape, generator=g) * 0.08).contiguous()

    w = {"model.embed_tokens.weight": rnd(c["vocab_size"], h), "model.norm.weight": torch.ones(h)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w.update({
            p + "input_layernorm.weight": torch.ones(h),
            p + "post_attention_layernorm.weight": torch.ones(h),
            p + "self_attn.q_proj.weight": rnd(nh * hd, h),
            p + "self_attn.k_proj.weight": rnd(nkv * hd, h),
            p + "self_attn.v_proj.weight": rnd(nkv * hd, h),
            p + "self_attn.o_proj.weight": rnd(h, nh * hd),
            p + "mlp.gate_proj.weight": rnd(inter, h),
            p + "mlp.up_proj.weight": rnd(inter, h),
            p + "mlp.down_proj.weight": rnd(h, inter),
        })
    save_file(w, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})


def ensure_default_model(path: str | None = None) -> str:
    """Build the default model folder if it is missing; return its path.

    The build goes to a temporary folder renamed into place, so concurrent
    launches never see a half-written model.
    """
    path = path or default_cache_dir()
    if os.path.isfile(os.path.join(path, "model.safetensors")):
        return path
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".build-", dir=os.path.dirname(path))
    try:
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(CONFIG, f, indent=2, sort_keys=True)
        with open(os.path.join(tmp, "generation_config.json"), "w") as f:
            json.dump({"bos_token_id": CONFIG["bos_token_id"], "eos_token_id": CONFIG["eos_token_id"]}, f)
        _build_tokenizer(tmp)
        _build_weights(tmp)
        try:
            os.rename(tmp, path)
        except OSError:  # another process won the race
            shutil.rmtree(tmp, ignore_errors=True)
        logger.info("built the embedded default model at %s (random weights: text is not meaningful)", path)
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    return path
