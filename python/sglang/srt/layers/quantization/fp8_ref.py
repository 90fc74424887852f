"""Torch references of the FP8 (e4m3) formats and GEMMs: what the kernels must compute, and the CPU path.

Format: OCP FP8 E4M3 (Micikevicius et al., "FP8 Formats for Deep Learning", 2022, sec. 3): ``torch.float8_e4m3fn``,
largest finite value 448, 3 mantissa bits (a relative rounding error of at most 2^-4 for normal values). A tensor
``v`` is stored as ``q = round_to_nearest_even(clamp(v / s, -448, 448))`` with a float32 scale ``s`` and read back as
``q * s``. Granularities used here:

* per output channel (rows of a weight ``[N, K]``): ``s[n] = amax(w[n, :]) / 448``;
* per token (rows of an activation ``[M, K]``): ``s[m] = amax(x[m, :]) / 448`` computed at run time (dynamic), or one
  calibrated scale for every token (static, a checkpoint's ``input_scale``);
* block-wise (DeepSeek-AI, "DeepSeek-V3 Technical Report", 2024, sec. 3.3.2): weights in 128 x 128 blocks
  (``weight_scale_inv`` [ceil(N/128), ceil(K/128)], the multiplier that dequantizes), activations in 1 x 128 groups
  per token.

Every function works on any device; CPU tensors of ``float8_e4m3fn`` support the casts used here (no fp8 arithmetic:
values are widened to float32 first). The GPU kernels (:mod:`sgl_kernel.triton.fp8`, ``torch._scaled_mm``, the FP8
branch of :mod:`sgl_kernel.triton.moe`) are tested against these on fresh random inputs.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
SCALE_FLOOR = 1e-10  # amax of an all-zero row/block is raised to this, so every scale is finite and positive


def quantize_with_scale(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``clamp(x / scale, -448, 448)`` in float32, rounded to e4m3 (nearest even). ``scale`` broadcasts against x."""
    return (x.float() / scale.float()).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def amax_scale(amax: torch.Tensor) -> torch.Tensor:
    """``max(amax, 1e-10) / 448`` in float32 (IEEE division, as the kernels' ``div_rn``): the scale that maps
    ``amax`` to the largest e4m3 value. The divisor is a tensor: CUDA torch turns division by a Python number into
    a multiplication by its reciprocal, which differs from the quotient in the last bit."""
    a = amax.float().clamp(min=SCALE_FLOOR)
    return a / a.new_full((), FP8_MAX)


def quant_per_token_ref(x: torch.Tensor, static_scale: Optional[torch.Tensor] = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """x ``[M, K]`` -> ``(q [M, K] e4m3, s)``: dynamic ``s [M, 1]`` = amax per row / 448, or with ``static_scale``
    (one element) ``s`` = that scale as ``[1]`` for every row."""
    if static_scale is not None:
        s = static_scale.reshape(1).float()
        return quantize_with_scale(x, s), s
    s = amax_scale(x.abs().amax(dim=-1, keepdim=True))
    return quantize_with_scale(x, s), s


def _pad_cols(t: torch.Tensor, group: int) -> torch.Tensor:
    pad = (-t.shape[-1]) % group
    return F.pad(t, (0, pad)) if pad else t


def quant_per_token_group_ref(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x ``[M, K]`` -> ``(q [M, K] e4m3, s [M, ceil(K / group)] fp32)``: one scale per row and group of ``group``
    consecutive columns (the last group may be shorter)."""
    m, k = x.shape
    xp = _pad_cols(x.float(), group).view(m, -1, group)
    s = amax_scale(xp.abs().amax(dim=-1))
    q = quantize_with_scale(xp, s.unsqueeze(-1)).view(m, -1)[:, :k]
    return q, s


def quant_weight_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w ``[N, K]`` -> ``(q [N, K] e4m3, s [N] fp32)``, ``s[n] = amax(w[n]) / 448``."""
    s = amax_scale(w.abs().amax(dim=-1))
    return quantize_with_scale(w, s.unsqueeze(-1)), s


def quant_weight_per_tensor(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w -> ``(q e4m3, s)`` with one scale ``s`` (a 0-d fp32 tensor) = amax(w) / 448."""
    s = amax_scale(w.abs().amax())
    return quantize_with_scale(w, s), s


def quant_weight_block(w: torch.Tensor, block_n: int, block_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """w ``[N, K]`` -> ``(q [N, K] e4m3, s [ceil(N / block_n), ceil(K / block_k)] fp32)``: one scale per
    ``block_n x block_k`` block (edge blocks may be smaller); ``w ~= q * s`` blockwise."""
    n, k = w.shape
    wp = _pad_cols(_pad_cols(w.float(), block_k).t(), block_n).t()  # [Np, Kp]
    nb, kb = wp.shape[0] // block_n, wp.shape[1] // block_k
    blocks = wp.view(nb, block_n, kb, block_k)
    s = amax_scale(blocks.abs().amax(dim=(1, 3)))
    q = quantize_with_scale(blocks, s[:, None, :, None]).view(nb * block_n, kb * block_k)[:n, :k]
    return q, s


def expand_block_scale(s: torch.Tensor, rows: int, cols: int, rows_per_scale: int, block_k: int) -> torch.Tensor:
    """A block scale ``[ceil(rows / rows_per_scale), ceil(cols / block_k)]`` widened to one value per element
    ``[rows, cols]``."""
    return s.float().repeat_interleave(rows_per_scale, 0)[:rows].repeat_interleave(block_k, 1)[:, :cols]


def dequant_weight(q: torch.Tensor, s: torch.Tensor, block: Optional[tuple[int, int]] = None,
                   rows_per_scale: Optional[int] = None) -> torch.Tensor:
    """``q * s`` in float32: per output channel (``block`` None; ``s`` [N], [N, 1] or one value) or block-wise
    (``block = (block_n, block_k)``; ``s`` [ceil(N / r), ceil(K / block_k)] with ``r = rows_per_scale``, default
    block_n)."""
    if block is None:
        return q.float() * (s.float().reshape(-1, 1) if s.numel() > 1 else s.float().reshape(()))
    r = rows_per_scale or block[0]
    return q.float() * expand_block_scale(s, q.shape[0], q.shape[1], r, block[1])


def w8a8_scaled_gemm_ref(xq: torch.Tensor, xs: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor,
                         bias: Optional[torch.Tensor] = None, out_dtype: torch.dtype = torch.bfloat16,
                         group_k: Optional[int] = None, rows_per_scale: int = 1) -> torch.Tensor:
    """Reference of :func:`sgl_kernel.triton.fp8.w8a8_scaled_gemm` (same arguments): ``(xq * xs) @ (wq * ws)^T +
    bias`` in float32, cast to ``out_dtype``."""
    m, k = xq.shape
    if group_k is None:
        a = xq.float() * xs.float().reshape(-1, 1) if xs.numel() > 1 else xq.float() * xs.float().reshape(())
        w = dequant_weight(wq, ws)
    else:
        a = xq.float() * expand_block_scale(xs, m, k, 1, group_k)
        w = dequant_weight(wq, ws, (rows_per_scale, group_k), rows_per_scale)
    y = a @ w.t()
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


def fp8_linear_ref(x: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor, bias: Optional[torch.Tensor] = None,
                   block: Optional[tuple[int, int]] = None, rows_per_scale: Optional[int] = None,
                   input_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The W8A8 linear layer, emulated: x ``[..., K]`` quantized to e4m3 (per token, with ``input_scale`` statically,
    or per token and ``block[1]``-column group for block-wise weights), both operands dequantized, an fp32 matmul,
    + bias, cast to x's dtype -> ``[..., N]``. This is the CPU path of every FP8 linear layer and the reference of
    the GPU ones."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if block is not None:
        xq, xs = quant_per_token_group_ref(x2, block[1])
        a = xq.float() * expand_block_scale(xs, x2.shape[0], x2.shape[1], 1, block[1])
    else:
        xq, xs = quant_per_token_ref(x2, input_scale)
        a = xq.float() * (xs if input_scale is None else xs.reshape(()))
    y = a @ dequant_weight(wq, ws, block, rows_per_scale).t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).reshape(*shape[:-1], wq.shape[0])


def skinny_fp8_gemm_ref(x: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor,
                        bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Reference of :func:`sgl_kernel.triton.fp8.skinny_fp8_gemm` (weight-only FP8): ``x @ (wq * ws)^T + bias`` with
    x not quantized, fp32 accumulation, in x's dtype."""
    y = x.float() @ dequant_weight(wq, ws).t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def fused_moe_fp8_ref(x: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor,
                      w2_scale: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                      block_size: Optional[tuple[int, int]] = None, w13_rows_per_scale: Optional[int] = None,
                      w2_rows_per_scale: Optional[int] = None, a13_scale: Optional[torch.Tensor] = None,
                      a2_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Reference of :func:`sgl_kernel.triton.moe.fused_moe_fp8` (same arguments) and the CPU path of FP8 experts: per
    expert, the gate/up GEMM's input and the down GEMM's input (``silu(gate) * up``, rounded to x's dtype as the
    kernel's intermediate is) quantized as :func:`fp8_linear_ref` does, each GEMM on dequantized operands in fp32;
    the top-k outputs weighted and summed in fp32 -> ``[N, H]`` in x's dtype."""
    n, h = x.shape
    out = torch.zeros(n, h, dtype=torch.float32, device=x.device)
    flat_ids = topk_ids.reshape(-1)
    flat_w = topk_weights.reshape(-1).float()
    token_of = torch.arange(n, device=x.device).repeat_interleave(topk_ids.shape[1])
    for expert in torch.unique(flat_ids).tolist():
        if expert < 0:  # a skipped (token, slot) pair (expert parallelism's padding) adds 0, as in the kernel
            continue
        sel = (flat_ids == expert).nonzero(as_tuple=True)[0]
        tok = token_of[sel]
        gate_up = fp8_linear_ref(x[tok], w13[expert], w13_scale[expert], None, block_size, w13_rows_per_scale,
                                 a13_scale)
        gate, up = gate_up.float().chunk(2, dim=-1)
        act = (F.silu(gate) * up).to(x.dtype)
        y = fp8_linear_ref(act, w2[expert], w2_scale[expert], None, block_size, w2_rows_per_scale, a2_scale)
        out.index_add_(0, tok, y.float() * flat_w[sel].unsqueeze(1))
    return out.to(x.dtype)
