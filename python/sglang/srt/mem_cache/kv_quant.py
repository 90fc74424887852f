"""KV cache storage formats (``--kv-cache-dtype``): the accepted names, the storage dtype they resolve to, per-layer FP8
scales, and the torch reference of how K/V are quantized into and dequantized out of an FP8 cache.

FP8 formats: E4M3 (4 exponent, 3 mantissa bits, largest finite 448, no infinities) and E5M2 (5/2 bits, largest
finite 57344), Micikevicius et al., "FP8 Formats for Deep Learning" (2022), sec. 3 and Table 1. As in vLLM and SGLang,
one FP32 scale per attention layer for K and one for V ("per-tensor" scaling, sec. 4 of the paper): a value ``x`` is
stored as ``fp8(clamp(x / s, -max, max))`` and read as ``fp8_value * s``. The scales come from the checkpoint
(``k_scale`` / ``v_scale`` tensors, see :mod:`sglang.srt.model_loader.kv_scales`), else 1.0 (SGLang's default; the
values are then only rounded and saturated, which suits models whose K/V stay well inside the FP8 range).

Rounding, the one definition every path follows (pool stores, the fused RoPE + KV-store kernel, the torch reference):
``q = fp8_rne(clamp(fp32(x) * fp32(1 / s), -max, max))`` with round-to-nearest-even and saturation to the largest
finite value (Hopper's ``cvt.rn.satfinite``); a plain cast would turn E4M3 overflow into NaN.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

#: ``--kv-cache-dtype`` values SGLang's ``launch_server`` accepts (its argparse choices).
SGLANG_KV_CACHE_DTYPES = ("auto", "fp8_e5m2", "fp8_e4m3", "mxfp8", "bf16", "bfloat16", "nvfp4", "fp4_mx_block16",
                          "fp4_e2m1")
#: The values this server implements (the others are refused before any worker starts).
SUPPORTED_KV_CACHE_DTYPES = ("auto", "bf16", "bfloat16", "fp8_e4m3", "fp8_e5m2")

_FP8_BY_NAME = {"fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}
#: FP8 storage dtypes an FP8 KV cache may use (those this torch build has).
FP8_KV_DTYPES = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n))


def check_kv_cache_dtype(name: str) -> None:
    """Refuse a ``--kv-cache-dtype`` this server cannot serve.

    Raises:
        ValueError: ``name`` is one of SGLang's other formats (MXFP8, NVFP4, FP4) or unknown; the message names the
            value and the supported ones.
    """
    if name in SUPPORTED_KV_CACHE_DTYPES:
        if name in _FP8_BY_NAME and not hasattr(torch, _FP8_BY_NAME[name]):
            raise ValueError(f"--kv-cache-dtype={name!r} needs torch.{_FP8_BY_NAME[name]} (torch >= 2.1); this "
                             f"torch {torch.__version__} lacks it; use auto or bf16")
        return
    what = "is not supported here" if name in SGLANG_KV_CACHE_DTYPES else "is unknown"
    raise ValueError(f"--kv-cache-dtype={name!r} {what}; use one of {', '.join(SUPPORTED_KV_CACHE_DTYPES)}")


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The KV cache's storage dtype for ``--kv-cache-dtype name``: ``auto`` = the model's compute dtype (SGLang's
    meaning), ``bf16`` / ``bfloat16`` = ``torch.bfloat16``, ``fp8_e4m3`` = ``torch.float8_e4m3fn``, ``fp8_e5m2`` =
    ``torch.float8_e5m2``.

    Raises:
        ValueError: an unsupported or unknown name (:func:`check_kv_cache_dtype`).
    """
    check_kv_cache_dtype(name)
    if name == "auto":
        return model_dtype
    if name in ("bf16", "bfloat16"):
        return torch.bfloat16
    return getattr(torch, _FP8_BY_NAME[name])


def is_fp8(dtype: torch.dtype) -> bool:
    """True for the FP8 storage dtypes of :data:`FP8_KV_DTYPES`."""
    return dtype in FP8_KV_DTYPES


def fp8_max(dtype: torch.dtype) -> float:
    """Largest finite value of an FP8 dtype (448 for E4M3, 57344 for E5M2); ValueError for other dtypes."""
    if not is_fp8(dtype):
        raise ValueError(f"{dtype} is not an FP8 KV dtype ({FP8_KV_DTYPES})")
    return float(torch.finfo(dtype).max)


@dataclass(frozen=True)
class KVScales:
    """Per-layer FP8 scales of the K and V caches (``k[l]``, ``v[l]``: FP32-representable positive floats, one per
    attention layer held by this worker, layer order) and where they came from (``source``: ``"checkpoint"`` or
    ``"default"`` = 1.0).

    Raises (``__post_init__``): ValueError when the tuples differ in length or hold a non-finite or non-positive
    value.
    """

    k: tuple[float, ...]
    v: tuple[float, ...]
    source: str = "default"

    def __post_init__(self) -> None:
        if len(self.k) != len(self.v):
            raise ValueError(f"KVScales: {len(self.k)} K scales but {len(self.v)} V scales")
        for name, vals in (("k", self.k), ("v", self.v)):
            bad = [(i, s) for i, s in enumerate(vals) if not (math.isfinite(s) and s > 0.0)]
            if bad:
                raise ValueError(f"KVScales: {name}_scale of layer {bad[0][0]} is {bad[0][1]}; FP8 KV scales must be "
                                 "finite and > 0")

    @classmethod
    def unit(cls, num_layers: int) -> "KVScales":
        """1.0 for every layer (SGLang's default when the checkpoint has none)."""
        return cls((1.0,) * num_layers, (1.0,) * num_layers, "default")

    @property
    def num_layers(self) -> int:
        """Layers covered."""
        return len(self.k)

    @property
    def is_unit(self) -> bool:
        """Every scale is 1.0."""
        return all(s == 1.0 for s in self.k + self.v)


def quantize_kv(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Torch reference of the KV-cache store: ``x`` (any float dtype and shape, any device) as ``dtype``.

    FP8 ``dtype``: ``fp8_rne(clamp(fp32(x) * fp32(1 / scale), -max, max))`` (module doc); other dtypes: a plain cast
    (``scale`` must then be 1.0). Returns a new tensor of ``x``'s shape in ``dtype``.

    Raises:
        ValueError: ``scale`` is not finite and positive, or not 1.0 for a non-FP8 dtype.
    """
    if not (math.isfinite(scale) and scale > 0.0):
        raise ValueError(f"quantize_kv: scale={scale} must be finite and > 0")
    if not is_fp8(dtype):
        if scale != 1.0:
            raise ValueError(f"quantize_kv: scale={scale} given for the unscaled KV dtype {dtype}")
        return x.to(dtype)
    y = x.float()
    if scale != 1.0:
        y = y * (1.0 / scale)
    lim = fp8_max(dtype)
    return y.clamp(-lim, lim).to(dtype)


def dequantize_kv(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Torch reference of reading the KV cache: ``x`` (the cache dtype) as ``dtype``; FP8 values are widened to FP32,
    multiplied by ``scale`` and rounded to ``dtype`` (FP8 -> FP32 is exact). Non-FP8 ``x``: a cast (``scale`` 1.0)."""
    if not is_fp8(x.dtype):
        return x.to(dtype)
    y = x.float()
    if scale != 1.0:
        y = y * scale
    return y.to(dtype)


def describe_format(dtype: torch.dtype, scales: Optional[KVScales]) -> str:
    """One log line: the storage dtype and, for FP8, the scale source and range."""
    name = str(dtype).replace("torch.", "")
    if scales is None:
        return name
    vals = scales.k + scales.v
    return f"{name}, per-layer K/V scales from {scales.source} (min {min(vals):.4g}, max {max(vals):.4g})"
