"""Weight sharding of the TP layers, lazy per-rank checkpoint reads, and TP argument validation (no processes)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.distributed.communicator import NoCommCommunicator
from sglang.srt.distributed.parallel_state import DistConfig, dist_init_method, local_kv_heads, validate_tp_config
from sglang.srt.layers.linear import (ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear,
                                      RowParallelLinear)
from sglang.srt.layers.logits_processor import LogitsProcessor
from sglang.srt.layers.moe.fused_moe import FusedMoE, fused_moe_ref
from sglang.srt.layers.moe.router import select_experts
from sglang.srt.layers.vocab_parallel_embedding import VocabParallelEmbedding
from sglang.srt.model_loader.loader import SafetensorsSlice, load_model

safetensors_torch = pytest.importorskip("safetensors.torch")


def _g():
    return torch.Generator().manual_seed(int.from_bytes(os.urandom(2), "little"))


class SumComm:
    """Single-process stand-in for the TP group: ``all_reduce`` sums the partials registered so far."""

    def __init__(self):
        self.parts = []

    def all_reduce(self, x):
        self.parts.append(x)
        return x


@pytest.mark.parametrize("tp", [2, 4])
def test_column_row_merged_shards_rebuild_full(tp):
    g = _g()
    x = torch.randn(5, 12, generator=g)
    w_col, b_col = torch.randn(8, 12, generator=g), torch.randn(8, generator=g)
    cols = [ColumnParallelLinear(12, 8, bias=True, tp_rank=r, tp_size=tp) for r in range(tp)]
    for c in cols:
        c.weight.weight_loader(c.weight, w_col)
        c.bias.weight_loader(c.bias, b_col)
    torch.testing.assert_close(torch.cat([c(x) for c in cols], dim=-1), x @ w_col.T + b_col)
    w_row, b_row = torch.randn(7, 8, generator=g), torch.randn(7, generator=g)
    h = torch.randn(5, 8, generator=g)
    rows = [RowParallelLinear(8, 7, bias=True, tp_rank=r, tp_size=tp, reduce_results=False) for r in range(tp)]
    for r in rows:
        r.weight.weight_loader(r.weight, w_row)
        r.bias.weight_loader(r.bias, b_row)
    n = 8 // tp
    partial = sum(r(h[:, i * n:(i + 1) * n]) for i, r in enumerate(rows))
    torch.testing.assert_close(partial, h @ w_row.T + b_row, atol=1e-5, rtol=1e-5)
    gate, up = torch.randn(8, 12, generator=g), torch.randn(8, 12, generator=g)
    merged = [MergedColumnParallelLinear(12, [8, 8], tp_rank=r, tp_size=tp) for r in range(tp)]
    for m in merged:
        m.weight.weight_loader(m.weight, gate, 0)
        m.weight.weight_loader(m.weight, up, 1)
    outs = [m(x) for m in merged]
    torch.testing.assert_close(torch.cat([o[:, :n] for o in outs], -1), x @ gate.T)
    torch.testing.assert_close(torch.cat([o[:, n:] for o in outs], -1), x @ up.T)


@pytest.mark.parametrize("tp,kv", [(2, 2), (4, 2), (8, 2)])
def test_qkv_sharding_and_kv_replication(tp, kv):
    g = _g()
    hd, heads = 4, 8
    q, k, v = (torch.randn(n * hd, 16, generator=g) for n in (heads, kv, kv))
    for r in range(tp):
        layer = QKVParallelLinear(16, hd, heads, kv, tp_rank=r, tp_size=tp)
        for sid, w in zip("qkv", (q, k, v)):
            layer.weight.weight_loader(layer.weight, w, sid)
        assert layer.num_kv_heads == local_kv_heads(kv, tp)
        kv_head = r * layer.num_kv_heads if tp <= kv else r // (tp // kv)
        qs, ks = layer.q_size, layer.kv_size
        assert torch.equal(layer.weight[:qs], q[r * qs:(r + 1) * qs])
        assert torch.equal(layer.weight[qs:qs + ks], k[kv_head * hd:kv_head * hd + ks])
        assert torch.equal(layer.weight[qs + ks:], v[kv_head * hd:kv_head * hd + ks])


def test_vocab_parallel_embedding_and_lm_head_gather():
    g = _g()
    vocab, dim, tp = 11, 6, 3  # padded to 12: the last shard has a zero padding row
    full = torch.randn(vocab, dim, generator=g)
    embs = [VocabParallelEmbedding(vocab, dim, tp_rank=r, tp_size=tp, comm=SumComm()) for r in range(tp)]
    for e in embs:
        e.weight.weight_loader(e.weight, full)
    assert torch.equal(embs[-1].weight[-1], torch.zeros(dim))
    ids = torch.randint(0, vocab, (9,), generator=g)
    torch.testing.assert_close(sum(e(ids) for e in embs), full[ids])
    hidden = torch.randn(4, dim, generator=g)

    class Gather:
        def all_gather(self, x, dim=-1):
            return torch.cat([hidden @ e.weight.T for e in embs], dim=dim)

    proc = LogitsProcessor(vocab, tp_size=tp, comm=Gather())
    torch.testing.assert_close(proc._project(hidden, embs[0].weight), (hidden @ full.T).float())
    with pytest.raises(ValueError, match="all-gather"):
        LogitsProcessor(vocab, tp_size=2)._project(hidden, embs[0].weight)


@pytest.mark.parametrize("tp,ep", [(2, 1), (2, 2), (4, 2), (4, 4)])
def test_fused_moe_tp_and_ep_partials_sum_to_full(tp, ep):
    g = _g()
    e, h, i, n = 4, 8, 12, 7
    w1, w3 = torch.randn(e, i, h, generator=g), torch.randn(e, i, h, generator=g)
    w2 = torch.randn(e, h, i, generator=g)
    x, logits = torch.randn(n, h, generator=g), torch.randn(n, e, generator=g)
    tw, ti = select_experts(logits, 2, True)
    want = fused_moe_ref(x, torch.cat([w1, w3], dim=1), w2, tw, ti)
    total = 0
    for r in range(tp):
        layer = FusedMoE(e, 2, h, i, True, tp_rank=r, tp_size=tp, reduce_results=False, ep_size=ep)
        assert layer.w13_weight.shape == (e // ep, 2 * i * ep // tp, h)
        for x_id in range(e):
            layer.w13_weight.weight_loader(layer.w13_weight, w1[x_id], "w1", x_id)
            layer.w13_weight.weight_loader(layer.w13_weight, w3[x_id], "w3", x_id)
            layer.w2_weight.weight_loader(layer.w2_weight, w2[x_id], "w2", x_id)
        assert {s[0] for s in layer.w2_weight.expected_shards} == set(
            range(layer.expert_start, layer.expert_start + e // ep))
        total = total + layer(x, logits)
    torch.testing.assert_close(total, want, atol=1e-4, rtol=1e-4)


LLAMA_CFG = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=32, intermediate_size=48,
                 num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
                 max_position_embeddings=128, rms_norm_eps=1e-5, tie_word_embeddings=False, torch_dtype="float32")


def _checkpoint(path, cfg) -> dict:
    g = _g()
    h, i, v, kv = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"], 2 * 8
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,), "lm_head.weight": (v, h),
              "model.layers.0.self_attn.q_proj.weight": (h, h), "model.layers.0.self_attn.k_proj.weight": (kv, h),
              "model.layers.0.self_attn.v_proj.weight": (kv, h), "model.layers.0.self_attn.o_proj.weight": (h, h),
              "model.layers.0.mlp.gate_proj.weight": (i, h), "model.layers.0.mlp.up_proj.weight": (i, h),
              "model.layers.0.mlp.down_proj.weight": (h, i), "model.layers.0.input_layernorm.weight": (h,),
              "model.layers.0.post_attention_layernorm.weight": (h,)}
    state = {k: torch.randn(s, generator=g) for k, s in shapes.items()}
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    safetensors_torch.save_file(state, os.path.join(path, "model.safetensors"))
    return state


def test_rank_reads_only_its_slices(tmp_path, monkeypatch):
    state = _checkpoint(str(tmp_path), LLAMA_CFG)
    full_reads = []
    real = SafetensorsSlice.materialize
    monkeypatch.setattr(SafetensorsSlice, "materialize", lambda self: full_reads.append(self.name) or real(self))
    model = load_model(ModelConfig.from_path(str(tmp_path)), "auto", "cpu", tp_rank=1, tp_size=2,
                       comm=NoCommCommunicator(1, 2))
    assert all(n.endswith("norm.weight") for n in full_reads), full_reads  # only replicated 1-D norms
    layer = model.model.layers[0]
    assert torch.equal(layer.self_attn.o_proj.weight, state["model.layers.0.self_attn.o_proj.weight"][:, 16:])
    assert torch.equal(layer.mlp.down_proj.weight, state["model.layers.0.mlp.down_proj.weight"][:, 24:])
    assert torch.equal(model.lm_head.weight, state["lm_head.weight"][32:])
    assert torch.equal(layer.self_attn.qkv_proj.weight[16:24], state["model.layers.0.self_attn.k_proj.weight"][8:])


def test_safetensors_slice_errors(tmp_path):
    _checkpoint(str(tmp_path), LLAMA_CFG)
    from safetensors import safe_open

    handle = safe_open(os.path.join(tmp_path, "model.safetensors"), framework="pt", device="cpu")
    sl = SafetensorsSlice(handle, "lm_head.weight", "model.safetensors", torch.float32)
    assert tuple(sl.shape) == (64, 32) and sl.dim() == 2 and sl.is_floating_point()
    with pytest.raises(ValueError, match="outside its shape"):
        sl.narrow(0, 60, 8)
    with pytest.raises(ValueError, match="nope"):
        SafetensorsSlice(handle, "nope", "model.safetensors", torch.float32)


def _cfg(tmp_path, **kw) -> ModelConfig:
    path = tmp_path / "cfg"
    os.makedirs(path, exist_ok=True)
    with open(path / "config.json", "w") as f:
        json.dump(dict(LLAMA_CFG, **kw), f)
    return ModelConfig.from_path(str(path))


def test_validate_tp_config_errors(tmp_path):
    mc = _cfg(tmp_path, num_attention_heads=8, num_key_value_heads=4, hidden_size=64, intermediate_size=172)
    for tp in (1, 2, 4):
        validate_tp_config(mc, tp)
    with pytest.raises(ValueError, match=r"--tp-size=3 does not divide num_attention_heads=8.*\[1, 2, 4, 8\]"):
        validate_tp_config(mc, 3)
    with pytest.raises(ValueError, match="intermediate_size=172 .* not divisible by 8"):
        validate_tp_config(_cfg(tmp_path, num_attention_heads=8, num_key_value_heads=8, hidden_size=64,
                                intermediate_size=172), 8)
    with pytest.raises(ValueError, match="--ep-size=2 needs a MoE model"):
        validate_tp_config(mc, 2, ep_size=2)
    moe = _cfg(tmp_path, architectures=["MixtralForCausalLM"], num_local_experts=3, num_experts_per_tok=2)
    with pytest.raises(ValueError, match="num_experts=3 .* not divisible by 2"):
        validate_tp_config(moe, 2, ep_size=2)


def test_dist_config_validation():
    assert dist_init_method("10.0.0.1:5000") == "tcp://10.0.0.1:5000"
    assert dist_init_method(None, 1234) == "tcp://127.0.0.1:1234"
    with pytest.raises(ValueError, match="HOST:PORT"):
        dist_init_method("nohost")
    cfg = DistConfig(tp_rank=5, tp_size=8, init_method="tcp://h:1", nnodes=2, node_rank=1)
    assert cfg.local_rank == 1 and cfg.ranks_per_node == 4
    with pytest.raises(ValueError, match="does not live on node 0"):
        DistConfig(tp_rank=5, tp_size=8, init_method="tcp://h:1", nnodes=2, node_rank=0)
    with pytest.raises(ValueError, match="ep-size=3"):
        DistConfig(tp_rank=0, tp_size=4, init_method="tcp://h:1", ep_size=3)
    with pytest.raises(ValueError, match="multiple of --nnodes=3"):
        DistConfig(tp_rank=0, tp_size=4, init_method="tcp://h:1", nnodes=3)
