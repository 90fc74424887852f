"""Mixture-of-experts kernels: fused top-k softmax routing and a grouped expert GEMM.

Routing (Shazeer et al., "Outrageously Large Neural Networks", 2017, sec. 2.1): one program
per token computes the softmax over all experts in fp32 and picks the top k by repeated
arg-max, optionally renormalizing (Mixtral, Jiang et al. 2024, sec. 2.1); same semantics as
:func:`sglang.srt.layers.moe.router.select_experts`.

Expert computation (semantics of :func:`sglang.srt.layers.moe.fused_moe.fused_moe_ref`): the
(token, choice) pairs are sorted by expert and each expert's run is padded to a multiple of
``BLOCK_M`` (the block-aligned layout of MegaBlocks, Gale et al. 2023, sec. 5, and of vLLM's
``moe_align_block_size``), so every M tile of one grouped GEMM kernel belongs to one expert.
The kernel gathers its A rows through the sorted ids (no permuted copy of x), runs
``x @ w13[e]^T``, then SiLU-and-mul, then a second grouped GEMM ``h @ w2[e]^T`` scaled by the
routing weight; the k partial outputs of each token are summed in fp32. The alignment runs
as device tensor ops with sizes bounded from the shapes alone (no host synchronisation).
"""

from __future__ import annotations

import logging
from typing import Optional

import torch
import triton
import triton.language as tl

from sgl_kernel.triton.activation import silu_and_mul
from sgl_kernel.triton.common import check_cuda_or_interpret, interpreting, next_pow2

logger = logging.getLogger(__name__)


@triton.jit
def _topk_softmax_kernel(Logits, W_out, Id_out, stride_l, E, TOPK: tl.constexpr, RENORM: tl.constexpr,
                         BLOCK_E: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_E)
    mask = offs < E
    x = tl.load(Logits + row * stride_l + offs, mask=mask, other=float("-inf")).to(tl.float32)
    x = x - tl.max(x, 0)
    ex = tl.where(mask, tl.exp(x), 0.0)
    p = ex / tl.sum(ex, 0)
    p = tl.where(mask, p, -1.0)
    denom = 1.0
    if RENORM:  # first pass: the sum of the k largest probabilities
        q = p
        total = 0.0
        for j in tl.static_range(TOPK):
            best = tl.max(q, 0)
            idx = tl.min(tl.where(q == best, offs, BLOCK_E), 0)
            total += best
            q = tl.where(offs == idx, -1.0, q)
        denom = total
    for j in tl.static_range(TOPK):
        best = tl.max(p, 0)
        idx = tl.min(tl.where(p == best, offs, BLOCK_E), 0)  # first index reaching the maximum
        tl.store(W_out + row * TOPK + j, best / denom)
        tl.store(Id_out + row * TOPK + j, idx.to(tl.int64))
        p = tl.where(offs == idx, -1.0, p)


def fused_topk(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k softmax routing: router_logits [N, E] (CUDA, any float dtype) ->
    (topk_weights [N, top_k] fp32, topk_ids [N, top_k] int64), by decreasing weight.

    Raises:
        ValueError: logits not 2-D, top_k outside [1, E], or CPU tensors outside the Triton interpreter.
    """
    check_cuda_or_interpret(router_logits, what="fused_topk")
    if router_logits.dim() != 2 or router_logits.stride(-1) != 1:
        raise ValueError(f"fused_topk: router_logits must be [N, E] with contiguous rows, got {tuple(router_logits.shape)}")
    n, e = router_logits.shape
    if not 1 <= top_k <= e:
        raise ValueError(f"fused_topk: top_k={top_k} must be in [1, num_experts={e}]")
    w = torch.empty(n, top_k, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(n, top_k, dtype=torch.int64, device=router_logits.device)
    if n:
        _topk_softmax_kernel[(n,)](router_logits, w, ids, router_logits.stride(0), e, TOPK=top_k,
                                   RENORM=renormalize, BLOCK_E=max(16, next_pow2(e)), num_warps=1 if e <= 128 else 4)
    return w, ids


def moe_align_block_size(topk_ids: torch.Tensor, block_m: int, num_experts: int
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort (token, choice) pairs by expert and pad every expert's run to a multiple of ``block_m``.

    Args:
        topk_ids: [N, k] integer expert ids in ``[0, num_experts)``; a negative id marks a pair to skip (it gets
            no block: expert parallelism's padding rows, which the kernel then never computes).
    Returns:
        sorted_ids: [P] int32, flat pair indices ``n * k + j`` grouped by expert (stable), padding
            entries hold ``N * k``; P = ``N*k + min(N*k, E) * (block_m - 1)`` rounded up to block_m
            (an upper bound computed from the shapes, so no host sync).
        expert_ids: [P / block_m] int32, the expert of each M block, -1 for unused blocks.
    """
    flat = topk_ids.reshape(-1).to(torch.int64)
    nk = flat.numel()
    dev = flat.device
    key = torch.where(flat < 0, num_experts, flat)  # skipped pairs: one extra bin past the last expert
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=dev).scatter_add_(0, key, torch.ones_like(key))
    counts.narrow(0, num_experts, 1).zero_()  # a kernel, not `counts[E] = 0` (a host copy: breaks graph capture)
    padded = (counts + block_m - 1) // block_m * block_m
    pad_end = torch.cumsum(padded, 0)
    pad_start = pad_end - padded
    cnt_start = torch.cumsum(counts, 0) - counts
    order = torch.argsort(key, stable=True)
    e_sorted = key[order]
    total = triton.cdiv(nk + min(nk, num_experts) * (block_m - 1), block_m) * block_m
    dest = pad_start[e_sorted] + torch.arange(nk, device=dev) - cnt_start[e_sorted]
    dest = torch.where(e_sorted < num_experts, dest, total)  # skipped pairs land in a scratch entry, dropped below
    sorted_ids = torch.full((total + 1,), nk, dtype=torch.int32, device=dev)
    sorted_ids[dest] = order.to(torch.int32)
    sorted_ids = sorted_ids[:total]
    pad_end = pad_end[:num_experts]
    block_start = torch.arange(0, total, block_m, device=dev)
    expert_ids = torch.searchsorted(pad_end, block_start, right=True)
    expert_ids = torch.where(block_start < pad_end[-1], expert_ids, -1).to(torch.int32)
    return sorted_ids, expert_ids


@triton.jit
def _moe_gemm_kernel(A, B, C, TopkW, SortedIds, ExpertIds, N_out, K, num_valid, num_m_blocks,
                     stride_am, stride_be, stride_bn, stride_cm,
                     AS, BS, stride_asm, stride_bse, stride_bsn, GROUP_K, ROWS_PER_BS,
                     TOPK_DIV: tl.constexpr, MUL_W: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, DOT_F32: tl.constexpr, FP8_MODE: tl.constexpr):
    # FP8_MODE 0: A and B in the activation dtype (AS/BS unused). 1: e4m3 A with a scale per A row (AS[row *
    # stride_asm]) and e4m3 B with a scale per (expert, output channel) (BS[e * stride_bse + n * stride_bsn]), applied
    # after the K loop. 2: block-wise: A scales per (row, K group of GROUP_K), B scales per (expert, ROWS_PER_BS output
    # rows, K group), applied per K tile (BLOCK_K divides GROUP_K).
    pid = tl.program_id(0)
    num_n = tl.cdiv(N_out, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    gsize = tl.minimum(num_m_blocks - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % gsize
    pid_n = (pid % per_group) // gsize
    expert = tl.load(ExpertIds + pid_m).to(tl.int64)
    if expert >= 0:
        tok = tl.load(SortedIds + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        tmask = tok < num_valid
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = offs_n < N_out
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = A + (tok // TOPK_DIV)[:, None] * stride_am + offs_k[None, :]
        b_ptrs = B + expert * stride_be + offs_n[None, :].to(tl.int64) * stride_bn + offs_k[:, None]
        as_row = AS + (tok // TOPK_DIV) * stride_asm
        if FP8_MODE == 2:
            bs_row = BS + expert * stride_bse + (offs_n // ROWS_PER_BS).to(tl.int64) * stride_bsn
        else:
            bs_row = BS + expert * stride_bse + offs_n.to(tl.int64) * stride_bsn
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kmask = offs_k < K - k0
            a = tl.load(a_ptrs, mask=tmask[:, None] & kmask[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=kmask[:, None] & nmask[None, :], other=0.0)
            if DOT_F32:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            if FP8_MODE == 2:
                kb = k0 // GROUP_K
                a_s = tl.load(as_row + kb, mask=tmask, other=0.0)
                b_s = tl.load(bs_row + kb, mask=nmask, other=0.0)
                acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
            else:
                acc += tl.dot(a, b)
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K
        if FP8_MODE == 1:
            a_s = tl.load(as_row, mask=tmask, other=0.0)
            acc = acc * a_s[:, None] * tl.load(bs_row, mask=nmask, other=0.0)[None, :]
        if MUL_W:
            acc = acc * tl.load(TopkW + tok, mask=tmask, other=0.0).to(tl.float32)[:, None]
        tl.store(C + tok[:, None] * stride_cm + offs_n[None, :], acc.to(C.dtype.element_ty),
                 mask=tmask[:, None] & nmask[None, :])


def _gemm_config(tokens_per_expert: float, on_gpu: bool) -> dict:
    if not on_gpu:
        return dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, GROUP_M=4, num_warps=4, num_stages=1)
    if tokens_per_expert <= 16:
        return dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=4)
    if tokens_per_expert <= 64:
        return dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=4)
    return dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3)


def _grouped_gemm(a, b, c, topk_w, sorted_ids, expert_ids, topk_div, mul_w, cfg, a_scale=None, b_scale=None,
                  group_k=None, rows_per_scale=1):
    """One grouped GEMM launch; ``a_scale``/``b_scale`` given: e4m3 ``a``/``b`` (see ``_moe_gemm_kernel``'s
    FP8_MODE: per row x per channel when ``group_k`` is None, else block-wise)."""
    n_out, k = b.shape[1], b.shape[2]
    num_m = expert_ids.shape[0]
    grid = (num_m * triton.cdiv(n_out, cfg["BLOCK_N"]),)
    mode = 0 if b_scale is None else (1 if group_k is None else 2)
    a_s = a_scale if a_scale is not None else topk_w
    b_s = b_scale if b_scale is not None else topk_w
    _moe_gemm_kernel[grid](a, b, c, topk_w, sorted_ids, expert_ids, n_out, k, c.shape[0], num_m,
                           a.stride(0), b.stride(0), b.stride(1), c.stride(0),
                           a_s, b_s, a_s.stride(0) if mode else 0, b_s.stride(0) if mode else 0,
                           b_s.stride(1) if mode else 0, group_k or 1, rows_per_scale,
                           TOPK_DIV=topk_div, MUL_W=mul_w, DOT_F32=interpreting(), FP8_MODE=mode, **cfg)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
    """Grouped-GEMM MoE with the semantics of :func:`~sglang.srt.layers.moe.fused_moe.fused_moe_ref`.

    Args:
        x: [N, H] fp16/bf16/fp32 CUDA activations (contiguous rows).
        w13: [E, 2I, H] stacked gate/up weights; w2: [E, H, I] down weights (x's dtype, contiguous).
        topk_weights: [N, k] routing weights (used in fp32); topk_ids: [N, k] expert ids in [0, E); a negative id
            skips its (token, slot) pair: nothing is computed for it and it adds 0 (expert parallelism's padding).
    Returns:
        [N, H] in x.dtype.
    Raises:
        ValueError: inconsistent shapes/dtypes, or CPU tensors outside the Triton interpreter.
    Note: fp32 inputs run the products in TF32 on a GPU.
    """
    check_cuda_or_interpret(x, w13, w2, topk_weights, topk_ids, what="fused_moe")
    n, h = x.shape
    e, two_i, h2 = w13.shape
    if (h2 != h or w2.shape != (e, h, two_i // 2) or topk_ids.shape != topk_weights.shape
            or topk_ids.shape[0] != n or w13.dtype != x.dtype or w2.dtype != x.dtype):
        raise ValueError(f"fused_moe: inconsistent x={tuple(x.shape)} {x.dtype} w13={tuple(w13.shape)} {w13.dtype} "
                         f"w2={tuple(w2.shape)} {w2.dtype} topk_weights={tuple(topk_weights.shape)} "
                         f"topk_ids={tuple(topk_ids.shape)}")
    if n == 0:
        return torch.empty_like(x)
    x = x.contiguous()
    w13 = w13.contiguous()
    w2 = w2.contiguous()
    top_k = topk_ids.shape[1]
    nk = n * top_k
    cfg = _gemm_config(nk / e, x.is_cuda)
    sorted_ids, expert_ids = moe_align_block_size(topk_ids, cfg["BLOCK_M"], e)
    flat_w = topk_weights.reshape(-1).to(torch.float32).contiguous()
    inter1 = torch.empty(nk, two_i, dtype=x.dtype, device=x.device)
    _grouped_gemm(x, w13, inter1, flat_w, sorted_ids, expert_ids, top_k, False, cfg)
    act = silu_and_mul(inter1)
    # skipped pairs' rows are never written: zero them when they are summed with others (k > 1); with k == 1 the row
    # is returned as is, so it is zeroed after the sum (a [N, H] pass instead of a memset of [N*k, H])
    inter2 = (torch.zeros if top_k > 1 else torch.empty)(nk, h, dtype=x.dtype, device=x.device)
    _grouped_gemm(act, w2, inter2, flat_w, sorted_ids, expert_ids, 1, True, cfg)
    out = inter2.view(n, top_k, h).sum(dim=1, dtype=torch.float32).to(x.dtype)
    if top_k == 1:
        out.masked_fill_(topk_ids < 0, 0.0)
    return out


def fused_moe_fp8(x: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor,
                  w2_scale: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                  block_size: Optional[tuple[int, int]] = None, w13_rows_per_scale: int = 1,
                  w2_rows_per_scale: int = 1, a13_scale: Optional[torch.Tensor] = None,
                  a2_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The grouped-GEMM MoE of :func:`fused_moe` with e4m3 experts (W8A8; semantics of
    :func:`sglang.srt.layers.quantization.fp8_ref.fused_moe_fp8_ref`).

    Each GEMM's input is quantized to e4m3 first (x before the gate/up GEMM, the SiLU-and-mul output before the down
    GEMM): per token (:func:`~sgl_kernel.triton.fp8.per_token_quant_fp8`), with one static scale when ``a13_scale`` /
    ``a2_scale`` is given (a checkpoint's ``input_scale``), or per token and group of ``block_size[1]`` columns
    for block-wise experts (:func:`~sgl_kernel.triton.fp8.per_token_group_quant_fp8`, DeepSeek-V3 sec. 3.3).

    Args:
        x: [N, H] bf16/fp16 activations; topk_weights, topk_ids: [N, k] as :func:`fused_moe`.
        w13: [E, 2I, H] e4m3; w2: [E, H, I] e4m3 (contiguous).
        w13_scale, w2_scale: fp32. Per channel (``block_size`` None): [E, 2I] and [E, H]. Block-wise
            (``block_size = (block_n, block_k)``): [E, ceil(2I / w13_rows_per_scale), ceil(H / block_k)] and
            [E, ceil(H / w2_rows_per_scale), ceil(I / block_k)] (rows_per_scale: block_n, or 1 for scales expanded
            per row).
        a13_scale, a2_scale: optional one-element fp32 static input scales (per-channel mode only).
    Returns:
        [N, H] in x.dtype.
    Raises:
        ValueError: inconsistent shapes/dtypes, static scales with block-wise experts, a block size the kernel cannot
            tile, or CPU tensors outside the Triton interpreter.
    """
    from sgl_kernel.triton.fp8 import block_gemm_supported, per_token_group_quant_fp8, per_token_quant_fp8

    check_cuda_or_interpret(x, w13, w2, w13_scale, w2_scale, topk_weights, topk_ids, what="fused_moe_fp8")
    n, h = x.shape
    e, two_i, h2 = w13.shape
    fp8 = torch.float8_e4m3fn
    if (h2 != h or w2.shape != (e, h, two_i // 2) or topk_ids.shape != topk_weights.shape
            or topk_ids.shape[0] != n or w13.dtype != fp8 or w2.dtype != fp8):
        raise ValueError(f"fused_moe_fp8: inconsistent x={tuple(x.shape)} w13={tuple(w13.shape)} {w13.dtype} "
                         f"w2={tuple(w2.shape)} {w2.dtype} topk_ids={tuple(topk_ids.shape)}")
    if block_size is not None and (a13_scale is not None or a2_scale is not None):
        raise ValueError("fused_moe_fp8: block-wise experts take dynamic activation scales only")
    if n == 0:
        return torch.empty_like(x)
    top_k = topk_ids.shape[1]
    nk = n * top_k
    cfg = _gemm_config(nk / e, x.is_cuda)
    group_k = None
    if block_size is not None:
        group_k = int(block_size[1])
        cfg = dict(cfg, BLOCK_K=min(cfg["BLOCK_K"], group_k))
        if not block_gemm_supported(group_k, x.is_cuda and not interpreting()):
            raise ValueError(f"fused_moe_fp8: block size {group_k} along K is not supported by the kernel")

    def quant(a: torch.Tensor, static: Optional[torch.Tensor]):
        if group_k is not None:
            return per_token_group_quant_fp8(a, group_k)
        q, s = per_token_quant_fp8(a, static)
        return q, (s.reshape(1, 1).expand(a.shape[0], 1) if static is not None else s)

    x = x.contiguous()
    sorted_ids, expert_ids = moe_align_block_size(topk_ids, cfg["BLOCK_M"], e)
    flat_w = topk_weights.reshape(-1).to(torch.float32).contiguous()
    xq, xs = quant(x, a13_scale)
    inter1 = torch.empty(nk, two_i, dtype=x.dtype, device=x.device)
    _grouped_gemm(xq, w13.contiguous(), inter1, flat_w, sorted_ids, expert_ids, top_k, False, cfg, xs,
                  w13_scale.to(torch.float32).contiguous(), group_k, w13_rows_per_scale)
    aq, a_s = quant(silu_and_mul(inter1), a2_scale)
    # negative expert ids (expert parallelism's padding) are skipped: their rows are zeroed as in fused_moe
    inter2 = (torch.zeros if top_k > 1 else torch.empty)(nk, h, dtype=x.dtype, device=x.device)
    _grouped_gemm(aq, w2.contiguous(), inter2, flat_w, sorted_ids, expert_ids, 1, True, cfg, a_s,
                  w2_scale.to(torch.float32).contiguous(), group_k, w2_rows_per_scale)
    out = inter2.view(n, top_k, h).sum(dim=1, dtype=torch.float32).to(x.dtype)
    if top_k == 1:
        out.masked_fill_(topk_ids < 0, 0.0)
    return out
