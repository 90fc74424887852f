"""MoE model dimensions for the AFD planner, read from a HF ``config.json``.

Plain JSON (no torch, no transformers) so the planner runs anywhere.  Accepts
Mixtral (``num_local_experts``, ``intermediate_size``), Qwen2-MoE / Qwen3-MoE
(``num_experts``, ``moe_intermediate_size``, shared experts, ``mlp_only_layers``,
``decoder_sparse_step``) and DBRX (``ffn_config`` / ``attn_config``), plus a flat
form whose keys are this class's field names (used for the paper's Table 4
models, which have no public config).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields
from typing import Any


@dataclass(frozen=True)
class MoEModelSpec:
    """Dimensions of an MoE decoder (all counts, no units unless stated).

    Attributes:
        name: label for logs.
        num_layers: decoder layers ``L``.
        hidden_size: ``h``.
        num_heads / num_kv_heads / head_dim: attention shape (GQA when kv < heads).
        num_experts: routed experts per MoE layer ``E``.
        top_k: experts per token ``K``.
        moe_intermediate_size: intermediate size ``I`` of one routed expert (SwiGLU: 3 matrices).
        num_moe_layers: layers with routed experts (others are dense MLP layers).
        dense_intermediate_size: intermediate size of the dense MLP layers (0 if none).
        shared_intermediate_size: total shared-expert intermediate size per MoE layer (0 if none);
            shared experts are dense, so they stay with attention.
        vocab_size: vocabulary (embedding + LM head live with attention).
        tie_word_embeddings: LM head shares the embedding.
        dtype_bytes: bytes per weight/activation/KV element (2 = bf16).
    """

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    num_moe_layers: int = -1
    dense_intermediate_size: int = 0
    shared_intermediate_size: int = 0
    vocab_size: int = 32000
    tie_word_embeddings: bool = False
    dtype_bytes: int = 2

    def __post_init__(self):
        if self.num_moe_layers < 0:
            object.__setattr__(self, "num_moe_layers", self.num_layers)
        for f in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim", "num_experts",
                  "top_k", "moe_intermediate_size", "dtype_bytes"):
            if int(getattr(self, f)) <= 0:
                raise ValueError(f"model {self.name!r}: {f}={getattr(self, f)!r} must be a positive integer")
        if self.top_k > self.num_experts:
            raise ValueError(f"model {self.name!r}: top_k={self.top_k} exceeds num_experts={self.num_experts}")
        if not 0 < self.num_moe_layers <= self.num_layers:
            raise ValueError(f"model {self.name!r}: num_moe_layers={self.num_moe_layers} not in [1, {self.num_layers}]")

    # ---- derived sizes (elements, per layer unless stated) -------------------------------------
    @property
    def attn_params_per_layer(self) -> float:
        """Parameters that stay on attention nodes, averaged per layer: QKV/O projections, router,
        shared experts and the dense MLP layers (amortized over all layers)."""
        h, d = self.hidden_size, self.head_dim
        qkvo = h * self.num_heads * d * 2 + 2 * h * self.num_kv_heads * d
        frac_moe = self.num_moe_layers / self.num_layers
        router = h * self.num_experts * frac_moe
        shared = 3 * h * self.shared_intermediate_size * frac_moe
        dense = 3 * h * self.dense_intermediate_size * (1 - frac_moe)
        return qkvo + router + shared + dense

    @property
    def expert_params(self) -> int:
        """Parameters of one routed expert in one layer (gate, up, down)."""
        return 3 * self.hidden_size * self.moe_intermediate_size

    @property
    def embedding_params(self) -> int:
        """Embedding + LM head parameters (attention side, once per model)."""
        return self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)

    @property
    def kv_bytes_per_token_layer(self) -> int:
        """KV-cache bytes of one token in one layer (K and V, all KV heads)."""
        return 2 * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def total_params(self) -> float:
        """All parameters (for logs)."""
        return (self.attn_params_per_layer * self.num_layers + self.embedding_params
                + self.expert_params * self.num_experts * self.num_moe_layers)

    def to_dict(self) -> dict[str, Any]:
        """Flat dict (the form :meth:`from_hf_config` also accepts)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    # ---- constructors ------------------------------------------------------------------------
    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any], name: str = "model", dtype_bytes: int = 2) -> "MoEModelSpec":
        """Build from a HF ``config.json`` dict (or this class's flat form).

        Raises:
            ValueError: a dense model (no routed experts) or missing fields, naming them.
        """
        if "moe_intermediate_size" in cfg and "num_layers" in cfg:  # flat form
            known = {f.name for f in fields(cls)}
            return cls(**{k: v for k, v in cfg.items() if k in known})
        if "ffn_config" in cfg:  # DBRX
            ffn, attn = cfg["ffn_config"], cfg.get("attn_config", {})
            h, nh = cfg["d_model"], cfg["n_heads"]
            return cls(name=name, num_layers=cfg["n_layers"], hidden_size=h, num_heads=nh,
                       num_kv_heads=attn.get("kv_n_heads", nh), head_dim=h // nh,
                       num_experts=ffn["moe_num_experts"], top_k=ffn["moe_top_k"],
                       moe_intermediate_size=ffn["ffn_hidden_size"], vocab_size=cfg.get("vocab_size", 100352),
                       tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)), dtype_bytes=dtype_bytes)
        n_exp = cfg.get("num_local_experts") or cfg.get("num_experts") or cfg.get("n_routed_experts")
        if not n_exp:
            arch = (cfg.get("architectures") or [cfg.get("model_type", "?")])[0]
            raise ValueError(f"{name}: {arch} is a dense model (no num_local_experts/num_experts in config.json); "
                             "attention/FFN disaggregation plans MoE models only")
        try:
            h, L, nh = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"]
            top_k = cfg["num_experts_per_tok"]
        except KeyError as e:
            raise ValueError(f"{name}: config.json lacks {e.args[0]!r}, needed to plan an MoE deployment") from None
        inter = cfg.get("intermediate_size", 0)
        moe_inter = cfg.get("moe_intermediate_size") or inter
        if "moe_intermediate_size" in cfg:  # Qwen-MoE: dense layers may use intermediate_size
            step = int(cfg.get("decoder_sparse_step", 1) or 1)
            mlp_only = set(cfg.get("mlp_only_layers") or [])
            n_moe = sum(1 for i in range(L) if i not in mlp_only and (i + 1) % step == 0)
        else:
            n_moe = L
        return cls(name=name, num_layers=L, hidden_size=h, num_heads=nh,
                   num_kv_heads=cfg.get("num_key_value_heads", nh), head_dim=cfg.get("head_dim") or h // nh,
                   num_experts=int(n_exp), top_k=int(top_k), moe_intermediate_size=int(moe_inter),
                   num_moe_layers=n_moe, dense_intermediate_size=int(inter) if n_moe < L else 0,
                   shared_intermediate_size=int(cfg.get("shared_expert_intermediate_size", 0) or 0),
                   vocab_size=int(cfg.get("vocab_size", 32000)),
                   tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)), dtype_bytes=dtype_bytes)

    @classmethod
    def from_path(cls, path: str, dtype_bytes: int = 2) -> "MoEModelSpec":
        """Read a checkpoint folder holding ``config.json`` or a JSON file path.

        Raises:
            ValueError: no such file, bad JSON, or a dense model.
        """
        cfg_file = os.path.join(path, "config.json") if os.path.isdir(path) else path
        if not os.path.isfile(cfg_file):
            raise ValueError(f"--model-path {path!r}: no config.json there; "
                             "pass a HF checkpoint folder or a config file")
        try:
            with open(cfg_file) as f:
                cfg = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"--model-path {path!r}: {cfg_file} is not valid JSON ({e})") from None
        if os.path.isdir(path) or os.path.basename(path) == "config.json":
            name = os.path.basename(os.path.normpath(os.path.dirname(cfg_file)))
        else:
            name = os.path.splitext(os.path.basename(path))[0]
        return cls.from_hf_config(cfg, name=name, dtype_bytes=dtype_bytes)
