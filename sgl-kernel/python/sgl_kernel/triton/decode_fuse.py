"""Decode-step epilogue fusions: fewer kernels per decoder layer at the same bytes.

On an H200 a Llama-3.1-8B decode step at batch 32 runs ~357 kernels; each kernel's ramp and tail (~2-4 us) weighs
more at 4.26 TB/s than on an H100. Two fusions remove up to 96 of them (32 layers):

* :func:`splitk_add_rmsnorm` -- the split-K partial sums ``[S, M, H]`` (fp32) of a row-parallel projection
  (o_proj, down_proj run as the skinny GEMM with split-K > 1, :func:`sgl_kernel.triton.skinny_gemm.skinny_gemm_partials`)
  are summed inside the following fused residual-add + RMSNorm, so the separate split-K reduce kernel goes away.
  Numerics are those of the unfused path bit for bit: the partials are summed in split order starting from zero,
  the bias added in fp32, the sum rounded to the activation dtype, then added to the residual and normalized exactly
  as :mod:`sgl_kernel.triton.fused_add_rmsnorm` does (same block and warp count, so the same reduction tree).
* :func:`skinny_gemm_silu` -- the gate_up projection (weight ``[2I, K]`` = ``[gate; up]``) as the skinny GEMM with
  SiLU-and-mul in its epilogue: each program streams the matching ``BLOCK_N`` rows of gate and of up over all of K
  (split-K 1: the epilogue is not linear) and writes ``silu(gate) * up`` ``[M, I]``, so the ``[M, 2I]``
  intermediate and the SiLU-and-mul kernel go away. gate and up are rounded to the activation dtype before the
  activation, as the unfused skinny GEMM + :func:`sgl_kernel.triton.activation.silu_and_mul` do, so the result equals
  that pair bit for bit when the tiles match.

Technique: epilogue fusion of GEMMs (e.g. NVIDIA CUTLASS "epilogue visitor"; Chen et al., "TVM", OSDI 2018, sec. 4.1
operator fusion), applied to the split-K weight-streaming GEMM of :mod:`sgl_kernel.triton.skinny_gemm` and to the
RMSNorm of Zhang & Sennrich (NeurIPS 2019, eq. 4) / SwiGLU of Shazeer ("GLU Variants Improve Transformer", 2020,
eq. 6). Chosen per (shape, batch bucket) by the decode-GEMM table (:mod:`sglang.srt.layers.decode_gemm`) only when
``SGLANG_DECODE_FUSE_EPILOGUE=1`` (default OFF until a GPU A/B shows a win). Both kernels launch with programmatic
dependent launch where :func:`sgl_kernel.triton.common.use_pdl` allows.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch
import triton
import triton.language as tl

from sgl_kernel.triton.common import check_cuda_or_interpret, interpreting, next_pow2, use_pdl
from sgl_kernel.triton.skinny_gemm import MAX_M, _prefetch_lines

logger = logging.getLogger(__name__)


@triton.jit
def _splitk_add_rmsnorm_kernel(P, B, R, W, Y, M, H, SPLIT, stride_r, stride_y, eps,
                               HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr, USE_GDC: tl.constexpr = False):
    if USE_GDC:  # programmatic dependent launch: wait for the GEMM's partials, then let the next kernel launch
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < H
    w = tl.load(W + offs, mask=mask, other=0.0).to(tl.float32)  # weight first, as the unfused norm kernel
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in range(0, SPLIT):  # fixed split order from zero: the split-K reduce kernel's sum, bit for bit
        acc += tl.load(P + (s * M + row) * H + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(B + offs, mask=mask, other=0.0).to(tl.float32)
    r = tl.load(R + row * stride_r + offs, mask=mask, other=0.0)
    x = acc.to(r.dtype)  # the GEMM output rounded as the reduce kernel stores it
    s_ = (x.to(tl.float32) + r.to(tl.float32)).to(r.dtype)
    tl.store(R + row * stride_r + offs, s_, mask=mask)
    xf = s_.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / H + eps)
    tl.store(Y + row * stride_y + offs, (xf * inv * w).to(Y.dtype.element_ty), mask=mask)


def splitk_add_rmsnorm(parts: torch.Tensor, bias: Optional[torch.Tensor], residual: torch.Tensor,
                       weight: torch.Tensor, eps: float, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x = sum_s parts[s] (+ bias)`` rounded to residual's dtype, then in place ``residual = x + residual`` and
    ``out = rmsnorm(residual) * weight`` -- the split-K reduce and the fused add + RMSNorm in one kernel.

    Args:
        parts: [S, M, H] fp32, contiguous: split-K partial sums of a GEMM (S >= 1).
        bias: optional [H] (the GEMM's bias, added once after the sum), any float dtype.
        residual: [M, H] bf16/fp16/fp32 (overwritten with the sum), last dim contiguous.
        weight: [H] RMSNorm weight; eps: RMSNorm epsilon.
        out: optional [M, H] output in residual's dtype (default: a new tensor).
    Returns:
        ``out`` [M, H] (the normalized sum), same dtype and device as residual.
    Raises:
        ValueError: shapes/dtypes disagree, or CPU tensors outside the Triton interpreter.
    """
    check_cuda_or_interpret(parts, residual, weight, what="splitk_add_rmsnorm")
    if parts.dim() != 3 or parts.dtype != torch.float32 or not parts.is_contiguous() \
            or residual.dim() != 2 or tuple(parts.shape[1:]) != tuple(residual.shape) or residual.stride(-1) != 1 \
            or tuple(weight.shape) != (residual.shape[1],) \
            or (bias is not None and tuple(bias.shape) != (residual.shape[1],)):
        raise ValueError(f"splitk_add_rmsnorm: parts {tuple(parts.shape)} {parts.dtype}, residual "
                         f"{tuple(residual.shape)}, weight {tuple(weight.shape)}, bias "
                         f"{None if bias is None else tuple(bias.shape)}: need contiguous fp32 parts [S, M, H], "
                         "residual [M, H] with contiguous rows, weight and bias [H]")
    m, h = residual.shape
    y = torch.empty_like(residual) if out is None else out
    if tuple(y.shape) != (m, h) or y.stride(-1) != 1 or y.dtype != residual.dtype:
        raise ValueError(f"splitk_add_rmsnorm: out {tuple(y.shape)} {y.dtype} must be ({m}, {h}) {residual.dtype}")
    if m == 0:
        return y
    block = next_pow2(h)
    warps = min(max(block // 512, 1), 16)  # as fused_add_rmsnorm: the same reduction tree
    pdl = use_pdl(residual.device)
    _splitk_add_rmsnorm_kernel[(m,)](parts, bias if bias is not None else weight, residual, weight, y, m, h,
                                     parts.shape[0], residual.stride(0), y.stride(0), eps,
                                     HAS_BIAS=bias is not None, BLOCK=block, USE_GDC=pdl, num_warps=warps,
                                     **({"launch_pdl": True} if pdl else {}))
    return y


@triton.jit(do_not_specialize=["M"])
def _skinny_silu_kernel(X, W, B, Y, M, I, K, stride_xm, stride_wn, stride_ym,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        HAS_BIAS: tl.constexpr, DOT_F32: tl.constexpr, USE_GDC: tl.constexpr = False,
                        PF_LINES: tl.constexpr = 1, PF_STEP: tl.constexpr = 64):
    pid = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)  # gate rows; the up rows are I + offs_n
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < I
    g_rows = W + offs_n.to(tl.int64)[:, None] * stride_wn
    u_rows = W + (offs_n + I).to(tl.int64)[:, None] * stride_wn
    if USE_GDC:  # weights are read-only for the step: start both strips' streams before waiting
        pf_k = tl.arange(0, PF_LINES) * PF_STEP
        pf_mask = mask_n[:, None] & (pf_k < K)[None, :]
        pf_g = tl.where(pf_mask, g_rows + pf_k[None, :], W)
        pf_u = tl.where(pf_mask, u_rows + pf_k[None, :], W)
        tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n prefetch.global.L2 [$2];\n mov.u32 $0, 0;",
                                  "=r,l,l", [pf_g, pf_u], dtype=tl.int32, is_pure=False, pack=1)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    x_ptr = X + offs_m[:, None] * stride_xm + offs_k[None, :]
    for k0 in range(0, K, BLOCK_K):
        mask_k = (k0 + offs_k) < K
        x = tl.load(x_ptr + k0, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        wmask = mask_n[:, None] & mask_k[None, :]
        wg = tl.load(g_rows + k0 + offs_k[None, :], mask=wmask, other=0.0)
        wu = tl.load(u_rows + k0 + offs_k[None, :], mask=wmask, other=0.0)
        if DOT_F32:
            acc_g += tl.dot(x.to(tl.float32), tl.trans(wg.to(tl.float32)))
            acc_u += tl.dot(x.to(tl.float32), tl.trans(wu.to(tl.float32)))
        else:
            acc_g += tl.dot(x, tl.trans(wg))
            acc_u += tl.dot(x, tl.trans(wu))
    if HAS_BIAS:
        acc_g += tl.load(B + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        acc_u += tl.load(B + I + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    # round gate and up to the activation dtype first, as the unfused GEMM stores them for the SiLU kernel
    g = acc_g.to(Y.dtype.element_ty).to(tl.float32)
    u = acc_u.to(Y.dtype.element_ty).to(tl.float32)
    y = g / (1.0 + tl.exp(-g)) * u
    tl.store(Y + offs_m[:, None] * stride_ym + offs_n[None, :], y.to(Y.dtype.element_ty),
             mask=mask_m[:, None] & mask_n[None, :])


def skinny_gemm_silu(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor] = None, block_n: int = 32,
                     block_k: int = 256, num_warps: int = 4, num_stages: int = 4, split_k: int = 1) -> torch.Tensor:
    """``silu(g) * u`` with ``[g | u] = x @ w.T (+ bias)`` in one weight-streaming kernel (the gate_up projection with
    SiLU-and-mul in its epilogue).

    Args:
        x: [M, K] bf16/fp16 (fp32 under the interpreter), 1 <= M <= 128, last dim contiguous.
        w: [2I, K] same dtype, rows 0..I-1 the gate and I..2I-1 the up projection (MergedColumnParallelLinear's
            layout), last dim contiguous; bias: optional [2I].
        block_n, block_k, num_warps, num_stages: as :class:`~sgl_kernel.triton.skinny_gemm.SkinnyConfig` (each
            program holds ``block_n`` gate and ``block_n`` up rows).
        split_k: must be 1 (the epilogue is not linear in the partial sums); accepted so a table's config kwargs pass.
    Returns:
        [M, I] in x's dtype, contiguous.
    Raises:
        ValueError: split_k != 1, odd row count of w, M outside 1..128, shapes/dtypes disagree, block sizes not
            powers of two >= 16, or CPU tensors outside the Triton interpreter.
    """
    check_cuda_or_interpret(x, w, what="skinny_gemm_silu")
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1] or w.shape[0] % 2 or not 1 <= x.shape[0] <= MAX_M \
            or x.dtype != w.dtype or x.stride(-1) != 1 or w.stride(-1) != 1 \
            or (bias is not None and tuple(bias.shape) != (w.shape[0],)):
        raise ValueError(f"skinny_gemm_silu: x {tuple(x.shape)} {x.dtype}, w {tuple(w.shape)} {w.dtype}, bias "
                         f"{None if bias is None else tuple(bias.shape)}: need x [M<= {MAX_M}, K], w [2I, K] of one "
                         "dtype with contiguous rows, bias [2I]")
    if split_k != 1 or any(b < 16 or b & (b - 1) for b in (block_n, block_k)):
        raise ValueError(f"skinny_gemm_silu: split_k={split_k} block_n={block_n} block_k={block_k}: need split_k 1 "
                         "and block sizes that are powers of two >= 16")
    m, k = x.shape
    i = w.shape[0] // 2
    bk = min(block_k, max(16, next_pow2(k)))
    y = torch.empty(m, i, dtype=x.dtype, device=x.device)
    pdl = use_pdl(x.device)
    _skinny_silu_kernel[(triton.cdiv(i, block_n),)](
        x, w, bias if bias is not None else w, y, m, i, k, x.stride(0), w.stride(0), i,
        BLOCK_M=max(16, next_pow2(m)), BLOCK_N=block_n, BLOCK_K=bk, HAS_BIAS=bias is not None,
        DOT_F32=interpreting(), USE_GDC=pdl, num_warps=num_warps, num_stages=num_stages,
        PF_LINES=max(1, _prefetch_lines(k, 2 * block_n, x.element_size()) // 2) if pdl else 1,
        PF_STEP=max(1, 128 // x.element_size()), **({"launch_pdl": True} if pdl else {}))
    return y
