"""FP8 KV-cache scales published in checkpoints: which tensor names carry them and reading them per layer.

FP8 checkpoints of vLLM / SGLang's ecosystem carry one scalar per attention layer for K and one for V, under one of
these names (``N`` = layer index; the ``model.`` prefix may be absent):

* ``model.layers.N.self_attn.k_scale`` / ``.v_scale`` (llm-compressor / compressed-tensors, the current form; also
  with vLLM's ``.self_attn.attn.`` infix);
* ``model.layers.N.self_attn.k_proj.k_scale`` / ``.v_proj.v_scale`` (NVIDIA ModelOpt exports);
* ``model.layers.N.self_attn.k_proj.output_scale`` / ``.v_proj.output_scale`` (older compressed-tensors);
* ``model.layers.N.self_attn.kv_scale`` (AutoFP8, deprecated: one scale for both K and V).

vLLM's ``maybe_remap_kv_scale_name`` (``model_executor/model_loader/weight_utils.py``) maps the same names. A
layer with only a K scale uses it for V too (vLLM does the same for ``kv_scale``); a layer with none gets 1.0 (with a
warning when others have one). The model's own weight loading never sees these tensors (the loader drops every name
:func:`is_kv_scale_name` matches).
"""

from __future__ import annotations

import logging
import math
import re
from typing import Optional, Sequence

from sglang.srt.mem_cache.kv_quant import KVScales

logger = logging.getLogger(__name__)

_ATTN = r"^(?:model\.)?layers\.(\d+)\.self_attn\."
_PATTERNS = (
    (re.compile(_ATTN + r"(?:attn\.)?(k_scale|v_scale|kv_scale)$"), None),
    (re.compile(_ATTN + r"k_proj\.(k_scale|output_scale)$"), "k"),
    (re.compile(_ATTN + r"v_proj\.(v_scale|output_scale)$"), "v"),
)


def parse_kv_scale_name(name: str) -> Optional[tuple[int, str]]:
    """``(layer, "k" | "v" | "kv")`` for a checkpoint tensor name that carries an FP8 KV-cache scale, else None."""
    for pat, which in _PATTERNS:
        m = pat.match(name)
        if m:
            if which is None:
                which = {"k_scale": "k", "v_scale": "v", "kv_scale": "kv"}[m.group(2)]
            return int(m.group(1)), which
    return None


def is_kv_scale_name(name: str) -> bool:
    """True for the checkpoint names of FP8 KV-cache scales (module doc); the weight loader skips them."""
    return parse_kv_scale_name(name) is not None


def read_kv_scales(files: Sequence[str], num_layers: int) -> Optional[KVScales]:
    """The FP8 KV scales of a safetensors checkpoint, or None when it has none.

    Args:
        files: the checkpoint's ``*.safetensors`` files (only headers and the scalar scale tensors are read).
        num_layers: attention layers of the model.
    Returns:
        :class:`KVScales` with ``source="checkpoint"`` (layers without a scale get 1.0), or None.
    Raises:
        ValueError: an unreadable file, a scale of a layer ``>= num_layers``, a scale tensor with more than one
            element (per-head / per-channel KV scales are not supported: SGLang's FP8 KV cache is per-tensor), or a
            scale that is not finite and positive. Each message names the tensor and the file.
    """
    from safetensors import safe_open

    k: list[Optional[float]] = [None] * num_layers
    v: list[Optional[float]] = [None] * num_layers
    found = 0
    for file in files:
        try:
            handle = safe_open(file, framework="pt", device="cpu")
            names = [n for n in handle.keys() if is_kv_scale_name(n)]
        except Exception as e:  # safetensors raises its own error types
            raise ValueError(f"cannot read safetensors file {file}: {e}") from e
        for name in names:
            layer, which = parse_kv_scale_name(name)
            if layer >= num_layers:
                raise ValueError(f"KV scale {name!r} in {file} names layer {layer}, but the model has {num_layers} "
                                 "layers; the checkpoint does not match config.json")
            t = handle.get_tensor(name)
            if t.numel() != 1:
                raise ValueError(f"KV scale {name!r} in {file} has shape {tuple(t.shape)}; only per-tensor (one "
                                 "scalar per layer) FP8 KV scales are supported")
            val = float(t.float().reshape(()))
            if not (math.isfinite(val) and val > 0.0):
                raise ValueError(f"KV scale {name!r} in {file} is {val}; FP8 KV scales must be finite and > 0")
            if which == "k" or (which == "kv" and k[layer] is None):  # a K/V-specific name wins over kv_scale
                k[layer] = val
            if which == "v" or (which == "kv" and v[layer] is None):
                v[layer] = val
            found += 1
    if not found:
        return None
    missing = [i for i in range(num_layers) if k[i] is None and v[i] is None]
    if missing:
        logger.warning("the checkpoint has FP8 KV scales, but none for layers %s: those use 1.0", missing)
    ks = tuple(a if a is not None else (b if b is not None else 1.0) for a, b in zip(k, v))
    vs = tuple(b if b is not None else (a if a is not None else 1.0) for a, b in zip(k, v))
    return KVScales(ks, vs, "checkpoint")


def kv_scales_for(load_format: str, files_of, num_layers: int, kv_dtype_name: str) -> KVScales:
    """The scales an FP8 KV cache uses: the checkpoint's (:func:`read_kv_scales`), else 1.0 for every layer (SGLang's
    default; a warning for ``fp8_e4m3``, whose range is narrow, as vLLM and SGLang warn). ``files_of``: a callable
    returning the checkpoint files (not called for ``--load-format dummy``, whose scales are 1.0)."""
    scales = None if load_format == "dummy" else read_kv_scales(files_of(), num_layers)
    if scales is not None:
        return scales
    if kv_dtype_name == "fp8_e4m3" and load_format != "dummy":
        logger.warning("--kv-cache-dtype fp8_e4m3 without k_scale/v_scale in the checkpoint: using scale 1.0 for "
                       "every layer, which may cost accuracy (K/V beyond +-448 saturate)")
    return KVScales.unit(num_layers)
