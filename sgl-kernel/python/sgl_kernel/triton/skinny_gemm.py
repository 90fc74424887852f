"""Weight-streaming GEMM for decode-sized batches: ``y = x @ w.T`` with few rows of x (M <= 128).

At decode a linear layer is bound by reading its weight once from HBM. The decode-step profiles of issues 19 and
27 (Llama-3.1-8B, batch 1-32) show cuBLAS at ~0.65-0.71 of the copy bandwidth on the smaller projections (qkv
4096x6144, o_proj 4096x4096: too few tiles for 132 SMs, split-K tails). This kernel gives every program a
``BLOCK_N``-row strip of the weight over one ``K_CHUNK`` of K, streamed in ``BLOCK_K`` tiles through a multi-stage
``cp.async`` pipeline, with all (padded) rows of x in one ``tl.dot`` per tile. With ``split_k == 1`` a program covers
all of K and writes the output (no reduce, deterministic); with ``split_k > 1`` the programs write fp32 partials
``[split, M, N]`` that a second kernel sums in a fixed order (still deterministic) to fill the SMs when N is small.
Technique: the classic GEMV / "skinny GEMM" weight-streaming schedule with split-K (e.g. NVIDIA, "CUTLASS GEMV" and
its split-K GEMM; Williams et al., "Roofline", CACM 2009, for the bandwidth bound).

Which shapes and batch sizes use it is decided by measurement on the device
(:mod:`sglang.srt.layers.decode_gemm`); ``SGLANG_SKINNY_GEMM=1`` forces the fixed default config.
Both kernels launch with programmatic dependent launch where :func:`sgl_kernel.triton.common.use_pdl` allows
(the default; ``SGLANG_DECODE_PDL=0`` opts out): each program pulls the first :data:`PREFETCH_K`
columns of its weight strip into L2 (``prefetch.global.L2``) before ``griddepcontrol.wait``, so at a ~15 us qkv /
o_proj call the weight stream overlaps the previous kernel instead of starting after the launch + first-load bubble.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from sgl_kernel.triton.common import check_cuda_or_interpret, interpreting, next_pow2, use_pdl

logger = logging.getLogger(__name__)

MAX_M = 128
# Under programmatic dependent launch each program prefetches the first min(PREFETCH_K, PREFETCH_BYTES / row bytes) K
# columns of its weight rows into L2: 64 KiB x 132 resident programs ~ 8.4 MB ~ 3 us of HBM time, about the launch + first-load
# bubble it is meant to fill, without flooding L2 on wide strips.
PREFETCH_K = 1024
PREFETCH_BYTES = 64 * 1024


@dataclass(frozen=True)
class SkinnyConfig:
    """One launch configuration of :func:`skinny_gemm` (frozen; tables of them are built by the decode-GEMM tuner).

    Attributes:
        block_n: weight rows per program (power of two >= 16).
        block_k: K elements per pipelined tile (power of two >= 16; 16-byte ``cp.async`` loads need >= 8 bf16).
        split_k: programs along K (>= 1); > 1 adds an fp32 partial buffer and a reduce kernel.
        num_warps, num_stages: Triton launch / software-pipeline depth.
    """

    block_n: int = 16
    block_k: int = 512
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4

    def kwargs(self) -> dict:
        """The keyword arguments of :func:`skinny_gemm` for this config."""
        return dict(block_n=self.block_n, block_k=self.block_k, split_k=self.split_k, num_warps=self.num_warps,
                    num_stages=self.num_stages)

    def __str__(self) -> str:
        return f"n{self.block_n} k{self.block_k} s{self.split_k} w{self.num_warps} st{self.num_stages}"


@triton.jit(do_not_specialize=["M"])  # one compile per BLOCK_M class, not per M == 1 / M % 16 == 0 / other
def _skinny_gemm_kernel(X, W, B, Y, M, N, K, K_CHUNK, stride_xm, stride_wn, stride_ym,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr, DOT_F32: tl.constexpr,
                        USE_GDC: tl.constexpr = False, PF_LINES: tl.constexpr = 1, PF_STEP: tl.constexpr = 64):
    pid = tl.program_id(0)
    sid = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    k_lo = sid * K_CHUNK
    k_hi = tl.minimum(k_lo + K_CHUNK, K)
    if USE_GDC:  # programmatic dependent launch: the weight is read-only for the whole step, so start its stream now
        pf_k = k_lo + tl.arange(0, PF_LINES) * PF_STEP  # one address per 128-byte line
        pf = W + offs_n.to(tl.int64)[:, None] * stride_wn + pf_k[None, :]
        pf = tl.where(mask_n[:, None] & (pf_k < k_hi)[None, :], pf, W)
        tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n mov.u32 $0, 0;", "=r,l", [pf], dtype=tl.int32,
                                  is_pure=False, pack=1)
        tl.extra.cuda.gdc_wait()  # wait for the previous kernel, then let the next one launch
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
            acc += tl.dot(x, tl.trans(w))
    mask = mask_m[:, None] & mask_n[None, :]
    if PARTIAL:  # fp32 partial sums [split, M, N], rows of stride_ym
        tl.store(Y + sid * M * stride_ym + offs_m[:, None] * stride_ym + offs_n[None, :], acc, mask=mask)
    else:
        if HAS_BIAS:
            acc += tl.load(B + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        tl.store(Y + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(Y.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["MN"])
def _splitk_reduce_kernel(P, B, Y, MN, N, SPLIT, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr,
                          USE_GDC: tl.constexpr = False):
    if USE_GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in range(0, SPLIT):  # fixed order: deterministic
        acc += tl.load(P + s * MN + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(B + offs % N, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + offs, acc.to(Y.dtype.element_ty), mask=mask)


def _prefetch_lines(chunk: int, block_n: int, elem_bytes: int) -> int:
    """128-byte lines per weight row that a program prefetches under programmatic dependent launch (a power of two
    >= 1): the first ``min(chunk, PREFETCH_K, PREFETCH_BYTES / (block_n * elem_bytes))`` K columns of its strip."""
    cols = min(chunk, PREFETCH_K, max(1, PREFETCH_BYTES // (block_n * elem_bytes)))
    lines = max(1, cols * elem_bytes // 128)
    return 1 << (lines.bit_length() - 1)  # round down: never past the byte cap


def _check(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor], block_n: int, block_k: int,
           split_k: int, what: str) -> None:
    check_cuda_or_interpret(x, w, what=what)
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1] or not 1 <= x.shape[0] <= MAX_M \
            or x.dtype != w.dtype or x.stride(-1) != 1 or w.stride(-1) != 1 \
            or (bias is not None and tuple(bias.shape) != (w.shape[0],)):
        raise ValueError(f"{what}: x {tuple(x.shape)} {x.dtype}, w {tuple(w.shape)} {w.dtype}, bias "
                         f"{None if bias is None else tuple(bias.shape)}: need x [M<= {MAX_M}, K], w [N, K] of one "
                         "dtype with contiguous rows, bias [N]")
    if split_k < 1 or any(b < 16 or b & (b - 1) for b in (block_n, block_k)):
        raise ValueError(f"{what}: split_k={split_k} block_n={block_n} block_k={block_k}: need split_k >= 1 "
                         "and block sizes that are powers of two >= 16")


def split_plan(k: int, block_k: int, split_k: int):
    """``(block_k, k_chunk, splits)`` the GEMM launches for K ``k``: the tile clipped to K, whole tiles per split,
    and the number of non-empty splits (``splits`` 1: no partials, no reduce)."""
    bk = min(block_k, max(16, next_pow2(k)))
    chunk = triton.cdiv(triton.cdiv(k, split_k), bk) * bk
    return bk, chunk, triton.cdiv(k, chunk)


def _gemm(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor], block_n: int, block_k: int,
          num_warps: int, num_stages: int, split_k: int) -> torch.Tensor:
    """Launch the GEMM kernel; returns y [M, N] (x's dtype, bias added) for one split, else the fp32 partials
    [split, M, N] (no bias)."""
    m, k = x.shape
    n = w.shape[0]
    bk, chunk, split = split_plan(k, block_k, split_k)
    if split > 1:
        out = torch.empty(split, m, n, dtype=torch.float32, device=x.device)
    else:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    pdl = use_pdl(x.device)
    launch = {"launch_pdl": True} if pdl else {}
    pf_step = max(1, 128 // x.element_size())  # elements per 128-byte line
    _skinny_gemm_kernel[(triton.cdiv(n, block_n), split)](
        x, w, bias if bias is not None else w, out, m, n, k, chunk, x.stride(0), w.stride(0), n,
        BLOCK_M=max(16, next_pow2(m)), BLOCK_N=block_n, BLOCK_K=bk, HAS_BIAS=bias is not None,
        PARTIAL=split > 1, DOT_F32=interpreting(), USE_GDC=pdl, num_warps=num_warps, num_stages=num_stages,
        PF_LINES=_prefetch_lines(chunk, block_n, x.element_size()) if pdl else 1, PF_STEP=pf_step,
        **launch)
    return out


def skinny_gemm(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor] = None, block_n: int = 16,
                block_k: int = 512, num_warps: int = 4, num_stages: int = 4, split_k: int = 1) -> torch.Tensor:
    """``x @ w.T (+ bias)`` for x ``[M, K]`` with ``1 <= M <= MAX_M`` (128) (the semantics of ``F.linear``).

    Args:
        x: [M, K] bf16/fp16 (fp32 under the interpreter), last dim contiguous.
        w: [N, K] same dtype, last dim contiguous; bias: optional [N].
        block_n, block_k, num_warps, num_stages: tile / pipeline choices (see :class:`SkinnyConfig`).
        split_k: programs along K; > 1 writes fp32 partials (``split_k * M * N * 4`` bytes) then reduces them.
    Returns:
        [M, N] in x's dtype (fp32 accumulation), contiguous.
    Raises:
        ValueError: M outside 1..MAX_M, shapes/dtypes disagree, split_k < 1, block sizes not powers of two >= 16,
            or CPU tensors outside the Triton interpreter.
    """
    _check(x, w, bias, block_n, block_k, split_k, "skinny_gemm")
    out = _gemm(x, w, bias, block_n, block_k, num_warps, num_stages, split_k)
    if out.dim() == 2:
        return out
    m, n = out.shape[1:]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    pdl = use_pdl(x.device)
    block = 1024
    _splitk_reduce_kernel[(triton.cdiv(m * n, block),)](
        out, bias if bias is not None else w, y, m * n, n, out.shape[0], HAS_BIAS=bias is not None, BLOCK=block,
        USE_GDC=pdl, num_warps=4, **({"launch_pdl": True} if pdl else {}))
    return y


def skinny_gemm_partials(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor] = None, block_n: int = 16,
                         block_k: int = 512, num_warps: int = 4, num_stages: int = 4, split_k: int = 1
                         ) -> torch.Tensor:
    """The GEMM kernel of :func:`skinny_gemm` without its split-K reduce (an epilogue fusion: the reduce runs in the
    next fused add + RMSNorm, :func:`sgl_kernel.triton.decode_fuse.splitk_add_rmsnorm`).

    Args: as :func:`skinny_gemm`.
    Returns:
        [M, N] in x's dtype with the bias added (the final output) when the K range fits one split (``split_k`` 1,
        or K too short to split); else the fp32 partial sums [S, M, N] (S >= 2 non-empty splits, no bias: the
        consumer adds it once), contiguous.
    Raises:
        ValueError: as :func:`skinny_gemm`.
    """
    _check(x, w, bias, block_n, block_k, split_k, "skinny_gemm_partials")
    return _gemm(x, w, bias, block_n, block_k, num_warps, num_stages, split_k)
