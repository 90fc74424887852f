"""Gated activations of the MLP (SwiGLU: Shazeer, "GLU Variants Improve Transformer", 2020, eq. 6)."""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :I]) * x[..., I:]`` for x ``[..., 2I]`` -> ``[..., I]`` in x.dtype (torch reference).

    Raises:
        ValueError: the last dim of x is odd.
    """
    d = x.shape[-1]
    if d % 2:
        raise ValueError(f"SiluAndMul expects an even last dim (gate and up halves), got {d}")
    return F.silu(x[..., : d // 2]) * x[..., d // 2:]


class SiluAndMul(nn.Module):
    """SwiGLU activation: x ``[N, 2I]`` (gate then up, as MergedColumnParallelLinear packs them) -> ``[N, I]``.

    Runs :func:`sglang.srt.layers.ops.silu_and_mul` (a Triton kernel on CUDA, :func:`silu_and_mul_ref` elsewhere).
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x ``[N, 2I]`` -> ``silu(gate) * up`` ``[N, I]`` in x's dtype."""
        return ops.silu_and_mul(x)


# ops dispatches to this module's reference, so it is imported after the reference is defined.
from sglang.srt.layers import ops  # noqa: E402
