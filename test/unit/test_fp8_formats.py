"""FP8 (e4m3) formats, the ``quantization_config`` parser, and how FP8 weights and scales load into layers (CPU).

* the torch references round within e4m3's bound (relative error <= 2^-4 for normal values, half a subnormal step
  below) at every granularity (per token, per group, per channel, per tensor, 128 x 128 blocks);
* ``quantization_config`` / ``--quantization`` errors name the field or flag;
* per layer kind (column / QKV / merged / row parallel, experts) and TP rank, the loaded e4m3 weight and scales are
  exactly the checkpoint's slices (per-tensor scales fill their shard's rows; block scales are sliced along blocks,
  or expanded per row where a packed shard is not block aligned at TP 1), a TP split that cuts a block is refused
  naming ``--tp-size``, and online quantization gives every TP rank the scales of the unsharded rows.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from conftest import shared_path  # noqa: E402

from sglang.srt.layers.linear import (ColumnParallelLinear, MergedColumnParallelLinear,  # noqa: E402
                                      QKVParallelLinear, RowParallelLinear)
from sglang.srt.layers.moe.fused_moe import FusedMoE  # noqa: E402
from sglang.srt.layers.quantization import check_flag, resolve_quant_config  # noqa: E402
from sglang.srt.layers.quantization.fp8_config import Fp8Config  # noqa: E402
from sglang.srt.layers.quantization.fp8_ref import (FP8_DTYPE, dequant_weight,  # noqa: E402
                                                    quant_per_token_group_ref, quant_per_token_ref,
                                                    quant_weight_block, quant_weight_per_channel,
                                                    quant_weight_per_tensor, w8a8_scaled_gemm_ref)

SUBNORMAL_STEP = 2.0 ** -9  # e4m3 subnormal spacing, in units of the scale


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _assert_e4m3_bound(v: torch.Tensor, deq: torch.Tensor, scale: torch.Tensor) -> None:
    """|v - deq| <= max(2^-4 |v|, scale * 2^-10) element-wise (round to nearest: half a step)."""
    err = (v.float() - deq.float()).abs()
    bound = torch.maximum(v.float().abs() * 2.0 ** -4, scale.float() * SUBNORMAL_STEP / 2) * (1 + 1e-6)
    assert bool((err <= bound).all()), f"worst excess {(err - bound).max().item():.3g}"


def test_per_token_and_group_quantization_round_within_e4m3():
    x = torch.randn(7, 300, generator=_gen(1)) * torch.logspace(-3, 2, 7).unsqueeze(1)
    x[3] = 0.0  # an all-zero row keeps a finite positive scale
    q, s = quant_per_token_ref(x)
    assert q.dtype == FP8_DTYPE and s.shape == (7, 1) and bool((s > 0).all())
    assert torch.allclose(s.squeeze(1), x.abs().amax(1).clamp(min=1e-10) / 448)
    _assert_e4m3_bound(x, q.float() * s, s.expand_as(x))
    qg, sg = quant_per_token_group_ref(x, 128)
    assert sg.shape == (7, 3)  # 300 columns: groups of 128, 128, 44
    sx = sg.repeat_interleave(128, 1)[:, :300]
    _assert_e4m3_bound(x, qg.float() * sx, sx)
    assert torch.equal(quant_per_token_group_ref(x, 300)[0], q)  # one group per row == per token
    static = torch.tensor([0.01])
    qs, ss = quant_per_token_ref(x, static)
    assert torch.equal(ss, static) and qs.float().abs().max() == 448  # clamped, never NaN
    assert not torch.isnan(qs.float()).any()


def test_weight_quantization_granularities():
    w = torch.randn(300, 200, generator=_gen(2)) * 0.05
    q, s = quant_weight_per_channel(w)
    assert s.shape == (300,) and torch.allclose(s, w.abs().amax(1) / 448)
    _assert_e4m3_bound(w, dequant_weight(q, s), s.unsqueeze(1).expand_as(w))
    qt, st = quant_weight_per_tensor(w)
    assert st.dim() == 0 and qt.float().abs().max() == 448
    _assert_e4m3_bound(w, dequant_weight(qt, st), st.expand_as(w))
    qb, sb = quant_weight_block(w, 128, 128)
    assert sb.shape == (3, 2)
    assert torch.isclose(sb[2, 1], w[256:, 128:].abs().max() / 448)  # the partial corner block
    full = sb.repeat_interleave(128, 0)[:300].repeat_interleave(128, 1)[:, :200]
    _assert_e4m3_bound(w, dequant_weight(qb, sb, (128, 128)), full)


def test_w8a8_reference_equals_dequantized_matmul():
    x = torch.randn(5, 256, generator=_gen(3))
    w = torch.randn(64, 256, generator=_gen(4)) / 16
    xq, xs = quant_per_token_group_ref(x, 128)
    wq, ws = quant_weight_block(w, 32, 128)
    got = w8a8_scaled_gemm_ref(xq, xs, wq, ws, out_dtype=torch.float32, group_k=128, rows_per_scale=32)
    a = xq.float() * xs.repeat_interleave(128, 1)
    want = a @ (wq.float() * ws.repeat_interleave(32, 0).repeat_interleave(128, 1)).t()
    torch.testing.assert_close(got, want)
    assert (got - x @ w.t()).abs().max() < 0.15 * (x @ w.t()).abs().max()  # and close to the unquantized product


# ---- quantization_config / --quantization ------------------------------------------------------------------
@pytest.mark.parametrize("qc,field", [
    ({"quant_method": "awq", "activation_scheme": "dynamic"}, "quant_method"),
    ({"activation_scheme": "dynamic"}, "quant_method"),
    ({"quant_method": "fp8"}, "activation_scheme"),
    ({"quant_method": "fp8", "activation_scheme": "per_token"}, "activation_scheme"),
    ({"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128]}, "weight_block_size"),
    ({"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [0, 128]}, "weight_block_size"),
    ({"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128.0, 128]}, "weight_block_size"),
    ({"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": "128x128"}, "weight_block_size"),
    ({"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [128, 128]}, "activation_scheme"),
    ({"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e5m2"}, "fmt"),
    ({"quant_method": "fp8", "activation_scheme": "dynamic", "ignored_layers": "lm_head"}, "ignored_layers"),
    ("fp8", "quantization_config"),
])
def test_bad_quantization_config_names_the_field(qc, field):
    with pytest.raises(ValueError, match=field):
        resolve_quant_config({"quantization_config": qc}, None)


def test_quantization_config_and_flag_resolution():
    assert resolve_quant_config({}, None) is None
    online = resolve_quant_config({}, "fp8")
    assert not online.checkpoint_fp8 and online.weight_block_size is None
    qwen = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [128, 128],
            "modules_to_not_convert": ["lm_head", "mlp.gate"]}
    cfg = resolve_quant_config({"quantization_config": qwen}, None)  # detected without --quantization
    assert cfg.checkpoint_fp8 and cfg.weight_block_size == (128, 128) and cfg.activation_scheme == "dynamic"
    assert resolve_quant_config({"quantization_config": qwen}, "fp8") == cfg
    assert cfg.is_ignored("model.layers.3.mlp.gate") and not cfg.is_ignored("model.layers.3.mlp.gate_proj")
    assert cfg.is_ignored("lm_head")
    llama = {"quant_method": "fp8", "activation_scheme": "static", "ignored_layers": ["lm_head"]}
    assert resolve_quant_config({"quantization_config": llama}, None).activation_scheme == "static"
    for bad in ("int8", "awq", "FP8"):
        with pytest.raises(ValueError, match="--quantization"):
            check_flag(bad)


def test_server_args_refuse_bad_quantization_flags():
    from sglang.srt.server_args import ServerArgs, prepare_server_args

    with pytest.raises(ValueError, match="--quantization='gptq'.*fp8"):
        ServerArgs(quantization="gptq")
    with pytest.raises(ValueError, match="enable-tdist-overlap"):
        ServerArgs(quantization="fp8", enable_tdist_overlap=True)
    assert prepare_server_args(["--quantization", "fp8"]).quantization == "fp8"


def test_packed_layer_partly_ignored_is_refused():
    cfg = Fp8Config.from_checkpoint({"quant_method": "fp8", "activation_scheme": "dynamic",
                                     "ignored_layers": ["model.layers.0.self_attn.k_proj"]})
    layer = QKVParallelLinear(64, 16, 4, 2, params_dtype=torch.float32)
    names = tuple(f"model.layers.0.self_attn.{p}_proj" for p in "qkv")
    with pytest.raises(ValueError, match="ignored_layers"):
        cfg.linear_method(layer, "model.layers.0.self_attn.qkv_proj", names)


# ---- loading into layers -----------------------------------------------------------------------------------
def _quantized(layer, cfg: Fp8Config):
    method = cfg.linear_method(layer, "layer", ("layer",))
    method.create_weights(layer)
    layer.quant_method = method
    return layer


def _deq(layer) -> torch.Tensor:
    m = layer.quant_method
    if m.block is not None:
        return dequant_weight(layer.weight, layer.weight_scale_inv, m.block, m.rows_per_scale)
    return dequant_weight(layer.weight, layer.weight_scale)


PER_TENSOR = Fp8Config.from_checkpoint({"quant_method": "fp8", "activation_scheme": "static"})
BLOCK = Fp8Config.from_checkpoint({"quant_method": "fp8", "activation_scheme": "dynamic",
                                   "weight_block_size": [128, 128]})


@pytest.mark.parametrize("tp", [1, 2])
def test_per_tensor_checkpoint_shards_fill_their_rows(tp):
    """q, k, v with three different per-tensor scales load into one packed layer without re-quantization: each rank's
    rows dequantize exactly to its slice of the dequantized q / k / v; input_scale is the largest of the three."""
    hidden, hd, heads, kv = 64, 16, 4, 2
    full = {}
    for i, (p, rows) in enumerate((("q", heads * hd), ("k", kv * hd), ("v", kv * hd))):
        q, s = quant_weight_per_tensor(torch.randn(rows, hidden, generator=_gen(10 + i)) * (i + 1))
        full[p] = (q, s, torch.tensor(0.01 * (i + 1)))
    for rank in range(tp):
        layer = _quantized(QKVParallelLinear(hidden, hd, heads, kv, params_dtype=torch.float32, tp_rank=rank,
                                             tp_size=tp), PER_TENSOR)
        assert layer.weight.dtype == FP8_DTYPE and layer.weight_scale.shape == (layer.out_local,)
        for p, (q, s, a) in full.items():
            layer.weight.weight_loader(layer.weight, q, p)
            layer.weight_scale.weight_loader(layer.weight_scale, s, p)
            layer.input_scale.weight_loader(layer.input_scale, a, p)
        want = torch.cat([dequant_weight(q, s).chunk(tp)[rank] for q, s, _ in full.values()])
        assert torch.equal(_deq(layer), want)
        assert layer.input_scale.item() == pytest.approx(0.03)
        assert set(layer.weight.expected_shards) == set(layer.input_scale.expected_shards) == {"q", "k", "v"}


@pytest.mark.parametrize("tp", [1, 2])
def test_block_checkpoint_slices_along_blocks(tp):
    """Column-parallel [512, 256] and row-parallel [256, 512] weights with 128 x 128 block scales: every rank holds its
    whole blocks (compact layout) and dequantizes exactly to its slice of the dequantized full weight."""
    w = torch.randn(512, 256, generator=_gen(20))
    q, s = quant_weight_block(w, 128, 128)
    wr = torch.randn(256, 512, generator=_gen(21))
    qr, sr = quant_weight_block(wr, 128, 128)
    for rank in range(tp):
        col = _quantized(ColumnParallelLinear(256, 512, params_dtype=torch.float32, tp_rank=rank, tp_size=tp), BLOCK)
        col.weight.weight_loader(col.weight, q)
        col.weight_scale_inv.weight_loader(col.weight_scale_inv, s.to(torch.bfloat16))  # Qwen stores bf16 scales
        assert col.quant_method.rows_per_scale == 128 and col.weight_scale_inv.shape == (4 // tp, 2)
        assert torch.equal(_deq(col), dequant_weight(q, s.to(torch.bfloat16).float(), (128, 128)).chunk(tp)[rank])
        row = _quantized(RowParallelLinear(512, 256, params_dtype=torch.float32, tp_rank=rank, tp_size=tp), BLOCK)
        row.weight.weight_loader(row.weight, qr)
        row.weight_scale_inv.weight_loader(row.weight_scale_inv, sr)
        assert row.weight_scale_inv.shape == (2, 4 // tp)
        assert torch.equal(_deq(row), dequant_weight(qr, sr, (128, 128)).chunk(tp, dim=1)[rank])


def test_block_scales_expand_per_row_for_unaligned_packed_shards():
    """TP 1, gate/up of 172 rows each (not multiples of 128): the block scales are kept per row, exactly."""
    g, u = torch.randn(172, 64, generator=_gen(30)), torch.randn(172, 64, generator=_gen(31)) * 3
    layer = _quantized(MergedColumnParallelLinear(64, [172, 172], params_dtype=torch.float32), BLOCK)
    assert layer.quant_method.rows_per_scale == 1 and layer.weight_scale_inv.shape == (344, 1)
    want = []
    for i, w in enumerate((g, u)):
        q, s = quant_weight_block(w, 128, 128)
        layer.weight.weight_loader(layer.weight, q, i)
        layer.weight_scale_inv.weight_loader(layer.weight_scale_inv, s, i)
        want.append(dequant_weight(q, s, (128, 128)))
    assert torch.equal(_deq(layer), torch.cat(want))


def test_tp_split_cutting_a_block_is_refused():
    with pytest.raises(ValueError, match="--tp-size"):
        _quantized(ColumnParallelLinear(256, 384, params_dtype=torch.float32, tp_rank=0, tp_size=2), BLOCK)
    with pytest.raises(ValueError, match="--tp-size"):
        _quantized(RowParallelLinear(384, 256, params_dtype=torch.float32, tp_rank=1, tp_size=2), BLOCK)
    moe = FusedMoE(4, 2, 256, 384, params_dtype=torch.float32, tp_rank=0, tp_size=2)
    with pytest.raises(ValueError, match="--ep-size"):
        BLOCK.moe_method(moe, "experts").create_weights(moe)


@pytest.mark.parametrize("tp", [2, 4])
def test_online_quantization_scales_are_those_of_the_unsharded_rows(tp):
    """--quantization fp8: a row-parallel layer's per-channel scales come from the full rows, so the ranks' e4m3
    weights concatenate to exactly the TP 1 weight (column-parallel: the rows themselves)."""
    w = torch.randn(96, 256, generator=_gen(40))
    online = Fp8Config.online()
    ref = _quantized(RowParallelLinear(256, 96, params_dtype=torch.float32), online)
    ref.weight.weight_loader(ref.weight, w)
    parts = []
    for rank in range(tp):
        row = _quantized(RowParallelLinear(256, 96, params_dtype=torch.float32, tp_rank=rank, tp_size=tp), online)
        assert row.weight_scale.expected_shards == ()  # computed, not read
        row.weight.weight_loader(row.weight, w)
        assert torch.equal(row.weight_scale, ref.weight_scale)
        parts.append(row.weight)
    assert torch.equal(torch.cat(parts, dim=1).float(), ref.weight.float())
    q, s = quant_weight_per_channel(w)
    assert torch.equal(ref.weight.float(), q.float()) and torch.equal(ref.weight_scale, s)


@pytest.mark.parametrize("tp,ep", [(1, 1), (2, 1), (2, 2)])
def test_expert_weights_and_scales_load_per_rank(tp, ep):
    """Per-tensor FP8 experts: each rank's w13 / w2 rows and scales are its slices of the checkpoint's (other EP
    ranks' experts are not read), and the static input scales are the largest over ALL experts on every rank."""
    e, h, i = 4, 64, 96
    ckpt = {}
    for x in range(e):
        for k, shape in (("w1", (i, h)), ("w3", (i, h)), ("w2", (h, i))):
            q, s = quant_weight_per_tensor(torch.randn(*shape, generator=_gen(100 * x + len(k) + ord(k[1]))))
            ckpt[(x, k)] = (q, s, torch.tensor(0.001 * (1 + x + (k == "w2"))))
    for rank in range(tp):
        moe = FusedMoE(e, 2, h, i, params_dtype=torch.float32, tp_rank=rank, tp_size=tp, ep_size=ep)
        method = PER_TENSOR.moe_method(moe, "experts")
        method.create_weights(moe)
        for (x, k), (q, s, a) in ckpt.items():
            kind = "w2" if k == "w2" else "w13"
            for suffix, t in (("weight", q), ("weight_scale", s), ("input_scale", a)):
                p = getattr(moe, f"{kind}_{suffix}")
                p.weight_loader(p, t, k, x)
        n = moe.i_local
        for loc in range(moe.num_local_experts):
            x = moe.expert_start + loc
            r = moe.moe_tp_rank
            w1 = dequant_weight(*ckpt[(x, "w1")][:2])[r * n:(r + 1) * n]
            w3 = dequant_weight(*ckpt[(x, "w3")][:2])[r * n:(r + 1) * n]
            w2 = dequant_weight(*ckpt[(x, "w2")][:2])[:, r * n:(r + 1) * n]
            assert torch.equal(dequant_weight(moe.w13_weight[loc], moe.w13_weight_scale[loc]), torch.cat([w1, w3]))
            assert torch.equal(dequant_weight(moe.w2_weight[loc], moe.w2_weight_scale[loc]), w2)
        assert moe.w13_input_scale.item() == pytest.approx(0.004) and moe.w2_input_scale.item() == pytest.approx(0.005)


def test_fp8_weight_where_checkpoint_is_bf16_is_refused():
    layer = _quantized(ColumnParallelLinear(64, 32, params_dtype=torch.float32), PER_TENSOR)
    with pytest.raises(ValueError, match="ignored_layers"):
        layer.weight.weight_loader(layer.weight, torch.randn(32, 64))


def test_techniques_without_quantized_weights_are_refused_by_the_plan():
    """--enable-afd with FP8 weights (flag, or a checkpoint's quantization_config) fails the plan's model check before
    any worker starts; without quantization the same launch passes it."""
    from sglang.srt.deployment.compose import check_model
    from sglang.srt.server_args import ServerArgs

    moe = shared_path("models", "stories260K-moe8")
    check_model(ServerArgs(model_path=moe, enable_afd=True, device="cpu"))
    with pytest.raises(ValueError, match="--enable-afd does not support quantized weights"):
        check_model(ServerArgs(model_path=moe, enable_afd=True, device="cpu", quantization="fp8"))
    with tempfile.TemporaryDirectory() as d:
        shutil.copy(os.path.join(moe, "config.json"), d)
        cfg = json.load(open(os.path.join(d, "config.json")))
        cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic"}
        json.dump(cfg, open(os.path.join(d, "config.json"), "w"))
        with pytest.raises(ValueError, match="--enable-afd does not support quantized weights"):
            check_model(ServerArgs(model_path=d, enable_afd=True, device="cpu"))


def test_scaled_mm_rowwise_call_matches_the_reference_on_cpu():
    """The ``torch._scaled_mm`` call the CUDA path makes (e4m3 x [M, K] row-major, the [N, K] weight's transpose as the
    column-major operand, scale_a [M, 1] or one static value, scale_b [1, N], bf16 out) computes the reference
    product; checked with torch's CPU kernel where this torch has one (the operand layout and scale shapes are the
    same on CUDA)."""
    from sglang.srt.layers.quantization import fp8_ops

    x = torch.randn(5, 64, generator=_gen(50)).to(torch.bfloat16)
    wq, ws = quant_weight_per_channel(torch.randn(48, 64, generator=_gen(51)))
    bias = torch.randn(48, generator=_gen(52)).to(torch.bfloat16)
    for static in (None, torch.tensor([0.02])):
        xq, xs = quant_per_token_ref(x, static)
        try:
            got = fp8_ops.scaled_mm_rowwise(xq, xs, wq, ws, bias, torch.bfloat16)
        except (RuntimeError, NotImplementedError) as e:
            pytest.skip(f"this torch has no CPU row-wise _scaled_mm ({e})")
        want = w8a8_scaled_gemm_ref(xq, xs, wq, ws, bias, torch.bfloat16)
        # the bias is added to the bf16 product (one more bf16 rounding than the reference's fp32 sum)
        assert (got.float() - want.float()).abs().max() <= 2 * 2 ** -8 * want.float().abs().max()


def test_fp8_moe_reference_skips_negative_expert_ids():
    """Expert parallelism pads received rows with expert id -1 (weight 0): the FP8 MoE reference must skip them, not
    index the last expert (whose output could be non-finite and poison the weighted sum)."""
    from sglang.srt.layers.quantization.fp8_ref import fused_moe_fp8_ref

    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    e, h, inter, n, k = 4, 32, 16, 12, 2
    w13 = torch.randn(e, 2 * inter, h, generator=g)
    w2 = torch.randn(e, h, inter, generator=g)
    q13, s13 = zip(*(quant_weight_per_channel(w) for w in w13))
    q2, s2 = zip(*(quant_weight_per_channel(w) for w in w2))
    q13, s13, q2, s2 = torch.stack(q13), torch.stack(s13), torch.stack(q2), torch.stack(s2)
    x = torch.randn(n, h, generator=g)
    ids = torch.randint(0, e, (n, k), generator=g)
    w = torch.rand(n, k, generator=g)
    padded_ids, padded_w = ids.clone(), w.clone()
    padded_ids[::2, 1] = -1
    padded_w[::2, 1] = 0.0
    q2[-1].view(torch.uint8).fill_(0x7F)  # the last expert's down weights all NaN: indexing it would poison rows
    kept_w = w.clone()
    kept_w[::2, 1] = 0.0
    safe_ids = ids.clone()
    safe_ids[::2, 1] = 0  # a real expert with weight 0 gives the same sum when its output is finite
    q2_ok = q2.clone()
    q2_ok[-1] = q2[0]
    ref = fused_moe_fp8_ref(x, q13, s13, q2_ok, s2, kept_w, safe_ids)
    got = fused_moe_fp8_ref(x, q13, s13, q2, s2, padded_w, padded_ids)
    keep = (padded_ids != e - 1).all(dim=1)  # rows that route no real pair to the NaN expert
    assert keep.any()
    assert torch.isfinite(got[keep]).all()
    torch.testing.assert_close(got[keep], ref[keep])
