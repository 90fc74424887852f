"""Gated activations of the MLP (SwiGLU: Shazeer, "GLU Variants Improve Transformer", 2020, eq. 6)."""

from __future__ import annotations

import logging

import torch
from torch import nn

from sglang.srt.layers import ops
from sglang.srt.ops_ref import silu_and_mul_ref  # noqa: F401  (re-exported)

logger = logging.getLogger(__name__)




class SiluAndMul(nn.Module):
    """SwiGLU activation: x ``[N, 2I]`` (gate then up, as MergedColumnParallelLinear packs them) -> ``[N, I]``.

    Runs :func:`sglang.srt.layers.ops.silu_and_mul` (a Triton kernel on CUDA, :func:`silu_and_mul_ref` elsewhere).
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x ``[N, 2I]`` -> ``silu(gate) * up`` ``[N, I]`` in x's dtype."""
        return ops.silu_and_mul(x)


