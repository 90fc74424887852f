"""GPU correctness of the decode epilogue fusions (compiled Triton, bf16, Llama-3.1-8B shapes), fresh random
inputs each run, plain launches (SGLANG_DECODE_PDL=0) and programmatic dependent launch (=2):

* split-K partials + :func:`~sgl_kernel.triton.decode_fuse.splitk_add_rmsnorm` equal the skinny GEMM (its split-K
  reduce kernel) + the fused add + RMSNorm kernel bit for bit (normed output and residual), and the torch reference
  within bf16 rounding;
* :func:`~sgl_kernel.triton.decode_fuse.skinny_gemm_silu` equals the torch reference within bf16 rounding and the
  unfused skinny GEMM + SiLU-and-mul within one rounding step (bitwise under the interpreter, test/unit);
* the tuner in fused mode (``autotune(..., fuse_epilogue=True)``) tags its choices and the installed layers, run in a
  CUDA graph, replay what they compute eagerly and match the unfused layers.
Speed: scripts/gpu/one_gpu.sh decode_switch_ab (benchmark/decode/step_ab.py --switch-ab with SGLANG_DECODE_FUSE_EPILOGUE).
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "python"))
sys.path.insert(0, str(REPO / "test"))

from conftest import gpu_tiered  # noqa: E402

DEV = "cuda"
SEED = int.from_bytes(os.urandom(4), "little")


@pytest.fixture(autouse=True)
def _cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")


def _rand(gen, *shape, scale=1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(torch.bfloat16).to(DEV)


def _close(a, b, tol=2e-2):
    err = (a.float() - b.float()).abs().max().item()
    ref = max(b.float().abs().max().item(), 1.0)
    assert a.shape == b.shape and err <= tol * ref, f"max abs err {err} > {tol * ref} (seed {SEED})"


@pytest.mark.parametrize("m,n,k,bn,bk,split,pdl", gpu_tiered([
    (1, 4096, 4096, 32, 128, 2, "0"), (32, 4096, 4096, 32, 128, 2, "0"), (32, 4096, 14336, 64, 128, 4, "0"),
    (128, 4096, 14336, 128, 64, 2, "0"), (32, 4096, 4096, 32, 128, 2, "2"), (1, 4096, 14336, 64, 128, 4, "2")],
    smoke=(0, 4)))
def test_splitk_add_rmsnorm_bitwise_vs_reduce_then_norm(m, n, k, bn, bk, split, pdl, monkeypatch):
    """o_proj / down_proj shapes: fused reduce + add + RMSNorm == reduce kernel + add + RMSNorm kernel, bit for bit."""
    from sgl_kernel.triton import decode_fuse, fused_add_rmsnorm, skinny_gemm
    from sglang.srt.ops_ref import SplitKPartials, splitk_add_rmsnorm_ref

    monkeypatch.setenv("SGLANG_DECODE_PDL", pdl)
    gen = torch.Generator().manual_seed(SEED + m + k)
    x, w = _rand(gen, m, k), _rand(gen, n, k, scale=k ** -0.5)
    res, nw = _rand(gen, m, n), _rand(gen, n, scale=0.1) + 1
    kw = dict(block_n=bn, block_k=bk, split_k=split)
    parts = skinny_gemm.skinny_gemm_partials(x, w, **kw)
    assert parts.dim() == 3 and parts.shape[0] > 1
    y_un = skinny_gemm.skinny_gemm(x, w, **kw)
    r_un = res.clone()
    fused_add_rmsnorm.fused_add_rmsnorm(y_un, r_un, nw, 1e-5)
    r_fu = res.clone()
    y_fu = decode_fuse.splitk_add_rmsnorm(parts, None, r_fu, nw, 1e-5)
    torch.cuda.synchronize()
    assert torch.equal(r_fu, r_un), f"residual differs (seed {SEED})"
    assert torch.equal(y_fu, y_un), f"normed output differs (seed {SEED})"
    want_y, want_r = splitk_add_rmsnorm_ref(SplitKPartials(parts, None, torch.bfloat16), res, nw, 1e-5)
    _close(y_fu, want_y)
    _close(r_fu, want_r)


@pytest.mark.parametrize("m,bn,bk,pdl", gpu_tiered([(1, 32, 256, "0"), (32, 64, 128, "0"), (32, 16, 128, "0"),
                                                     (128, 32, 128, "0"), (1, 32, 256, "2"), (32, 64, 128, "2")],
                                                    smoke=(1, 4)))
def test_skinny_gemm_silu_vs_reference(m, bn, bk, pdl, monkeypatch):
    """gate_up [28672, 4096] + SiLU-and-mul in one kernel vs the torch reference and the unfused kernel pair."""
    from sgl_kernel.triton import activation, decode_fuse, skinny_gemm
    from sglang.srt.layers.decode_fuse import gate_up_silu_ref

    monkeypatch.setenv("SGLANG_DECODE_PDL", pdl)
    gen = torch.Generator().manual_seed(SEED + m)
    x, w = _rand(gen, m, 4096), _rand(gen, 28672, 4096, scale=4096 ** -0.5)
    got = decode_fuse.skinny_gemm_silu(x, w, block_n=bn, block_k=bk)
    unfused = activation.silu_and_mul(skinny_gemm.skinny_gemm(x, w, block_n=bn, block_k=bk))
    torch.cuda.synchronize()
    _close(got, gate_up_silu_ref(x, w))
    _close(got, unfused, tol=1e-2)
    same = (got == unfused).float().mean().item()
    print(f"skinny_gemm_silu m={m} n{bn} k{bk} pdl={pdl}: {same:.6f} of elements bitwise equal to GEMM + SiLU")


def _mlp_layers(gen, inter=14336, h=4096):
    from sglang.srt.layers.layernorm import RMSNorm
    from sglang.srt.layers.linear import RowParallelLinear
    from sglang.srt.layers.moe.sparse_moe_block import DenseMLP

    o_proj = RowParallelLinear(h, h, params_dtype=torch.bfloat16)
    mlp = DenseMLP(h, inter, params_dtype=torch.bfloat16)
    norm = RMSNorm(h, 1e-5, torch.bfloat16)
    mods = torch.nn.ModuleList([o_proj, mlp, norm]).to(DEV)
    for p in mods.parameters():
        p.data.copy_(_rand(gen, *p.shape, scale=p.shape[-1] ** -0.5) + (1 if p.dim() == 1 else 0))
    return mods


@pytest.mark.gpu
def test_fused_tune_install_and_graph_replay(monkeypatch):
    """autotune in fused mode on the o_proj / gate_up / down shapes tags each choice; with its best skinny forms
    installed (and the flags mark_model would set on a Llama layer) o_proj -> norm -> MLP -> norm replays in a CUDA
    graph exactly as it runs eagerly, and matches the same layers on cuBLAS within bf16 rounding (residual too)."""
    from sgl_kernel.triton.skinny_gemm import SkinnyConfig
    from sglang.srt.layers import decode_gemm

    monkeypatch.setenv("SGLANG_DECODE_PDL", "0")
    # two candidates (one split-K) keep the compile time short: this checks the fused modes, not the candidate set
    monkeypatch.setattr(decode_gemm, "candidates", lambda m, n, k, sms: [SkinnyConfig(32, 128, 2, 4, 4),
                                                                          SkinnyConfig(64, 128, 1, 4, 4)])
    gen = torch.Generator().manual_seed(SEED)
    mods = _mlp_layers(gen)
    o_proj, mlp, norm = mods
    weights = decode_gemm.model_linear_weights(mods)
    deferred = [(4096, 4096, "bfloat16"), (4096, 14336, "bfloat16")]
    gated = [(28672, 4096, "bfloat16")]
    fused = decode_gemm.autotune(weights, [32], torch.device(DEV), deferred=deferred, gated=gated,
                                 fuse_epilogue=True)
    tags = {shape: cs[0].fused for shape, cs in fused.entries}
    assert tags == {deferred[0]: "partials", deferred[1]: "partials", gated[0]: "silu"}, tags
    print("\n".join(fused.describe()))
    x, res = _rand(gen, 32, 4096), _rand(gen, 32, 4096)

    def chain():
        r = res.clone()
        h, r = norm(o_proj(x), r)
        y, r = norm(mlp(h), r)
        return y, r

    # run the best skinny form of every shape even where cuBLAS won the timing, so the fused kernels are exercised
    forced = decode_gemm.DecodeGemmTable(fused.device_name, tuple(
        (shape, tuple(dataclasses.replace(c, config=c.skinny_config) for c in cs)) for shape, cs in fused.entries),
        fuse_epilogue=True)
    decode_gemm.install(mods, forced)
    o_proj.defer_splitk_reduce = mlp.down_proj.defer_splitk_reduce = mlp.fuse_gate_silu = True
    with torch.inference_mode():
        eager = chain()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            chain()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = chain()
        graph.replay()
        torch.cuda.synchronize()
        for a, b in zip(captured, eager):
            assert torch.equal(a, b), f"graph replay differs from eager (seed {SEED})"
        decode_gemm.install(mods, None)  # clears the flags; cuBLAS everywhere
        assert not (o_proj.defer_splitk_reduce or mlp.fuse_gate_silu)
        plain = chain()
    for a, b in zip(eager, plain):
        _close(a, b)
