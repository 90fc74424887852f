"""RMSNorm, with the fused "add residual then normalize" form the decoder layers use.

Reference: Zhang & Sennrich, "Root Mean Square Layer Normalization" (NeurIPS 2019), eq. 4.
The fused add + RMSNorm semantics below are the contract that faster kernels
(e.g. the TokenWeave fused AllReduce + residual + RMSNorm) must reproduce.
"""

from __future__ import annotations

import logging
from typing import Optional, Union

import torch
from torch import nn

logger = logging.getLogger(__name__)


def rmsnorm_ref(
    x: torch.Tensor, w: torch.Tensor, eps: float, residual: Optional[torch.Tensor] = None
) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """Torch reference of (fused add +) RMSNorm.

    Args:
        x: [..., H], any float dtype, any device.
        w: [H] weight (any float dtype; used in fp32).
        eps: added to the mean square before the reciprocal square root.
        residual: optional [..., H] tensor of x's shape.
    Returns:
        Without ``residual``: ``y = x / sqrt(mean(x^2) + eps) * w`` in x.dtype.
        With ``residual``: ``(y(s), s)`` where ``s = x + residual`` rounded to
        x.dtype (the new residual stream) and ``y(s)`` is the norm of that
        rounded sum; so ``rmsnorm_ref(x, w, eps, r)[0] == rmsnorm_ref(x + r, w, eps)``
        exactly. The sum of squares, the normalization and the weight multiply
        run in fp32; the result is cast to x.dtype once at the end.
    Raises:
        ValueError: last dims of x, w (or residual) disagree.
    """
    if x.shape[-1] != w.shape[-1]:
        raise ValueError(f"rmsnorm: x last dim {x.shape[-1]} != weight size {w.shape[-1]}")
    if residual is not None:
        if residual.shape != x.shape:
            raise ValueError(f"rmsnorm: residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
        s = (x.float() + residual.float()).to(x.dtype)
        return rmsnorm_ref(s, w, eps), s
    xf = x.float()
    inv = torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (xf * inv * w.float()).to(x.dtype)


class RMSNorm(nn.Module):
    """RMSNorm over the last dim with a learned weight ``[hidden_size]``.

    Args:
        hidden_size: normalized size H.
        eps: numerical epsilon (HF ``rms_norm_eps``).
        params_dtype: weight dtype (default: torch's default dtype).
        comm: tensor parallelism's fused path. When set, ``forward(x, residual)`` treats ``x`` as this
            rank's *partial sum* (the output of a ``RowParallelLinear``/``FusedMoE`` built with
            ``reduce_results=False``) and returns ``comm.all_reduce_add_rmsnorm(x, residual, weight, eps)``:
            AllReduce + residual add + RMSNorm in one call (TokenWeave, Gond et al. 2025, sec. 3.3), so a
            fused kernel can replace the three steps without touching model code. ``forward(x)``
            without a residual never communicates (its input is already complete).
    ``forward(x [.., H])`` -> normed x; ``forward(x, residual)`` -> ``(normed(x + residual), x + residual)``;
    see :func:`rmsnorm_ref` for the exact numerics.
    Kernels: on CUDA tensors both forms run the fused Triton kernels of :mod:`sglang.srt.layers.ops`, and
    ``forward(x, residual)`` then works *in place*: the results are written into ``x`` and ``residual``
    and returned (callers use the returned tensors and do not reuse the inputs). Elsewhere (CPU) the torch
    reference :func:`rmsnorm_ref` returns new tensors.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, params_dtype: Optional[torch.dtype] = None,
                 comm=None):
        super().__init__()
        self.hidden_size = hidden_size
        self.eps = eps
        self.comm = comm
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=params_dtype), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        """x ``[..., H]`` -> normed x, or with ``residual`` -> ``(normed(x + residual), x + residual)`` (fused
        all-reduce first when ``comm`` is set); see the class docstring for in-place behaviour."""
        if residual is not None and self.comm is not None:
            return self.comm.all_reduce_add_rmsnorm(x, residual, self.weight, self.eps)
        if residual is None:
            return ops.rmsnorm(x, self.weight, self.eps)
        if x.is_cuda:
            return ops.fused_add_rmsnorm(x, residual, self.weight, self.eps)
        return rmsnorm_ref(x, self.weight, self.eps, residual)

    def extra_repr(self) -> str:
        """Hidden size, eps and whether the all-reduce is fused, for ``repr``."""
        return f"{self.hidden_size}, eps={self.eps}{', fused all-reduce' if self.comm is not None else ''}"


# ops dispatches to this module's reference, so it is imported after the reference is defined.
from sglang.srt.layers import ops  # noqa: E402
