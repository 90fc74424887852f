"""Layer units vs explicit references: RMSNorm, RoPE (incl. llama3/linear scaling), SiluAndMul, MoE routing and
experts, and tensor-parallel weight sharding of the linear/embedding/MoE layers."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from sglang.srt.layers.activation import SiluAndMul
from sglang.srt.layers.layernorm import RMSNorm, rmsnorm_ref
from sglang.srt.layers.linear import (ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear,
                                      ReplicatedLinear, RowParallelLinear)
from sglang.srt.layers.moe.fused_moe import FusedMoE, fused_moe_ref
from sglang.srt.layers.moe.router import select_experts
from sglang.srt.layers.rotary_embedding import default_inv_freq, get_rope
from sglang.srt.layers.vocab_parallel_embedding import VocabParallelEmbedding


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(1234)


# ---------------------------------------------------------------- RMSNorm
def _rms64(x, w, eps):
    x = x.double()
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.double()


def test_rmsnorm_without_and_with_residual(gen):
    x, r = torch.randn(7, 48, generator=gen) * 3, torch.randn(7, 48, generator=gen)
    norm = RMSNorm(48, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(48, generator=gen) + 0.5)
    y = norm(x)
    assert y.dtype == torch.float32 and y.shape == x.shape
    torch.testing.assert_close(y.double(), _rms64(x, norm.weight, 1e-5), rtol=1e-5, atol=1e-5)
    y2, res = norm(x, r)
    torch.testing.assert_close(res, x + r, rtol=0, atol=0)
    torch.testing.assert_close(y2.double(), _rms64(x + r, norm.weight, 1e-5), rtol=1e-5, atol=1e-5)


def test_rmsnorm_bf16_semantics(gen):
    x, r = torch.randn(5, 32, generator=gen).bfloat16(), torch.randn(5, 32, generator=gen).bfloat16()
    w = torch.rand(32, generator=gen) + 0.5
    y, res = rmsnorm_ref(x, w, 1e-6, r)
    assert y.dtype == res.dtype == torch.bfloat16
    assert torch.equal(res, (x.float() + r.float()).bfloat16())
    assert torch.equal(y, rmsnorm_ref(res, w, 1e-6))  # the norm of the rounded sum
    torch.testing.assert_close(y.double(), _rms64(res, w, 1e-6), rtol=1e-2, atol=1e-2)
    with pytest.raises(ValueError, match="residual shape"):
        rmsnorm_ref(x, w, 1e-6, r[:, :16])


# ---------------------------------------------------------------- RoPE
def _rope_complex(x, positions, inv_freq, head_dim, rotary_dim, neox):
    """Explicit complex rotation: pair (a, b) -> (a + ib) * exp(i * pos * f)."""
    n = x.shape[0]
    xh = x.double().view(n, -1, head_dim).clone()
    rot = xh[..., :rotary_dim]
    half = rotary_dim // 2
    a, b = (rot[..., :half], rot[..., half:]) if neox else (rot[..., 0::2], rot[..., 1::2])
    angle = positions.double()[:, None, None] * inv_freq.double()[None, None, :]
    z = torch.complex(a, b) * torch.exp(1j * angle)
    if neox:
        xh[..., :half], xh[..., half:rotary_dim] = z.real, z.imag
    else:
        xh[..., 0:rotary_dim:2], xh[..., 1:rotary_dim:2] = z.real, z.imag
    return xh.view(n, -1)


@pytest.mark.parametrize("neox,rotary_dim", [(True, 16), (False, 16), (True, 8)])
def test_rope_default_vs_complex_rotation(gen, neox, rotary_dim):
    hd, nh, nkv = 16, 4, 2
    rope = get_rope(hd, rotary_dim, 300, 10000.0, None, is_neox_style=neox)
    assert rope.cos_sin_cache.dtype == torch.float32 and rope.cos_sin_cache.shape == (300, rotary_dim)
    pos = torch.randint(0, 300, (9,), generator=gen)
    q, k = torch.randn(9, nh * hd, generator=gen), torch.randn(9, nkv * hd, generator=gen)
    qo, ko = rope(pos, q, k)
    inv = torch.tensor([10000.0 ** (-2 * i / rotary_dim) for i in range(rotary_dim // 2)], dtype=torch.float64)
    torch.testing.assert_close(qo.double(), _rope_complex(q, pos, inv, hd, rotary_dim, neox), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ko.double(), _rope_complex(k, pos, inv, hd, rotary_dim, neox), rtol=1e-4, atol=1e-4)


LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}


def _llama3_inv_freq_explicit(hd, base, s):
    out = []
    for i in range(hd // 2):
        f = base ** (-2 * i / hd)
        wavelen = 2 * math.pi / f
        lo, hi = s["original_max_position_embeddings"] / s["low_freq_factor"], \
            s["original_max_position_embeddings"] / s["high_freq_factor"]
        if wavelen < hi:
            out.append(f)
        elif wavelen > lo:
            out.append(f / s["factor"])
        else:
            t = (s["original_max_position_embeddings"] / wavelen - s["low_freq_factor"]) / \
                (s["high_freq_factor"] - s["low_freq_factor"])
            out.append((1 - t) * f / s["factor"] + t * f)
    return torch.tensor(out, dtype=torch.float64)


def test_rope_llama3_scaling(gen):
    hd = 32
    expected = _llama3_inv_freq_explicit(hd, 10000.0, LLAMA3)
    assert (expected != default_inv_freq(hd, 10000.0).double()).any()  # the scaling does something here
    rope = get_rope(hd, hd, 200, 10000.0, LLAMA3)
    pos = torch.randint(0, 200, (6,), generator=gen)
    q, k = torch.randn(6, 2 * hd, generator=gen), torch.randn(6, hd, generator=gen)
    qo, ko = rope(pos, q, k)
    torch.testing.assert_close(qo.double(), _rope_complex(q, pos, expected, hd, hd, True), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ko.double(), _rope_complex(k, pos, expected, hd, hd, True), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("scaling", [LLAMA3, {"rope_type": "linear", "factor": 4.0}])
def test_rope_inv_freq_matches_transformers(scaling):
    rope_utils = pytest.importorskip("transformers.modeling_rope_utils")
    from transformers import LlamaConfig

    cfg = LlamaConfig(hidden_size=64, num_attention_heads=2, rope_parameters={"rope_theta": 5000.0, **scaling})
    hf_inv, _ = rope_utils.ROPE_INIT_FUNCTIONS[scaling["rope_type"]](cfg, "cpu")
    rope = get_rope(32, 32, 100, 5000.0, scaling)
    t = torch.arange(100, dtype=torch.float32)
    ref = torch.outer(t, hf_inv.float())
    torch.testing.assert_close(rope.cos_sin_cache, torch.cat([ref.cos(), ref.sin()], -1), rtol=1e-6, atol=1e-6)


def test_rope_errors():
    with pytest.raises(ValueError, match="'yarn'.*supported rope types"):
        get_rope(16, 16, 10, 10000.0, {"rope_type": "yarn", "factor": 2.0})
    with pytest.raises(ValueError, match="low_freq_factor"):
        get_rope(16, 16, 10, 10000.0, {"rope_type": "llama3", "factor": 2.0})
    with pytest.raises(ValueError, match="rotary_dim"):
        get_rope(16, 18, 10, 10000.0, None)


# ---------------------------------------------------------------- SiluAndMul
def test_silu_and_mul(gen):
    x = torch.randn(6, 2 * 20, generator=gen)
    ref = x[:, :20] / (1 + torch.exp(-x[:, :20])) * x[:, 20:]
    torch.testing.assert_close(SiluAndMul()(x), ref, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="even"):
        SiluAndMul()(x[:, :7])


# ---------------------------------------------------------------- MoE
@pytest.mark.parametrize("renormalize", [True, False])
def test_router(gen, renormalize):
    logits = torch.randn(10, 6, generator=gen).bfloat16()
    w, ids = select_experts(logits, 3, renormalize)
    assert w.dtype == torch.float32 and w.shape == ids.shape == (10, 3)
    probs = torch.softmax(logits.double(), -1)
    for n in range(10):
        order = sorted(range(6), key=lambda e: -probs[n, e].item())[:3]
        assert ids[n].tolist() == order
        chosen = probs[n, order]
        ref = chosen / chosen.sum() if renormalize else chosen
        torch.testing.assert_close(w[n].double(), ref, rtol=1e-5, atol=1e-6)
    if renormalize:
        torch.testing.assert_close(w.sum(-1), torch.ones(10))
    with pytest.raises(ValueError, match="top_k=7"):
        select_experts(logits, 7, True)


def test_fused_moe_ref_vs_dense_loop(gen):
    n, h, i, e, k = 9, 16, 12, 6, 2
    x = torch.randn(n, h, generator=gen)
    w13, w2 = torch.randn(e, 2 * i, h, generator=gen), torch.randn(e, h, i, generator=gen)
    ids = torch.randint(0, e - 1, (n, k), generator=gen)  # expert e-1 gets no token
    wts = torch.rand(n, k, generator=gen)
    out = fused_moe_ref(x, w13, w2, wts, ids)
    ref = torch.zeros(n, h, dtype=torch.float64)
    for t in range(n):
        for j in range(k):
            ex = ids[t, j]
            g, u = w13[ex, :i].double() @ x[t].double(), w13[ex, i:].double() @ x[t].double()
            ref[t] += wts[t, j].double() * (w2[ex].double() @ (g * torch.sigmoid(g) * u))
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-4)


def test_fused_moe_layer_loader_and_forward(gen):
    e, h, i = 4, 8, 6
    gate = [torch.randn(i, h, generator=gen) for _ in range(e)]
    up = [torch.randn(i, h, generator=gen) for _ in range(e)]
    down = [torch.randn(h, i, generator=gen) for _ in range(e)]
    layers = [FusedMoE(e, 2, h, i, True, tp_rank=r, tp_size=2, reduce_results=False) for r in range(2)]
    for layer in layers:
        for ex in range(e):
            layer.w13_weight.weight_loader(layer.w13_weight, gate[ex], "w1", ex)
            layer.w13_weight.weight_loader(layer.w13_weight, up[ex], "w3", ex)
            layer.w2_weight.weight_loader(layer.w2_weight, down[ex], "w2", ex)
    x, logits = torch.randn(5, h, generator=gen), torch.randn(5, e, generator=gen)
    full_w13 = torch.stack([torch.cat([g, u]) for g, u in zip(gate, up)])
    ref = fused_moe_ref(x, full_w13, torch.stack(down), *select_experts(logits, 2, True))
    assert layers[0].w13_weight.shape == (e, i, h) and layers[0].w2_weight.shape == (e, h, i // 2)
    torch.testing.assert_close(layers[0](x, logits) + layers[1](x, logits), ref, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="comm"):
        FusedMoE(e, 2, h, i, True, tp_rank=0, tp_size=2)(x, logits)
    with pytest.raises(ValueError, match="shard_id"):
        layers[0].w2_weight.weight_loader(layers[0].w2_weight, down[0], "w4", 0)


# ---------------------------------------------------------------- tensor-parallel sharding
class _SumComm:
    """Fake all-reduce collecting partial outputs (sum done by the test)."""

    def all_reduce(self, t):
        return t


def test_column_and_row_parallel_reassemble(gen):
    w, b = torch.randn(12, 10, generator=gen), torch.randn(12, generator=gen)
    cols = [ColumnParallelLinear(10, 12, bias=True, tp_rank=r, tp_size=2) for r in range(2)]
    for c in cols:
        c.weight.weight_loader(c.weight, w)
        c.bias.weight_loader(c.bias, b)
    assert torch.equal(torch.cat([c.weight for c in cols]), w) and torch.equal(torch.cat([c.bias for c in cols]), b)
    x = torch.randn(3, 10, generator=gen)
    torch.testing.assert_close(torch.cat([c(x) for c in cols], -1), F.linear(x, w, b))
    rw, rb = torch.randn(7, 12, generator=gen), torch.randn(7, generator=gen)
    rows = [RowParallelLinear(12, 7, bias=True, tp_rank=r, tp_size=2, comm=_SumComm()) for r in range(2)]
    for r in rows:
        r.weight.weight_loader(r.weight, rw)
        r.bias.weight_loader(r.bias, rb)
    assert torch.equal(torch.cat([r.weight for r in rows], 1), rw)
    y = torch.randn(3, 12, generator=gen)
    torch.testing.assert_close(rows[0](y[:, :6]) + rows[1](y[:, 6:]), F.linear(y, rw, rb))
    with pytest.raises(ValueError, match="comm"):
        RowParallelLinear(12, 7, tp_rank=0, tp_size=2)(y[:, :6])
    with pytest.raises(ValueError, match="not divisible"):
        ColumnParallelLinear(10, 13, tp_rank=0, tp_size=2)
    rep = ReplicatedLinear(10, 12)
    rep.weight.weight_loader(rep.weight, w)
    assert torch.equal(rep.weight, w)
    with pytest.raises(ValueError, match="shape"):
        rep.weight.weight_loader(rep.weight, w[:5])


def test_merged_column_parallel_reassemble(gen):
    g, u = torch.randn(8, 6, generator=gen), torch.randn(8, 6, generator=gen)
    parts = [MergedColumnParallelLinear(6, [8, 8], tp_rank=r, tp_size=2) for r in range(2)]
    for p in parts:
        p.weight.weight_loader(p.weight, g, 0)
        p.weight.weight_loader(p.weight, u, 1)
        assert p.weight.expected_shards == (0, 1)
    assert torch.equal(torch.cat([p.weight[:4] for p in parts]), g)
    assert torch.equal(torch.cat([p.weight[4:] for p in parts]), u)
    packed = MergedColumnParallelLinear(6, [8, 8])
    packed.weight.weight_loader(packed.weight, torch.cat([g, u]))
    assert torch.equal(packed.weight, torch.cat([g, u]))


@pytest.mark.parametrize("tp_size", [2, 4])
def test_qkv_parallel_reassemble_and_kv_replication(gen, tp_size):
    hd, nh, nkv, hidden = 3, 4, 2, 5
    q = torch.randn(nh * hd, hidden, generator=gen)
    k, v = torch.randn(nkv * hd, hidden, generator=gen), torch.randn(nkv * hd, hidden, generator=gen)
    bq, bk, bv = torch.randn(nh * hd, generator=gen), torch.randn(nkv * hd, generator=gen), torch.randn(nkv * hd, generator=gen)
    ranks = [QKVParallelLinear(hidden, hd, nh, nkv, bias=True, tp_rank=r, tp_size=tp_size) for r in range(tp_size)]
    for layer in ranks:
        for sid, w, b in (("q", q, bq), ("k", k, bk), ("v", v, bv)):
            layer.weight.weight_loader(layer.weight, w, sid)
            layer.bias.weight_loader(layer.bias, b, sid)
    qs = [layer.weight[:layer.q_size] for layer in ranks]
    assert torch.equal(torch.cat(qs), q)
    replicas = max(tp_size // nkv, 1)
    ks = [layer.weight[layer.q_size:layer.q_size + layer.kv_size] for layer in ranks]
    vs = [layer.bias[layer.q_size + layer.kv_size:] for layer in ranks]
    assert all(layer.num_kv_heads == nkv * replicas // tp_size for layer in ranks)
    assert torch.equal(torch.cat(ks[::replicas]), k) and torch.equal(torch.cat(vs[::replicas]), bv)
    for r in range(tp_size):  # replicated ranks hold the same KV head
        assert torch.equal(ks[r], ks[r - r % replicas])
    full = QKVParallelLinear(hidden, hd, nh, nkv)
    full.weight.weight_loader(full.weight, torch.cat([q, k, v]))
    assert torch.equal(full.weight, torch.cat([q, k, v]))


def test_vocab_parallel_embedding_padding_and_forward(gen):
    table = torch.randn(11, 4, generator=gen)  # 11 rows, tp 2 -> 6 rows each, one zero padding row
    shards = [VocabParallelEmbedding(11, 4, tp_rank=r, tp_size=2, comm=_SumComm()) for r in range(2)]
    for s in shards:
        s.weight.weight_loader(s.weight, table)
    assert torch.equal(torch.cat([s.weight for s in shards])[:11], table)
    assert torch.equal(shards[1].weight[-1], torch.zeros(4))
    ids = torch.randint(0, 11, (9,), generator=gen)
    torch.testing.assert_close(shards[0](ids) + shards[1](ids), table[ids])
    single = VocabParallelEmbedding(11, 4)
    single.weight.weight_loader(single.weight, table)
    assert torch.equal(single(ids), table[ids])
