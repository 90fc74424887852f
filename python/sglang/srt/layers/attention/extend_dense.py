"""Causal attention of prefill rows that have no cached prefix, through PyTorch's fused attention kernels.

A prefill row without a prefix attends only to its own new tokens, so it is a plain causal attention whose keys are
the row's K/V just written to the paged pool: PyTorch's fused kernels apply. Two ways (``SGLANG_EXTEND_ATTENTION``):

* ``sdpa``: one ``torch.nn.functional.scaled_dot_product_attention(is_causal=True)`` per row, K/V heads repeated to the
  query heads (so every SDPA backend qualifies, cuDNN's included);
* ``varlen``: one FlashAttention-2 variable-length call over all such rows (Dao, "FlashAttention-2", 2023; PyTorch's
  ``aten._flash_attention_forward`` with cumulative sequence lengths, grouped-query heads natively), CUDA only;
* ``triton`` (default): every prefill row stays on the Triton extend kernel.

Rows with a prefix (a radix-cache hit, the later chunks of a chunked prefill) always use the Triton kernel.
"""

from __future__ import annotations

import os
from typing import Sequence

import torch
import torch.nn.functional as F

EXTEND_ATTENTION_ENV = "SGLANG_EXTEND_ATTENTION"
EXTEND_IMPLS = ("triton", "sdpa", "varlen")


def extend_impl_from_env() -> str:
    """``SGLANG_EXTEND_ATTENTION`` (unset: ``triton``). Raises ValueError naming the choices for another value."""
    val = os.environ.get(EXTEND_ATTENTION_ENV, "").strip() or "triton"
    if val not in EXTEND_IMPLS:
        raise ValueError(f"{EXTEND_ATTENTION_ENV}={val!r}: use one of {EXTEND_IMPLS}")
    return val


def _gather(buf: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``buf[slots]`` ([n, num_kv_heads, head_dim]) as ``dtype``; a 1-byte (FP8) buffer is gathered through its uint8
    view (gather kernels cover every dtype's bytes) and widened after."""
    if buf.element_size() == 1 and buf.is_floating_point():
        return buf.view(torch.uint8).index_select(0, slots).view(buf.dtype).to(dtype)
    return buf.index_select(0, slots).to(dtype)


def prefix_free_attention(q3: torch.Tensor, out3: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
                          loc: torch.Tensor, segments: Sequence[tuple[int, int]], scale: float, impl: str,
                          k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Causal attention of each prefix-free row over its own new tokens, written into ``out3``.

    Args:
        q3: [N, num_heads, head_dim] queries of the batch's new tokens (any float dtype; computed in it).
        out3: [N, num_heads, head_dim] output; rows of the segments are written.
        k_buf, v_buf: [slots, num_kv_heads, head_dim] pool buffers holding the rows' new K/V (cast to q's dtype; an
            FP8 cache's values are widened exactly, then scaled as below).
        loc: [N] int KV slot of each new token (``out_cache_loc``).
        segments: ``(first token, length)`` of each prefix-free row in the flat token order, length >= 1.
        scale: softmax scale.
        impl: ``sdpa`` or ``varlen`` (see the module docstring).
        k_scale, v_scale: dequantization scales of an FP8 cache (stored x scale = value; 1.0 otherwise, see
            :mod:`sglang.srt.mem_cache.kv_quant`). As in the Triton kernels, ``k_scale`` is folded into the softmax
            scale (``q . (s k) = s (q . k)``) and ``v_scale`` multiplies the output (``sum p (s v) = s sum p v``), so
            the gathered rows are only widened, never rescaled element by element.
    Raises:
        ValueError: an unknown ``impl``, ``varlen`` off CUDA, or num_heads not a multiple of num_kv_heads.
    """
    if not segments:
        return
    nh, nkv = q3.shape[1], k_buf.shape[1]
    if nh % nkv:
        raise ValueError(f"prefix_free_attention: {nh} query heads are not a multiple of {nkv} KV heads")
    if impl == "varlen":
        if not q3.is_cuda:
            raise ValueError("prefix_free_attention: impl='varlen' needs CUDA tensors (FlashAttention-2)")
        idx = torch.cat([torch.arange(s, s + n, device=q3.device) for s, n in segments])
        lens = torch.tensor([0] + [n for _, n in segments], dtype=torch.int32)
        cu = torch.cumsum(lens, 0, dtype=torch.int32).to(q3.device, non_blocking=True)
        slots = loc[idx].long()
        q = q3.index_select(0, idx)
        k = _gather(k_buf, slots, q.dtype)
        v = _gather(v_buf, slots, q.dtype)
        longest = max(n for _, n in segments)
        out = torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, longest, longest, 0.0, True, False,
                                                      scale=scale * k_scale)[0]
        if v_scale != 1.0:
            out = out.float() * v_scale
        out3.index_copy_(0, idx, out.to(out3.dtype))
        return
    if impl != "sdpa":
        raise ValueError(f"prefix_free_attention: impl={impl!r}; use 'sdpa' or 'varlen'")
    group = nh // nkv
    for s, n in segments:
        slots = loc[s:s + n].long()
        qi = q3[s:s + n].transpose(0, 1).unsqueeze(0)  # [1, nh, n, hd]
        ki = _gather(k_buf, slots, q3.dtype).transpose(0, 1).repeat_interleave(group, 0).unsqueeze(0)
        vi = _gather(v_buf, slots, q3.dtype).transpose(0, 1).repeat_interleave(group, 0).unsqueeze(0)
        oi = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=scale * k_scale)
        if v_scale != 1.0:
            oi = oi.float() * v_scale
        out3[s:s + n] = oi[0].transpose(0, 1).to(out3.dtype)
