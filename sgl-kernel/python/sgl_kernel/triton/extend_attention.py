"""Paged prefill/extend attention: new tokens attend to a cached prefix plus, causally, to each other.

Technique: FlashAttention-2 tiling with an online softmax (Dao, "FlashAttention-2",
2023, alg. 1): a program owns ``BLOCK_M`` query rows of one (request, head) and
streams key/value tiles of ``BLOCK_N`` rows, so the score matrix never reaches
HBM. The keys come from the paged pool through ``req_to_token`` (the new tokens'
K/V are written to the pool before the call), in two phases: tiles that every
query row of the block may see (the cached prefix and earlier new tokens, no
mask) and the diagonal tiles with the causal mask. Query blocks are scheduled longest first (the causal work of
block ``m`` grows with ``m``), so a prefill does not end on a tail wave of the longest blocks.

Rows with ``extend_len == 1`` are decode rows; a mixed batch therefore runs
through this kernel unchanged.
"""

from __future__ import annotations

import logging

import torch
import triton
import triton.language as tl

from sgl_kernel.triton.common import check_cuda_or_interpret, interpreting, next_pow2

logger = logging.getLogger(__name__)

_LOG2E = 1.4426950408889634


@triton.jit
def _attend_tile(q, acc, m_i, l_i, n0, kv_end, qpos, k_base, v_base, r2t, stride_kt, stride_vt, offs_d, mask_d,
                 qk_scale, CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr):
    offs_n = n0 + tl.arange(0, BLOCK_N)
    mask_n = offs_n < kv_end
    slots = tl.load(r2t + offs_n, mask=mask_n, other=0).to(tl.int64)
    k = tl.load(k_base + slots[None, :] * stride_kt + offs_d[:, None],
                mask=mask_n[None, :] & mask_d[:, None], other=0.0).to(q.dtype)
    qk = tl.dot(q, k) * qk_scale
    if CAUSAL:
        visible = mask_n[None, :] & (offs_n[None, :] <= qpos[:, None])
    else:
        visible = mask_n[None, :]
    qk = tl.where(visible, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    p = tl.math.exp2(qk - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_base + slots[:, None] * stride_vt + offs_d[None, :],
                mask=mask_n[:, None] & mask_d[None, :], other=0.0).to(q.dtype)
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v)
    return acc, m_new, l_i


@triton.jit
def _extend_kernel(
    Q, Out, K_buf, V_buf, Req_to_token, Req_pool_idx, Prefix_lens, Extend_lens, Extend_start,
    qk_scale,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_kt, stride_kh, stride_vt, stride_vh, stride_r2t,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, DOT_F32: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    # heaviest query blocks first (issue 27): block m of a causal prefill reads m + 1 key tiles and the hardware
    # launches programs in grid order, so the long blocks start in the first waves and the short ones fill the tail
    mblk = tl.num_programs(2) - 1 - tl.program_id(2)
    ext_len = tl.load(Extend_lens + b).to(tl.int32)
    if mblk * BLOCK_M < ext_len:
        prefix = tl.load(Prefix_lens + b).to(tl.int32)
        q_start = tl.load(Extend_start + b).to(tl.int64)
        req = tl.load(Req_pool_idx + b).to(tl.int64)
        kvh = h // GROUP
        offs_m = mblk * BLOCK_M + tl.arange(0, BLOCK_M)
        mask_m = offs_m < ext_len
        offs_d = tl.arange(0, BLOCK_D)
        mask_d = offs_d < HEAD_DIM
        q = tl.load(Q + (q_start + offs_m)[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
                    mask=mask_m[:, None] & mask_d[None, :], other=0.0)
        if DOT_F32:
            q = q.to(tl.float32)
        qpos = prefix + offs_m

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        k_base = K_buf + kvh * stride_kh
        v_base = V_buf + kvh * stride_vh
        r2t = Req_to_token + req * stride_r2t
        # keys every row of this block sees: positions < prefix + first row of the block
        full_end = prefix + mblk * BLOCK_M
        for n0 in range(0, full_end, BLOCK_N):
            acc, m_i, l_i = _attend_tile(q, acc, m_i, l_i, n0, full_end, qpos, k_base, v_base, r2t, stride_kt,
                                         stride_vt, offs_d, mask_d, qk_scale, False, BLOCK_N)
        # diagonal: keys up to the block's last row, causal mask
        diag_end = tl.minimum(prefix + (mblk + 1) * BLOCK_M, prefix + ext_len)
        for n0 in range(full_end, diag_end, BLOCK_N):
            acc, m_i, l_i = _attend_tile(q, acc, m_i, l_i, n0, diag_end, qpos, k_base, v_base, r2t, stride_kt,
                                         stride_vt, offs_d, mask_d, qk_scale, True, BLOCK_N)
        out = acc / l_i[:, None]
        tl.store(Out + (q_start + offs_m)[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
                 out.to(Out.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])


def _extend_config(head_dim: int, on_gpu: bool) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages); sized for Hopper's 228 KB shared memory."""
    if not on_gpu:
        return 32, 32, 4, 1
    if head_dim > 128:
        return 64, 32, 4, 2
    if head_dim > 64:
        return 128, 64, 8, 2
    return 128, 64, 4, 2


def extend_attention_fwd(q: torch.Tensor, out: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
                         req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, prefix_lens: torch.Tensor,
                         extend_lens: torch.Tensor, extend_start_loc: torch.Tensor, max_extend_len: int,
                         sm_scale: float) -> None:
    """Causal attention of every request's new tokens over its paged KV, written into ``out``.

    Args:
        q: [N, num_heads, head_dim] queries of all new tokens, request after request (last dim contiguous).
        out: [N, num_heads, head_dim] output (any float dtype).
        k_buf, v_buf: [slots, num_kv_heads, head_dim] pool buffers; positions ``0 .. prefix+extend-1`` of
            every request must already hold K/V (new tokens included).
        req_to_token: [rows, max_context] int32/int64 slot map.
        req_pool_indices, prefix_lens, extend_lens, extend_start_loc: [bs] integer device tensors;
            request i's queries are rows ``extend_start_loc[i] ..+ extend_lens[i]`` at absolute positions
            ``prefix_lens[i] ..``.
        max_extend_len: host int >= max(extend_lens) (sizes the grid; extra programs exit at once).
        sm_scale: softmax scale.
    Raises:
        ValueError: inconsistent shapes, num_heads not a multiple of num_kv_heads, non-CUDA tensors
            outside the Triton interpreter.
    Note: with fp32 inputs on a GPU the products run in TF32 (Triton's default dot precision).
    """
    n, nh, hd = q.shape
    nkv = k_buf.shape[1]
    check_cuda_or_interpret(q, out, k_buf, v_buf, req_to_token, what="extend_attention_fwd")
    if nh % nkv or k_buf.shape[2] != hd or v_buf.shape != k_buf.shape or tuple(out.shape) != (n, nh, hd):
        raise ValueError(f"extend_attention_fwd: q {tuple(q.shape)}, out {tuple(out.shape)}, "
                         f"k_buf {tuple(k_buf.shape)}, v_buf {tuple(v_buf.shape)} are inconsistent")
    bs = req_pool_indices.shape[0]
    if n == 0 or bs == 0 or max_extend_len <= 0:
        return
    block_m, block_n, warps, stages = _extend_config(hd, q.is_cuda)
    block_m = min(block_m, max(16, next_pow2(max_extend_len)))
    grid = (bs, nh, triton.cdiv(max_extend_len, block_m))
    _extend_kernel[grid](
        q, out, k_buf, v_buf, req_to_token, req_pool_indices, prefix_lens, extend_lens, extend_start_loc,
        sm_scale * _LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_buf.stride(0), k_buf.stride(1),
        v_buf.stride(0), v_buf.stride(1), req_to_token.stride(0),
        GROUP=nh // nkv, HEAD_DIM=hd, BLOCK_D=max(16, next_pow2(hd)), BLOCK_M=block_m, BLOCK_N=block_n,
        DOT_F32=interpreting(), num_warps=warps, num_stages=stages,
    )
