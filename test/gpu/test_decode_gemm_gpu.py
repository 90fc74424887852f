"""GPU correctness of the decode-GEMM autotune (compiled Triton, bf16, Llama-3.1-8B qkv / o_proj shapes).

Every candidate skinny config the tuner may pick equals F.linear on fresh random inputs, and after
:func:`~sglang.srt.layers.decode_gemm.autotune` + :func:`~sglang.srt.layers.decode_gemm.install` each linear layer
returns exactly what the table names (the skinny kernel with that config, or cuBLAS) for decode row counts inside and
beyond the buckets. Speed is measured in benchmark/decode/gemm_tune.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "python"))
sys.path.insert(0, str(REPO / "test"))

from conftest import gpu_tiered  # noqa: E402
DEV = "cuda"


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    err = (a.float() - b.float()).abs().max().item()
    tol = 2e-2 * max(b.float().abs().max().item(), 1.0)
    assert a.shape == b.shape and a.dtype == b.dtype and err <= tol, f"max abs err {err} > {tol}"


@pytest.fixture(scope="module")
def layers():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from sglang.srt.layers.linear import RowParallelLinear

    gen = torch.Generator().manual_seed(27)
    mods = []
    for n, k, bias in ((6144, 4096, True), (6144, 4096, True), (4096, 4096, False), (4096, 4096, False)):
        mod = RowParallelLinear(k, n, bias=bias, params_dtype=torch.bfloat16).to(DEV)
        for p in mod.parameters():
            p.data.copy_((torch.randn(p.shape, generator=gen) / k ** 0.5).to(torch.bfloat16))
        mods.append(mod)
    return torch.nn.ModuleList(mods)


@pytest.mark.parametrize("m,which", gpu_tiered([(1, 0), (128, 2)]))
def test_decode_gemm_candidates_vs_linear(layers, m, which):
    """Each candidate config (split-K or not) at m rows equals F.linear within bf16 rounding (qkv with bias at 1 row,
    o_proj without at 128; the other classes and both bias variants run under the interpreter in
    test/unit/test_decode_gemm.py and through the dispatch test below)."""
    from sgl_kernel.triton.skinny_gemm import skinny_gemm
    from sglang.srt.layers.decode_gemm import candidates

    gen = torch.Generator().manual_seed(m)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for mod in (layers[which],):
        n, k = mod.weight.shape
        x = torch.randn(m, k, generator=gen).to(torch.bfloat16).to(DEV)
        want = torch.nn.functional.linear(x, mod.weight, mod.bias)
        for cfg in candidates(m, n, k, sms):
            _close(skinny_gemm(x, mod.weight, mod.bias, **cfg.kwargs()), want)


@pytest.mark.gpu
def test_decode_gemm_autotuned_dispatch_vs_linear(layers):
    """autotune() on this GPU, install(), then every layer returns bit for bit what its table entry names (skinny
    config or cuBLAS) and matches F.linear within bf16 rounding; a skinny choice was measured faster than cuBLAS."""
    from sgl_kernel.triton.skinny_gemm import skinny_gemm
    from sglang.srt.layers import decode_gemm

    table = decode_gemm.autotune(decode_gemm.model_linear_weights(layers), [1, 8, 16, 32, 64, 128], DEV)
    assert {s for s, _ in table.entries} == {(6144, 4096, "bfloat16"), (4096, 4096, "bfloat16")}
    for _, choices in table.entries:
        assert [c.m_max for c in choices] == [1, 8, 16, 32, 64, 128]
        assert all(c.config is None or c.skinny_us < c.cublas_us for c in choices)
    assert decode_gemm.install(layers, table) == len(layers)
    gen = torch.Generator().manual_seed(1)
    try:
        for m in (1, 5, 32, 100, 128, 200):
            for mod in layers:
                n, k = mod.weight.shape
                x = torch.randn(m, k, generator=gen).to(torch.bfloat16).to(DEV)
                cfg = table.lookup(n, k, torch.bfloat16, m)
                got = mod(x)
                if cfg is None:
                    assert torch.equal(got, torch.nn.functional.linear(x, mod.weight, mod.bias))
                else:
                    assert m <= 128 and torch.equal(got, skinny_gemm(x, mod.weight, mod.bias, **cfg.kwargs()))
                _close(got, torch.nn.functional.linear(x, mod.weight, mod.bias))
    finally:
        decode_gemm.install(layers, None)
