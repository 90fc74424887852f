"""SiLU-and-mul (SwiGLU gate) as a Triton kernel.

Reference: Shazeer, "GLU Variants Improve Transformer" (2020), eq. 6. For x = [gate | up] of
shape [N, 2I] it returns ``silu(gate) * up`` [N, I], computed in fp32 and rounded once (the torch
reference :func:`sglang.srt.layers.activation.silu_and_mul_ref` rounds silu(gate) before the
multiply, so low-precision results may differ by one rounding step).
"""

from __future__ import annotations

import logging
from typing import Optional

import torch
import triton
import triton.language as tl

from sgl_kernel.triton.common import check_cuda_or_interpret, use_pdl

logger = logging.getLogger(__name__)


@triton.jit
def _silu_and_mul_kernel(X, Y, stride_x, stride_y, I, BLOCK: tl.constexpr, USE_GDC: tl.constexpr = False):
    if USE_GDC:  # programmatic dependent launch: wait for the previous kernel, then let the next launch
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < I
    g = tl.load(X + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(X + row * stride_x + I + offs, mask=mask, other=0.0).to(tl.float32)
    y = g / (1.0 + tl.exp(-g)) * u
    tl.store(Y + row * stride_y + offs, y.to(Y.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``silu(x[:, :I]) * x[:, I:]`` for x [N, 2I] (CUDA, last dim contiguous) -> [N, I] in x.dtype (or ``out``).

    Raises:
        ValueError: x not 2-D, odd last dim, bad ``out`` shape, or CPU tensors outside the Triton interpreter.
    """
    check_cuda_or_interpret(x, what="silu_and_mul")
    if x.dim() != 2 or x.shape[1] % 2 or x.stride(-1) != 1:
        raise ValueError(f"silu_and_mul: x must be [N, 2I] with an even, contiguous last dim; got {tuple(x.shape)}")
    n, two_i = x.shape
    i = two_i // 2
    y = torch.empty(n, i, dtype=x.dtype, device=x.device) if out is None else out
    if y.shape != (n, i) or y.stride(-1) != 1:
        raise ValueError(f"silu_and_mul: out shape {tuple(y.shape)} must be ({n}, {i})")
    if n == 0:
        return y
    block = 1024 if i >= 1024 else max(16, triton.next_power_of_2(i))
    pdl = use_pdl(x.device)
    _silu_and_mul_kernel[(n, triton.cdiv(i, block))](x, y, x.stride(0), y.stride(0), i, BLOCK=block, USE_GDC=pdl,
                                                      num_warps=4, **({"launch_pdl": True} if pdl else {}))
    return y
