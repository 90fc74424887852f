"""Model configuration read from a HF ``config.json`` (frozen, passed explicitly)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

_DTYPES = {
    "float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
    "float16": torch.float16, "half": torch.float16, "fp16": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
}


def resolve_dtype(requested: str, config_dtype: Optional[str], device: str) -> torch.dtype:
    """The compute dtype for ``--dtype``.

    ``auto`` keeps the checkpoint's dtype, except that fp32 checkpoints run in
    bf16 on GPU (as SGLang does) and half-precision checkpoints run in fp32 on
    CPU (CPU half matmuls are slow and inexact).
    Raises ValueError for an unknown dtype name.
    """
    if requested != "auto":
        if requested not in _DTYPES:
            raise ValueError(f"--dtype={requested!r} is unknown; use auto, float32, float16 or bfloat16")
        return _DTYPES[requested]
    cfg = _DTYPES.get(str(config_dtype).replace("torch.", ""), torch.float32)
    if device == "cpu":
        return torch.float32
    return torch.bfloat16 if cfg == torch.float32 else cfg


@dataclass(frozen=True)
class ModelConfig:
    """What the engine needs to know about a model.

    Attributes:
        path: folder holding ``config.json`` (and weights unless ``--load-format dummy``).
        hf_config: the raw ``config.json`` dict.
        architecture: e.g. ``"LlamaForCausalLM"``.
        context_len: max tokens per sequence (prompt + output).
        dtype: compute dtype of weights, activations and the KV cache.
    """

    path: str
    hf_config: dict[str, Any] = field(repr=False)
    architecture: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    context_len: int
    dtype: torch.dtype
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_path(cls, path: str, context_length: Optional[int] = None, dtype: str = "auto",
                  device: str = "cpu") -> "ModelConfig":
        """Read ``path/config.json``.

        Raises:
            ValueError: no config.json, no architectures field, or a context
                length larger than the model supports.
        """
        cfg_file = os.path.join(path, "config.json")
        if not os.path.isfile(cfg_file):
            raise ValueError(f"model path {path!r} has no config.json; pass a HF checkpoint folder to --model-path")
        with open(cfg_file) as f:
            hf = json.load(f)
        archs = hf.get("architectures") or []
        if not archs:
            raise ValueError(f"{cfg_file} has no 'architectures' field; cannot pick a model class")
        n_heads = hf["num_attention_heads"]
        head_dim = hf.get("head_dim") or hf["hidden_size"] // n_heads
        max_pos = hf.get("max_position_embeddings", 2048)
        if context_length is not None and context_length > max_pos:
            raise ValueError(
                f"--context-length={context_length} exceeds the model's max_position_embeddings={max_pos}; "
                "use a smaller value"
            )
        eos = hf.get("eos_token_id")
        gen_cfg = os.path.join(path, "generation_config.json")
        if os.path.isfile(gen_cfg):
            with open(gen_cfg) as f:
                eos = json.load(f).get("eos_token_id", eos)
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        return cls(
            path=path,
            hf_config=hf,
            architecture=archs[0],
            hidden_size=hf["hidden_size"],
            num_hidden_layers=hf["num_hidden_layers"],
            num_attention_heads=n_heads,
            num_key_value_heads=hf.get("num_key_value_heads", n_heads),
            head_dim=head_dim,
            vocab_size=hf["vocab_size"],
            context_len=context_length or max_pos,
            dtype=resolve_dtype(dtype, hf.get("torch_dtype") or hf.get("dtype"), device),
            eos_token_ids=eos_ids,
        )

    def get(self, key: str, default: Any = None) -> Any:
        """A raw ``config.json`` field."""
        return self.hf_config.get(key, default)

    @property
    def rope_theta(self) -> float:
        """RoPE base frequency (``rope_theta``, also read from transformers 5's ``rope_parameters``)."""
        rp = self.hf_config.get("rope_parameters") or {}
        return float(self.hf_config.get("rope_theta", rp.get("rope_theta", 10000.0)))

    @property
    def rope_scaling(self) -> Optional[dict[str, Any]]:
        """Rope scaling dict (``rope_type`` normalized), or None for plain RoPE."""
        rs = self.hf_config.get("rope_scaling") or self.hf_config.get("rope_parameters")
        if not rs:
            return None
        rs = dict(rs)
        rs.setdefault("rope_type", rs.get("type", "default"))
        return None if rs["rope_type"] == "default" else rs
