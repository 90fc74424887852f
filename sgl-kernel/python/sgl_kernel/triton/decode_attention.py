"""Split-KV paged decode attention (flash-decoding) with grouped-query heads.

Technique: Dao et al., "Flash-Decoding for long-context inference" (2023): the
keys of one request are cut into ``num_kv_splits`` chunks processed by
separate programs, each producing a partial softmax-weighted output plus its
log-sum-exp; a second kernel merges the partials (the online-softmax rescaling
of Milakov & Gimelshein, "Online normalizer calculation for softmax", 2018).
GQA (Ainslie et al., 2023): one program handles all ``num_heads //
num_kv_heads`` query heads that share a KV head, so every K/V row is read from
HBM once per split and the QK^T / PV products are small matrix multiplies.

KV layout: the paged pool of :class:`~sglang.srt.mem_cache.memory_pool.MHATokenToKVPool`,
``k_buf``/``v_buf`` ``[slots, kv_heads, head_dim]``; the slot of position ``p``
of batch row ``b`` is ``req_to_token[req_pool_indices[b], p]``. The number of
splits is fixed per launch (not derived from sequence lengths on the host), so
a launch can be captured in a CUDA graph and replayed with other lengths.

Decode step within 1.3x of the memory floor: the split count follows the grid-size rule of
:func:`default_num_kv_splits` (one wave of resident programs: long splits, few partials); at one split the split
kernel normalises and writes the output itself (no partials, no reduce launch); K tiles are loaded as contiguous
``[BLOCK_N, head_dim]`` rows (16-byte vector loads, one offset tensor shared with V, both issued before the first
product). ``legacy=True`` / ``policy="legacy"`` keep the previous kernel and rule for side-by-side benchmarks.
The fused split reduce was removed (``SGLANG_DECODE_FUSED_REDUCE``, last split program merges via an arrival
counter): on one H100 its graph replay was within noise of the two-launch reduce at batch 1/32/128
(benchmark/results/archive/decode/2026-11-26_step_1652utc_h100.md), so the simpler path stays.

Variable-length batches (the ``balanced`` policy, the serving default): a serving batch mixes rows of 1 to several
thousand keys, and one split program walks a whole row at large batch sizes, so a long row started late ends the
step with the GPU mostly idle. The launch can take a row order (:func:`decode_row_order`, longest first, computed on
the device, so a CUDA graph replays it with the new lengths) and a length-aware split rule (``min_split_len``: a row
uses only as many of the grid's splits as its length needs, and a one-split row writes its output directly).
"""

from __future__ import annotations

import logging
import math
import os
from typing import Optional

import torch
import triton
import triton.language as tl

from sgl_kernel.triton.common import check_cuda_or_interpret, interpreting, next_pow2, use_pdl

logger = logging.getLogger(__name__)

_LOG2E = 1.4426950408889634


@triton.jit
def _decode_split_kernel(
    Q, K_buf, V_buf, Req_to_token, Req_pool_idx, Seq_lens, Mid_o, Mid_lse, Out, Order,
    qk_scale,  # softmax scale * log2(e) * K dequantization scale (1.0 unless the cache is FP8)
    v_scale,  # V dequantization scale (1.0 unless the cache is FP8)
    min_split_len,  # LEN_SPLITS: a row uses cdiv(seq_len, min_split_len) splits, at most NUM_SPLITS
    stride_qb, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_r2t,
    stride_mob, stride_moh, stride_mos, stride_mlb, stride_mlh, stride_ob, stride_oh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, DOT_F32: tl.constexpr,
    K_ROWS: tl.constexpr, DIRECT_OUT: tl.constexpr, USE_GDC: tl.constexpr = False,
    HAS_ORDER: tl.constexpr = False, LEN_SPLITS: tl.constexpr = False,
):
    # K_ROWS: load each K tile as [BLOCK_N, BLOCK_D] (one contiguous head_dim row per slot: 16-byte vector loads)
    # and transpose in registers for QK^T; False keeps the original [BLOCK_D, BLOCK_N] gather.
    # DIRECT_OUT (only with NUM_SPLITS == 1): write the normalised output straight into Out in its dtype, so no
    # partial results and no reduce launch.
    # USE_GDC: launched with programmatic dependent launch; wait for the previous kernel before any memory access,
    # then let the next kernel launch (and prefetch its weights) while this one runs.
    if USE_GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    # HAS_ORDER: program row i handles batch row Order[i] (rows sorted longest first, so the hardware, which starts
    # programs in grid order, starts the longest KV walks first and the short ones fill the last wave).
    # LEN_SPLITS: a row of seq_len keys uses n = min(NUM_SPLITS, cdiv(seq_len, min_split_len)) splits of split_len
    # keys; programs past the row's last non-empty split exit without writing; a row with one split writes Out
    # directly (normalised) and the reduce skips it.
    if HAS_ORDER:
        b = tl.load(Order + tl.program_id(0)).to(tl.int64)
    else:
        b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(Seq_lens + b).to(tl.int32)
    if LEN_SPLITS:
        n_split = tl.minimum(tl.maximum(tl.cdiv(seq_len, min_split_len), 1), NUM_SPLITS)
    else:
        n_split = NUM_SPLITS
    split_len = tl.cdiv(tl.cdiv(seq_len, n_split), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)
    if LEN_SPLITS:
        n_used = tl.cdiv(seq_len, split_len)
        if split < n_used:
            _decode_split_body(Q, K_buf, V_buf, Req_to_token, Req_pool_idx, Mid_o, Mid_lse, Out, b, kvh, split,
                               start, end, n_used == 1, qk_scale, v_scale, stride_qb, stride_qh, stride_kt,
                               stride_kh, stride_vt, stride_vh, stride_r2t, stride_mob, stride_moh, stride_mos,
                               stride_mlb, stride_mlh, stride_ob, stride_oh, GROUP, HEAD_DIM, BLOCK_D, BLOCK_H, BLOCK_N,
                               DOT_F32, K_ROWS)
    else:
        _decode_split_body(Q, K_buf, V_buf, Req_to_token, Req_pool_idx, Mid_o, Mid_lse, Out, b, kvh, split, start,
                           end, DIRECT_OUT, qk_scale, v_scale, stride_qb, stride_qh, stride_kt, stride_kh, stride_vt,
                           stride_vh, stride_r2t, stride_mob, stride_moh, stride_mos, stride_mlb, stride_mlh,
                           stride_ob, stride_oh, GROUP, HEAD_DIM, BLOCK_D, BLOCK_H, BLOCK_N, DOT_F32, K_ROWS)


@triton.jit
def _decode_split_body(Q, K_buf, V_buf, Req_to_token, Req_pool_idx, Mid_o, Mid_lse, Out, b, kvh, split, start, end,
                       direct, qk_scale, v_scale, stride_qb, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                       stride_r2t, stride_mob, stride_moh, stride_mos, stride_mlb, stride_mlh, stride_ob, stride_oh,
                       GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr,
                       BLOCK_N: tl.constexpr, DOT_F32: tl.constexpr, K_ROWS: tl.constexpr):
    # direct: write the normalised output into Out (the row's only split) instead of a partial result; a constexpr
    # (DIRECT_OUT) or, with LEN_SPLITS, a per-row scalar
    req = tl.load(Req_pool_idx + b).to(tl.int64)

    offs_g = tl.arange(0, BLOCK_H)
    mask_h = offs_g < GROUP
    offs_h = kvh * GROUP + offs_g
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    q = tl.load(Q + b * stride_qb + offs_h[:, None] * stride_qh + offs_d[None, :],
                mask=mask_h[:, None] & mask_d[None, :], other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    k_base = K_buf + kvh * stride_kh
    v_base = V_buf + kvh * stride_vh
    r2t = Req_to_token + req * stride_r2t
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        slots = tl.load(r2t + offs_n, mask=mask_n, other=0).to(tl.int64)
        if K_ROWS:  # K and V tiles share one offset tensor (the wrapper checks equal slot strides) and are
            # issued together, so both are in flight before the first dot
            offs_kv = slots[:, None] * stride_kt + offs_d[None, :]
            mask_kv = mask_n[:, None] & mask_d[None, :]
            k = tl.load(k_base + offs_kv, mask=mask_kv, other=0.0).to(q.dtype)
            v = tl.load(v_base + offs_kv, mask=mask_kv, other=0.0).to(q.dtype)
            qk = tl.dot(q, tl.trans(k)) * qk_scale  # [BLOCK_H, BLOCK_N], log2 domain
        else:
            k = tl.load(k_base + slots[None, :] * stride_kt + offs_d[:, None],
                        mask=mask_n[None, :] & mask_d[:, None], other=0.0).to(q.dtype)
            qk = tl.dot(q, k) * qk_scale  # [BLOCK_H, BLOCK_N], log2 domain
        qk = tl.where(mask_n[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.math.exp2(qk - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        if not K_ROWS:
            v = tl.load(v_base + slots[:, None] * stride_vt + offs_d[None, :],
                        mask=mask_n[:, None] & mask_d[None, :], other=0.0).to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v)
        m_i = m_new

    nonempty = end > start
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    out = acc / l_safe[:, None] * v_scale  # sum_j p_j (s_v v_j) = s_v sum_j p_j v_j: V dequantized in registers
    if direct:
        tl.store(Out + b * stride_ob + offs_h[:, None] * stride_oh + offs_d[None, :], out.to(Out.dtype.element_ty),
                 mask=mask_h[:, None] & mask_d[None, :])
    else:
        lse = tl.where(nonempty, m_i + tl.math.log2(l_safe), float("-inf"))
        tl.store(Mid_o + b * stride_mob + offs_h[:, None] * stride_moh + split * stride_mos + offs_d[None, :], out,
                 mask=mask_h[:, None] & mask_d[None, :])
        tl.store(Mid_lse + b * stride_mlb + offs_h * stride_mlh + split, lse, mask=mask_h)


@triton.jit
def _decode_reduce_kernel(
    Mid_o, Mid_lse, Out, Seq_lens, min_split_len,
    stride_mob, stride_moh, stride_mos, stride_mlb, stride_mlh, stride_ob, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
    LEN_SPLITS: tl.constexpr = False, SPLIT_BLOCK_N: tl.constexpr = 64,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    if LEN_SPLITS:  # the split kernel's rule (same integers): rows with one split were written directly
        seq_len = tl.load(Seq_lens + b).to(tl.int32)
        n_split = tl.minimum(tl.maximum(tl.cdiv(seq_len, min_split_len), 1), NUM_SPLITS)
        split_len = tl.cdiv(tl.cdiv(seq_len, n_split), SPLIT_BLOCK_N) * SPLIT_BLOCK_N
        n_used = tl.cdiv(seq_len, split_len)
        if n_used > 1:
            _decode_reduce_body(Mid_o, Mid_lse, Out, b, h, n_used, stride_mob, stride_moh, stride_mos, stride_mlb,
                                stride_mlh, stride_ob, stride_oh, HEAD_DIM, BLOCK_D, BLOCK_S)
    else:
        _decode_reduce_body(Mid_o, Mid_lse, Out, b, h, NUM_SPLITS, stride_mob, stride_moh, stride_mos, stride_mlb,
                            stride_mlh, stride_ob, stride_oh, HEAD_DIM, BLOCK_D, BLOCK_S)


@triton.jit
def _decode_reduce_body(Mid_o, Mid_lse, Out, b, h, n_used, stride_mob, stride_moh, stride_mos, stride_mlb, stride_mlh,
                        stride_ob, stride_oh, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr):
    offs_s = tl.arange(0, BLOCK_S)
    mask_s = offs_s < n_used
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    lse = tl.load(Mid_lse + b * stride_mlb + h * stride_mlh + offs_s, mask=mask_s, other=float("-inf"))
    m = tl.max(lse, 0)
    w = tl.where(lse > float("-inf"), tl.math.exp2(lse - m), 0.0)
    o = tl.load(Mid_o + b * stride_mob + h * stride_moh + offs_s[:, None] * stride_mos + offs_d[None, :],
                mask=mask_s[:, None] & mask_d[None, :], other=0.0)
    out = tl.sum(o * w[:, None], 0) / tl.sum(w, 0)
    tl.store(Out + b * stride_ob + h * stride_oh + offs_d, out.to(Out.dtype.element_ty), mask=mask_d)


SPLIT_POLICIES = ("balanced", "wave", "legacy")
#: keys per split below which the ``balanced`` policy gives a row fewer splits than the grid has (two BLOCK_N tiles
#: of the multi-split config): a short row is one program writing its output directly, a long row uses every split
BALANCED_MIN_SPLIT_LEN = 128


def decode_row_order(seq_lens: torch.Tensor) -> torch.Tensor:
    """The launch order of the ``balanced`` policy: batch rows sorted by KV length, longest first, ``[bs]`` int64 on
    ``seq_lens``' device (one ``torch.argsort``, no host sync: it can be captured in a CUDA graph and replayed with
    other lengths).

    Why: a decode step's split programs walk their rows' whole KV; the GPU starts programs in grid order as earlier
    ones finish, so with rows in batch order a long row that starts late ends the step alone while the rest of the
    GPU idles. Starting the longest walks first is Graham's longest-processing-time-first list scheduling (Graham,
    "Bounds on multiprocessing timing anomalies", SIAM J. Appl. Math. 1969, sec. 4: within 4/3 of the optimal
    makespan), and the short rows fill the last wave.
    """
    return torch.argsort(seq_lens, descending=True)


def default_num_kv_splits(batch_size: int, num_kv_heads: int, device: torch.device, max_splits: int = 16,
                          policy: str = "wave", num_sms: Optional[int] = None, programs_per_sm: int = 2) -> int:
    """Splits per (request, KV head) of the split kernel; depends only on the batch shape (never on sequence
    lengths), so one value serves every CUDA-graph replay of a captured batch size.

    ``policy="balanced"`` (the backend's default): the ``wave`` count for the grid; the backend launches it with
    :func:`decode_row_order` (longest rows first) and ``min_split_len=BALANCED_MIN_SPLIT_LEN`` (short rows use fewer
    splits), see :func:`decode_attention_fwd`. The count itself depends only on the batch shape.
    ``policy="wave"``: the largest count whose grid ``batch_size * num_kv_heads * splits`` still fits in
    one wave of resident programs, ``floor(programs_per_sm * num_sms / (batch_size * num_kv_heads))``, clamped to
    ``1..max_splits``: the grid fills the GPU about once, each program walks one long stretch of the sequence,
    and at one split there are no partial results and no reduce launch. ``programs_per_sm=2``: measured on one
    H100 (132 SMs, Llama-3.1-8B decode, 1K context, 2026-11-25, ``benchmark/decode/attention_rope_kernels.py``): at batch 32
    one split (256 programs) reads KV at 0.80 of the HBM copy bandwidth, two splits at 0.67 and 3-16 splits at
    0.68-0.70; at batch 128 one split is best (0.95). A split program uses ~39 KiB of shared memory and 80
    registers (sm_90a AOT build), so up to 5 could be resident per SM, but filling that many with short splits
    costs more in partial results and the reduce than it gains in occupancy.
    ``policy="legacy"``: the former rule, ``next_pow2(ceil(8 * num_sms / (batch_size * num_kv_heads)))``
    (several waves of short programs), kept for old-vs-new benchmarks.
    Args:
        num_sms: multiprocessor count (None: read from ``device``; CPU devices return ``min(4, max_splits)``).
    Returns 1..max_splits. Raises ValueError for an unknown policy or non-positive sizes.
    """
    if policy not in SPLIT_POLICIES:
        raise ValueError(f"default_num_kv_splits: policy={policy!r}; use one of {SPLIT_POLICIES}")
    if batch_size < 1 or num_kv_heads < 1 or max_splits < 1 or programs_per_sm < 1:
        raise ValueError(f"default_num_kv_splits: sizes must be >= 1, got batch_size={batch_size}, "
                         f"num_kv_heads={num_kv_heads}, max_splits={max_splits}, programs_per_sm={programs_per_sm}")
    if num_sms is None:
        if device.type != "cuda":
            return min(4, max_splits)
        num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    rows = batch_size * num_kv_heads
    if policy == "legacy":
        return max(1, min(max_splits, next_pow2(math.ceil(8 * num_sms / rows))))
    return max(1, min(max_splits, (programs_per_sm * num_sms) // rows))  # wave and balanced


def decode_attention_workspace(batch_size: int, num_heads: int, head_dim: int, num_kv_splits: int,
                               device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Allocate the partial-result buffers: ``mid_o`` [bs, num_heads, splits, head_dim] fp32 and
    ``mid_lse`` [bs, num_heads, splits] fp32 (log2-domain log-sum-exp)."""
    mid_o = torch.empty(batch_size, num_heads, num_kv_splits, head_dim, dtype=torch.float32, device=device)
    mid_lse = torch.empty(batch_size, num_heads, num_kv_splits, dtype=torch.float32, device=device)
    return mid_o, mid_lse


def _decode_config(head_dim: int, group: int, num_kv_splits: int = 1, arch: int = 0) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages) for the split kernel.

    ``arch`` is ``major * 10 + minor`` of the GPU (0: unknown / interpreter). On sm_90+ (228 KB of shared memory
    per SM) head_dim <= 128 runs a 3-stage pipeline: in CUDA graphs on an H200 (benchmark/decode/attention_configs.py, context
    1024, 32 q / 8 KV heads, 2026-11-26, ``benchmark/results/archive/decode/2026-11-26_step_2029utc_h200.md``) one split
    with BLOCK_N 128 / 3 stages read KV at 0.84 of copy bandwidth at batch 32 (0.46 with the 64 / 2-stage
    default) and 0.98 at batch 128 (0.78); at 16 splits (batch 1) 64 / 2 stages stayed best (5.7 vs 5.9 us).
    """
    if head_dim > 128 or group > 16:
        return 32, 4, 2
    if arch >= 90:
        return (128, 4, 3) if num_kv_splits == 1 else (64, 4, 2)
    return 64, 4, 2


SMALL_GRID_TILE_ENV = "SGLANG_DECODE_ATTN_SMALL_GRID_TILE"


def small_grid_tile(bs: int, num_kv_heads: int, num_kv_splits: int, device: torch.device
                    ) -> Optional[tuple[int, int, int]]:
    """``(BLOCK_N, num_warps, num_stages)`` from ``SGLANG_DECODE_ATTN_SMALL_GRID_TILE="BLOCK_N/warps/stages"`` for a
    one-split launch whose grid fits one wave at two programs per SM (``bs * num_kv_heads <= 2 * SMs``: batch 32 of
    Llama-3.1-8B on an H100); None when unset or not such a launch (then :func:`_decode_config` decides). Why:
    at batch 32 the 128 / 4 / 3 tile reads KV at 0.88 of copy bandwidth against 0.94 at batch 128, so this lets
    the GPU A/B (``scripts/gpu/one_gpu.sh decode_switch_ab`` with ``DECODE_SETS``) try other tiles for that grid only. Read at launch (a CUDA graph
    keeps the tile it captured).

    Raises:
        ValueError: a malformed value (not three positive integers, BLOCK_N not a power of two >= 16).
    """
    val = os.environ.get(SMALL_GRID_TILE_ENV, "").strip()
    if not val:
        return None
    try:
        tile = tuple(int(x) for x in val.split("/"))
    except ValueError:
        tile = ()
    if len(tile) != 3 or min(tile) < 1 or tile[0] < 16 or tile[0] & (tile[0] - 1):
        raise ValueError(f"{SMALL_GRID_TILE_ENV}={val!r}: use BLOCK_N/num_warps/num_stages, e.g. 128/8/3")
    if num_kv_splits != 1 or device.type != "cuda" \
            or bs * num_kv_heads > 2 * torch.cuda.get_device_properties(device).multi_processor_count:
        return None
    return tile


def _arch_of(device: torch.device) -> int:
    """``major * 10 + minor`` of a CUDA device; 0 for CPU / the Triton interpreter."""
    if device.type != "cuda" or interpreting():
        return 0
    major, minor = torch.cuda.get_device_capability(device)
    return major * 10 + minor


def decode_attention_fwd(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, out: torch.Tensor,
                         req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                         sm_scale: float, num_kv_splits: int, mid_o: torch.Tensor, mid_lse: torch.Tensor,
                         block_n: Optional[int] = None, num_warps: Optional[int] = None,
                         num_stages: Optional[int] = None, legacy: bool = False, order: Optional[torch.Tensor] = None,
                         min_split_len: int = 0, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Paged decode attention of one new token per request, written into ``out``.

    Args:
        q: [bs, num_heads, head_dim] (fp16/bf16/fp32; last dim contiguous).
        k_buf, v_buf: [slots, num_kv_heads, head_dim] KV pool buffers (any float dtype incl. fp8,
            cast to q's dtype on load; slot and head strides are passed to the kernel, so strided views such as a
            token-major pool's work; last dim contiguous); the new token's K/V must already be written.
        out: [bs, num_heads, head_dim] output (any float dtype; last dim contiguous).
        req_to_token: [rows, max_context] int32/int64; req_pool_indices [bs] and seq_lens [bs]
            integer device tensors (seq_lens counts the new token; each >= 1).
        sm_scale: softmax scale (usually head_dim**-0.5).
        num_kv_splits: partial results per (request, KV head), >= 1 (see :func:`default_num_kv_splits`).
        mid_o, mid_lse: workspaces at least ``[bs, num_heads, num_kv_splits, head_dim]`` and
            ``[bs, num_heads, num_kv_splits]`` fp32 (see :func:`decode_attention_workspace`); only the
            leading ``[:bs, :, :num_kv_splits]`` part is used.
        block_n, num_warps, num_stages: tile/launch overrides for tuning sweeps (None: defaults per head_dim).
        legacy: True runs the former kernel (K tiles gathered transposed, a reduce launch even
            at one split), for old-vs-new benchmarks; False (default) loads K rows contiguously and, at
            ``num_kv_splits == 1``, writes ``out`` directly without the reduce kernel.
        order: None (programs take rows in batch order) or a ``[bs]`` integer device tensor holding a permutation of
            ``0..bs-1``: program row ``i`` handles batch row ``order[i]``, so the rows listed first start first
            (:func:`decode_row_order`: longest first). Results do not depend on it.
        min_split_len: 0 (every row uses ``num_kv_splits`` splits) or > 0: a row of ``s`` keys uses
            ``min(num_kv_splits, ceil(s / min_split_len))`` splits (its programs past the last non-empty split
            exit at once, writing nothing), and a row left with one split writes ``out`` directly (the reduce
            skips it). Only meaningful with ``num_kv_splits > 1``.
        k_scale, v_scale: dequantization scales of an FP8 cache (K = stored K x ``k_scale``, V likewise; see
            :mod:`sglang.srt.mem_cache.kv_quant`); 1.0 otherwise. The FP8 tiles are widened to q's dtype in
            registers (exact) and the scales applied without a dequantized copy: ``k_scale`` is folded into the
            softmax scale (``q . (s k) = s (q . k)``) and ``v_scale`` multiplies the normalised output
            (``sum p (s v) = s sum p v``) in every split program, whether it writes ``out`` directly or a partial
            result (the reduce is linear in the partial outputs, so scaling them before it is the same).
    Raises:
        ValueError: inconsistent shapes, num_heads not a multiple of num_kv_heads, non-CUDA tensors
            outside the Triton interpreter, ``order`` not ``[bs]``, a negative ``min_split_len``, or ``order`` /
            ``min_split_len`` with ``legacy``.
    Note: with fp32 inputs on a GPU the products run in TF32 (Triton's default dot precision).
    Tuning switches, read at launch: ``SGLANG_DECODE_ATTN_SMALL_GRID_TILE`` (A/B, off by default; see
    :func:`small_grid_tile`; explicit ``block_n`` / ``num_warps`` / ``num_stages`` still win) and
    ``SGLANG_DECODE_PDL`` (programmatic dependent launch of the split kernel, on by default where
    :func:`sgl_kernel.triton.common.use_pdl` allows; ``=0`` opts out; never with ``legacy``).
    """
    bs, nh, hd = q.shape
    nkv = k_buf.shape[1]
    check_cuda_or_interpret(q, k_buf, v_buf, out, req_to_token, what="decode_attention_fwd")
    if nh % nkv or k_buf.shape[2] != hd or v_buf.shape != k_buf.shape or tuple(out.shape) != (bs, nh, hd) \
            or k_buf.stride(2) != 1 or v_buf.stride(2) != 1:
        raise ValueError(f"decode_attention_fwd: q {tuple(q.shape)}, k_buf {tuple(k_buf.shape)}, "
                         f"v_buf {tuple(v_buf.shape)}, out {tuple(out.shape)} are inconsistent (or a K/V buffer's "
                         "head_dim is not contiguous)")
    if num_kv_splits < 1 or mid_o.shape[0] < bs or mid_o.shape[2] < num_kv_splits or mid_o.shape[1] != nh \
            or mid_o.shape[3] != hd or mid_lse.shape[0] < bs or mid_lse.shape[2] < num_kv_splits:
        raise ValueError(f"decode_attention_fwd: workspace {tuple(mid_o.shape)}/{tuple(mid_lse.shape)} too small "
                         f"for bs={bs}, heads={nh}, splits={num_kv_splits}, head_dim={hd}")
    if min_split_len < 0 or (order is not None and tuple(order.shape) != (bs,)) \
            or (legacy and (order is not None or min_split_len)):
        raise ValueError(f"decode_attention_fwd: order {None if order is None else tuple(order.shape)} (want "
                         f"({bs},)) / min_split_len={min_split_len} (want >= 0); neither applies with legacy=True")
    if bs == 0:
        return
    group = nh // nkv
    block_d = max(16, next_pow2(hd))
    block_h = max(16, next_pow2(group))
    block_n_d, warps_d, stages_d = (None if legacy else small_grid_tile(bs, nkv, num_kv_splits, q.device)) \
        or _decode_config(hd, group, num_kv_splits, _arch_of(q.device))
    block_n = block_n or block_n_d
    warps = num_warps or warps_d
    stages = num_stages or stages_d
    direct = num_kv_splits == 1 and not legacy
    len_splits = min_split_len > 0 and num_kv_splits > 1
    pdl = not legacy and use_pdl(q.device)
    k_rows = not legacy and k_buf.stride(0) == v_buf.stride(0)  # K and V tiles share one offset tensor
    _decode_split_kernel[(bs, nkv, num_kv_splits)](
        q, k_buf, v_buf, req_to_token, req_pool_indices, seq_lens, mid_o, mid_lse, out,
        order if order is not None else seq_lens, sm_scale * _LOG2E * k_scale, v_scale, max(1, min_split_len),
        q.stride(0), q.stride(1), k_buf.stride(0), k_buf.stride(1), v_buf.stride(0), v_buf.stride(1),
        req_to_token.stride(0), mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0),
        mid_lse.stride(1), out.stride(0), out.stride(1),
        GROUP=group, HEAD_DIM=hd, BLOCK_D=block_d, BLOCK_H=block_h, BLOCK_N=block_n, NUM_SPLITS=num_kv_splits,
        DOT_F32=interpreting(), K_ROWS=k_rows, DIRECT_OUT=direct, USE_GDC=pdl, HAS_ORDER=order is not None,
        LEN_SPLITS=len_splits, num_warps=warps, num_stages=stages, **({"launch_pdl": True} if pdl else {}),
    )
    if direct:
        return
    _decode_reduce_kernel[(bs, nh)](
        mid_o, mid_lse, out, seq_lens, max(1, min_split_len),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        out.stride(0), out.stride(1),
        HEAD_DIM=hd, BLOCK_D=block_d, NUM_SPLITS=num_kv_splits, BLOCK_S=max(2, next_pow2(num_kv_splits)),
        LEN_SPLITS=len_splits, SPLIT_BLOCK_N=block_n, num_warps=4 if block_d >= 128 else 2,
    )
