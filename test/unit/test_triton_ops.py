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
from sglang.srt.layers.attention.triton_ops import decode_attention_fwd, decode_attention_workspace  # noqa: E402
from sglang.srt.layers.layernorm import rmsnorm_ref  # noqa: E402
from sglang.srt.layers.moe.fused_moe import fused_moe_ref  # noqa: E402
from sglang.srt.layers.moe.router import select_experts  # noqa: E402
from sglang.srt.layers.rotary_embedding import get_rope  # noqa: E402
from sglang.srt.layers.triton_ops import activation, fused_add_rmsnorm, moe, rope  # noqa: E402

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


@pytest.mark.parametrize("splits", [1, 3, 16])
def test_decode_kernel_split_counts(splits):
    gen = torch.Generator().manual_seed(splits)
    bs, nh, nkv, hd, slots, ctx = 3, 8, 2, 32, 300, 128
    seq = torch.tensor([1, 77, 128])
    r2t = torch.randperm(bs * ctx, generator=gen)[: bs * ctx].view(bs, ctx).remainder(slots).to(torch.int32)
    kb, vb = torch.randn(slots, nkv, hd, generator=gen), torch.randn(slots, nkv, hd, generator=gen)
    q = torch.randn(bs, nh, hd, generator=gen)
    out = torch.empty_like(q)
    mid_o, mid_lse = decode_attention_workspace(bs, nh, hd, splits, torch.device("cpu"))
    decode_attention_fwd(q, kb, vb, out, r2t, torch.arange(bs), seq, 0.3, splits, mid_o, mid_lse)
    for b in range(bs):
        s = r2t[b, : seq[b]].long()
        kk = kb[s].repeat_interleave(nh // nkv, 1)  # [seq, nh, hd]
        vv = vb[s].repeat_interleave(nh // nkv, 1)
        p = torch.softmax(torch.einsum("hd,shd->hs", q[b], kk) * 0.3, -1)
        close(out[b], torch.einsum("hs,shd->hd", p, vv), torch.float32, scale=10.0)


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
