"""Attention backends behind one interface (:class:`AttentionBackend`), created by name with lazy imports (an
optional library such as FlashInfer is imported only when its backend is created)."""

from __future__ import annotations

from sglang.srt.layers.attention.base_attn_backend import AttentionBackend

_REGISTRY = {
    "torch_native": ("sglang.srt.layers.attention.torch_native_backend", "TorchNativeAttnBackend"),
    "triton": ("sglang.srt.layers.attention.triton_backend", "TritonAttnBackend"),
    "flashinfer": ("sglang.srt.layers.attention.flashinfer_backend", "FlashInferAttnBackend"),  # optional extra
}


def create_attention_backend(name: str) -> AttentionBackend:
    """Instantiate the backend registered as ``name``.

    Raises:
        ValueError: unknown name (the message lists the known ones).
    """
    import importlib

    if name not in _REGISTRY:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {sorted(_REGISTRY)}")
    mod, cls = _REGISTRY[name]
    return getattr(importlib.import_module(mod), cls)()


__all__ = ["AttentionBackend", "create_attention_backend"]
