"""TokenWeave's selective GEMM carveout: which GEMMs run beside a communication stage, derived from the
executor's schedule (``sglang.srt.tokenweave.overlap``), the planner's per-GEMM wave model, and that the executor
with ``carveout_scope="overlap"`` enters the carveout exactly around those GEMMs (CPU: the carveout object is
replaced by a recorder) while the logits stay those of the unsplit forward."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from sglang.srt.layers.stages import DENSE_STAGES, MOE_STAGES
from sglang.srt.tokenweave.overlap import (STAGE_GEMMS, comm_windows, forward_schedule, layer_overlap,
                                           overlapped_gemms, width_sms)
from sglang.srt.tokenweave.planner import GemmShape, plan_split

MOE_LAYER = DENSE_STAGES[:-1] + MOE_STAGES
QKV, O, GU, DOWN = "self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"


def test_dense_layer_overlaps_each_windows_first_gemm():
    """Dense steady state: the other split's AllReduce starts with each compute stage, so each split's QKV and
    gate/up projections overlap a comm and its output / down projections run alone (head 1); head None: every
    GEMM of every window (all eight)."""
    assert layer_overlap(DENSE_STAGES) == {(0, "attention", QKV), (1, "attention", QKV), (0, "mlp", GU),
                                           (1, "mlp", GU)}
    every = {(s, st, g) for s in (0, 1) for st in ("attention", "mlp") for g in STAGE_GEMMS[st]}
    assert layer_overlap(DENSE_STAGES, head=None) == every
    assert layer_overlap(DENSE_STAGES, head=2) == every  # each window is one stage of two GEMMs


def test_dense_windows_follow_the_dependency_chain():
    """Each comm runs beside exactly the compute stage issued after its split's previous stage (the other split's);
    the first layer's input norm (no residual yet) is no comm, so nothing overlaps layer 0's first attention."""
    windows = {c: w for c, w in comm_windows(forward_schedule([DENSE_STAGES] * 2))}
    assert windows[(0, "post_attention_norm", 0)] == [(0, "attention", 1)]
    assert windows[(0, "post_attention_norm", 1)] == [(0, "mlp", 0)]
    assert windows[(1, "input_norm", 0)] == [(0, "mlp", 1)]
    assert windows[(1, "input_norm", 1)] == [(1, "attention", 0)]
    assert (0, "input_norm", 0) not in windows and (0, "input_norm", 1) not in windows
    got = overlapped_gemms(forward_schedule([DENSE_STAGES] * 2))
    assert (0, 0, "attention", QKV) not in got and (1, 0, "attention", QKV) in got


def test_moe_layer_windows_are_one_stage_each():
    """MoE stages are separate: the post-attention AllReduce of split 1 has only split 0's router beside it, the
    next input norm of split 0 only split 1's combine (shared expert gate first); the experts (Triton) and
    dispatch have no cuBLAS GEMM."""
    assert layer_overlap(MOE_LAYER) == {(1, "attention", QKV), (0, "attention", QKV), (0, "moe_route", "mlp.gate"),
                                        (1, "moe_combine", "mlp.shared_expert_gate")}
    assert layer_overlap(MOE_LAYER, stage_gemms={"attention": (QKV, O)}) == {(0, "attention", QKV),
                                                                             (1, "attention", QKV)}


def test_one_split_and_bad_arguments():
    """One split: nothing runs beside its own comm (each comm waits for its split's compute); bad inputs raise."""
    assert layer_overlap(DENSE_STAGES, num_splits=1) == frozenset()
    with pytest.raises(ValueError, match="head=0"):
        layer_overlap(DENSE_STAGES, head=0)
    with pytest.raises(ValueError, match="num_splits"):
        forward_schedule([DENSE_STAGES], 0)
    with pytest.raises(ValueError, match="need layers"):
        forward_schedule([])


def test_planner_counts_full_width_gemms_on_every_sm():
    """The wave model per GEMM: capped QKV / gate-up on 116 SMs, O / down on 132 (Llama-3.3-70B at TP4). At 1024
    tokens that moves the cut from 640 + 384 (all on 116 SMs) to the exact half; bad ``sms`` raise."""
    from sglang.srt.tokenweave.planner import layer_gemm_widths

    widths = layer_gemm_widths(8192, 64, 8, 128, 28672, 4)
    sms = width_sms(layer_overlap(DENSE_STAGES), 132, 16)
    assert sms == (116, 132, 116, 132)
    assert width_sms(layer_overlap(DENSE_STAGES), 132, 0) == (132,) * 4
    assert plan_split(1024, widths, GemmShape(num_sms=116)).prefix == 640
    per_gemm = plan_split(1024, widths, GemmShape(), sms=sms)
    assert per_gemm.prefix == 512
    assert per_gemm.unsplit_waves == sum(GemmShape().waves(1024, w, n) for w, n in zip(widths, sms))
    assert plan_split(1024, widths, GemmShape(), sms=(116,) * 4) == plan_split(1024, widths, GemmShape(num_sms=116))
    for bad in ((116, 132), (116, 0, 116, 132)):
        with pytest.raises(ValueError, match="sms="):
            plan_split(1024, widths, GemmShape(), sms=bad)


class _Recorder:
    """Stands in for GemmCarveout: counts enters/exits, knows whether it is entered."""

    carveout = 16

    def __init__(self):
        self.entered, self.enters, self.exits = False, 0, 0

    def __enter__(self):
        assert not self.entered, "carveout entered twice"
        self.entered, self.enters = True, self.enters + 1
        return self

    def __exit__(self, *exc):
        assert self.entered, "carveout left without being entered"
        self.entered, self.exits = False, self.exits + 1


def _model(tmp_path, kind: str):
    transformers = pytest.importorskip("transformers")
    sys.path.insert(0, os.path.dirname(__file__))
    from model_harness import ModelHarness, randomize_weights

    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_loader.loader import load_model

    common = dict(vocab_size=97, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    if kind == "dense":
        cfg, cls = transformers.Qwen2Config(intermediate_size=96, **common), transformers.Qwen2ForCausalLM
    else:  # layer 0 MoE with a shared expert, layer 1 dense
        cfg = transformers.Qwen2MoeConfig(intermediate_size=96, num_experts=4, num_experts_per_tok=2,
                                          moe_intermediate_size=32, shared_expert_intermediate_size=48,
                                          norm_topk_prob=False, mlp_only_layers=[1], **common)
        cls = transformers.Qwen2MoeForCausalLM
    hf = cls(cfg).float().eval()
    randomize_weights(hf, 3)
    hf.save_pretrained(str(tmp_path))
    config = ModelConfig.from_path(str(tmp_path))
    return config, load_model(config, "auto", "cpu"), ModelHarness


@pytest.mark.parametrize("kind", ["dense", "moe_shared"])
def test_executor_caps_exactly_the_overlapped_gemms(tmp_path, kind):
    """``carveout_scope="overlap"`` on a real model: every cuBLAS GEMM call of the split forward runs inside the
    carveout iff :func:`layer_overlap` lists its (split, stage, GEMM); the carveout is never entered outside the
    decoder GEMMs (logits) and left each time; the logits equal the unsplit forward's. Scope "all" removes the
    hooks; a bad scope raises."""
    from sglang.srt.layers.linear import LinearBase
    from sglang.srt.tokenweave import gemm_widths_of
    from sglang.srt.tokenweave.executor import TokenWeaveConfig, TokenWeaveExecutor

    config, model, harness = _model(tmp_path, kind)
    h = harness(model, config)
    h.step([("a", list(range(5))), ("b", list(range(7)))])
    fb = h.prepare([("a", [3]), ("b", list(range(9))), ("c", list(range(6)))])
    ref = h.run(fb)
    ex = TokenWeaveExecutor(TokenWeaveConfig(min_tokens=2, gemm_widths=gemm_widths_of(config, 1),
                                             carveout_scope="overlap"), torch.device("cpu"))
    rec = ex._carveout = _Recorder()
    ex._install_caps(model)  # before the recording hooks, so the executor's pre-hook runs first
    calls, handles = [], []
    for name, mod in model.named_modules():
        if isinstance(mod, LinearBase):
            handles.append(mod.register_forward_pre_hook(
                lambda m, a, name=name: calls.append((name, rec.entered))))
    want = []
    for layer in model.decoder_layers:
        ovl = layer_overlap(tuple(layer.stage_names()))
        prefix = next(n for n, m in model.named_modules() if m is layer)
        for stage in layer.stage_names():
            for split in (0, 1):
                for path in STAGE_GEMMS.get(stage, ()):
                    if any(n == f"{prefix}.{path}" for n, _ in model.named_modules()):
                        want.append((f"{prefix}.{path}", (split, stage, path) in ovl))
    assert kind == "dense" or any(n.endswith("mlp.shared_expert_gate") and e for n, e in want)
    h.poison_kv(fb)
    with torch.inference_mode():
        out = ex.run(model, fb)
    for hd in handles:
        hd.remove()
    layer_calls = [c for c in calls if any(c[0] == w[0] for w in want)]
    assert layer_calls == want
    assert not any(entered for name, entered in calls if (name, entered) not in want)
    assert rec.enters == rec.exits == sum(e for _, e in want) > 0 and not rec.entered
    assert (out.next_token_logits - ref).abs().max().item() < 2e-5
    assert len(ex._hooks) == 2 * len({n for n, e in want if e})  # one pre/post pair per capped module
    ex.set_carveout_scope("all")
    assert not ex._hooks and not ex._caps and ex._plan_sms is None
    with pytest.raises(ValueError, match="carveout_scope='some'"):
        ex.set_carveout_scope("some")
    with pytest.raises(ValueError, match="carveout_scope"):
        TokenWeaveConfig(gemm_widths=(8,), carveout_scope="gemm")
