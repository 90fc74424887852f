"""Argument validation for tw-comm ops (shared by the torch ops and the sglang workspace API).

Every check raises ValueError naming the offending value and the fix, before anything is launched.
"""

from __future__ import annotations

from typing import Optional

import torch

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)
MAX_HIDDEN = 16384


def _check_2d(name: str, t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2-D [tokens, hidden], got shape {tuple(t.shape)}; reshape to 2-D first")


def _check_dtype(name: str, t: torch.Tensor) -> None:
    if t.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"{name}.dtype={t.dtype} is not supported; use torch.bfloat16 or torch.float16")


def _check_hidden(hidden: int) -> None:
    if hidden % 8 != 0 or hidden <= 0:
        raise ValueError(f"hidden={hidden} must be a positive multiple of 8 (16-byte vectors); pad the hidden dim")
    if hidden > MAX_HIDDEN:
        raise ValueError(f"hidden={hidden} exceeds the maximum {MAX_HIDDEN}; split the hidden dim or use NCCL")


def _check_like(name: str, t: torch.Tensor, ref: torch.Tensor, ref_name: str) -> None:
    if tuple(t.shape) != tuple(ref.shape):
        raise ValueError(f"{name}.shape={tuple(t.shape)} must equal {ref_name}.shape={tuple(ref.shape)}")
    if t.dtype != ref.dtype:
        raise ValueError(f"{name}.dtype={t.dtype} must equal {ref_name}.dtype={ref.dtype}")
    if t.device != ref.device:
        raise ValueError(f"{name}.device={t.device} must equal {ref_name}.device={ref.device}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (strides {t.stride()}); call .contiguous()")


def validate_allreduce_rmsnorm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    out: Optional[torch.Tensor] = None,
    eps: float = 1e-6,
) -> None:
    """Check the arguments of ``residual += allreduce(x); out = rmsnorm(residual) * weight``.

    x, residual, out: [T, H] contiguous, same dtype (bf16 or fp16) and device; weight: [H] same dtype/device;
    H a multiple of 8 and <= 16384; eps > 0. Raises ValueError naming the bad value.
    """
    _check_2d("x", x)
    _check_dtype("x", x)
    if not x.is_contiguous():
        raise ValueError(f"x must be contiguous (strides {x.stride()}); call .contiguous()")
    _check_hidden(x.shape[1])
    _check_like("residual", residual, x, "x")
    if out is not None:
        _check_like("out", out, x, "x")
    if not isinstance(weight, torch.Tensor) or tuple(weight.shape) != (x.shape[1],):
        shape = tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__
        raise ValueError(f"weight.shape={shape} must be ({x.shape[1]},) (the hidden size)")
    if weight.dtype != x.dtype or weight.device != x.device or not weight.is_contiguous():
        raise ValueError(
            f"weight (dtype={weight.dtype}, device={weight.device}) must be contiguous with x's dtype {x.dtype} "
            f"and device {x.device}"
        )
    if not eps > 0:
        raise ValueError(f"eps={eps} must be > 0")


def validate_allreduce(x: torch.Tensor, out: Optional[torch.Tensor] = None) -> None:
    """Check the arguments of a plain AllReduce: x (and out) [T, H] contiguous bf16/fp16, H % 8 == 0, <= 16384."""
    _check_2d("x", x)
    _check_dtype("x", x)
    if not x.is_contiguous():
        raise ValueError(f"x must be contiguous (strides {x.stride()}); call .contiguous()")
    _check_hidden(x.shape[1])
    if out is not None:
        _check_like("out", out, x, "x")
