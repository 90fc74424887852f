"""Rotary position embedding (RoPE) with precomputed fp32 cos/sin caches.

References: Su et al., "RoFormer" (2021), sec. 3.4 (rotation of dimension pairs);
linear position interpolation: Chen et al., "Extending Context Window of Large
Language Models via Positional Interpolation" (2023), sec. 2.2; Llama-3 frequency
scaling: Meta, "The Llama 3 Herd of Models" (2024) / the Llama 3.1 release
(per-frequency interpolation between ``low_freq_factor`` and ``high_freq_factor``).

Supported ``rope_type``: "default", "linear", "llama3". Others ("dynamic",
"yarn", "longrope", ...) raise ValueError: dynamic NTK as HF implements it
changes frequencies with the current sequence length, which a fixed cache
cannot reproduce.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Optional

import torch
from torch import nn

from sglang.srt.layers import ops

logger = logging.getLogger(__name__)

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def default_inv_freq(rotary_dim: int, base: float) -> torch.Tensor:
    """``base ** (-2i / rotary_dim)`` for i in ``0 .. rotary_dim/2 - 1``: [rotary_dim/2] fp32 (RoFormer eq. 15)."""
    return 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64, device="cpu").float() / rotary_dim))


def llama3_inv_freq(inv_freq: torch.Tensor, factor: float, low_freq_factor: float, high_freq_factor: float,
                    original_max_position: int) -> torch.Tensor:
    """Llama-3.1 frequency scaling of ``inv_freq`` [rotary_dim/2] fp32.

    Wavelengths longer than ``original_max_position / low_freq_factor`` are
    divided by ``factor`` (interpolated), shorter than
    ``original_max_position / high_freq_factor`` kept, and those between
    blended linearly in ``original_max_position / wavelength``.
    """
    if high_freq_factor == low_freq_factor:
        raise ValueError("llama3 rope scaling needs high_freq_factor != low_freq_factor")
    wavelen = 2 * math.pi / inv_freq
    low_wavelen = original_max_position / low_freq_factor
    high_wavelen = original_max_position / high_freq_factor
    smooth = (original_max_position / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = torch.where(wavelen > low_wavelen, inv_freq / factor, blended)
    return torch.where(wavelen < high_wavelen, inv_freq, out)


class RotaryEmbedding(nn.Module):
    """Applies RoPE to the first ``rotary_dim`` dims of every head of q and k.

    Args:
        head_dim: per-head size; rotary_dim: rotated dims (<= head_dim, even).
        max_position: cache length; positions must be in ``[0, max_position)``.
        inv_freq: [rotary_dim/2] fp32 inverse frequencies.
        is_neox_style: True pairs dim i with i + rotary_dim/2 (Llama/Qwen/HF
            "rotate_half"); False pairs adjacent dims (2i, 2i+1) (GPT-J).
    Buffer ``cos_sin_cache`` [max_position, rotary_dim] fp32 (cos half, then
    sin half), non-persistent, on the default device at construction.
    """

    def __init__(self, head_dim: int, rotary_dim: int, max_position: int, inv_freq: torch.Tensor,
                 is_neox_style: bool = True):
        super().__init__()
        if rotary_dim % 2 or rotary_dim > head_dim:
            raise ValueError(f"rotary_dim={rotary_dim} must be even and <= head_dim={head_dim}")
        self.head_dim, self.rotary_dim, self.max_position = head_dim, rotary_dim, max_position
        self.is_neox_style = is_neox_style
        self._inv_freq = inv_freq.detach().float()
        self.register_buffer("cos_sin_cache", self._cache(torch.get_default_device()), persistent=False)

    def _cache(self, device: torch.device) -> torch.Tensor:
        t = torch.arange(self.max_position, dtype=torch.float32, device=device)
        freqs = torch.outer(t, self._inv_freq.to(device))
        return torch.cat([freqs.cos(), freqs.sin()], dim=-1)

    def reset_buffers(self, device: torch.device) -> None:
        """Recompute ``cos_sin_cache`` on ``device`` (after construction on ``meta``; see
        :func:`~sglang.srt.model_loader.role_build.build_for_role`)."""
        self.cos_sin_cache = self._cache(torch.device(device))

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        x = x.view(n, -1, self.head_dim)
        rot = x[..., : self.rotary_dim].float()
        if self.is_neox_style:
            x1, x2 = rot.chunk(2, dim=-1)
        else:
            x1, x2 = rot[..., 0::2], rot[..., 1::2]
        c, s = cos.unsqueeze(1), sin.unsqueeze(1)
        o1, o2 = x1 * c - x2 * s, x2 * c + x1 * s
        out = torch.cat([o1, o2], dim=-1) if self.is_neox_style else torch.stack([o1, o2], dim=-1).flatten(-2)
        if self.rotary_dim < self.head_dim:
            out = torch.cat([out.to(x.dtype), x[..., self.rotary_dim:]], dim=-1)
        return out.to(x.dtype).reshape(n, -1)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [N] int64; q [N, nh*head_dim]; k [N, nkv*head_dim] -> rotated (q, k), same shapes and dtypes.

        The rotation runs in fp32 and is cast back to the input dtype. On CUDA it is the Triton kernel of
        :func:`sglang.srt.layers.ops.apply_rope`, which rotates q and k *in place* and returns them;
        elsewhere new tensors are returned (the torch code below).
        """
        if q.is_cuda:
            return ops.apply_rope(positions, q, k, self.cos_sin_cache, self.head_dim, self.is_neox_style)
        cos, sin = self.cos_sin_cache[positions].chunk(2, dim=-1)
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    def extra_repr(self) -> str:
        """Head and rotary dims, max position and the NeoX flag for ``repr``."""
        return f"head_dim={self.head_dim}, rotary_dim={self.rotary_dim}, max_position={self.max_position}, " \
               f"neox={self.is_neox_style}"


def get_rope(head_dim: int, rotary_dim: int, max_position: int, base: float,
             rope_scaling: Optional[dict[str, Any]] = None, is_neox_style: bool = True) -> RotaryEmbedding:
    """Build a :class:`RotaryEmbedding` for a HF rope config.

    Args:
        rope_scaling: None (plain RoPE) or a HF ``rope_scaling``/``rope_parameters`` dict with
            ``rope_type`` (or ``type``): "default"; "linear" (``factor``); "llama3"
            (``factor``, ``low_freq_factor``, ``high_freq_factor``,
            ``original_max_position_embeddings``).
    Raises:
        ValueError: an unsupported rope type (the message lists the supported
            ones) or missing llama3/linear fields.
    """
    inv_freq = default_inv_freq(rotary_dim, base)
    rope_type = "default"
    if rope_scaling:
        rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope_type={rope_type!r} is not supported; supported rope types: {list(SUPPORTED_ROPE_TYPES)}")
    try:
        if rope_type == "linear":
            inv_freq = inv_freq / float(rope_scaling["factor"])
        elif rope_type == "llama3":
            inv_freq = llama3_inv_freq(inv_freq, float(rope_scaling["factor"]), float(rope_scaling["low_freq_factor"]),
                                       float(rope_scaling["high_freq_factor"]),
                                       int(rope_scaling["original_max_position_embeddings"]))
    except KeyError as e:
        raise ValueError(f"rope_scaling of type {rope_type!r} lacks field {e.args[0]!r}: {rope_scaling}") from None
    return RotaryEmbedding(head_dim, rotary_dim, max_position, inv_freq, is_neox_style)
