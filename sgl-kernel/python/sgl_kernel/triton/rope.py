"""Rotary position embedding applied in place to q and k by one Triton kernel.

Reference: Su et al., "RoFormer" (2021), sec. 3.4. Semantics match
:class:`sglang.srt.layers.rotary_embedding.RotaryEmbedding`: the first ``rotary_dim`` dims of
every head are rotated in fp32 with ``cos``/``sin`` read from a ``[max_pos, rotary_dim]`` fp32
cache (cos half, then sin half) and rounded back to the input dtype; the other dims pass through.
Neox style pairs dim i with i + rotary_dim/2; GPT-J style pairs dims 2i and 2i+1.
One program handles all q and k heads of one token, so cos/sin are loaded once per token.
"""

from __future__ import annotations

import logging

import torch
import triton
import triton.language as tl

from sgl_kernel.triton.common import check_cuda_or_interpret, next_pow2

logger = logging.getLogger(__name__)


@triton.jit
def _rotate_heads(X, row, stride_x, num_heads, cos, sin, offs_i, mask_i,
                  HEAD_DIM: tl.constexpr, HALF: tl.constexpr, NEOX: tl.constexpr, BLOCK_H: tl.constexpr):
    offs_h = tl.arange(0, BLOCK_H)
    mask = (offs_h < num_heads)[:, None] & mask_i[None, :]
    base = X + row * stride_x + offs_h[:, None] * HEAD_DIM
    if NEOX:
        p1 = base + offs_i[None, :]
        p2 = base + HALF + offs_i[None, :]
    else:
        p1 = base + 2 * offs_i[None, :]
        p2 = base + 2 * offs_i[None, :] + 1
    x1 = tl.load(p1, mask=mask, other=0.0)
    x2 = tl.load(p2, mask=mask, other=0.0)
    x1f = x1.to(tl.float32)
    x2f = x2.to(tl.float32)
    o1 = x1f * cos[None, :] - x2f * sin[None, :]
    o2 = x2f * cos[None, :] + x1f * sin[None, :]
    tl.store(p1, o1.to(x1.dtype), mask=mask)
    tl.store(p2, o2.to(x2.dtype), mask=mask)


@triton.jit
def _rope_kernel(Pos, Q, K, Cache, stride_q, stride_k, stride_c, num_q_heads, num_k_heads,
                 HEAD_DIM: tl.constexpr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, NEOX: tl.constexpr,
                 BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    pos = tl.load(Pos + row).to(tl.int64)
    offs_i = tl.arange(0, BLOCK_HALF)
    mask_i = offs_i < HALF
    cos = tl.load(Cache + pos * stride_c + offs_i, mask=mask_i, other=0.0).to(tl.float32)
    sin = tl.load(Cache + pos * stride_c + HALF + offs_i, mask=mask_i, other=0.0).to(tl.float32)
    _rotate_heads(Q, row, stride_q, num_q_heads, cos, sin, offs_i, mask_i, HEAD_DIM, HALF, NEOX, BLOCK_HQ)
    _rotate_heads(K, row, stride_k, num_k_heads, cos, sin, offs_i, mask_i, HEAD_DIM, HALF, NEOX, BLOCK_HK)


def apply_rope(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor,
               head_dim: int, is_neox_style: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k in place; returns ``(q, k)``.

    Args:
        positions: [N] integer positions in ``[0, max_pos)`` (not checked on the device).
        q: [N, num_q_heads * head_dim]; k: [N, num_k_heads * head_dim]; fp16/bf16/fp32, each row's
            elements contiguous (row stride free, e.g. views into a fused qkv tensor).
        cos_sin_cache: [max_pos, rotary_dim] fp32 (cos half then sin half), rotary_dim even, <= head_dim.
        head_dim: per-head size.
        is_neox_style: pairing of rotated dims (see the module docstring).
    Raises:
        ValueError: shapes disagree, or CPU tensors outside the Triton interpreter.
    """
    check_cuda_or_interpret(positions, q, k, cos_sin_cache, what="apply_rope")
    rot = cos_sin_cache.shape[-1]
    n = positions.shape[0]
    if (cos_sin_cache.dim() != 2 or rot % 2 or rot > head_dim or q.dim() != 2 or k.dim() != 2
            or q.shape[0] != n or k.shape[0] != n or q.shape[1] % head_dim or k.shape[1] % head_dim
            or q.stride(-1) != 1 or k.stride(-1) != 1 or cos_sin_cache.stride(-1) != 1):
        raise ValueError(f"apply_rope: positions {tuple(positions.shape)}, q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"cos_sin_cache {tuple(cos_sin_cache.shape)}, head_dim={head_dim} are inconsistent "
                         "(need [N], [N, h*head_dim] rows contiguous, [max_pos, even rotary_dim <= head_dim])")
    if n == 0:
        return q, k
    nq, nk = q.shape[1] // head_dim, k.shape[1] // head_dim
    half = rot // 2
    _rope_kernel[(n,)](positions, q, k, cos_sin_cache, q.stride(0), k.stride(0), cos_sin_cache.stride(0), nq, nk,
                       HEAD_DIM=head_dim, HALF=half, BLOCK_HALF=max(2, next_pow2(half)), NEOX=is_neox_style,
                       BLOCK_HQ=max(2, next_pow2(nq)), BLOCK_HK=max(2, next_pow2(nk)), num_warps=4)
    return q, k
