"""The embedded models: served by name, with no download.

* ``sglang-tw/stories260K`` (the default: ``python -m sglang.launch_server`` with no ``--model-path``):
  Andrej Karpathy's trained 260K-parameter TinyStories Llama (llama2.c ``stories260K``, MIT licence), shipped
  as package data in ``sglang/data/stories260K`` with its ``LICENSE``. It writes simple English stories.
* ``sglang-tw/tiny-random-llama``: a tiny Llama with seeded random weights, built locally on first use. Its
  text is **not meaningful**; stack tests use it. Its tokenizer is byte-level (256 byte tokens + Llama-3 style
  special tokens, no merges) with a Llama-3 style chat template. Everything is deterministic: two builds
  produce identical files.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "sglang-tw/stories260K"
"""``--model-path`` value (and the default) that serves the packaged trained stories260K."""
TINY_RANDOM_MODEL = "sglang-tw/tiny-random-llama"
"""``--model-path`` value that serves the locally built random-weight Llama (stack tests)."""
EMBEDDED_MODELS = (DEFAULT_MODEL, TINY_RANDOM_MODEL)
STORIES260K_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                     "tokenizer_config.json", "LICENSE")

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


def stories260k_dir() -> str:
    """The packaged ``stories260K`` folder (``sglang/data/stories260K`` inside the installed package)."""
    import sglang

    return os.path.join(os.path.dirname(os.path.abspath(sglang.__file__)), "data", "stories260K")


def embedded_model_path(name: str) -> str:
    """The local folder that serves the embedded model ``name`` (building the random one if needed).

    Raises:
        ValueError: ``name`` is not an embedded model, or the packaged stories260K files are missing
            (an install without package data); the message names the fix.
    """
    if name == TINY_RANDOM_MODEL:
        return ensure_default_model()
    if name != DEFAULT_MODEL:
        raise ValueError(f"--model-path={name!r} is not an embedded model; use one of {', '.join(EMBEDDED_MODELS)} "
                         "or a local HF checkpoint folder")
    path = stories260k_dir()
    missing = [f for f in STORIES260K_FILES if not os.path.isfile(os.path.join(path, f))]
    if missing:
        raise ValueError(f"the embedded default model {DEFAULT_MODEL!r} is incomplete in {path} (missing "
                         f"{', '.join(missing)}): reinstall sglang with its package data, e.g. "
                         "pip install -e ./python, or pass --model-path to a local HF checkpoint folder")
    return path


def default_cache_dir() -> str:
    """Where the random-weight model is materialized (``$SGLANG_TW_CACHE`` or ``~/.cache/sglang-tw``)."""
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
    """Build the random-weight ``sglang-tw/tiny-random-llama`` folder if it is missing; return its path.

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
        logger.info("built the embedded %s at %s (random weights: text is not meaningful)", TINY_RANDOM_MODEL, path)
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    return path
