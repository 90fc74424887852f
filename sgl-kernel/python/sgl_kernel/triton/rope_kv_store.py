"""RoPE on q and k fused with the KV-cache store of k and v: one Triton kernel per layer instead of a RoPE kernel
plus two indexed stores (``k_buf[loc] = k``, ``v_buf[loc] = v``).

Reference: RoPE as in Su et al., "RoFormer" (2021), sec. 3.4, with the semantics of
:func:`sgl_kernel.triton.rope.apply_rope` (first ``rotary_dim`` dims of each head rotated in fp32 with cos/sin from a
``[max_pos, rotary_dim]`` fp32 cache, rounded to the input dtype; Neox or GPT-J pairing; other dims pass through).
Per token (one program): q is rotated in place (as ``apply_rope`` does); k is rotated in registers and written,
with v, into the pool slot ``loc[token]`` of ``k_buf``/``v_buf`` ``[slots, kv_heads, head_dim]``. The pool layout is
untouched (same slots, same ``[slot, head, dim]`` order), so everything that reads the pool (attention kernels, PD
disaggregation descriptors, HiCache) sees the same bytes as after ``apply_rope`` + ``set_kv_buffer``: the rotated
k is rounded to k's dtype first and only then cast to the pool dtype, exactly as the unfused path does. The
caller's k tensor itself is not modified.
Launched with programmatic dependent launch where :func:`sgl_kernel.triton.common.use_pdl` allows (the default;
``SGLANG_DECODE_PDL=0`` opts out). A variant that loaded k and v before storing q wrote different k bytes
on an H200 (2026-11-27), so it was removed; the loads stay in program order.
"""

from __future__ import annotations

import logging

import torch
import triton
import triton.language as tl

from sgl_kernel.triton.common import check_cuda_or_interpret, next_pow2, use_pdl
from sgl_kernel.triton.rope import _rotate_heads

logger = logging.getLogger(__name__)


@triton.jit
def _rope_kv_store_kernel(Pos, Q, K, V, Cache, K_buf, V_buf, Loc,
                          stride_q, stride_k, stride_v, stride_c, stride_kbt, stride_kbh, stride_vbt, stride_vbh,
                          num_q_heads, num_kv_heads, k_scale_inv, v_scale_inv,
                          HEAD_DIM: tl.constexpr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
                          BLOCK_D: tl.constexpr, NEOX: tl.constexpr, BLOCK_HQ: tl.constexpr,
                          BLOCK_HK: tl.constexpr, PASS_THROUGH: tl.constexpr, USE_GDC: tl.constexpr = False,
                          QUANT_MAX: tl.constexpr = 0.0):
    # USE_GDC: launched with programmatic dependent launch; wait for the previous kernel before any memory access,
    # then let the next kernel launch (and prefetch its weights) while this one runs.
    # QUANT_MAX > 0: the pool is FP8 with that largest finite value; K (V) is stored as
    # fp8(clamp(fp32(rounded value) * k_scale_inv, -QUANT_MAX, QUANT_MAX)) (sglang.srt.mem_cache.kv_quant).
    if USE_GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    pos = tl.load(Pos + row).to(tl.int64)
    slot = tl.load(Loc + row).to(tl.int64)
    offs_i = tl.arange(0, BLOCK_HALF)
    mask_i = offs_i < HALF
    offs_h = tl.arange(0, BLOCK_HK)
    mask_h = offs_h < num_kv_heads
    src = K + row * stride_k + offs_h[:, None] * HEAD_DIM
    dst = K_buf + slot * stride_kbt + offs_h[:, None] * stride_kbh
    if NEOX:
        o1 = offs_i[None, :]
        o2 = HALF + offs_i[None, :]
    else:
        o1 = 2 * offs_i[None, :]
        o2 = 2 * offs_i[None, :] + 1
    mask = mask_h[:, None] & mask_i[None, :]
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    mask_v = mask_h[:, None] & mask_d[None, :]
    cos = tl.load(Cache + pos * stride_c + offs_i, mask=mask_i, other=0.0).to(tl.float32)
    sin = tl.load(Cache + pos * stride_c + HALF + offs_i, mask=mask_i, other=0.0).to(tl.float32)
    _rotate_heads(Q, row, stride_q, num_q_heads, cos, sin, offs_i, mask_i, HEAD_DIM, HALF, NEOX, BLOCK_HQ)

    x1 = tl.load(src + o1, mask=mask, other=0.0)
    x2 = tl.load(src + o2, mask=mask, other=0.0)
    x1f = x1.to(tl.float32)
    x2f = x2.to(tl.float32)
    r1 = x1f * cos[None, :] - x2f * sin[None, :]  # same expression as _rotate_heads: same rounding
    r2 = x2f * cos[None, :] + x1f * sin[None, :]
    tl.store(dst + o1, _to_cache(r1.to(x1.dtype), k_scale_inv, K_buf, QUANT_MAX), mask=mask)
    tl.store(dst + o2, _to_cache(r2.to(x2.dtype), k_scale_inv, K_buf, QUANT_MAX), mask=mask)
    if PASS_THROUGH:  # dims [2 * HALF, HEAD_DIM) are not rotated
        mask_p = mask_h[:, None] & (mask_d & (offs_d >= 2 * HALF))[None, :]
        kp = tl.load(src + offs_d[None, :], mask=mask_p, other=0.0)
        tl.store(dst + offs_d[None, :], _to_cache(kp, k_scale_inv, K_buf, QUANT_MAX), mask=mask_p)
    vv = tl.load(V + row * stride_v + offs_h[:, None] * HEAD_DIM + offs_d[None, :], mask=mask_v, other=0.0)
    tl.store(V_buf + slot * stride_vbt + offs_h[:, None] * stride_vbh + offs_d[None, :],
             _to_cache(vv, v_scale_inv, V_buf, QUANT_MAX), mask=mask_v)


@triton.jit
def _to_cache(x, scale_inv, Buf, QUANT_MAX: tl.constexpr):
    """``x`` as the cache's element type: a cast, or for an FP8 cache (``QUANT_MAX > 0``) the scaled, saturated
    round-to-nearest-even conversion of :func:`sglang.srt.mem_cache.kv_quant.quantize_kv`."""
    if QUANT_MAX > 0.0:
        y = x.to(tl.float32) * scale_inv
        y = tl.minimum(tl.maximum(y, -QUANT_MAX), QUANT_MAX)
        return y.to(Buf.dtype.element_ty)
    return x.to(Buf.dtype.element_ty)


_FP8 = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n))


def rope_and_store_kv(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      cos_sin_cache: torch.Tensor, head_dim: int, is_neox_style: bool, k_buf: torch.Tensor,
                      v_buf: torch.Tensor, loc: torch.Tensor, k_scale: float = 1.0,
                      v_scale: float = 1.0) -> torch.Tensor:
    """Rotate q in place and write rotated k and v into the KV pool slots ``loc``; returns q.

    Args:
        positions: [N] integer positions in ``[0, max_pos)`` (not checked on the device).
        q: [N, num_q_heads * head_dim]; k, v: [N, num_kv_heads * head_dim]; fp16/bf16/fp32, each row's elements
            contiguous (row strides free: views into the fused qkv output are fine). k and v are only read.
        cos_sin_cache: [max_pos, rotary_dim] fp32 (cos half then sin half), rotary_dim even, <= head_dim.
        head_dim: per-head size; is_neox_style: pairing of rotated dims (see :mod:`sgl_kernel.triton.rope`).
        k_buf, v_buf: one layer's pool buffers ``[slots, num_kv_heads, head_dim]`` (float dtype, last dim
            contiguous; slot and head strides free, e.g. a token-major pool's strided views); values are cast to
            their dtype after rounding to k's/v's dtype.
        loc: [N] integer slot indices (not checked on the device: the caller's allocator owns them).
        k_scale, v_scale: FP8 caches (``k_buf``/``v_buf`` of dtype ``float8_e4m3fn`` / ``float8_e5m2``): the layer's
            scales; k (rotated, rounded to k's dtype) and v are stored as ``fp8(clamp(x / scale, -max, max))``, round
            to nearest even, as :func:`sglang.srt.mem_cache.kv_quant.quantize_kv`. Must be 1.0 for other caches.
    Raises:
        ValueError: shapes/strides disagree, CPU tensors outside the Triton interpreter, K and V caches of different
            dtypes, or scales that are not positive (or not 1.0 for a non-FP8 cache).
    """
    check_cuda_or_interpret(positions, q, k, v, cos_sin_cache, k_buf, v_buf, loc, what="rope_and_store_kv")
    rot = cos_sin_cache.shape[-1]
    n = positions.shape[0]
    nkv = k_buf.shape[1] if k_buf.dim() == 3 else -1
    if (cos_sin_cache.dim() != 2 or rot % 2 or rot > head_dim or q.dim() != 2 or k.dim() != 2 or v.dim() != 2
            or q.shape[0] != n or k.shape[0] != n or v.shape[0] != n or loc.shape != (n,)
            or q.shape[1] % head_dim or k_buf.dim() != 3 or k_buf.shape[2] != head_dim
            or v_buf.shape != k_buf.shape or k.shape[1] != nkv * head_dim or v.shape[1] != nkv * head_dim
            or min(q.stride(-1), k.stride(-1), v.stride(-1), cos_sin_cache.stride(-1), k_buf.stride(-1),
                   v_buf.stride(-1)) != 1):
        raise ValueError(f"rope_and_store_kv: positions {tuple(positions.shape)}, q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}, cos_sin_cache {tuple(cos_sin_cache.shape)}, "
                         f"k_buf {tuple(k_buf.shape)}, v_buf {tuple(v_buf.shape)}, loc {tuple(loc.shape)}, "
                         f"head_dim={head_dim} are inconsistent (need [N], [N, h*head_dim] rows contiguous, "
                         "[max_pos, even rotary_dim <= head_dim], [slots, kv_heads, head_dim], [N])")
    fp8 = k_buf.dtype in _FP8
    if v_buf.dtype != k_buf.dtype or not (k_scale > 0.0 and v_scale > 0.0) \
            or (not fp8 and (k_scale != 1.0 or v_scale != 1.0)):
        raise ValueError(f"rope_and_store_kv: k_buf {k_buf.dtype} / v_buf {v_buf.dtype} with k_scale={k_scale}, "
                         f"v_scale={v_scale}: the caches must share a dtype and scales must be > 0 (1.0 unless FP8)")
    if n == 0:
        return q
    half = rot // 2
    pdl = use_pdl(q.device)
    _rope_kv_store_kernel[(n,)](
        positions, q, k, v, cos_sin_cache, k_buf, v_buf, loc,
        q.stride(0), k.stride(0), v.stride(0), cos_sin_cache.stride(0), k_buf.stride(0), k_buf.stride(1),
        v_buf.stride(0), v_buf.stride(1), q.shape[1] // head_dim, nkv, 1.0 / k_scale, 1.0 / v_scale,
        HEAD_DIM=head_dim, HALF=half, BLOCK_HALF=max(2, next_pow2(half)), BLOCK_D=max(2, next_pow2(head_dim)),
        NEOX=is_neox_style, BLOCK_HQ=max(2, next_pow2(q.shape[1] // head_dim)), BLOCK_HK=max(2, next_pow2(nkv)),
        PASS_THROUGH=rot < head_dim, USE_GDC=pdl, QUANT_MAX=float(torch.finfo(k_buf.dtype).max) if fp8 else 0.0,
        num_warps=4, **({"launch_pdl": True} if pdl else {}))
    return q
