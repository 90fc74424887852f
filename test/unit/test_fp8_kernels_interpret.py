"""The FP8 Triton kernels vs their torch references on CPU under the Triton interpreter (small shapes; the compiled
kernels are tested on a GPU in test/gpu/test_fp8_gpu.py).

Activation quantization must match the reference bit for bit (same amax, IEEE division, round-to-nearest-even), up to
the interpreter's own e4m3 conversion at ties and binade carries (the GPU test has no exemption);
the GEMMs (W8A8 per-channel and block-wise, the weight-only skinny GEMM with split-K, the FP8 fused MoE in all three
scale modes) within fp32 accumulation-order differences and one rounding of the output dtype.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("CUDA host: the compiled kernels are tested in test/gpu/test_fp8_gpu.py", allow_module_level=True)
if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.fail("triton was imported (by an earlier-collected test module) before TRITON_INTERPRET=1 was set, so its "
                "library functions are compiled-mode; import triton lazily in that module", pytrace=False)
os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

from sgl_kernel.triton import fp8, moe  # noqa: E402

from sglang.srt.layers.quantization import fp8_ref  # noqa: E402
from sglang.srt.ops_ref import select_experts  # noqa: E402


def _g(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _close(a: torch.Tensor, b: torch.Tensor, rel: float) -> None:
    err = (a.float() - b.float()).abs().max().item()
    tol = rel * max(b.float().abs().max().item(), 1e-6)
    assert err <= tol, f"max abs err {err:.4g} > {tol:.4g}"


def _same_except_interpreter_rounding(q: torch.Tensor, rq: torch.Tensor, v: torch.Tensor) -> None:
    """``q == rq`` bitwise, except where the Triton interpreter's fp32 -> e4m3 conversion is known to differ from
    round-to-nearest-even (it rounds ties up, truncates subnormals and drops the carry into the exponent: 124.7 -> 64
    instead of 128): at exact ties, below 2^-6 (e4m3 subnormals) and where the correctly rounded value is the next
    power of two. The GPU test asserts bitwise equality everywhere."""
    v = v.float()
    r = rq.float()
    a = v.abs().clamp(min=2.0 ** -6)
    step = torch.exp2(torch.floor(torch.log2(a))) / 8  # e4m3 spacing in v's binade
    tie = torch.remainder(a, step) == step / 2
    carry = (r.abs() == torch.exp2(torch.floor(torch.log2(a)) + 1)) & (r.abs() > a)
    exempt = tie | carry | ((v.abs() < 2.0 ** -6) & (v != 0))
    same = q.view(torch.uint8) == rq.view(torch.uint8)
    assert bool(same[~exempt].all()), f"{int((~same & ~exempt).sum())} elements differ outside the exempt set"
    assert exempt.float().mean() < 0.2  # most elements are compared


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_activation_quantization_matches_the_reference(dtype):
    x = (torch.randn(5, 200, generator=_g(1)) * torch.logspace(-2, 2, 5).unsqueeze(1)).to(dtype)
    x[2] = 0
    q, s = fp8.per_token_quant_fp8(x)
    rq, rs = fp8_ref.quant_per_token_ref(x)
    assert torch.equal(s, rs)  # scales bit for bit
    _same_except_interpreter_rounding(q, rq, x.float() / rs)
    q, s = fp8.per_token_group_quant_fp8(x, 64)
    rq, rs = fp8_ref.quant_per_token_group_ref(x, 64)
    assert s.shape == (5, 4) and torch.equal(s, rs)
    _same_except_interpreter_rounding(q, rq, x.float() / rs.repeat_interleave(64, 1)[:, :200])
    static = torch.tensor([0.02])
    q, s = fp8.per_token_quant_fp8(x, static)
    rq, _ = fp8_ref.quant_per_token_ref(x, static)
    _same_except_interpreter_rounding(q, rq, (x.float() / 0.02).clamp(-448, 448))


@pytest.mark.parametrize("m,n,k", [(3, 48, 80), (20, 64, 96)])
def test_w8a8_gemm_per_channel_and_block(m, n, k):
    x = torch.randn(m, k, generator=_g(m))
    w = torch.randn(n, k, generator=_g(n)) / k ** 0.5
    bias = torch.randn(n, generator=_g(3))
    xq, xs = fp8_ref.quant_per_token_ref(x)
    wq, ws = fp8_ref.quant_weight_per_channel(w)
    got = fp8.w8a8_scaled_gemm(xq, xs, wq, ws, bias, out_dtype=torch.float32)
    _close(got, fp8_ref.w8a8_scaled_gemm_ref(xq, xs, wq, ws, bias, torch.float32), 1e-5)
    xq, xs = fp8_ref.quant_per_token_group_ref(x, 32)
    for rows in (16, 1):  # block rows, and scales expanded per row
        wq, ws = fp8_ref.quant_weight_block(w, 16, 32)
        if rows == 1:
            ws = ws.repeat_interleave(16, 0)[:n]
        got = fp8.w8a8_scaled_gemm(xq, xs, wq, ws, None, torch.float32, group_k=32, rows_per_scale=rows)
        _close(got, fp8_ref.w8a8_scaled_gemm_ref(xq, xs, wq, ws, None, torch.float32, 32, rows), 1e-5)


@pytest.mark.parametrize("split_k", [1, 3])
def test_skinny_fp8_gemm(split_k):
    x = torch.randn(5, 160, generator=_g(4))
    wq, ws = fp8_ref.quant_weight_per_channel(torch.randn(48, 160, generator=_g(5)))
    bias = torch.randn(48, generator=_g(6))
    got = fp8.skinny_fp8_gemm(x, wq, ws, bias, block_n=16, block_k=32, split_k=split_k)
    _close(got, fp8_ref.skinny_fp8_gemm_ref(x, wq, ws, bias), 1e-5)


@pytest.mark.parametrize("mode", ["per-channel", "static", "block"])
def test_fused_moe_fp8(mode, monkeypatch):
    e, n_tok, h, i, top_k = 4, 9, 64, 32, 2
    x = torch.randn(n_tok, h, generator=_g(7))
    w13 = torch.randn(e, 2 * i, h, generator=_g(8)) / h ** 0.5
    w2 = torch.randn(e, h, i, generator=_g(9)) / i ** 0.5
    tw, ti = select_experts(torch.randn(n_tok, e, generator=_g(10)), top_k, True)
    kw = {}
    if mode == "block":
        q13, s13 = zip(*(fp8_ref.quant_weight_block(w, 16, 32) for w in w13))
        q2, s2 = zip(*(fp8_ref.quant_weight_block(w, 16, 32) for w in w2))
        kw = dict(block_size=(16, 32), w13_rows_per_scale=16, w2_rows_per_scale=16)
    else:
        q13, s13 = zip(*(fp8_ref.quant_weight_per_channel(w) for w in w13))
        q2, s2 = zip(*(fp8_ref.quant_weight_per_channel(w) for w in w2))
        if mode == "static":
            gu = torch.einsum("nh,eih->nei", x, w13)  # calibrated static scales: the inputs' amax / 448
            act = torch.nn.functional.silu(gu[..., :i]) * gu[..., i:]
            kw = dict(a13_scale=(x.abs().max() / 448).reshape(1), a2_scale=(act.abs().max() / 448).reshape(1))
    args = (x, torch.stack(q13), torch.stack(s13), torch.stack(q2), torch.stack(s2), tw, ti)
    # the kernel's activation quantization is checked above; the interpreter's e4m3 conversion rounds some values
    # differently (see _same_except_interpreter_rounding), so here the grouped GEMMs get the reference's
    monkeypatch.setattr(fp8, "per_token_quant_fp8", fp8_ref.quant_per_token_ref)
    monkeypatch.setattr(fp8, "per_token_group_quant_fp8", fp8_ref.quant_per_token_group_ref)
    got = moe.fused_moe_fp8(*args, **kw)
    want = fp8_ref.fused_moe_fp8_ref(*args, **kw)
    _close(got, want, 1e-4)
    unquantized = moe.fused_moe(x, w13, w2, tw, ti)
    assert (got - unquantized).abs().max() < 0.2 * unquantized.abs().max()  # and close to the model-dtype experts
