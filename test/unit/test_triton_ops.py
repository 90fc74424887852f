"""Fused-op Triton kernels vs their torch references, on CPU under the Triton interpreter.

Covers add+RMSNorm, RMSNorm, RoPE (neox and GPT-J, partial rotary), SiLU-and-mul, top-k
routing, the MoE block alignment and the grouped-GEMM MoE, plus the split-KV decode
kernel with explicit split counts. Skips on CUDA hosts (see test/gpu/test_triton_kernels_gpu.py).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("CUDA host: the compiled kernels are tested in test/gpu/test_triton_kernels_gpu.py",
                allow_module_level=True)
if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.fail("triton was imported (by an earlier-collected test module) before TRITON_INTERPRET=1 was set, so its "
                "library functions are compiled-mode; import triton lazily in that module", pytrace=False)
os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

from sglang.srt.layers import ops  # noqa: E402
from sglang.srt.layers.activation import silu_and_mul_ref  # noqa: E402
from sglang.srt.layers.attention.triton_ops import (decode_attention_fwd, decode_attention_workspace,  # noqa: E402
                                                     default_num_kv_splits)
from sglang.srt.layers.layernorm import rmsnorm_ref  # noqa: E402
from sglang.srt.layers.moe.fused_moe import fused_moe_ref  # noqa: E402
from sglang.srt.layers.moe.router import select_experts  # noqa: E402
from sglang.srt.layers.rotary_embedding import get_rope  # noqa: E402
from sglang.srt.layers.triton_ops import activation, fused_add_rmsnorm, moe, rope, rope_kv_store  # noqa: E402
from sgl_kernel.triton import skinny_gemm  # noqa: E402

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# one to two roundings of the dtype, relative to the output scale
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, b.shape, a.dtype, b.dtype)
    err = (a.float() - b.float()).abs().max().item()
    ref = max(b.float().abs().max().item(), 1.0) * scale
    assert err <= TOL[dtype] * ref, f"max abs err {err} (tolerance {TOL[dtype] * ref})"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("h", [64, 100])
def test_rmsnorm_and_fused_add(dtype, h):
    gen = torch.Generator().manual_seed(h)
    x = torch.randn(5, h, generator=gen).to(dtype)
    r = torch.randn(5, h, generator=gen).to(dtype)
    w = (torch.rand(h, generator=gen) + 0.5).to(dtype)
    close(fused_add_rmsnorm.rmsnorm(x, w, 1e-6), rmsnorm_ref(x, w, 1e-6), dtype)
    want_y, want_s = rmsnorm_ref(x, w, 1e-6, r)
    xk, rk = x.clone(), r.clone()
    fused_add_rmsnorm.fused_add_rmsnorm(xk, rk, w, 1e-6)
    if dtype == torch.bfloat16:  # the 3.9 interpreter truncates fp32 -> bf16 (GPUs round to nearest even)
        close(rk, want_s, dtype)
    else:
        assert torch.equal(rk, want_s)  # the residual sum is rounded exactly like the reference
    close(xk, want_y, dtype)


def test_rmsnorm_rejects_bad_weight():
    with pytest.raises(ValueError, match="weight shape"):
        fused_add_rmsnorm.rmsnorm(torch.randn(2, 8), torch.randn(7), 1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("neox,rotary_dim", [(True, 16), (False, 16), (True, 8)])
def test_rope_matches_rotary_embedding(dtype, neox, rotary_dim):
    gen = torch.Generator().manual_seed(rotary_dim + neox)
    hd, nq, nk, n = 16, 4, 2, 7
    emb = get_rope(hd, rotary_dim, 64, 10000.0, is_neox_style=neox)
    pos = torch.randint(0, 64, (n,), generator=gen)
    qkv = torch.randn(n, (nq + 2 * nk) * hd, generator=gen).to(dtype)
    q, k = qkv[:, : nq * hd], qkv[:, nq * hd: (nq + nk) * hd]  # strided views, as after a fused qkv GEMM
    want_q, want_k = emb(pos, q.clone(), k.clone())
    v_before = qkv[:, (nq + nk) * hd:].clone()
    rope.apply_rope(pos, q, k, emb.cos_sin_cache, hd, neox)
    close(q, want_q, dtype)
    close(k, want_k, dtype)
    assert torch.equal(qkv[:, (nq + nk) * hd:], v_before)  # v untouched


def test_rope_reference_in_ops_matches_module():
    gen = torch.Generator().manual_seed(5)
    emb = get_rope(8, 8, 32, 500.0, is_neox_style=False)
    pos = torch.randint(0, 32, (4,), generator=gen)
    q, k = torch.randn(4, 16, generator=gen), torch.randn(4, 8, generator=gen)
    want = emb(pos, q, k)
    got = ops.apply_rope(pos, q.clone(), k.clone(), emb.cos_sin_cache, 8, False)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def _rope_kv_case(gen, dtype, pool_dtype, hd, rotary_dim, neox, nq=4, nkv=2, n=6, slots=40):
    """Random fused-qkv rows (strided q/k/v views), positions, distinct shuffled slots and a random pool."""
    emb = get_rope(hd, rotary_dim, 64, 10000.0, is_neox_style=neox)
    pos = torch.randint(0, 64, (n,), generator=gen)
    qkv = torch.randn(n, (nq + 2 * nkv) * hd, generator=gen).to(dtype)
    loc = torch.randperm(slots, generator=gen)[:n]
    kb = torch.randn(slots, nkv, hd, generator=gen).to(pool_dtype)
    vb = torch.randn(slots, nkv, hd, generator=gen).to(pool_dtype)
    return emb, pos, qkv, loc, kb, vb


@pytest.mark.parametrize("dtype,pool_dtype", [(torch.float32, torch.float32), (torch.float16, torch.float16),
                                              (torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16)])
@pytest.mark.parametrize("neox,hd,rotary_dim", [(True, 16, 16), (False, 16, 16), (True, 16, 8), (False, 12, 8)])
def test_rope_and_store_kv_matches_rope_then_store(dtype, pool_dtype, neox, hd, rotary_dim):
    """The fused kernel equals apply_rope (Triton) + indexed stores bit for bit (same rounding: rotated k rounded to
    k's dtype, then cast to the pool's), and the torch reference within rounding; k and v stay untouched, slots
    outside ``loc`` keep their bytes."""
    gen = torch.Generator().manual_seed(hd + rotary_dim + 2 * neox)
    nq, nkv = 4, 2
    emb, pos, qkv, loc, kb, vb = _rope_kv_case(gen, dtype, pool_dtype, hd, rotary_dim, neox, nq, nkv)
    q, k, v = qkv[:, : nq * hd], qkv[:, nq * hd: (nq + nkv) * hd], qkv[:, (nq + nkv) * hd:]
    kv_before = qkv[:, nq * hd:].clone()
    # unfused: Triton RoPE in place on copies, then the pool's indexed stores
    q2, k2 = q.clone(), k.clone()
    rope.apply_rope(pos, q2, k2, emb.cos_sin_cache, hd, neox)
    kb2, vb2 = kb.clone(), vb.clone()
    kb2[loc] = k2.view(-1, nkv, hd).to(pool_dtype)
    vb2[loc] = v.reshape(-1, nkv, hd).to(pool_dtype)
    # torch reference
    q3, kb3, vb3 = q.clone(), kb.clone(), vb.clone()
    ops.rope_and_store_kv_ref(pos, q3, k, v, emb.cos_sin_cache, hd, neox, kb3, vb3, loc)
    rope_kv_store.rope_and_store_kv(pos, q, k, v, emb.cos_sin_cache, hd, neox, kb, vb, loc)
    assert torch.equal(qkv[:, nq * hd:], kv_before)  # k and v not modified
    assert torch.equal(q, q2)
    if pool_dtype == dtype:
        assert torch.equal(kb, kb2) and torch.equal(vb, vb2)
        assert torch.equal(vb, vb3)
    else:  # the 3.9 interpreter truncates fp32 -> bf16 where torch rounds (the GPU test checks equality there)
        close(kb, kb2, pool_dtype)
        close(vb, vb2, pool_dtype)
    untouched = torch.ones(kb.shape[0], dtype=torch.bool)
    untouched[loc] = False
    assert torch.equal(kb[untouched], kb3[untouched]) and torch.equal(vb[untouched], vb3[untouched])
    close(q, q3, dtype)
    close(kb, kb3, pool_dtype)
    close(vb, vb3, pool_dtype)


def test_rope_and_store_kv_rejects_bad_shapes():
    gen = torch.Generator().manual_seed(3)
    emb, pos, qkv, loc, kb, vb = _rope_kv_case(gen, torch.float32, torch.float32, 16, 16, True)
    q, k, v = qkv[:, :64], qkv[:, 64:96], qkv[:, 96:]
    with pytest.raises(ValueError, match="inconsistent"):
        rope_kv_store.rope_and_store_kv(pos, q, k, v, emb.cos_sin_cache, 16, True, kb[:, :1], vb[:, :1], loc)
    with pytest.raises(ValueError, match="inconsistent"):
        rope_kv_store.rope_and_store_kv(pos, q, k, v, emb.cos_sin_cache, 16, True, kb, vb, loc[:-1])


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype):
    gen = torch.Generator().manual_seed(9)
    x = (torch.randn(6, 2 * 40, generator=gen) * 3).to(dtype)
    close(activation.silu_and_mul(x), silu_and_mul_ref(x), dtype)


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("e,k", [(8, 2), (60, 4), (16, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_topk(renormalize, e, k, dtype):
    gen = torch.Generator().manual_seed(e * 10 + k)
    logits = torch.randn(9, e, generator=gen).to(dtype)
    w, ids = moe.fused_topk(logits, k, renormalize)
    rw, rids = select_experts(logits, k, renormalize)
    assert ids.dtype == torch.int64 and w.dtype == torch.float32
    torch.testing.assert_close(w, rw, rtol=1e-5, atol=1e-6)
    if dtype == torch.float32:
        assert torch.equal(ids, rids)
    else:  # bf16 logits tie; a tied expert may be picked in either order
        probs = torch.softmax(logits.float(), -1)
        torch.testing.assert_close(probs.gather(1, ids), probs.gather(1, rids))
        assert all(len(set(row)) == k for row in ids.tolist())


def test_moe_align_block_size():
    gen = torch.Generator().manual_seed(1)
    n, k, e, bm = 11, 2, 6, 4
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(n)])
    sorted_ids, expert_ids = moe.moe_align_block_size(ids, bm, e)
    flat = ids.reshape(-1)
    valid = sorted_ids[sorted_ids < n * k].long()
    assert sorted(valid.tolist()) == list(range(n * k))  # every pair exactly once
    for b, ex in enumerate(expert_ids.tolist()):
        blk = sorted_ids[b * bm:(b + 1) * bm].long()
        blk = blk[blk < n * k]
        if ex < 0:
            assert blk.numel() == 0
        else:
            assert (flat[blk] == ex).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,e,k", [(5, 4, 2), (40, 8, 2), (3, 16, 4)])
def test_fused_moe_matches_reference(dtype, n, e, k):
    gen = torch.Generator().manual_seed(n + e + k)
    h, i = 32, 48
    x = torch.randn(n, h, generator=gen).to(dtype)
    w13 = (torch.randn(e, 2 * i, h, generator=gen) / h ** 0.5).to(dtype)
    w2 = (torch.randn(e, h, i, generator=gen) / i ** 0.5).to(dtype)
    tw, tid = select_experts(torch.randn(n, e, generator=gen), k, True)
    close(moe.fused_moe(x, w13, w2, tw, tid), fused_moe_ref(x, w13, w2, tw, tid), dtype, scale=2.0)


@pytest.mark.parametrize("n,e,k", [(9, 4, 1), (7, 6, 2), (5, 4, 3)])
def test_fused_moe_skips_negative_ids(n, e, k):
    """Expert parallelism's padding rows (id -1): no block, nothing computed, the pair adds 0 (k = 1: a zero row)."""
    gen = torch.Generator().manual_seed(n * e * k)
    h, i = 32, 48
    x = torch.randn(n, h, generator=gen)
    w13, w2 = torch.randn(e, 2 * i, h, generator=gen) / h ** 0.5, torch.randn(e, h, i, generator=gen) / i ** 0.5
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(n)])
    ids[torch.rand(n, k, generator=gen) < 0.4] = -1
    ids[0] = -1  # a row with every slot skipped
    w = torch.rand(n, k, generator=gen)
    sorted_ids, _ = moe.moe_align_block_size(ids, 4, e)
    flat = ids.reshape(-1)
    assert sorted(sorted_ids[sorted_ids < n * k].tolist()) == [p for p in range(n * k) if flat[p] >= 0]
    got = moe.fused_moe(x, w13, w2, w, ids)
    want = fused_moe_ref(x, w13, w2, w * (ids >= 0), ids.clamp(min=0))  # skipped = weight 0
    close(got, want, torch.float32, scale=2.0)
    close(fused_moe_ref(x, w13, w2, w, ids), want, torch.float32, scale=2.0)
    assert torch.equal(got[0], torch.zeros(h))


@pytest.mark.parametrize("legacy", [False, True])
@pytest.mark.parametrize("splits", [1, 3, 16])
def test_decode_kernel_split_counts(splits, legacy):
    """Both kernel variants (contiguous K rows + direct output at one split; legacy transposed K + reduce) at
    1/3/16 splits vs a dense softmax reference."""
    gen = torch.Generator().manual_seed(splits + 100 * legacy)
    bs, nh, nkv, hd, slots, ctx = 3, 8, 2, 32, 300, 128
    seq = torch.tensor([1, 77, 128])
    r2t = torch.randperm(bs * ctx, generator=gen)[: bs * ctx].view(bs, ctx).remainder(slots).to(torch.int32)
    kb, vb = torch.randn(slots, nkv, hd, generator=gen), torch.randn(slots, nkv, hd, generator=gen)
    q = torch.randn(bs, nh, hd, generator=gen)
    out = torch.empty_like(q)
    mid_o, mid_lse = decode_attention_workspace(bs, nh, hd, splits, torch.device("cpu"))
    mid_o.fill_(float("nan"))  # the direct path must not read the workspace; the split path must overwrite it
    mid_lse.fill_(float("nan"))
    decode_attention_fwd(q, kb, vb, out, r2t, torch.arange(bs), seq, 0.3, splits, mid_o, mid_lse, legacy=legacy)
    for b in range(bs):
        s = r2t[b, : seq[b]].long()
        kk = kb[s].repeat_interleave(nh // nkv, 1)  # [seq, nh, hd]
        vv = vb[s].repeat_interleave(nh // nkv, 1)
        p = torch.softmax(torch.einsum("hd,shd->hs", q[b], kk) * 0.3, -1)
        close(out[b], torch.einsum("hs,shd->hd", p, vv), torch.float32, scale=10.0)


def test_decode_config_per_arch_and_hopper_tile_matches_reference():
    """sm_90+ at one split uses BLOCK_N 128 / 3 stages (measured on an H200); other cases keep 64 / 2 stages, and
    head_dim > 128 or wide groups 32 / 2. The Hopper tile is run in the interpreter against the dense reference."""
    from sgl_kernel.triton.decode_attention import _arch_of, _decode_config

    assert _decode_config(128, 4, 1, 90) == (128, 4, 3)
    assert _decode_config(128, 4, 16, 90) == (64, 4, 2)
    assert _decode_config(128, 4, 1, 80) == (64, 4, 2)
    assert _decode_config(256, 4, 1, 90) == (32, 4, 2)
    assert _arch_of(torch.device("cpu")) == 0
    gen = torch.Generator().manual_seed(7)
    bs, nh, nkv, hd, ctx = 2, 8, 2, 32, 300
    seq = torch.tensor([300, 129])
    r2t = torch.randperm(bs * ctx, generator=gen).view(bs, ctx).to(torch.int32)
    kb, vb = torch.randn(bs * ctx, nkv, hd, generator=gen), torch.randn(bs * ctx, nkv, hd, generator=gen)
    q = torch.randn(bs, nh, hd, generator=gen)
    out = torch.empty_like(q)
    mid_o, mid_lse = decode_attention_workspace(bs, nh, hd, 1, torch.device("cpu"))
    decode_attention_fwd(q, kb, vb, out, r2t, torch.arange(bs), seq, 0.3, 1, mid_o, mid_lse,
                         block_n=128, num_warps=4, num_stages=3)
    for b in range(bs):
        s = r2t[b, : seq[b]].long()
        kk, vv = kb[s].repeat_interleave(nh // nkv, 1), vb[s].repeat_interleave(nh // nkv, 1)
        p = torch.softmax(torch.einsum("hd,shd->hs", q[b], kk) * 0.3, -1)
        close(out[b], torch.einsum("hs,shd->hd", p, vv), torch.float32, scale=10.0)


def test_pdl_and_small_grid_tile_switches(monkeypatch):
    """Decode switches: programmatic dependent launch is the default (unset or 2) and 0 opts out; malformed values,
    the removed wait-only mode 1 included, raise ValueError naming the variable and the fix; neither PDL nor the
    small-grid attention tile ever applies off CUDA or in the interpreter (the tile neither at several splits nor
    when unset)."""
    from sgl_kernel.triton import common
    from sgl_kernel.triton.decode_attention import small_grid_tile

    cpu = torch.device("cpu")
    for bad in ("on", "1", "3", "true"):
        monkeypatch.setenv("SGLANG_DECODE_PDL", bad)
        with pytest.raises(ValueError, match=f"SGLANG_DECODE_PDL='{bad}': use 0 .* or 2"):
            common.use_pdl(cpu)
    for mode in ("0", "2", " 2 ", ""):
        monkeypatch.setenv("SGLANG_DECODE_PDL", mode)
        assert common.use_pdl(cpu) is False  # never off CUDA / in the interpreter
    monkeypatch.delenv("SGLANG_DECODE_PDL")
    assert common.use_pdl(cpu) is False
    assert isinstance(common.triton_has_launch_pdl(), bool)
    assert small_grid_tile(32, 8, 1, cpu) is None
    for bad in ("128/8", "100/8/3", "128/x/3", "128/0/3"):
        monkeypatch.setenv("SGLANG_DECODE_ATTN_SMALL_GRID_TILE", bad)
        with pytest.raises(ValueError, match="SGLANG_DECODE_ATTN_SMALL_GRID_TILE"):
            small_grid_tile(32, 8, 1, cpu)
    monkeypatch.setenv("SGLANG_DECODE_ATTN_SMALL_GRID_TILE", "128/8/3")
    assert small_grid_tile(32, 8, 1, cpu) is None and small_grid_tile(32, 8, 2, cpu) is None


def test_pdl_gate_on_a_cuda_device(monkeypatch):
    """With a CUDA device faked on this CPU machine (interpreter off): PDL unset is on for the H100 (where it measured
    faster) and off for the H200 (where it measured slower); =2 forces it on and =0 off; it is never on below Hopper
    (capability 9), without Triton's launch_pdl option, or on ROCm."""
    from sgl_kernel.triton import common

    dev = torch.device("cuda", 0)
    cap = [(9, 0)]
    monkeypatch.setattr(common, "interpreting", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: cap[0])
    monkeypatch.setattr(common, "triton_has_launch_pdl", lambda: True)
    monkeypatch.setattr(torch.version, "hip", None)
    name = ["NVIDIA H100 80GB HBM3"]
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: name[0])
    monkeypatch.delenv("SGLANG_DECODE_PDL", raising=False)
    assert common.use_pdl(dev) is True  # unset: on where it measured faster (H100)
    name[0] = "NVIDIA H200"
    assert common.use_pdl(dev) is False  # unset: off where it measured slower (H200) or was never measured
    monkeypatch.setenv("SGLANG_DECODE_PDL", "2")
    assert common.use_pdl(dev) is True
    monkeypatch.setenv("SGLANG_DECODE_PDL", "0")
    name[0] = "NVIDIA H100 80GB HBM3"
    assert common.use_pdl(dev) is False
    monkeypatch.setenv("SGLANG_DECODE_PDL", "2")
    cap[0] = (8, 0)  # Ampere: no griddepcontrol
    assert common.use_pdl(dev) is False
    cap[0] = (10, 0)
    assert common.use_pdl(dev) is True
    monkeypatch.setattr(common, "triton_has_launch_pdl", lambda: False)
    assert common.use_pdl(dev) is False
    monkeypatch.setattr(common, "triton_has_launch_pdl", lambda: True)
    monkeypatch.setattr(torch.version, "hip", "6.2")
    assert common.use_pdl(dev) is False


def test_decode_split_policy_fills_the_gpu_about_once():
    """The 'wave' rule: largest split count whose grid fits one wave of 2 programs per SM (132-SM H100/H200, 8 KV heads),
    clamped to 1..max; the legacy rule is kept for old-vs-new benchmarks; bad input raises."""
    cpu = torch.device("cpu")
    want = {1: 16, 8: 4, 16: 2, 32: 1, 64: 1, 128: 1}
    for bs, s in want.items():
        assert default_num_kv_splits(bs, 8, cpu, 16, num_sms=132) == s
        assert s == 1 or bs * 8 * s <= 2 * 132 < bs * 8 * (s + 1) or s == 16  # one wave, as full as splits allow
    assert [default_num_kv_splits(bs, 8, cpu, 16, "legacy", num_sms=132) for bs in (1, 32, 128)] == [16, 8, 2]
    assert default_num_kv_splits(32, 8, cpu) == 4  # CPU without an SM count: fixed small count (interpreter tests)
    with pytest.raises(ValueError, match="policy"):
        default_num_kv_splits(1, 8, cpu, policy="fast")
    with pytest.raises(ValueError, match="batch_size=0"):
        default_num_kv_splits(0, 8, cpu, num_sms=132)


def test_ops_cpu_fallback_uses_references():
    gen = torch.Generator().manual_seed(2)
    x, r, w = torch.randn(3, 16, generator=gen), torch.randn(3, 16, generator=gen), torch.rand(16, generator=gen)
    want_y, want_s = rmsnorm_ref(x, w, 1e-5, r)
    y, s = ops.fused_add_rmsnorm(x.clone(), r.clone(), w, 1e-5)
    assert torch.equal(y, want_y) and torch.equal(s, want_s)
    assert torch.equal(ops.rmsnorm(x, w, 1e-5), rmsnorm_ref(x, w, 1e-5))
    assert torch.equal(ops.silu_and_mul(torch.cat([x, r], -1)), silu_and_mul_ref(torch.cat([x, r], -1)))
    logits = torch.randn(4, 8, generator=gen)
    assert all(torch.equal(a, b) for a, b in zip(ops.fused_topk(logits, 2, True), select_experts(logits, 2, True)))


@pytest.mark.parametrize("m,n,k,bias", [(1, 40, 96, False), (5, 33, 100, True), (16, 64, 1030, False)])
def test_skinny_gemm_matches_linear(m, n, k, bias):
    """The decode-batch weight-streaming GEMM equals F.linear (ragged N and K, optional bias); M outside 1..128
    raises."""
    gen = torch.Generator().manual_seed(m + n + k)
    x = torch.randn(m, k, generator=gen)
    w = torch.randn(n, k, generator=gen) / k ** 0.5
    b = torch.randn(n, generator=gen) if bias else None
    got = skinny_gemm.skinny_gemm(x, w, b, block_k=64)
    close(got, torch.nn.functional.linear(x, w, b), torch.float32, scale=10.0)
    with pytest.raises(ValueError, match="skinny_gemm"):
        skinny_gemm.skinny_gemm(torch.randn(129, k), w)


@pytest.mark.parametrize("chunk,block_n", [(4096, 16), (4096, 32), (4096, 128), (768, 32), (3584, 64), (64, 16)])
def test_skinny_prefetch_lines_stay_within_caps(chunk, block_n):
    """Programmatic dependent launch (the default): the L2 prefetch per program is a power of two of 128-byte
    lines per weight row (bf16), never past the program's K chunk, PREFETCH_K columns or PREFETCH_BYTES, and at least one line."""
    lines = skinny_gemm._prefetch_lines(chunk, block_n, 2)
    assert lines >= 1 and lines & (lines - 1) == 0
    assert lines == 1 or (lines * 64 <= min(chunk, skinny_gemm.PREFETCH_K)
                          and lines * 128 * block_n <= skinny_gemm.PREFETCH_BYTES)
    assert 2 * lines * 64 > min(chunk, skinny_gemm.PREFETCH_K, skinny_gemm.PREFETCH_BYTES // (2 * block_n))  # maximal


def test_ops_linear_skinny_dispatch(monkeypatch):
    """ops.linear(skinny=True): 1..16-row bf16 inputs take the skinny kernel (forced on CPU under the interpreter) and
    match F.linear within bf16 rounding; other shapes/dtypes and skinny=False stay F.linear bit for bit."""
    gen = torch.Generator().manual_seed(4)
    w = (torch.randn(24, 40, generator=gen) / 40 ** 0.5).to(torch.bfloat16)
    b = torch.randn(24, generator=gen).to(torch.bfloat16)
    calls = []
    real = skinny_gemm.skinny_gemm
    monkeypatch.setattr(ops, "_triton", lambda t, name: ops._kernels(name))
    monkeypatch.setattr(skinny_gemm, "skinny_gemm", lambda *a, **k: calls.append(1) or real(*a, **k))
    for m in (1, 16, 17):
        x = torch.randn(m, 40, generator=gen).to(torch.bfloat16)
        close(ops.linear(x, w, b, skinny=True), torch.nn.functional.linear(x, w, b), torch.bfloat16)
        assert torch.equal(ops.linear(x, w, b), torch.nn.functional.linear(x, w, b))
    assert len(calls) == 2  # m = 1 and 16 only
    xf = torch.randn(3, 40, generator=gen)
    assert torch.equal(ops.linear(xf, w.float(), None, skinny=True), torch.nn.functional.linear(xf, w.float()))
    assert len(calls) == 2
