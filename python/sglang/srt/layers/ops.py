"""Fused per-token ops with one front end: Triton kernels on CUDA tensors, torch references elsewhere.

Each function runs the kernel of :mod:`sglang.srt.layers.triton_ops` when its main tensor is
on CUDA and ``triton`` imports; otherwise (CPU, or no Triton) the torch reference of the layer
module that defines the op's semantics. Results agree within the rounding of the input dtype.
Kernel modules are imported lazily, on the first CUDA call.
"""

from __future__ import annotations

import functools
import importlib
import logging
from typing import Optional

import torch

from sglang.srt.ops_ref import (SplitKPartials, fused_moe_ref, rmsnorm_ref, select_experts, silu_and_mul_ref,
                                 splitk_add_rmsnorm_ref)

logger = logging.getLogger(__name__)


@functools.lru_cache(maxsize=None)
def _kernels(name: str):
    """The Triton kernel module ``sglang.srt.layers.triton_ops.<name>``, or None when triton is unusable."""
    try:
        return importlib.import_module(f"sglang.srt.layers.triton_ops.{name}")
    except ImportError as e:  # no triton: every op keeps its torch reference
        logger.warning("Triton kernels unavailable (%s); using torch references", e)
        return None


def _triton(t: torch.Tensor, name: str):
    return _kernels(name) if t.is_cuda else None


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x [..., H] with weight [H] -> new tensor in x.dtype (see :func:`~sglang.srt.layers.layernorm.rmsnorm_ref`)."""
    k = _triton(x, "fused_add_rmsnorm")
    if k is None:
        return rmsnorm_ref(x, weight, eps)
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    return k.rmsnorm(x2 if x2.stride(-1) == 1 else x2.contiguous(), weight, eps).view(shape)


def fused_add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """In place: ``residual += x`` (rounded to x.dtype), ``x = rmsnorm(residual) * weight``; returns ``(x, residual)``.

    Args:
        x, residual: [..., H] same shape and dtype, contiguous (both are overwritten); weight: [H].
    Raises:
        ValueError: shapes disagree.
    """
    if residual.shape != x.shape:
        raise ValueError(f"fused_add_rmsnorm: residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
    k = _triton(x, "fused_add_rmsnorm")
    if k is None or not (x.is_contiguous() and residual.is_contiguous()):
        y, s = rmsnorm_ref(x, weight, eps, residual)
        residual.copy_(s)
        x.copy_(y)
        return x, residual
    h = x.shape[-1]
    k.fused_add_rmsnorm(x.view(-1, h), residual.view(-1, h), weight, eps)
    return x, residual


def apply_rope_ref(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor,
                   head_dim: int, is_neox_style: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of RoPE (the math of :class:`~sglang.srt.layers.rotary_embedding.RotaryEmbedding`).

    Args as :func:`apply_rope`. Returns new rotated ``(q, k)`` (inputs untouched), same shapes and dtypes.
    """
    rot = cos_sin_cache.shape[-1]
    cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        """Rotate the first ``rot`` dims of every head of x ``[N, heads*head_dim]`` (computed in fp32, returned in x's
        dtype)."""
        n = x.shape[0]
        x = x.reshape(n, -1, head_dim)
        r = x[..., :rot].float()
        x1, x2 = r.chunk(2, dim=-1) if is_neox_style else (r[..., 0::2], r[..., 1::2])
        o1, o2 = x1 * c - x2 * s, x2 * c + x1 * s
        out = torch.cat([o1, o2], dim=-1) if is_neox_style else torch.stack([o1, o2], dim=-1).flatten(-2)
        out = torch.cat([out.to(x.dtype), x[..., rot:]], dim=-1)
        return out.reshape(n, -1)

    return rotate(q), rotate(k)


def apply_rope(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor,
               head_dim: int, is_neox_style: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k in place by their positions; returns ``(q, k)``.

    Args:
        positions: [N] int64; q: [N, nq*head_dim]; k: [N, nk*head_dim] (rows may be strided views).
        cos_sin_cache: [max_pos, rotary_dim] fp32, cos half then sin half (``RotaryEmbedding.cos_sin_cache``).
        is_neox_style: True pairs dims (i, i + rotary_dim/2); False pairs (2i, 2i+1) (GPT-J).
    Raises:
        ValueError: shapes disagree (Triton path).
    """
    kern = _triton(q, "rope")
    if kern is None or q.stride(-1) != 1 or k.stride(-1) != 1:
        rq, rk = apply_rope_ref(positions, q, k, cos_sin_cache, head_dim, is_neox_style)
        q.copy_(rq)
        k.copy_(rk)
        return q, k
    return kern.apply_rope(positions, q, k, cos_sin_cache, head_dim, is_neox_style)


def rope_and_store_kv_ref(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          cos_sin_cache: torch.Tensor, head_dim: int, is_neox_style: bool, k_buf: torch.Tensor,
                          v_buf: torch.Tensor, loc: torch.Tensor, k_scale: float = 1.0,
                          v_scale: float = 1.0) -> torch.Tensor:
    """Torch reference of :func:`rope_and_store_kv`: :func:`apply_rope_ref`, q overwritten with its rotation, then
    ``k_buf[loc] = rotated k`` and ``v_buf[loc] = v`` (each rounded to its own dtype, then cast to the buffer's; FP8
    buffers quantized with ``k_scale`` / ``v_scale`` by :func:`~sglang.srt.mem_cache.kv_quant.quantize_kv`).
    k and v are not modified. Returns q."""
    from sglang.srt.mem_cache.kv_quant import quantize_kv

    rq, rk = apply_rope_ref(positions, q, k, cos_sin_cache, head_dim, is_neox_style)
    q.copy_(rq)
    nkv = k_buf.shape[1]
    k_buf[loc] = quantize_kv(rk.reshape(-1, nkv, head_dim), k_scale, k_buf.dtype)
    v_buf[loc] = quantize_kv(v.reshape(-1, nkv, head_dim), v_scale, v_buf.dtype)
    return q


def rope_and_store_kv(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      cos_sin_cache: torch.Tensor, head_dim: int, is_neox_style: bool, k_buf: torch.Tensor,
                      v_buf: torch.Tensor, loc: torch.Tensor, k_scale: float = 1.0,
                      v_scale: float = 1.0) -> torch.Tensor:
    """RoPE on q (in place) and k, and the KV-cache store of rotated k and v into slots ``loc``, in one kernel on CUDA
    (:func:`sgl_kernel.triton.rope_kv_store.rope_and_store_kv`, whose docstring gives shapes and dtypes; FP8 buffers
    are quantized with the layer's ``k_scale`` / ``v_scale`` inside the kernel); the torch reference
    :func:`rope_and_store_kv_ref` elsewhere or for rows that are not contiguous. Returns q.
    Raises:
        ValueError: shapes disagree (Triton path).
    """
    kern = _triton(q, "rope_kv_store")
    if kern is None or q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        return rope_and_store_kv_ref(positions, q, k, v, cos_sin_cache, head_dim, is_neox_style, k_buf, v_buf, loc,
                                     k_scale, v_scale)
    return kern.rope_and_store_kv(positions, q, k, v, cos_sin_cache, head_dim, is_neox_style, k_buf, v_buf, loc,
                                  k_scale, v_scale)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, skinny: bool = False,
           table=None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, or the weight-streaming Triton GEMM
    (:func:`sgl_kernel.triton.skinny_gemm.skinny_gemm`) for a 2-D CUDA bf16/fp16 ``x`` with contiguous rows when
    ``table`` (a :class:`~sglang.srt.layers.decode_gemm.DecodeGemmTable` measured on this device) names a config for
    this (shape, row count), or with ``skinny=True`` (the fixed default config, 1..16 rows). x ``[..., in]``, weight
    ``[out, in]``, bias ``[out]`` -> ``[..., out]`` in x's dtype."""
    if (skinny or table is not None) and x.dim() == 2 and x.dtype in (torch.bfloat16, torch.float16) \
            and x.dtype == weight.dtype and x.stride(-1) == 1 and weight.stride(-1) == 1:
        cfg = table.lookup(weight.shape[0], weight.shape[1], x.dtype, x.shape[0]) if table is not None else None
        if cfg is not None or (skinny and 1 <= x.shape[0] <= 16):
            kern = _triton(x, "skinny_gemm")
            if kern is not None:
                return kern.skinny_gemm(x, weight, bias, **(cfg.kwargs() if cfg is not None else {}))
    return torch.nn.functional.linear(x, weight, bias)


def _skinny_ok(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return x.dim() == 2 and x.shape[0] >= 1 and x.dtype in (torch.bfloat16, torch.float16) \
        and x.dtype == weight.dtype and x.stride(-1) == 1 and weight.stride(-1) == 1


def linear_deferred(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], table):
    """:func:`linear` for a projection whose output feeds a fused add + RMSNorm (decode epilogue fusion,
    :mod:`sglang.srt.layers.decode_fuse`): where ``table`` names a skinny config with split-K > 1 for this (shape,
    rows) on CUDA, the GEMM's fp32 partials come back as a
    :class:`~sglang.srt.layers.decode_fuse.SplitKPartials` (the reduce runs inside the norm); otherwise exactly
    :func:`linear`'s tensor ``[M, out]``."""
    cfg = table.lookup(weight.shape[0], weight.shape[1], x.dtype, x.shape[0]) \
        if table is not None and _skinny_ok(x, weight) else None
    if cfg is not None and cfg.split_k > 1:
        kern = _triton(x, "skinny_gemm")
        if kern is not None:
            out = kern.skinny_gemm_partials(x, weight, bias, **cfg.kwargs())
            if out.dim() == 3:
                return SplitKPartials(out, bias, x.dtype)
            return out
    return linear(x, weight, bias, table=table)


def gate_up_silu(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], table) -> Optional[torch.Tensor]:
    """The gate_up projection with SiLU-and-mul in the skinny GEMM's epilogue (a decode fusion): x ``[M, K]``, weight
    ``[2I, K]`` -> ``silu(gate) * up`` ``[M, I]`` in x's dtype, when ``table`` names a split-K 1 skinny config for
    this (shape, rows) on CUDA; else None (the caller runs the GEMM and :func:`silu_and_mul`)."""
    cfg = table.lookup(weight.shape[0], weight.shape[1], x.dtype, x.shape[0]) \
        if table is not None and _skinny_ok(x, weight) else None
    if cfg is None or cfg.split_k != 1:
        return None
    kern = _triton(x, "decode_fuse")
    return None if kern is None else kern.skinny_gemm_silu(x, weight, bias, **cfg.kwargs())


def splitk_add_rmsnorm(p, residual: torch.Tensor, weight: torch.Tensor, eps: float
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum the deferred split-K partials ``p`` (a :class:`~sglang.srt.layers.decode_fuse.SplitKPartials`, [S, M, H])
    into the fused add + RMSNorm: ``residual = sum(p) + residual`` (in place on the kernel path), returns
    ``(normed [M, H], residual)`` -- one kernel on CUDA (:func:`sgl_kernel.triton.decode_fuse.splitk_add_rmsnorm`),
    the torch reference elsewhere. Raises ValueError when shapes disagree."""
    if tuple(p.shape) != tuple(residual.shape[-2:]) or residual.dim() != 2:
        raise ValueError(f"splitk_add_rmsnorm: partials of shape {tuple(p.shape)} vs residual "
                         f"{tuple(residual.shape)}: need a 2-D residual of the same shape")
    k = _triton(residual, "decode_fuse")
    if k is None or not residual.is_contiguous():
        y, s = splitk_add_rmsnorm_ref(p, residual, weight, eps)
        residual.copy_(s)
        return y, residual
    return k.splitk_add_rmsnorm(p.parts, p.bias, residual, weight, eps), residual


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :I]) * x[..., I:]`` for x [..., 2I] -> [..., I] in x.dtype."""
    k = _triton(x, "activation")
    if k is None:
        return silu_and_mul_ref(x)
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    y = k.silu_and_mul(x2 if x2.stride(-1) == 1 else x2.contiguous())
    return y.view(*shape[:-1], shape[-1] // 2)


def fused_topk(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k softmax routing; same contract as :func:`~sglang.srt.layers.moe.router.select_experts`
    (weights [N, k] fp32, ids [N, k] int64, by decreasing weight)."""
    k = _triton(router_logits, "moe")
    if k is None or router_logits.dim() != 2:
        return select_experts(router_logits, top_k, renormalize)
    return k.fused_topk(router_logits.contiguous(), top_k, renormalize)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """MoE experts; same contract as :func:`~sglang.srt.layers.moe.fused_moe.fused_moe_ref` ([N, H] in x.dtype).

    ``out``: optional [N, H] tensor the result is copied into (returned).
    """
    k = _triton(x, "moe")
    y = fused_moe_ref(x, w13, w2, topk_weights, topk_ids) if k is None else \
        k.fused_moe(x, w13, w2, topk_weights, topk_ids)
    if out is None:
        return y
    out.copy_(y)
    return out
