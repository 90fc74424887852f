"""FP8 (e4m3) kernels: activation quantization and the scaled W8A8 GEMM with per-channel or block-wise scales.

Format: OCP FP8 E4M3 (``torch.float8_e4m3fn``, Triton ``float8e4nv``; Micikevicius et al., "FP8 Formats for Deep
Learning", 2022, sec. 3: 4 exponent bits, 3 mantissa bits, no infinities, largest finite value 448). Every tensor
is stored as ``q = round(v / s)`` with a float32 scale ``s`` chosen so that ``|v| / s <= 448`` and read back as
``q * s``.

* :func:`per_token_quant_fp8`: one scale per row (``s = amax(row) / 448``; dynamic per-token activation scaling),
  or one given scale for the whole tensor (static, a checkpoint's ``input_scale``);
* :func:`per_token_group_quant_fp8`: one scale per row and group of ``group`` consecutive columns (the 1 x 128
  activation tiles of DeepSeek-V3's fine-grained quantization, DeepSeek-AI 2024, "DeepSeek-V3 Technical Report",
  sec. 3.3.2);
* :func:`w8a8_scaled_gemm`: ``y = (xq * xs) @ (wq * ws)^T`` accumulated in fp32, with the weight scales per output
  channel (``ws`` [N, 1], applied after the K loop) or per block of ``rows_per_scale`` output rows x ``group_k``
  input columns (``ws`` [ceil(N / rows_per_scale), ceil(K / group_k)], DeepSeek-V3's 128 x 128 weight blocks, applied
  per K tile, so a tile never straddles two scale groups).

The torch references that define the semantics live in :mod:`sglang.srt.layers.quantization.fp8_ref` (tests compare
against them on fresh random inputs; ``TRITON_INTERPRET=1`` runs these kernels on a CPU).
"""

from __future__ import annotations

import logging
from typing import Optional

import torch
import triton
import triton.language as tl

from sgl_kernel.triton.common import check_cuda_or_interpret, interpreting, next_pow2

logger = logging.getLogger(__name__)

FP8_MAX = 448.0  # largest finite float8_e4m3fn value
SCALE_FLOOR = 1e-10  # an all-zero row gets amax = SCALE_FLOOR (its scale stays finite and positive)


@triton.jit
def _quant_rows_kernel(X, Q, S, K, stride_x, stride_q, GROUP, n_groups, STATIC: tl.constexpr, BLOCK: tl.constexpr,
                       FP8_MAX_C: tl.constexpr, FLOOR: tl.constexpr):
    """One program per (row, group of GROUP columns): amax -> scale -> q = clamp(x / s) in e4m3 (or the static
    scale S[0])."""
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    k_lo = g * GROUP
    k_hi = tl.minimum(k_lo + GROUP, K)
    offs = tl.arange(0, BLOCK)
    if STATIC:
        s = tl.load(S).to(tl.float32)
    else:
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK):
            x = tl.load(X + row * stride_x + k0 + offs, mask=k0 + offs < k_hi, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        s = tl.math.div_rn(tl.maximum(tl.max(amax, 0), FLOOR), FP8_MAX_C)
        tl.store(S + row * n_groups + g, s)
    for k0 in range(k_lo, k_hi, BLOCK):
        mask = k0 + offs < k_hi
        x = tl.load(X + row * stride_x + k0 + offs, mask=mask, other=0.0).to(tl.float32)
        q = tl.clamp(tl.math.div_rn(x, s), -FP8_MAX_C, FP8_MAX_C)
        tl.store(Q + row * stride_q + k0 + offs, q.to(Q.dtype.element_ty), mask=mask)


def _quant(x: torch.Tensor, group: int, static_scale: Optional[torch.Tensor], what: str):
    check_cuda_or_interpret(x, what=what)
    if x.dim() != 2 or x.stride(-1) != 1 or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"{what}: x must be a 2-D bf16/fp16/fp32 tensor with contiguous rows, got "
                         f"{tuple(x.shape)} {x.dtype}")
    m, k = x.shape
    if group < 1:
        raise ValueError(f"{what}: group={group} must be >= 1")
    n_groups = triton.cdiv(k, group) if k else 0
    q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    if static_scale is not None:
        if static_scale.numel() != 1:
            raise ValueError(f"{what}: a static scale must hold one value, got shape {tuple(static_scale.shape)}")
        s = static_scale.reshape(1).to(torch.float32)
    else:
        s = torch.empty(m, n_groups, dtype=torch.float32, device=x.device)
    if m and k:
        block = min(1024, next_pow2(min(group, k)))
        _quant_rows_kernel[(m, n_groups)](x, q, s, k, x.stride(0), q.stride(0), group, n_groups,
                                          STATIC=static_scale is not None, BLOCK=max(16, block),
                                          FP8_MAX_C=FP8_MAX, FLOOR=SCALE_FLOOR, num_warps=4)
    return q, s


def per_token_quant_fp8(x: torch.Tensor, static_scale: Optional[torch.Tensor] = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize x ``[M, K]`` (bf16/fp16/fp32, CUDA, contiguous rows) to e4m3 with one scale per row.

    Returns ``(q [M, K] float8_e4m3fn, s)``: dynamic: ``s [M, 1]`` fp32 = ``max(amax(row), 1e-10) / 448``; with
    ``static_scale`` (a one-element fp32 tensor, e.g. a checkpoint's ``input_scale``) every row uses it and ``s`` is
    that scale as a ``[1]`` tensor. ``q = clamp(x / s, -448, 448)`` rounded to nearest even (IEEE division).

    Raises:
        ValueError: a bad shape/dtype, a static scale of more than one element, or CPU tensors outside the Triton
            interpreter.
    """
    k = x.shape[-1] if x.dim() else 1
    q, s = _quant(x, max(1, k), static_scale, "per_token_quant_fp8")
    return q, s


def per_token_group_quant_fp8(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize x ``[M, K]`` to e4m3 with one scale per row and group of ``group`` consecutive columns (the last group
    may be shorter): returns ``(q [M, K] float8_e4m3fn, s [M, ceil(K / group)] fp32)``, ``s = max(amax, 1e-10) /
    448`` per group. Raises ValueError as :func:`per_token_quant_fp8`."""
    return _quant(x, group, None, "per_token_group_quant_fp8")


@triton.jit(do_not_specialize=["M"])
def _w8a8_gemm_kernel(XQ, XS, WQ, WS, B, Y, M, N, K, stride_xm, stride_xsm, stride_wn, stride_wsn, stride_ym,
                      GROUP_K, ROWS_PER_SCALE, SCALE_IN_LOOP: tl.constexpr, HAS_BIAS: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                      DOT_F32: tl.constexpr):
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    gsize = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % gsize
    pid_n = (pid % per_group) // gsize
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mmask = offs_m < M
    nmask = offs_n < N
    x_ptrs = XQ + offs_m.to(tl.int64)[:, None] * stride_xm + offs_k[None, :]
    w_ptrs = WQ + offs_n.to(tl.int64)[None, :] * stride_wn + offs_k[:, None]
    xs_row = XS + offs_m.to(tl.int64) * stride_xsm
    ws_row = WS + (offs_n // ROWS_PER_SCALE).to(tl.int64) * stride_wsn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kmask = offs_k < K - k0
        a = tl.load(x_ptrs, mask=mmask[:, None] & kmask[None, :], other=0.0)
        b = tl.load(w_ptrs, mask=kmask[:, None] & nmask[None, :], other=0.0)
        if DOT_F32:
            part = tl.dot(a.to(tl.float32), b.to(tl.float32))
        else:
            part = tl.dot(a, b)
        if SCALE_IN_LOOP:  # block-wise: this K tile lies in scale group k0 // GROUP_K
            kb = k0 // GROUP_K
            xs = tl.load(xs_row + kb, mask=mmask, other=0.0)
            ws = tl.load(ws_row + kb, mask=nmask, other=0.0)
            acc += part * xs[:, None] * ws[None, :]
        else:
            acc += part
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if not SCALE_IN_LOOP:  # per-row activation scale x per-output-channel weight scale
        xs = tl.load(xs_row, mask=mmask, other=0.0)
        ws = tl.load(ws_row, mask=nmask, other=0.0)
        acc = acc * xs[:, None] * ws[None, :]
    if HAS_BIAS:
        acc += tl.load(B + offs_n, mask=nmask, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :], acc.to(Y.dtype.element_ty),
             mask=mmask[:, None] & nmask[None, :])


def _gemm_config(m: int, group_k: Optional[int], on_gpu: bool) -> dict:
    if not on_gpu:
        return dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32 if group_k is None else min(32, group_k), GROUP_M=4,
                    num_warps=4, num_stages=1)
    bk = 128 if group_k is None else min(128, group_k)
    if m <= 16:
        return dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=bk, GROUP_M=1, num_warps=4, num_stages=4)
    if m <= 64:
        return dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=bk, GROUP_M=8, num_warps=4, num_stages=4)
    return dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=bk, GROUP_M=8, num_warps=8, num_stages=3)


def block_gemm_supported(group_k: int, on_gpu: bool = True) -> bool:
    """Whether :func:`w8a8_scaled_gemm` runs block-wise scales of ``group_k`` input columns: the K tile must divide the
    group and be a power of two (>= 32 on a GPU, the fp8 MMA's K; >= 16 in the interpreter)."""
    bk = min(128, group_k) if on_gpu else min(32, group_k)
    return group_k % bk == 0 and bk & (bk - 1) == 0 and bk >= (32 if on_gpu else 16)


def w8a8_scaled_gemm(xq: torch.Tensor, xs: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor,
                     bias: Optional[torch.Tensor] = None, out_dtype: torch.dtype = torch.bfloat16,
                     group_k: Optional[int] = None, rows_per_scale: int = 1) -> torch.Tensor:
    """``y = (xq * xs) @ (wq * ws)^T (+ bias)``, fp32 accumulation, e4m3 tensor-core MMA on a GPU.

    Args:
        xq: [M, K] float8_e4m3fn activations (contiguous rows); wq: [N, K] float8_e4m3fn weight (contiguous rows).
        xs, ws: fp32 scales. Per channel (``group_k`` None): xs [M, 1] (per token) or [1] (one static scale, broadcast),
            ws [N] or [N, 1]. Block-wise (``group_k`` = the weight's block size along K): xs [M, ceil(K / group_k)]
            (per-token groups, :func:`per_token_group_quant_fp8`), ws [ceil(N / rows_per_scale), ceil(K / group_k)]
            (``rows_per_scale``: output rows sharing a scale row, the weight's block size along N, or 1 for scales
            expanded per row).
        bias: optional [N]; out_dtype: result dtype.
    Returns:
        [M, N] in ``out_dtype``.
    Raises:
        ValueError: inconsistent shapes or dtypes, a ``group_k`` :func:`block_gemm_supported` rejects, or CPU tensors
            outside the Triton interpreter.
    """
    check_cuda_or_interpret(xq, xs, wq, ws, what="w8a8_scaled_gemm")
    m, k = xq.shape
    n = wq.shape[0]
    fp8 = torch.float8_e4m3fn
    if xq.dtype != fp8 or wq.dtype != fp8 or wq.shape[1] != k or xq.stride(-1) != 1 or wq.stride(-1) != 1 \
            or (bias is not None and tuple(bias.shape) != (n,)) or rows_per_scale < 1:
        raise ValueError(f"w8a8_scaled_gemm: xq {tuple(xq.shape)} {xq.dtype}, wq {tuple(wq.shape)} {wq.dtype}, "
                         f"bias {None if bias is None else tuple(bias.shape)}: need e4m3 [M, K] and [N, K] with "
                         "contiguous rows and a [N] bias")
    xs = xs.to(torch.float32)
    ws = ws.to(torch.float32)
    if group_k is None:
        if xs.numel() == 1:
            xs = xs.reshape(1, 1).expand(m, 1)
        if xs.shape != (m, 1) or ws.numel() != n:
            raise ValueError(f"w8a8_scaled_gemm: per-channel scales xs {tuple(xs.shape)} ws {tuple(ws.shape)}: need "
                             f"xs [{m}, 1] (or one value) and ws [{n}]")
        ws = ws.reshape(n, 1)
        stride_xsm = xs.stride(0)
    else:
        kb = triton.cdiv(k, group_k)
        if not block_gemm_supported(group_k, xq.is_cuda and not interpreting()):
            raise ValueError(f"w8a8_scaled_gemm: block size {group_k} along K is not supported by the kernel")
        if xs.shape != (m, kb) or ws.shape != (triton.cdiv(n, rows_per_scale), kb):
            raise ValueError(f"w8a8_scaled_gemm: block scales xs {tuple(xs.shape)} ws {tuple(ws.shape)}: need xs "
                             f"[{m}, {kb}] and ws [{triton.cdiv(n, rows_per_scale)}, {kb}]")
        xs = xs.contiguous()
        stride_xsm = xs.stride(0)
    ws = ws.contiguous()
    y = torch.empty(m, n, dtype=out_dtype, device=xq.device)
    if m == 0 or n == 0:
        return y
    cfg = _gemm_config(m, group_k, xq.is_cuda and not interpreting())
    grid = (triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]),)
    _w8a8_gemm_kernel[grid](xq, xs, wq, ws, bias if bias is not None else ws, y, m, n, k, xq.stride(0), stride_xsm,
                            wq.stride(0), ws.stride(0), y.stride(0), group_k or max(k, 1), rows_per_scale,
                            SCALE_IN_LOOP=group_k is not None, HAS_BIAS=bias is not None, DOT_F32=interpreting(),
                            **cfg)
    return y


@triton.jit(do_not_specialize=["M"])
def _skinny_fp8_kernel(X, W, WS, B, Y, M, N, K, K_CHUNK, stride_xm, stride_wn, stride_ym,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                       PARTIAL: tl.constexpr, DOT_F32: tl.constexpr, USE_GDC: tl.constexpr = False,
                       PF_LINES: tl.constexpr = 1, PF_STEP: tl.constexpr = 128):
    """Weight-streaming ``x @ (wq * ws)^T`` for few rows: each program streams a BLOCK_N-row strip of the e4m3 weight
    over one K_CHUNK, widens it to x's dtype in registers, and scales the fp32 result by the per-row weight scale."""
    pid = tl.program_id(0)
    sid = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    k_lo = sid * K_CHUNK
    k_hi = tl.minimum(k_lo + K_CHUNK, K)
    if USE_GDC:  # programmatic dependent launch: the weight is read-only during the step, so start streaming it now
        pf_k = k_lo + tl.arange(0, PF_LINES) * PF_STEP
        pf = W + offs_n.to(tl.int64)[:, None] * stride_wn + pf_k[None, :]
        pf = tl.where(mask_n[:, None] & (pf_k < k_hi)[None, :], pf, W)
        tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n mov.u32 $0, 0;", "=r,l", [pf], dtype=tl.int32,
                                  is_pure=False, pack=1)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    x_ptr = X + offs_m[:, None] * stride_xm + offs_k[None, :]
    w_ptr = W + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    for k0 in range(k_lo, k_hi, BLOCK_K):
        mask_k = (k0 + offs_k) < k_hi
        x = tl.load(x_ptr + k0, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        w = tl.load(w_ptr + k0, mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        if DOT_F32:
            acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)))
        else:
            acc += tl.dot(x, tl.trans(w.to(X.dtype.element_ty)))
    acc = acc * tl.load(WS + offs_n, mask=mask_n, other=0.0)[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    if PARTIAL:  # fp32 partial sums [split, M, N] (each already scaled: the scale is per output column)
        tl.store(Y + sid * M * stride_ym + offs_m[:, None] * stride_ym + offs_n[None, :], acc, mask=mask)
    else:
        if HAS_BIAS:
            acc += tl.load(B + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        tl.store(Y + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(Y.dtype.element_ty), mask=mask)


def skinny_fp8_gemm(x: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor, bias: Optional[torch.Tensor] = None,
                    block_n: int = 16, block_k: int = 512, num_warps: int = 4, num_stages: int = 4,
                    split_k: int = 1) -> torch.Tensor:
    """``x @ (wq * ws[:, None])^T (+ bias)`` for a decode-sized x (weight-only FP8: x stays in its dtype).

    The weight-streaming schedule of :func:`sgl_kernel.triton.skinny_gemm.skinny_gemm` (same
    :class:`~sgl_kernel.triton.skinny_gemm.SkinnyConfig` knobs, split-K with the same deterministic reduce, the
    same programmatic-dependent-launch L2 prefetch) on an e4m3 weight that it widens to x's dtype in registers: half
    the weight bytes of the bf16 GEMM and no activation quantization kernel.

    Args:
        x: [M, K] bf16/fp16 (fp32 under the interpreter), 1 <= M <= 128, contiguous rows.
        wq: [N, K] float8_e4m3fn, contiguous rows; ws: [N] (or [N, 1]) fp32 per-output-channel scales.
        bias: optional [N]. block_n, block_k, num_warps, num_stages, split_k: as ``skinny_gemm``.
    Returns:
        [M, N] in x's dtype (fp32 accumulation).
    Raises:
        ValueError: M outside 1..128, inconsistent shapes/dtypes, bad block sizes, or CPU tensors outside the
            Triton interpreter.
    """
    from sgl_kernel.triton.common import use_pdl
    from sgl_kernel.triton.skinny_gemm import MAX_M, _prefetch_lines, _splitk_reduce_kernel, split_plan

    check_cuda_or_interpret(x, wq, ws, what="skinny_fp8_gemm")
    if x.dim() != 2 or wq.dim() != 2 or x.shape[1] != wq.shape[1] or not 1 <= x.shape[0] <= MAX_M \
            or wq.dtype != torch.float8_e4m3fn or x.stride(-1) != 1 or wq.stride(-1) != 1 \
            or ws.numel() != wq.shape[0] or (bias is not None and tuple(bias.shape) != (wq.shape[0],)):
        raise ValueError(f"skinny_fp8_gemm: x {tuple(x.shape)} {x.dtype}, wq {tuple(wq.shape)} {wq.dtype}, ws "
                         f"{tuple(ws.shape)}: need x [M<={MAX_M}, K], e4m3 wq [N, K] with contiguous rows, ws [N]")
    if split_k < 1 or any(b < 16 or b & (b - 1) for b in (block_n, block_k)):
        raise ValueError(f"skinny_fp8_gemm: split_k={split_k} block_n={block_n} block_k={block_k}: need split_k >= 1 "
                         "and block sizes that are powers of two >= 16")
    m, k = x.shape
    n = wq.shape[0]
    ws = ws.reshape(n).to(torch.float32).contiguous()
    bk, chunk, split = split_plan(k, block_k, split_k)
    out = torch.empty(split, m, n, dtype=torch.float32, device=x.device) if split > 1 else \
        torch.empty(m, n, dtype=x.dtype, device=x.device)
    pdl = use_pdl(x.device)
    launch = {"launch_pdl": True} if pdl else {}
    _skinny_fp8_kernel[(triton.cdiv(n, block_n), split)](
        x, wq, ws, bias if bias is not None else ws, out, m, n, k, chunk, x.stride(0), wq.stride(0), n,
        BLOCK_M=max(16, next_pow2(m)), BLOCK_N=block_n, BLOCK_K=bk, HAS_BIAS=bias is not None, PARTIAL=split > 1,
        DOT_F32=interpreting(), USE_GDC=pdl, PF_LINES=_prefetch_lines(chunk, block_n, 1) if pdl else 1, PF_STEP=128,
        num_warps=num_warps, num_stages=num_stages, **launch)
    if split == 1:
        return out
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    block = 1024
    _splitk_reduce_kernel[(triton.cdiv(m * n, block),)](
        out, bias if bias is not None else ws, y, m * n, n, split, HAS_BIAS=bias is not None, BLOCK=block,
        USE_GDC=pdl, num_warps=4, **launch)
    return y
