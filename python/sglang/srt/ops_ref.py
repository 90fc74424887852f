"""Torch reference implementations of the fused per-token ops (the semantics every kernel must match).

This module sits at the bottom of the import graph: it imports only torch, so layers, the op front end
(:mod:`sglang.srt.layers.ops`) and the communicators (:mod:`sglang.srt.distributed.communicator`) can all
use it without importing each other. Sources: RMSNorm (Zhang & Sennrich, NeurIPS 2019, eq. 4), SwiGLU
(Shazeer 2020, eq. 6), top-k softmax routing (Shazeer et al. 2017, sec. 2.1; Mixtral renormalizes the
top-k weights), MoE expert mixing (Shazeer et al. 2017, eq. 1); the deferred split-K sum of a projection that the
next fused add + RMSNorm reduces (decode epilogue fusion, :mod:`sglang.srt.layers.decode_fuse`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple, Union

import torch
import torch.nn.functional as F


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


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :I]) * x[..., I:]`` for x ``[..., 2I]`` -> ``[..., I]`` in x.dtype (torch reference).

    Raises:
        ValueError: the last dim of x is odd.
    """
    d = x.shape[-1]
    if d % 2:
        raise ValueError(f"SiluAndMul expects an even last dim (gate and up halves), got {d}")
    return F.silu(x[..., : d // 2]) * x[..., d // 2:]


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick each token's ``top_k`` experts by softmax probability.

    Args:
        router_logits: [N, E] any float dtype.
        top_k: experts per token, 1 <= top_k <= E.
        renormalize: divide the chosen probabilities by their sum (so they sum to 1).
    Returns:
        topk_weights [N, top_k] fp32 (softmax over all E experts in fp32, then
        optionally renormalized), topk_ids [N, top_k] int64, both on the logits'
        device, ordered by decreasing weight.
    Raises:
        ValueError: top_k outside ``[1, E]`` or logits not 2-D.
    """
    if router_logits.dim() != 2:
        raise ValueError(f"router_logits must be [N, E], got shape {tuple(router_logits.shape)}")
    n_exp = router_logits.shape[1]
    if not 1 <= top_k <= n_exp:
        raise ValueError(f"top_k={top_k} must be in [1, num_experts={n_exp}]")
    probs = torch.softmax(router_logits.float(), dim=-1)
    topk_weights, topk_ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return topk_weights, topk_ids


def fused_moe_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor) -> torch.Tensor:
    """Torch reference of the MoE expert computation.

    Args:
        x: [N, H] activations.
        w13: [E, 2I, H] stacked gate (rows 0..I-1) and up (rows I..2I-1) weights.
        w2: [E, H, I] down weights.
        topk_weights: [N, k] routing weights (any float dtype; used in fp32).
        topk_ids: [N, k] expert ids in ``[0, E)``; a negative id skips its (token, slot) pair (adds 0; expert
            parallelism's padding rows).
    Returns:
        [N, H] in x.dtype: ``sum_j topk_weights[n, j] * expert_{topk_ids[n, j]}(x[n])`` over the non-negative ids.
        Loops over the experts that received tokens and runs each only on its
        tokens; accumulation is in fp32.
    Raises:
        ValueError: inconsistent shapes.
    """
    n, h = x.shape
    e, two_i, h2 = w13.shape
    if h2 != h or w2.shape != (e, h, two_i // 2) or topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != n:
        raise ValueError(f"fused_moe_ref: inconsistent shapes x={tuple(x.shape)} w13={tuple(w13.shape)} "
                         f"w2={tuple(w2.shape)} topk_weights={tuple(topk_weights.shape)} topk_ids={tuple(topk_ids.shape)}")
    out = torch.zeros(n, h, dtype=torch.float32, device=x.device)
    flat_ids = topk_ids.reshape(-1)
    flat_w = topk_weights.reshape(-1).float()
    token_of = torch.arange(n, device=x.device).repeat_interleave(topk_ids.shape[1])
    for expert in torch.unique(flat_ids).tolist():
        if expert < 0:
            continue
        sel = (flat_ids == expert).nonzero(as_tuple=True)[0]
        tok = token_of[sel]
        gate_up = F.linear(x[tok], w13[expert])
        gate, up = gate_up.chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w2[expert])
        out.index_add_(0, tok, y.float() * flat_w[sel].unsqueeze(1))
    return out.to(x.dtype)


@dataclass(frozen=True)
class SplitKPartials:
    """A projection output whose split-K reduce is deferred to the consuming fused add + RMSNorm.

    Attributes:
        parts: [S, M, N] fp32 partial sums (S >= 2), contiguous, on the GEMM's device.
        bias: optional [N] bias (added once, after the sum), or None.
        dtype: the output dtype the unfused GEMM would have returned (bf16/fp16).
    """

    parts: torch.Tensor
    bias: Optional[torch.Tensor]
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        """``[M, N]``, the shape of the materialized output."""
        return self.parts.shape[1:]

    def materialize(self) -> torch.Tensor:
        """The output ``[M, N]`` in :attr:`dtype`: the partials summed in split order from zero in fp32, plus the
        bias, rounded once (the split-K reduce kernel's numerics)."""
        acc = torch.zeros(self.parts.shape[1:], dtype=torch.float32, device=self.parts.device)
        for s in range(self.parts.shape[0]):
            acc = acc + self.parts[s]
        if self.bias is not None:
            acc = acc + self.bias.float()
        return acc.to(self.dtype)


def splitk_add_rmsnorm_ref(p: "SplitKPartials", residual: torch.Tensor, weight: torch.Tensor, eps: float
                           ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of the fused reduce + add + RMSNorm: ``rmsnorm_ref(p.materialize(), weight, eps, residual)``
    -> ``(normed [M, N], new residual [M, N])``, new tensors in residual's dtype."""
    return rmsnorm_ref(p.materialize(), weight, eps, residual)
