"""Weight-streaming GEMM for decode-sized batches: ``y = x @ w.T`` with few rows of x (M <= 16).

At decode batch 1-16 a linear layer is a matrix-vector product bound by reading the weight once from HBM. The
decode-step profile of issue 19 (Llama-3.1-8B, batch 1) shows cuBLAS at ~65% of the HBM bandwidth on the
smaller projections (qkv 4096x6144, o_proj 4096x4096) and split-K launches with a separate reduce kernel. This
kernel gives every program a ``BLOCK_N``-row strip of the weight over the whole K (no split-K, no reduce, no
atomics, deterministic), streamed in ``BLOCK_K`` tiles through a multi-stage ``cp.async`` pipeline, with all
(padded) rows of x in one ``tl.dot`` per tile. Technique: the classic GEMV / "skinny GEMM" weight-streaming
schedule (e.g. NVIDIA, "CUTLASS GEMV"; Williams et al., "Roofline", CACM 2009, for the bandwidth bound).

Status: measured by ``benchmark/bench_decode_issue19.py`` against cuBLAS in the same run; not yet called by the
linear layers (a decision for after that measurement).
"""

from __future__ import annotations

import logging
from typing import Optional

import torch
import triton
import triton.language as tl

from sgl_kernel.triton.common import check_cuda_or_interpret, interpreting, next_pow2

logger = logging.getLogger(__name__)

MAX_M = 16


@triton.jit
def _skinny_gemm_kernel(X, W, B, Y, M, N, K, stride_xm, stride_wn, stride_ym,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        HAS_BIAS: tl.constexpr, DOT_F32: tl.constexpr):
    pid = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    x_ptr = X + offs_m[:, None] * stride_xm + offs_k[None, :]
    w_ptr = W + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    for k0 in range(0, K, BLOCK_K):
        mask_k = (k0 + offs_k) < K
        x = tl.load(x_ptr + k0, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        w = tl.load(w_ptr + k0, mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        if DOT_F32:
            acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)))
        else:
            acc += tl.dot(x, tl.trans(w))
    if HAS_BIAS:
        acc += tl.load(B + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(Y.dtype.element_ty),
             mask=mask_m[:, None] & mask_n[None, :])


def skinny_gemm(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor] = None, block_n: int = 16,
                block_k: int = 512, num_warps: int = 4, num_stages: int = 4) -> torch.Tensor:
    """``x @ w.T (+ bias)`` for x ``[M, K]`` with ``1 <= M <= 16`` (the semantics of ``F.linear``).

    Args:
        x: [M, K] bf16/fp16 (fp32 under the interpreter), last dim contiguous.
        w: [N, K] same dtype, last dim contiguous; bias: optional [N].
        block_n, block_k, num_warps, num_stages: tile / pipeline choices (tuning sweeps).
    Returns:
        [M, N] in x's dtype (fp32 accumulation).
    Raises:
        ValueError: M outside 1..16, shapes/dtypes disagree, or CPU tensors outside the Triton interpreter.
    """
    check_cuda_or_interpret(x, w, what="skinny_gemm")
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1] or not 1 <= x.shape[0] <= MAX_M \
            or x.dtype != w.dtype or x.stride(-1) != 1 or w.stride(-1) != 1 \
            or (bias is not None and tuple(bias.shape) != (w.shape[0],)):
        raise ValueError(f"skinny_gemm: x {tuple(x.shape)} {x.dtype}, w {tuple(w.shape)} {w.dtype}, bias "
                         f"{None if bias is None else tuple(bias.shape)}: need x [M<= {MAX_M}, K], w [N, K] of one "
                         "dtype with contiguous rows, bias [N]")
    m, k = x.shape
    n = w.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    _skinny_gemm_kernel[(triton.cdiv(n, block_n),)](
        x, w, bias if bias is not None else w, y, m, n, k, x.stride(0), w.stride(0), y.stride(0),
        BLOCK_M=max(16, next_pow2(m)), BLOCK_N=block_n, BLOCK_K=min(block_k, max(16, next_pow2(k))),
        HAS_BIAS=bias is not None, DOT_F32=interpreting(), num_warps=num_warps, num_stages=num_stages)
    return y
