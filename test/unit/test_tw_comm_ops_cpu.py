"""sgl_kernel imports on CPU, registers the tw-comm torch ops without building CUDA code, and falls back to the
torch reference for the local fused add + RMSNorm op."""

import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "sgl-kernel" / "python"))

from sgl_kernel.tw_comm import ops as tw_comm_ops  # noqa: E402,F401  (registers torch.ops.sgl_kernel.*)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_add_rmsnorm_cpu_fallback_matches_float64(dtype):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(9, 256, generator=g).to(dtype)
    residual = (torch.randn(9, 256, generator=g) * 3).to(dtype)
    weight = (torch.rand(256, generator=g) + 0.5).to(dtype)
    s = x.double() + residual.double()
    expect = s / torch.sqrt(s.pow(2).mean(-1, keepdim=True) + 1e-5) * weight.double()
    r = residual.clone()
    out = torch.full_like(x, float("nan"))
    torch.ops.sgl_kernel.tw_fused_add_rmsnorm(x, r, weight, out, 1e-5, 8)
    torch.testing.assert_close(r.double(), s, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(out.double(), expect, rtol=2e-2, atol=2e-2)


def test_collective_ops_are_cuda_only():
    x = torch.randn(2, 8).bfloat16()
    with pytest.raises((NotImplementedError, RuntimeError)):
        torch.ops.sgl_kernel.tw_allreduce_rmsnorm(0, x, x.clone(), x[0].clone(), x.clone(), 1e-5, 0, 8, False)
    with pytest.raises((NotImplementedError, RuntimeError)):
        torch.ops.sgl_kernel.tw_allreduce(0, x, x.clone(), 0, 8)


def test_dtype_codes():
    assert tw_comm_ops.dtype_code(torch.bfloat16) == 0 and tw_comm_ops.dtype_code(torch.float16) == 1
    with pytest.raises(ValueError, match="float32"):
        tw_comm_ops.dtype_code(torch.float32)
