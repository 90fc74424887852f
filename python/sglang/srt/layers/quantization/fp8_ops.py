"""FP8 GEMM front end: one call per layer kind, the fastest available path on CUDA, the torch reference elsewhere.

* per-channel weights (online ``--quantization fp8``, per-tensor and per-channel checkpoints): activation quantized
  per token (or with the checkpoint's static ``input_scale``) by :func:`sgl_kernel.triton.fp8.per_token_quant_fp8`,
  then ``torch._scaled_mm`` with row-wise scales (``scale_a`` [M, 1], ``scale_b`` [1, N], bf16 out; needs compute
  capability >= 8.9 and N, K multiples of 16) or, for other shapes/dtypes, the Triton W8A8 GEMM. For decode-sized
  batches the decode-GEMM table (:mod:`sglang.srt.layers.decode_gemm`, measured on the device) may pick the
  weight-only streaming kernel :func:`sgl_kernel.triton.fp8.skinny_fp8_gemm` instead, where it beat the path above.
* block-wise weights (``weight_block_size``): activation quantized per token and K group, then the Triton W8A8 GEMM
  with the scales applied per K tile (DeepSeek-V3 sec. 3.3); a block size the kernel cannot tile runs the reference.
* experts: :func:`sgl_kernel.triton.moe.fused_moe_fp8`.

Off CUDA (or without Triton) every call is the matching reference of :mod:`.fp8_ref`, which emulates the same
numerics (e4m3 storage and activation rounding, fp32 accumulation), so CPU CI covers the loaders and methods.
"""

from __future__ import annotations

import functools
import importlib
import logging
from typing import Optional

import torch

from sglang.srt.layers.quantization import fp8_ref

logger = logging.getLogger(__name__)


@functools.lru_cache(maxsize=None)
def _module(name: str):
    """``sgl_kernel.triton.<name>`` or None when Triton is unusable (then every op keeps its torch reference)."""
    try:
        return importlib.import_module(f"sgl_kernel.triton.{name}")
    except ImportError as e:
        logger.warning("FP8 Triton kernels unavailable (%s); using the torch references", e)
        return None


def _kernels(x: torch.Tensor, name: str = "fp8"):
    return _module(name) if x.is_cuda else None


@functools.lru_cache(maxsize=None)
def scaled_mm_available(device_index: int) -> bool:
    """Whether ``torch._scaled_mm`` with row-wise scales can run on CUDA device ``device_index`` (compute capability
    >= 8.9, the first with FP8 tensor cores)."""
    return hasattr(torch, "_scaled_mm") and torch.cuda.get_device_capability(device_index) >= (8, 9)


def scaled_mm_shape_ok(n: int, k: int) -> bool:
    """``torch._scaled_mm``'s alignment rule: both GEMM dims of the weight multiples of 16."""
    return n % 16 == 0 and k % 16 == 0


def scaled_mm_rowwise(xq: torch.Tensor, xs: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor,
                      bias: Optional[torch.Tensor], out_dtype: torch.dtype) -> torch.Tensor:
    """``torch._scaled_mm(xq, wq.T)`` with row-wise scales: xq [M, K] e4m3, xs [M, 1] or one value, wq [N, K] e4m3
    (its transpose is the column-major operand cuBLAS/CUTLASS want), ws [N] -> [M, N] in ``out_dtype`` (computed in
    bf16, the dtype row-wise scaling outputs; bias added after)."""
    m, n = xq.shape[0], wq.shape[0]
    if xs.numel() == 1:
        xs = xs.reshape(1, 1).expand(m, 1).contiguous()
    y = torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws.reshape(1, n), out_dtype=torch.bfloat16)
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y if out_dtype == torch.bfloat16 else y.to(out_dtype)


def linear_per_channel(x: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor, bias: Optional[torch.Tensor] = None,
                       input_scale: Optional[torch.Tensor] = None, table=None) -> torch.Tensor:
    """FP8 linear with per-output-channel weight scales: x ``[..., K]`` (model dtype), wq ``[N, K]`` e4m3, ws ``[N]``
    fp32, bias ``[N]``, ``input_scale`` one fp32 value (static activation scale) or None (dynamic per token) ->
    ``[..., N]`` in x's dtype. ``table``: the decode-GEMM table (or None); see the module docstring."""
    shape = x.shape
    n, k = wq.shape
    kern = _kernels(x)
    if kern is None:
        return fp8_ref.fp8_linear_ref(x, wq, ws, bias, None, None, input_scale)
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    if table is not None and 1 <= m <= 128 and x2.dtype in (torch.bfloat16, torch.float16):
        cfg = table.lookup(n, k, wq.dtype, m)
        if cfg is not None:
            return kern.skinny_fp8_gemm(x2, wq, ws, bias, **cfg.kwargs()).reshape(*shape[:-1], n)
    xq, xs = kern.per_token_quant_fp8(x2, input_scale)
    if x2.dtype != torch.float32 and scaled_mm_shape_ok(n, k) and scaled_mm_available(x.device.index or 0):
        y = scaled_mm_rowwise(xq, xs, wq, ws, bias, x.dtype)
    else:
        y = kern.w8a8_scaled_gemm(xq, xs, wq, ws, bias, out_dtype=x.dtype)
    return y.reshape(*shape[:-1], n)


@functools.lru_cache(maxsize=None)
def _warn_block_fallback(block_k: int) -> None:
    logger.warning("FP8 block size %d along K cannot be tiled by the Triton GEMM; those layers run the torch "
                   "reference (dequantized weights), which is slow", block_k)


def linear_block(x: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor, block: tuple[int, int], rows_per_scale: int,
                 bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """FP8 linear with block-wise weight scales: x ``[..., K]``, wq ``[N, K]`` e4m3, ws ``[ceil(N / rows_per_scale),
    ceil(K / block[1])]`` fp32 -> ``[..., N]`` in x's dtype (activations quantized per token and ``block[1]`` group)."""
    shape = x.shape
    n, k = wq.shape
    kern = _kernels(x)
    if kern is None or not kern.block_gemm_supported(block[1]):
        if kern is not None:
            _warn_block_fallback(block[1])
        return fp8_ref.fp8_linear_ref(x, wq, ws, bias, block, rows_per_scale)
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    xq, xs = kern.per_token_group_quant_fp8(x2, block[1])
    y = kern.w8a8_scaled_gemm(xq, xs, wq, ws, bias, out_dtype=x.dtype, group_k=block[1],
                              rows_per_scale=rows_per_scale)
    return y.reshape(*shape[:-1], n)


def fused_moe_fp8(x: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor,
                  w2_scale: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                  block: Optional[tuple[int, int]] = None, w13_rows_per_scale: int = 1, w2_rows_per_scale: int = 1,
                  a13_scale: Optional[torch.Tensor] = None, a2_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """FP8 experts (arguments as :func:`sgl_kernel.triton.moe.fused_moe_fp8`): the Triton grouped GEMM on CUDA,
    :func:`.fp8_ref.fused_moe_fp8_ref` elsewhere or for a block size the kernel cannot tile."""
    kern = _kernels(x, "moe")
    fp8 = _kernels(x)
    if kern is None or fp8 is None or x.dtype == torch.float32 \
            or (block is not None and not fp8.block_gemm_supported(block[1])):
        return fp8_ref.fused_moe_fp8_ref(x, w13, w13_scale, w2, w2_scale, topk_weights, topk_ids, block,
                                         w13_rows_per_scale, w2_rows_per_scale, a13_scale, a2_scale)
    return kern.fused_moe_fp8(x, w13, w13_scale, w2, w2_scale, topk_weights, topk_ids, block, w13_rows_per_scale,
                              w2_rows_per_scale, a13_scale, a2_scale)
