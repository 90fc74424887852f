"""Paged prefill/extend attention: new tokens attend to a cached prefix plus, causally, to each other.

Technique: FlashAttention-2 tiling with an online softmax (Dao, "FlashAttention-2",
2023, alg. 1 and sec. 3.1.1, causal masking only on the diagonal blocks): a program owns ``BLOCK_M`` query rows of
one (request, head), keeps its Q tile on chip for the whole loop and streams key/value tiles of ``BLOCK_N`` rows, so
the score matrix never reaches HBM. The keys come from the paged pool through ``req_to_token`` (the new tokens' K/V
are written to the pool before the call), in two loops: whole tiles that every query row of the block may see (the
radix-cached prefix and the earlier new tokens) with no mask and no bounds check at all, then the few tiles that
straddle the diagonal (or the end of the keys) with the causal mask. The softmax runs in base 2 with ``log2(e)``
folded into the scale (one FMA + ``exp2`` per score). Query blocks are scheduled longest first (the causal work of
block ``m`` grows with ``m``), so a prefill does not end on a tail wave of the longest blocks. Tile sizes are chosen
per GPU architecture in :func:`extend_config` (the only place).

Rows with ``extend_len == 1`` are decode rows; a mixed batch therefore runs
through this kernel unchanged.
"""

from __future__ import annotations

import functools
import logging
from typing import Dict, Optional, Tuple

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from sgl_kernel.triton.common import check_cuda_or_interpret, interpreting, next_pow2

logger = logging.getLogger(__name__)

_LOG2E = 1.4426950408889634


@triton.jit
def _attend_tile(q, acc, m_i, l_i, n0, kv_end, qpos, k_base, v_base, r2t, stride_kt, stride_vt, offs_d, mask_d,
                 qk_scale, MASKED: tl.constexpr, EVEN_D: tl.constexpr, BLOCK_N: tl.constexpr):
    offs_n = n0 + tl.arange(0, BLOCK_N)
    mask_n = offs_n < kv_end
    if MASKED:
        slots = tl.load(r2t + offs_n, mask=mask_n, other=0).to(tl.int64)
        if EVEN_D:
            kv_mask = mask_n[:, None]
        else:
            kv_mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(k_base + slots[:, None] * stride_kt + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_base + slots[:, None] * stride_vt + offs_d[None, :], mask=kv_mask, other=0.0)
    else:
        slots = tl.load(r2t + offs_n).to(tl.int64)
        if EVEN_D:
            k = tl.load(k_base + slots[:, None] * stride_kt + offs_d[None, :])
            v = tl.load(v_base + slots[:, None] * stride_vt + offs_d[None, :])
        else:
            k = tl.load(k_base + slots[:, None] * stride_kt + offs_d[None, :], mask=mask_d[None, :], other=0.0)
            v = tl.load(v_base + slots[:, None] * stride_vt + offs_d[None, :], mask=mask_d[None, :], other=0.0)
    qk = tl.dot(q, tl.trans(k.to(q.dtype)))
    if MASKED:
        qk = tl.where(mask_n[None, :] & (offs_n[None, :] <= qpos[:, None]), qk, float("-inf"))
    # every row sees >= 1 key of the first tile it visits, so m_new is finite and no row produces NaN
    m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
    p = tl.math.exp2(qk * qk_scale - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype))
    return acc, m_new, l_i


@triton.jit
def _extend_kernel(
    Q, Out, K_buf, V_buf, Req_to_token, Req_pool_idx, Prefix_lens, Extend_lens, Extend_start,
    qk_scale,  # softmax scale * log2(e) * K dequantization scale (1.0 unless the cache is FP8)
    v_scale,  # V dequantization scale (1.0 unless the cache is FP8)
    stride_qt, stride_qh, stride_ot, stride_oh, stride_kt, stride_kh, stride_vt, stride_vh, stride_r2t,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, DOT_F32: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    # heaviest query blocks first: block m of a causal prefill reads m + 1 key tiles and the hardware
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
        # whole tiles every row of this block sees (keys < prefix + first row of the block): no mask
        full_end = prefix + mblk * BLOCK_M
        unmasked_end = (full_end // BLOCK_N) * BLOCK_N
        for n0 in range(0, unmasked_end, BLOCK_N):
            acc, m_i, l_i = _attend_tile(q, acc, m_i, l_i, n0, unmasked_end, qpos, k_base, v_base, r2t, stride_kt,
                                         stride_vt, offs_d, mask_d, qk_scale, False, HEAD_DIM == BLOCK_D, BLOCK_N)
        # tiles straddling the diagonal, up to the block's last row: causal mask and key bound
        diag_end = tl.minimum(prefix + (mblk + 1) * BLOCK_M, prefix + ext_len)
        for n0 in range(unmasked_end, diag_end, BLOCK_N):
            acc, m_i, l_i = _attend_tile(q, acc, m_i, l_i, n0, diag_end, qpos, k_base, v_base, r2t, stride_kt,
                                         stride_vt, offs_d, mask_d, qk_scale, True, HEAD_DIM == BLOCK_D, BLOCK_N)
        out = acc / l_i[:, None] * v_scale  # V dequantized in registers: sum p (s v) = s sum p v
        tl.store(Out + (q_start + offs_m)[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
                 out.to(Out.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])


ExtendConfig = Tuple[int, int, int, int]

# opt-in shared memory one program (CTA) may use, bytes, by compute-capability major (minor where it differs): the
# CUDA programming guide's table "Technical Specifications per Compute Capability"; used when no device is at hand
# (AOT builds) - on a live GPU ``shared_memory_per_block_optin`` of its properties is taken instead
SMEM_OPTIN_BY_ARCH: Dict[Tuple[int, int], int] = {(8, 0): 166912, (8, 6): 101376, (8, 7): 166912, (8, 9): 101376,
                                                   (9, 0): 232448, (10, 0): 232448, (12, 0): 101376}

# candidates per head-dim class, fastest first (2026-11-26 tile sweeps on the H100 at head_dim 128, bf16), ending
# with tiles that fit any listed GPU in fp32
_HOPPER_D128 = ((128, 128, 8, 3), (128, 64, 8, 2), (64, 64, 4, 2), (32, 32, 4, 1))
_AMPERE_D128 = ((128, 64, 8, 2), (64, 64, 4, 2), (32, 32, 4, 1))
_D64 = ((128, 64, 4, 2), (64, 64, 4, 2), (32, 32, 4, 1))
_D256 = ((64, 32, 4, 2), (32, 32, 4, 1), (16, 16, 4, 1))


def smem_limit_for_arch(arch: Tuple[int, int]) -> int:
    """Opt-in shared memory per program in bytes for compute capability ``arch`` from
    :data:`SMEM_OPTIN_BY_ARCH` (unknown minor -> the major's ``.0`` entry; unknown major -> 101376, the smallest)."""
    return SMEM_OPTIN_BY_ARCH.get(tuple(arch), SMEM_OPTIN_BY_ARCH.get((arch[0], 0), 101376))


def extend_smem_bytes(config: ExtendConfig, head_dim: int, dtype_bytes: int) -> int:
    """Upper estimate of the shared memory of :func:`_extend_kernel` under ``config``, bytes: the Q tile
    (BLOCK_M x BLOCK_D) plus ``num_stages`` buffers of one K and one V tile (BLOCK_N x BLOCK_D each), at the padded
    head dim ``BLOCK_D = max(16, next_pow2(head_dim))`` and ``dtype_bytes`` per element (4 for fp32, 2 for bf16/fp16).
    Triton's pipeliner keeps at most that many buffers and the softmax works in registers, so the compiled kernel
    needs no more (AOT sm_90a, d 128: 164 KB compiled vs 224 KB estimated in bf16; 289 KB vs 448 KB in fp32)."""
    block_m, block_n, _, stages = config
    block_d = max(16, next_pow2(head_dim))
    return (block_m * block_d + max(1, stages) * 2 * block_n * block_d) * dtype_bytes


def extend_configs(head_dim: int, arch: Optional[Tuple[int, int]], dtype_bytes: int = 2,
                   smem_limit: Optional[int] = None) -> Tuple[ExtendConfig, ...]:
    """The candidate configs of :func:`extend_attention_fwd` for this shape and GPU, fastest first, keeping only those
    whose :func:`extend_smem_bytes` fits ``smem_limit`` (default :func:`smem_limit_for_arch`); the smallest candidate
    is kept if none fits. ``arch=None`` (Triton CPU interpreter): ``((32, 32, 4, 1),)``."""
    if arch is None:
        return ((32, 32, 4, 1),)
    if head_dim > 128:
        cands = _D256
    elif head_dim > 64:
        cands = _HOPPER_D128 if arch[0] >= 9 else _AMPERE_D128
    else:
        cands = _D64
    limit = smem_limit if smem_limit is not None else smem_limit_for_arch(arch)
    fit = tuple(c for c in cands if extend_smem_bytes(c, head_dim, dtype_bytes) <= limit)
    return fit or cands[-1:]


def extend_config(head_dim: int, arch: Optional[Tuple[int, int]], dtype_bytes: int = 2,
                  smem_limit: Optional[int] = None) -> ExtendConfig:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) of :func:`extend_attention_fwd`: the one place tiles are chosen.

    Args:
        head_dim: per-head dimension.
        arch: CUDA compute capability ``(major, minor)``; ``None`` for the Triton CPU interpreter (small tiles).
        dtype_bytes: element size of q/K/V (2 for bf16/fp16, 4 for fp32).
        smem_limit: opt-in shared memory per program in bytes (default: by ``arch``, :data:`SMEM_OPTIN_BY_ARCH`).
    Returns the fastest of :func:`extend_configs` that fits the shared memory. Hopper/Blackwell at head_dim in
    (64, 128], bf16: 128 x 128 tiles, 8 warps, 3 stages (tile sweeps, 8K causal prefill, d 128, H100: fastest;
    164 KB compiled for sm_90a); in fp32 that config needs 289 KB (> 227 KB, the OutOfResources the fp32
    qwen3 test hit), so (128, 64, 8, 2) is chosen. Ampere/Ada and the other head dims keep the earlier tiles.
    """
    return extend_configs(head_dim, arch, dtype_bytes, smem_limit)[0]


@functools.lru_cache(maxsize=16)
def _arch(device_index: int) -> Tuple[int, int]:
    """(major, minor) compute capability of CUDA device ``device_index`` (cached)."""
    return tuple(torch.cuda.get_device_capability(device_index))


def auto_configs(q: torch.Tensor) -> Tuple[int, list]:
    """The device index (-1 off CUDA) and the candidate configs, fastest first, that :func:`extend_attention_fwd`
    picks from for queries ``q`` ([N, num_heads, head_dim]) when no ``config`` is given: on CUDA those of
    :func:`extend_configs` for the device's arch, ``q``'s element size and its opt-in shared memory per block."""
    hd = q.shape[-1]
    if not q.is_cuda:
        return -1, extend_configs(hd, None)
    dev = q.device.index if q.device.index is not None else torch.cuda.current_device()
    return dev, extend_configs(hd, _arch(dev), q.element_size(), _smem_optin(dev))


@functools.lru_cache(maxsize=16)
def _smem_optin(device_index: int) -> int:
    props = torch.cuda.get_device_properties(device_index)
    optin = getattr(props, "shared_memory_per_block_optin", 0)  # absent from old torch builds: the arch table
    return int(optin) if optin else smem_limit_for_arch((props.major, props.minor))


# per (device, head_dim, dtype): index into extend_configs() after a launch raised OutOfResources (the estimate is an
# upper bound, so this is a safety net for a future Triton that allocates more; at most one step down per shape)
_FALLBACK: Dict[tuple, int] = {}


def extend_attention_fwd(q: torch.Tensor, out: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
                         req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, prefix_lens: torch.Tensor,
                         extend_lens: torch.Tensor, extend_start_loc: torch.Tensor, max_extend_len: int,
                         sm_scale: float, config: Optional[ExtendConfig] = None, k_scale: float = 1.0,
                         v_scale: float = 1.0) -> None:
    """Causal attention of every request's new tokens over its paged KV, written into ``out``.

    Args:
        q: [N, num_heads, head_dim] queries of all new tokens, request after request (last dim contiguous).
        out: [N, num_heads, head_dim] output (any float dtype).
        k_buf, v_buf: [slots, num_kv_heads, head_dim] pool buffers (slot and head strides free, e.g. a token-major
            pool's strided views; last dim contiguous); positions ``0 .. prefix+extend-1`` of every request must
            already hold K/V (new tokens included).
        req_to_token: [rows, max_context] int32/int64 slot map.
        req_pool_indices, prefix_lens, extend_lens, extend_start_loc: [bs] integer device tensors;
            request i's queries are rows ``extend_start_loc[i] ..+ extend_lens[i]`` at absolute positions
            ``prefix_lens[i] ..``.
        max_extend_len: host int >= max(extend_lens) (sizes the grid; extra programs exit at once).
        sm_scale: softmax scale.
        config: (BLOCK_M, BLOCK_N, num_warps, num_stages) override (benchmarks, tests); default
            :func:`extend_config` for this device, head dim and dtype (fits the device's
            ``shared_memory_per_block_optin``); if its first launch raises ``OutOfResources`` the next candidate of
            :func:`extend_configs` is used from then on for that (device, head_dim, dtype).
            BLOCK_M and BLOCK_N must be powers of two >= 16.
        k_scale, v_scale: dequantization scales of an FP8 cache (1.0 otherwise): K/V tiles are loaded in FP8,
            widened to q's dtype in registers, ``k_scale`` folded into the softmax scale and ``v_scale`` applied to
            the normalised output (no dequantized copy of the cache).
    Raises:
        ValueError: inconsistent shapes, num_heads not a multiple of num_kv_heads, non-CUDA tensors
            outside the Triton interpreter, a config whose tiles are not powers of two >= 16.
        triton.runtime.errors.OutOfResources: an explicit ``config`` that does not fit, or the fallback neither.
    Note: with fp32 inputs on a GPU the products run in TF32 (Triton's default dot precision).
    """
    n, nh, hd = q.shape
    nkv = k_buf.shape[1]
    check_cuda_or_interpret(q, out, k_buf, v_buf, req_to_token, what="extend_attention_fwd")
    if nh % nkv or k_buf.shape[2] != hd or v_buf.shape != k_buf.shape or tuple(out.shape) != (n, nh, hd) \
            or k_buf.stride(2) != 1 or v_buf.stride(2) != 1:
        raise ValueError(f"extend_attention_fwd: q {tuple(q.shape)}, out {tuple(out.shape)}, "
                         f"k_buf {tuple(k_buf.shape)}, v_buf {tuple(v_buf.shape)} are inconsistent (or a K/V buffer's "
                         "head_dim is not contiguous)")
    auto = config is None
    if auto:
        dev, cands = auto_configs(q)
        key = (dev, hd, q.dtype)
        config = cands[min(_FALLBACK.get(key, 0), len(cands) - 1)]
    block_m, block_n, warps, stages = config
    if any(x < 16 or x & (x - 1) for x in (block_m, block_n)):
        raise ValueError(f"extend_attention_fwd: config {config}: BLOCK_M and BLOCK_N must be powers of two >= 16")
    bs = req_pool_indices.shape[0]
    if n == 0 or bs == 0 or max_extend_len <= 0:
        return
    args = (q, out, k_buf, v_buf, req_to_token, req_pool_indices, prefix_lens, extend_lens, extend_start_loc, bs,
            max_extend_len, sm_scale, k_scale, v_scale)
    try:
        _launch(args, config)
    except OutOfResources as e:
        if not auto or key in _FALLBACK or len(cands) < 2:
            raise
        _FALLBACK[key] = 1
        logger.warning("extend_attention_fwd: config %s of head_dim %d %s is out of resources (%s); using %s",
                       config, hd, q.dtype, e, cands[1])
        _launch(args, cands[1])


def _launch(args: tuple, config: ExtendConfig) -> None:
    (q, out, k_buf, v_buf, req_to_token, req_pool_indices, prefix_lens, extend_lens, extend_start_loc, bs,
     max_extend_len, sm_scale, k_scale, v_scale) = args
    block_m, block_n, warps, stages = config
    nh, hd, nkv = q.shape[1], q.shape[2], k_buf.shape[1]
    block_m = min(block_m, max(16, next_pow2(max_extend_len)))
    grid = (bs, nh, triton.cdiv(max_extend_len, block_m))
    _extend_kernel[grid](
        q, out, k_buf, v_buf, req_to_token, req_pool_indices, prefix_lens, extend_lens, extend_start_loc,
        sm_scale * _LOG2E * k_scale, v_scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_buf.stride(0), k_buf.stride(1),
        v_buf.stride(0), v_buf.stride(1), req_to_token.stride(0),
        GROUP=nh // nkv, HEAD_DIM=hd, BLOCK_D=max(16, next_pow2(hd)), BLOCK_M=block_m, BLOCK_N=block_n,
        DOT_F32=interpreting(), num_warps=warps, num_stages=stages,
    )
