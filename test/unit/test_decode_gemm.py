"""Decode-GEMM autotune on CPU: the skinny GEMM's new configs (split-K, up to 128 rows, bias) vs F.linear
under the Triton interpreter, the frozen table's lookup rules, the candidate/bucket rules, the dispatch through
ops.linear and the linear layers, and the switch being off on CPU. The measured dispatch on a GPU is tested in
test/gpu/test_triton_kernels_gpu.py::test_decode_gemm_autotuned_dispatch_vs_linear."""

from __future__ import annotations

import os
import sys

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("CUDA host: see test/gpu/test_triton_kernels_gpu.py", allow_module_level=True)
if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.fail("triton was imported before TRITON_INTERPRET=1 was set; run this module in its own process",
                pytrace=False)
os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

from sgl_kernel.triton import skinny_gemm  # noqa: E402
from sgl_kernel.triton.skinny_gemm import SkinnyConfig  # noqa: E402
from sglang.srt.layers import decode_gemm, ops  # noqa: E402
from sglang.srt.layers.decode_gemm import DecodeGemmTable, GemmChoice  # noqa: E402
from sglang.srt.layers.linear import QKVParallelLinear, RowParallelLinear  # noqa: E402


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item() / max(b.float().abs().max().item(), 1.0)


@pytest.mark.parametrize("m,n,k,cfg,bias", [
    (1, 40, 96, SkinnyConfig(16, 64, 1, 4, 4), False),
    (3, 33, 300, SkinnyConfig(32, 64, 3, 4, 2), True),  # ragged K over 3 splits, bias after the reduce
    (24, 70, 520, SkinnyConfig(64, 128, 2, 4, 3), False),
    (64, 48, 1030, SkinnyConfig(16, 256, 8, 4, 3), True),  # split 8 of 5 tiles -> 5 non-empty splits
    (128, 17, 200, SkinnyConfig(16, 64, 1, 8, 3), True),
    (32, 300, 520, SkinnyConfig(128, 128, 2, 4, 4), False),  # the m<=32 wide strip, ragged N and K
    (100, 520, 333, SkinnyConfig(256, 64, 4, 8, 3), True),  # the m>64 256-row strip, split 4, ragged everything
])
def test_skinny_configs_match_linear(m, n, k, cfg, bias):
    """Every tuner-style config (block sizes, split-K, up to MAX_M rows) equals F.linear on fresh random inputs."""
    gen = torch.Generator().manual_seed(m * 7 + n + k)
    x = torch.randn(m, k, generator=gen)
    w = torch.randn(n, k, generator=gen) / k ** 0.5
    b = torch.randn(n, generator=gen) if bias else None
    got = skinny_gemm.skinny_gemm(x, w, b, **cfg.kwargs())
    assert got.shape == (m, n) and _err(got, torch.nn.functional.linear(x, w, b)) < 1e-5


def test_skinny_config_errors():
    """Bad split / block sizes and too many rows fail with a ValueError naming the problem."""
    x, w = torch.randn(4, 64), torch.randn(8, 64)
    for kw in (dict(split_k=0), dict(block_n=24), dict(block_k=8)):
        with pytest.raises(ValueError, match="split_k|block"):
            skinny_gemm.skinny_gemm(x, w, **kw)
    with pytest.raises(ValueError, match="M<= 128"):
        skinny_gemm.skinny_gemm(torch.randn(129, 64), w)


def _table(choices) -> DecodeGemmTable:
    return DecodeGemmTable(device_name="test", entries=(((24, 40, "bfloat16"), tuple(choices)),))


def test_table_lookup_by_bucket():
    """A bucket covers (previous top, its top]; cuBLAS (None) where it won, beyond the last bucket, for other shapes
    and dtypes. The table is frozen."""
    a, b = SkinnyConfig(16, 64), SkinnyConfig(32, 64, 2)
    t = _table([GemmChoice(1, a, 10.0, 8.0, a), GemmChoice(8, None, 10.0, 12.0, b), GemmChoice(32, b, 9.0, 7.0, b)])
    bf = torch.bfloat16
    assert t.lookup(24, 40, bf, 1) == a
    assert t.lookup(24, 40, bf, 2) is None and t.lookup(24, 40, bf, 8) is None
    assert t.lookup(24, 40, bf, 9) == b and t.lookup(24, 40, bf, 32) == b
    assert t.lookup(24, 40, bf, 33) is None
    assert t.lookup(24, 40, torch.float16, 1) is None and t.lookup(40, 24, bf, 1) is None
    assert any("cublas" in line for line in t.describe())
    with pytest.raises(AttributeError):
        t.device_name = "x"


def test_buckets_and_candidates():
    """Buckets stop at the one covering the largest captured size <= max_m; candidates fill the SMs via split-K
    only where N has too few tiles, and every candidate loads >= 64-element (16-byte-multiple) K tiles."""
    assert decode_gemm.buckets_for([1, 2, 4, 8, 16, 24, 32], 128) == [1, 8, 16, 32]
    assert decode_gemm.buckets_for([1, 2, 4, 8, 16, 24, 32, 40, 160], 128) == [1, 8, 16, 32, 64]
    assert decode_gemm.buckets_for([1, 8, 16, 160], 16) == [1, 8, 16]
    assert decode_gemm.buckets_for([160], 128) == []
    small = decode_gemm.candidates(16, 4096, 4096, 132)
    assert any(c.split_k > 1 for c in small) and all(c.block_k >= 64 for c in small)
    wide = decode_gemm.candidates(16, 28672, 4096, 132)
    assert all(c.split_k == 1 for c in wide if c.block_n >= 32)
    qkv32 = decode_gemm.candidates(32, 6144, 4096, 132)  # a one-kernel (split 1) config covering the SMs
    assert any(c.split_k == 1 and 6144 // c.block_n >= 132 for c in qkv32)
    with pytest.raises(ValueError, match="SGLANG_DECODE_GEMM_MAX_M"):
        os.environ[decode_gemm.MAX_M_ENV] = "256"
        try:
            decode_gemm.max_m_from_env()
        finally:
            del os.environ[decode_gemm.MAX_M_ENV]


def test_autotune_off_on_cpu(monkeypatch):
    """The switch never tunes on CPU (even when set) and autotune() itself refuses a CPU device."""
    monkeypatch.setenv(decode_gemm.AUTOTUNE_ENV, "1")
    layer = RowParallelLinear(40, 24, params_dtype=torch.bfloat16)
    assert not decode_gemm.enabled(torch.device("cpu"))
    assert decode_gemm.maybe_autotune(layer, [1, 8], torch.device("cpu")) is None
    with pytest.raises(ValueError, match="CUDA"):
        decode_gemm.autotune({}, [1], torch.device("cpu"))


def test_linear_layers_follow_installed_table(monkeypatch):
    """install() hands the table to every LinearBase; a row count the table maps to a config runs the skinny kernel
    (forced on CPU under the interpreter) within bf16 rounding of F.linear, others stay F.linear bit for bit."""
    gen = torch.Generator().manual_seed(5)
    model = torch.nn.ModuleList([RowParallelLinear(40, 24, bias=True, params_dtype=torch.bfloat16),
                                 QKVParallelLinear(40, 8, 2, 1, params_dtype=torch.bfloat16)])
    for p in model.parameters():
        p.data.copy_(torch.randn(p.shape, generator=gen) / 6)
    shapes = decode_gemm.model_linear_weights(model)
    assert sorted(shapes) == [(24, 40, "bfloat16"), (32, 40, "bfloat16")]
    cfg = SkinnyConfig(16, 64, 2)
    table = _table([GemmChoice(8, cfg, 10.0, 8.0, cfg)])
    assert decode_gemm.install(model, table) == 2
    calls = []
    real = skinny_gemm.skinny_gemm
    monkeypatch.setattr(ops, "_triton", lambda t, name: ops._kernels(name))
    monkeypatch.setattr(skinny_gemm, "skinny_gemm", lambda *a, **k: calls.append(k) or real(*a, **k))
    row = model[0]
    for m in (1, 8, 9):
        x = torch.randn(m, 40, generator=gen).to(torch.bfloat16)
        want = torch.nn.functional.linear(x, row.weight, row.bias)
        got = row(x)
        assert _err(got, want) < 1.6e-2 if m <= 8 else torch.equal(got, want)
        assert torch.equal(model[1](x), torch.nn.functional.linear(x, model[1].weight))  # shape not in the table
    assert calls == [cfg.kwargs()] * 2
    decode_gemm.install(model, None)
    assert row.decode_gemm is None


def test_lm_head_projection_follows_installed_table(monkeypatch):
    """The LM head (a vocabulary table, tied or not) is tuned like a linear: model_linear_weights lists it once, and
    LogitsProcessor._project with an installed table runs the skinny kernel for a covered row count (within bf16
    rounding of the matmul) and cuBLAS otherwise (bit for bit)."""
    from sglang.srt.layers.logits_processor import LogitsProcessor
    from sglang.srt.layers.vocab_parallel_embedding import ParallelLMHead

    gen = torch.Generator().manual_seed(6)
    model = torch.nn.ModuleDict({"lm_head": ParallelLMHead(40, 24, torch.bfloat16), "lp": LogitsProcessor(40)})
    w = model["lm_head"].weight
    w.data.copy_(torch.randn(w.shape, generator=gen) / 5)
    n = w.shape[0]
    assert decode_gemm.model_linear_weights(model) == {(n, 24, "bfloat16"): [w]}
    cfg = SkinnyConfig(16, 64)
    table = DecodeGemmTable("test", (((n, 24, "bfloat16"), (GemmChoice(4, cfg, 3.0, 2.0, cfg),)),))
    assert decode_gemm.install(model, table) == 1
    monkeypatch.setattr(ops, "_triton", lambda t, name: ops._kernels(name))
    lp = model["lp"]
    for m in (3, 6):
        x = torch.randn(m, 24, generator=gen).to(torch.bfloat16)
        want = torch.matmul(x, w.t()).float()[:, :40]
        got = lp._project(x, w)
        assert got.shape == want.shape and (_err(got, want) < 1.6e-2 if m <= 4 else torch.equal(got, want))


def test_autotune_default_on_for_cuda_and_zero_turns_it_off(monkeypatch):
    """Unset means on for a CUDA device (the measured default); ``0`` or empty keeps every linear on cuBLAS."""
    monkeypatch.delenv(decode_gemm.AUTOTUNE_ENV, raising=False)
    assert decode_gemm.enabled(torch.device("cuda"))
    for off in ("0", ""):
        monkeypatch.setenv(decode_gemm.AUTOTUNE_ENV, off)
        assert not decode_gemm.enabled(torch.device("cuda"))
