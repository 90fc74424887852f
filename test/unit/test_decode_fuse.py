"""Decode epilogue fusions on CPU under the Triton interpreter (fresh random inputs each run): the split-K
reduce inside the fused add + RMSNorm and the gate_up skinny GEMM with SiLU-and-mul, each against the unfused kernel
pair (bit for bit) and the torch reference; the layer wiring (flags set by decode_fuse.mark_model from the table, a
DenseMLP + RMSNorm chain bit-identical to the unfused path with 3 kernel launches fewer); the switch. The GPU
versions are in test/gpu/test_decode_fuse_gpu.py."""

from __future__ import annotations

import os
import sys

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("CUDA host: see test/gpu/test_decode_fuse_gpu.py", allow_module_level=True)
if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.fail("triton was imported before TRITON_INTERPRET=1 was set; run this module in its own process",
                pytrace=False)
os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

from sgl_kernel.triton import activation, decode_fuse, fused_add_rmsnorm, skinny_gemm  # noqa: E402
from sgl_kernel.triton.skinny_gemm import SkinnyConfig  # noqa: E402
from sglang.srt.layers import decode_gemm, ops  # noqa: E402
from sglang.srt.layers import decode_fuse as host  # noqa: E402
from sglang.srt.layers.decode_gemm import DecodeGemmTable, GemmChoice  # noqa: E402
from sglang.srt.layers.layernorm import RMSNorm  # noqa: E402
from sglang.srt.layers.moe.sparse_moe_block import DenseMLP  # noqa: E402

SEED = int.from_bytes(os.urandom(4), "little")


def _gen(salt: int) -> torch.Generator:
    return torch.Generator().manual_seed(SEED + salt)


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item() / max(b.float().abs().max().item(), 1.0)


@pytest.mark.parametrize("m,h,k,split,bias,dtype", [
    (1, 64, 256, 2, False, torch.bfloat16),
    (5, 96, 300, 3, True, torch.bfloat16),  # ragged H (block 128) and K, 3 splits, bias after the sum
    (32, 128, 1024, 4, False, torch.float16),
    (7, 80, 512, 2, True, torch.float32),
])
def test_splitk_add_rmsnorm_equals_reduce_then_norm(m, h, k, split, bias, dtype):
    """GEMM partials + splitk_add_rmsnorm == skinny_gemm (its split-K reduce kernel) + fused_add_rmsnorm, bit for
    bit in both outputs (the normed x and the residual), and within rounding of the torch reference (seed printed on
    failure)."""
    g = _gen(m * 31 + h + split)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = (torch.randn(h, k, generator=g) / k ** 0.5).to(dtype)
    b = torch.randn(h, generator=g).to(dtype) if bias else None
    nw = (1 + 0.1 * torch.randn(h, generator=g)).to(dtype)
    res = torch.randn(m, h, generator=g).to(dtype)
    cfg = SkinnyConfig(16, 64, split)
    parts = skinny_gemm.skinny_gemm_partials(x, w, b, **cfg.kwargs())
    assert parts.shape[0] > 1 and parts.dtype == torch.float32, f"seed {SEED}"
    y_un = skinny_gemm.skinny_gemm(x, w, b, **cfg.kwargs())
    r_un = res.clone()
    fused_add_rmsnorm.fused_add_rmsnorm(y_un, r_un, nw, 1e-6)
    r_fu = res.clone()
    y_fu = decode_fuse.splitk_add_rmsnorm(parts, b, r_fu, nw, 1e-6)
    assert torch.equal(r_fu, r_un) and torch.equal(y_fu, y_un), f"seed {SEED}"
    want_y, want_r = host.splitk_add_rmsnorm_ref(host.SplitKPartials(parts, b, dtype), res, nw, 1e-6)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert _err(y_fu, want_y) < tol and _err(r_fu, want_r) < tol, f"seed {SEED}"
    ref_lin = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float())
    assert _err(host.SplitKPartials(parts, b, dtype).materialize(), ref_lin) < tol, f"seed {SEED}"


@pytest.mark.parametrize("m,i,k,cfg,bias,dtype", [
    (1, 40, 96, SkinnyConfig(16, 64), False, torch.bfloat16),
    (3, 70, 300, SkinnyConfig(32, 128), True, torch.bfloat16),  # ragged I and K
    (32, 64, 520, SkinnyConfig(64, 128, num_stages=3), False, torch.float16),
    (100, 24, 200, SkinnyConfig(16, 64, num_warps=8), True, torch.float32),
])
def test_skinny_gemm_silu_equals_gemm_then_silu(m, i, k, cfg, bias, dtype):
    """skinny_gemm_silu == skinny_gemm (split-K 1, same tile) + silu_and_mul bit for bit, and within rounding of the
    torch reference silu(x @ gate.T) * (x @ up.T)."""
    g = _gen(m * 17 + i + k)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = (torch.randn(2 * i, k, generator=g) / k ** 0.5).to(dtype)
    b = torch.randn(2 * i, generator=g).to(dtype) if bias else None
    got = decode_fuse.skinny_gemm_silu(x, w, b, **cfg.kwargs())
    unfused = activation.silu_and_mul(skinny_gemm.skinny_gemm(x, w, b, **cfg.kwargs()))
    assert got.shape == (m, i) and got.dtype == dtype and torch.equal(got, unfused), f"seed {SEED}"
    want = host.gate_up_silu_ref(x.float(), w.float(), None if b is None else b.float())
    assert _err(got, want) < (1e-5 if dtype == torch.float32 else 2e-2), f"seed {SEED}"


def test_fused_kernels_reject_bad_input():
    """split-K > 1 or an odd weight row count for the SiLU epilogue, and mismatched partials, fail with ValueError."""
    x, w = torch.randn(4, 64), torch.randn(16, 64)
    with pytest.raises(ValueError, match="split_k"):
        decode_fuse.skinny_gemm_silu(x, w, split_k=2)
    with pytest.raises(ValueError, match=r"w \[2I, K\]"):
        decode_fuse.skinny_gemm_silu(x, torch.randn(15, 64))
    with pytest.raises(ValueError, match="parts"):
        decode_fuse.splitk_add_rmsnorm(torch.randn(2, 4, 8), None, torch.randn(4, 16), torch.ones(16), 1e-6)
    with pytest.raises(ValueError, match="parts"):
        decode_fuse.splitk_add_rmsnorm(torch.randn(2, 4, 8).double(), None, torch.randn(4, 8), torch.ones(8), 1e-6)


def test_switch_parsing(monkeypatch):
    """Unset / 0 / empty is off (the default), 1 on, anything else a ValueError naming the variable."""
    monkeypatch.delenv(host.FUSE_ENV, raising=False)
    assert not host.fuse_enabled()
    for v, on in (("0", False), ("", False), ("1", True)):
        monkeypatch.setenv(host.FUSE_ENV, v)
        assert host.fuse_enabled() is on
    monkeypatch.setenv(host.FUSE_ENV, "yes")
    with pytest.raises(ValueError, match=host.FUSE_ENV):
        host.fuse_enabled()


class _Launches:
    """Counts launches of the Triton kernels on the decode path (wraps each ``kernel[grid]``)."""

    NAMES = ((skinny_gemm, "_skinny_gemm_kernel"), (skinny_gemm, "_splitk_reduce_kernel"),
             (fused_add_rmsnorm, "_rmsnorm_kernel"), (activation, "_silu_and_mul_kernel"),
             (decode_fuse, "_splitk_add_rmsnorm_kernel"), (decode_fuse, "_skinny_silu_kernel"))

    def __init__(self, monkeypatch):
        self.count = {}
        for mod, name in self.NAMES:
            monkeypatch.setattr(mod, name, self._wrap(name, getattr(mod, name)))

    def _wrap(self, name, kern):
        outer = self

        class Wrapped:
            def __getitem__(self, grid):
                def launch(*a, **k):
                    outer.count[name] = outer.count.get(name, 0) + 1
                    return kern[grid](*a, **k)
                return launch
        return Wrapped()


def _mlp_norm_chain(monkeypatch, fuse: bool, seed: int):
    """o_proj-like -> RMSNorm(+res) -> DenseMLP -> RMSNorm(+res), bf16, tables with split-K 2 for the row-parallel
    shapes and a skinny config for gate_up; returns (outputs, launch counts)."""
    from sglang.srt.layers.linear import RowParallelLinear

    g = torch.Generator().manual_seed(seed)
    h, inter, m = 64, 96, 5
    o_proj = RowParallelLinear(128, h, params_dtype=torch.bfloat16)
    mlp = DenseMLP(h, inter, params_dtype=torch.bfloat16)
    n1, n2 = RMSNorm(h, 1e-6, torch.bfloat16), RMSNorm(h, 1e-6, torch.bfloat16)
    mods = torch.nn.ModuleList([o_proj, mlp, n1, n2])
    for p in mods.parameters():
        p.data.copy_(torch.randn(p.shape, generator=g) / 8 + (1.0 if p.dim() == 1 else 0.0))
    split2, wide = SkinnyConfig(16, 64, 2), SkinnyConfig(32, 64, 1)
    table = DecodeGemmTable("cpu-test", (
        ((h, 128, "bfloat16"), (GemmChoice(8, split2, 2.0, 1.0, split2, "partials" if fuse else ""),)),
        ((h, inter, "bfloat16"), (GemmChoice(8, split2, 2.0, 1.0, split2, "partials" if fuse else ""),)),
        ((2 * inter, h, "bfloat16"), (GemmChoice(8, wide, 2.0, 1.0, wide, "silu" if fuse else ""),)),
    ), fuse_epilogue=fuse)
    decode_gemm.install(mods, table)
    # the Llama structure is what mark_model looks for; set the flags it would set on these bare modules
    o_proj.defer_splitk_reduce = mlp.down_proj.defer_splitk_reduce = mlp.fuse_gate_silu = fuse
    a = torch.randn(m, 128, generator=g).to(torch.bfloat16)
    res = torch.randn(m, h, generator=g).to(torch.bfloat16)
    launches = _Launches(monkeypatch)

    def norm(mod, t, r):  # RMSNorm.forward's CUDA path (on CPU it would take the torch reference for a tensor)
        return mod(t, r) if isinstance(t, host.SplitKPartials) else ops.fused_add_rmsnorm(t, r, mod.weight, mod.eps)

    with torch.inference_mode():
        o = o_proj(a)
        assert isinstance(o, host.SplitKPartials) == fuse
        x, res = norm(n1, o, res)
        d = mlp(x)
        assert isinstance(d, host.SplitKPartials) == fuse
        y, res = norm(n2, d, res)
    return (x.clone(), y.clone(), res.clone()), dict(launches.count)  # a copy: later wrappers nest in this one


def test_layer_chain_fused_is_bit_identical_with_three_launches_less(monkeypatch):
    """With the fusion flags an o_proj -> norm -> MLP -> norm chain (split-K 2 projections, skinny gate_up) gives the
    unfused chain's outputs and residual bit for bit, in 5 kernel launches instead of 8 (no split-K reduce, no
    SiLU-and-mul): the per-layer saving the decode step gets (x 32 layers for Llama-3.1-8B, where the table picks
    the skinny kernel)."""
    monkeypatch.setattr(ops, "_triton", lambda t, name: ops._kernels(name))  # the kernels (interpreted) on CPU
    seed = SEED % 100000
    plain, n_plain = _mlp_norm_chain(monkeypatch, False, seed)
    fused, n_fused = _mlp_norm_chain(monkeypatch, True, seed)
    for a, b in zip(plain, fused):
        assert torch.equal(a, b), f"seed {SEED}"
    assert n_plain == {"_skinny_gemm_kernel": 3, "_splitk_reduce_kernel": 2, "_rmsnorm_kernel": 2,
                             "_silu_and_mul_kernel": 1}, n_plain
    assert n_fused == {"_skinny_gemm_kernel": 2, "_splitk_add_rmsnorm_kernel": 2, "_skinny_silu_kernel": 1}, n_fused
    assert sum(n_plain.values()) - sum(n_fused.values()) == 3


def test_partials_materialize_for_other_consumers():
    """A norm without a residual (or with a comm) gets the materialized sum: same as the unfused GEMM output."""
    g = _gen(7)
    parts = torch.randn(3, 4, 16, generator=g)
    b = torch.randn(16, generator=g).to(torch.bfloat16)
    p = host.SplitKPartials(parts, b, torch.bfloat16)
    want = ((parts[0] + parts[1]) + parts[2] + b.float()).to(torch.bfloat16)
    assert p.shape == (4, 16) and torch.equal(p.materialize(), want)
    norm = RMSNorm(16, 1e-6, torch.bfloat16)
    assert torch.equal(norm(p), norm(want))


def _stories(dtype: str = "bfloat16", name: str = "stories260K"):
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_loader.loader import load_model

    path = os.path.join(os.path.dirname(__file__), "..", "..", "..", "shared", "data", "models", name)
    if not os.path.isdir(path):
        pytest.skip(f"{path} missing")
    config = ModelConfig.from_path(path, None, dtype, "cpu")
    return load_model(config, "auto", "cpu"), config


def test_mark_model_flags_llama_and_moe_projections():
    """mark_model flags every o_proj and down_proj (deferred reduce) and gate_up (SiLU epilogue) of the trained Llama
    checkpoint, only the o_proj of the MoE twin (its MLP is a sparse block), and clears them all with on=False."""
    model, cfg = _stories()
    deferred, gated = host.mark_model(model, True)
    h, i = cfg.hidden_size, int(cfg.get("intermediate_size"))
    assert deferred == {(h, h, "bfloat16"), (h, i, "bfloat16")} and gated == {(2 * i, h, "bfloat16")}
    layers = model.model.layers
    assert all(ly.self_attn.o_proj.defer_splitk_reduce and ly.mlp.down_proj.defer_splitk_reduce
               and ly.mlp.fuse_gate_silu for ly in layers)
    assert host.mark_model(model, False) == (set(), set())
    assert not any(ly.self_attn.o_proj.defer_splitk_reduce or ly.mlp.fuse_gate_silu for ly in layers)
    moe, mcfg = _stories(name="stories260K-moe")
    deferred, gated = host.mark_model(moe, True)
    assert deferred == {(mcfg.hidden_size, mcfg.hidden_size, "bfloat16")} and gated == set()


def test_llama_forward_with_fusions_is_bit_identical(monkeypatch):
    """The trained stories260K Llama (bf16) through prefill and decode steps: with a table of split-K 2 skinny
    configs for o_proj / down_proj and a skinny gate_up, the fused table (fuse_epilogue, installed as the CUDA-graph
    runner does) gives the unfused table's logits bit for bit (every op on the Triton kernels, interpreted), in 3
    kernel launches fewer per layer and step."""
    from sglang.srt.layers import layernorm
    from sglang.test.model_harness import ModelHarness

    model, cfg = _stories()
    monkeypatch.setattr(ops, "_triton", lambda t, name: ops._kernels(name))

    def norm_kernel(x, w, eps, residual=None):  # RMSNorm's CUDA path on CPU tensors (the kernels, interpreted)
        if residual is None:
            return ops.rmsnorm(x, w, eps)
        return ops.fused_add_rmsnorm(x.contiguous().clone(), residual.contiguous().clone(), w, eps)

    monkeypatch.setattr(layernorm, "rmsnorm_ref", norm_kernel)
    h, i = cfg.hidden_size, int(cfg.get("intermediate_size"))
    split2, gu = SkinnyConfig(16, 16, 2), SkinnyConfig(16, 32, 1)

    def table(fuse: bool) -> DecodeGemmTable:
        tag = "partials" if fuse else ""
        return DecodeGemmTable("cpu-test", (
            ((h, h, "bfloat16"), (GemmChoice(128, split2, 2.0, 1.0, split2, tag),)),
            ((h, i, "bfloat16"), (GemmChoice(128, split2, 2.0, 1.0, split2, tag),)),
            ((2 * i, h, "bfloat16"), (GemmChoice(128, gu, 2.0, 1.0, gu, "silu" if fuse else ""),)),
        ), fuse_epilogue=fuse)

    gen = _gen(11)
    prompts = [torch.randint(3, cfg.vocab_size, (n,), generator=gen).tolist() for n in (5, 3)]
    out = {}
    for fuse in (False, True):
        decode_gemm.install(model, table(fuse))
        launches = _Launches(monkeypatch)
        harness = ModelHarness(model, cfg)
        with torch.inference_mode():
            logits = [harness.step([("a", prompts[0]), ("b", prompts[1])])]
            for _ in range(2):
                nxt = logits[-1].argmax(-1).tolist()
                logits.append(harness.step([("a", [nxt[0]]), ("b", [nxt[1]])]))
        out[fuse] = (logits, dict(launches.count))
        monkeypatch.undo()  # drop this run's launch counters (and the patches: set them again)
        monkeypatch.setattr(ops, "_triton", lambda t, name: ops._kernels(name))
        monkeypatch.setattr(layernorm, "rmsnorm_ref", norm_kernel)
    decode_gemm.install(model, None)
    for a, b in zip(out[False][0], out[True][0]):
        assert torch.equal(a, b), f"seed {SEED}"
    steps, layers = 3, cfg.num_hidden_layers
    assert out[False][1]["_splitk_reduce_kernel"] == 2 * layers * steps
    assert out[False][1]["_silu_and_mul_kernel"] == layers * steps
    assert "_splitk_reduce_kernel" not in out[True][1] and "_silu_and_mul_kernel" not in out[True][1]
    assert out[True][1]["_skinny_silu_kernel"] == layers * steps
    assert sum(out[False][1].values()) - sum(out[True][1].values()) == 3 * layers * steps


def test_silu_candidates_and_kernels_saved():
    """The tuner's gate_up + SiLU candidates are split-K 1 with half-height strips (same bytes per stage), without
    duplicates; kernels_saved counts one reduce per deferred split-K projection and one SiLU per fused gate_up at the
    bucket's row count (stories260K, 5 layers: 15), 0 without a table."""
    cands = decode_gemm._silu_candidates(decode_gemm.candidates(32, 28672, 4096, 132))
    assert cands and all(c.split_k == 1 for c in cands) and len(set(cands)) == len(cands)
    assert SkinnyConfig(16, 256, 1, 4, 4) in cands and SkinnyConfig(64, 128, 1, 4, 4) in cands
    model, cfg = _stories()
    h, i = cfg.hidden_size, int(cfg.get("intermediate_size"))
    split2, gu = SkinnyConfig(16, 16, 2), SkinnyConfig(16, 32, 1)
    table = DecodeGemmTable("cpu-test", (
        ((h, h, "bfloat16"), (GemmChoice(8, split2, 2.0, 1.0, split2, "partials"),)),
        ((h, i, "bfloat16"), (GemmChoice(8, split2, 2.0, 1.0, split2, "partials"),)),
        ((2 * i, h, "bfloat16"), (GemmChoice(8, gu, 2.0, 1.0, gu, "silu"),)),
    ), fuse_epilogue=True)
    decode_gemm.install(model, table)
    layers = cfg.num_hidden_layers
    assert host.kernels_saved(model, table, 8) == 3 * layers and host.kernels_saved(model, table, 9) == 0
    assert host.kernels_saved(model, None, 8) == 0
    decode_gemm.install(model, None)
    assert host.kernels_saved(model, table, 8) == 0  # flags cleared
