"""Small host-side helpers shared by the Triton kernels' launch wrappers."""

from __future__ import annotations

import os

import torch


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``).

    The Triton 3.9 interpreter computes ``tl.dot`` on bf16 operands wrongly
    (it multiplies the raw 16-bit patterns); kernels take a ``DOT_F32``
    constexpr set from this function and upcast their dot operands to fp32
    when it is True. On a GPU the operands stay in bf16/fp16 (tensor cores).
    """
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def next_pow2(n: int) -> int:
    """Smallest power of two >= max(n, 1)."""
    return 1 << max(int(n) - 1, 0).bit_length()


def check_cuda_or_interpret(*tensors: torch.Tensor, what: str) -> None:
    """Raise ValueError unless every tensor is on CUDA or the Triton interpreter is active.

    Raises:
        ValueError: a CPU tensor without ``TRITON_INTERPRET=1`` (use the torch reference in
            :mod:`sglang.srt.layers.ops` instead).
    """
    if interpreting():
        return
    for t in tensors:
        if not t.is_cuda:
            raise ValueError(f"{what}: Triton kernels need CUDA tensors, got one on {t.device}; "
                             "call sglang.srt.layers.ops (torch fallback) or set TRITON_INTERPRET=1")
