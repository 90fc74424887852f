"""FP8 models on CPU (emulated: e4m3 storage, dequantized fp32 compute): the stories260K checkpoints (dense and
8-expert MoE) quantized at load (``--quantization fp8``) and written in both published FP8 layouts (per-tensor with
static input scales, as Llama-3.1-8B-Instruct-FP8; 128 x 128 block-wise with bf16 ``weight_scale_inv``, as the Qwen3
FP8 releases) load without re-quantization and answer close to the fp32 model.

Tolerance (stated, not fitted): on the fp32 model's greedy path over the shared prompts (teacher forcing, 12
tokens), every position's logit error ``||l_fp8 - l_fp32||_2 / ||l_fp32||_2 <= 5 * 2^-4 = 0.3125``: e4m3 rounds each
GEMM input with a relative error of at most 2^-4 (3 mantissa bits; Micikevicius et al. 2022, sec. 3), and the five
decoder layers' errors are allowed to add up; measured 0.08-0.15. The top-1 token agrees at >= 85% of those
positions (measured 0.90-1.0), and the dense model's 12-token greedy continuation is identical on at least 3 of the 4
prompts. The 8-expert toy MoE (hidden size 64) sits near routing ties on two of the prompts, where already bf16
compute changes its greedy continuation, so its criterion is the per-position one. A checkpoint whose weight scales
are 25% off must fail the same tolerance (the check can fail).
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
from conftest import shared_path  # noqa: E402

from sglang.srt.configs.model_config import ModelConfig  # noqa: E402
from sglang.srt.model_loader.loader import load_model  # noqa: E402

PROMPTS = ["Once upon a time", "The little dog", "Lily and Tom went to the park. They", "One day, a bird"]
N_NEW = 12
LOGIT_TOL = 5 * 2.0 ** -4  # relative L2 logit error per position (module docstring)
TOP1_MIN = 0.85
VARIANTS = ("online", "per-tensor-static", "block")


def run(model, mc, prompts: list[list[int]], forced=None):
    """Greedy (or ``forced``) continuation of every prompt, all in one batch per step: ``(tokens [B][N], logits [B,
    N, V])``."""
    from sglang.test.model_harness import ModelHarness

    h = ModelHarness(model, mc, max_reqs=len(prompts), max_len=max(map(len, prompts)) + N_NEW + 2)
    items = [(f"r{i}", p) for i, p in enumerate(prompts)]
    toks: list[list[int]] = [[] for _ in prompts]
    logits = []
    for t in range(N_NEW):
        lg = h.step(items)
        logits.append(lg)
        top = lg.argmax(-1).tolist()
        for out, x in zip(toks, top):
            out.append(x)
        nxt = top if forced is None else [f[t] for f in forced]
        items = [(f"r{i}", [x]) for i, x in enumerate(nxt)]
    return toks, torch.stack(logits, 1)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> {variant: checkpoint folder or (source folder, "fp8")} for stories260K and stories260K-moe8."""
    from sglang.srt.layers.quantization.fp8_checkpoint import write_fp8_checkpoint

    out = {}
    root = tmp_path_factory.mktemp("fp8")
    for name in ("stories260K", "stories260K-moe8"):
        src = shared_path("models", name)
        out[name] = {"src": src, "online": src}
        write_fp8_checkpoint(src, str(root / f"{name}-pt"), "per-tensor", "static", scale_dtype=torch.float32)
        out[name]["per-tensor-static"] = str(root / f"{name}-pt")
        write_fp8_checkpoint(src, str(root / f"{name}-block"), "block", "dynamic", (128, 128), torch.bfloat16)
        out[name]["block"] = str(root / f"{name}-block")
    return out


@pytest.fixture(scope="module")
def reference(checkpoints):
    """name -> (prompt ids, fp32 greedy tokens, fp32 logits)."""
    from sglang.srt.utils.common import get_tokenizer

    ref = {}
    for name, c in checkpoints.items():
        mc = ModelConfig.from_path(c["src"])
        ids = [get_tokenizer(c["src"]).encode(p) for p in PROMPTS]
        ref[name] = (ids, *run(load_model(mc, "auto", "cpu"), mc, ids))
    return ref


def _load(path: str, variant: str):
    mc = ModelConfig.from_path(path)
    return mc, load_model(mc, "auto", "cpu", quantization="fp8" if variant == "online" else None)


def _errors(model, mc, ids, ref_toks, ref_logits) -> tuple[float, float]:
    toks, logits = run(model, mc, ids, forced=ref_toks)
    rel = ((logits - ref_logits).norm(dim=-1) / ref_logits.norm(dim=-1)).max().item()
    top1 = sum(a == b for t, r in zip(toks, ref_toks) for a, b in zip(t, r)) / (len(ids) * N_NEW)
    return rel, top1


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("name", ["stories260K", "stories260K-moe8"])
def test_fp8_model_answers_close_to_fp32(checkpoints, reference, name, variant):
    from sglang.srt.layers.linear import LinearBase

    mc, model = _load(checkpoints[name][variant], variant)
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == torch.float8_e4m3fn and qkv.quant_method is not None
    assert not isinstance(model.lm_head, LinearBase) and model.lm_head.weight.dtype == torch.float32  # stays fp32
    ids, ref_toks, ref_logits = reference[name]
    rel, top1 = _errors(model, mc, ids, ref_toks, ref_logits)
    print(f"{name} {variant}: max relative logit error {rel:.4f}, top-1 agreement {top1:.3f}")
    assert rel <= LOGIT_TOL and top1 >= TOP1_MIN
    if name == "stories260K":
        greedy, _ = run(model, mc, ids)
        assert sum(g == r for g, r in zip(greedy, ref_toks)) >= 3, (greedy, ref_toks)


def test_mis_scaled_checkpoint_fails_the_tolerance(checkpoints, reference, tmp_path):
    """The same per-tensor checkpoint with every weight_scale 25% too large is outside LOGIT_TOL."""
    from safetensors.torch import load_file, save_file

    src = checkpoints["stories260K"]["per-tensor-static"]
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in os.listdir(src):
        if f != "model.safetensors":
            (bad / f).write_bytes(open(os.path.join(src, f), "rb").read())
    state = load_file(os.path.join(src, "model.safetensors"))
    save_file({k: v * 1.25 if k.endswith(".weight_scale") else v for k, v in state.items()},
              str(bad / "model.safetensors"))
    mc, model = _load(str(bad), "per-tensor-static")
    ids, ref_toks, ref_logits = reference["stories260K"]
    rel, _ = _errors(model, mc, ids, ref_toks, ref_logits)
    assert rel > LOGIT_TOL, rel


@pytest.mark.parametrize("variant", ["per-tensor-static", "block"])
def test_checkpoint_weights_load_without_requantization(checkpoints, variant):
    """The loaded e4m3 bytes are the checkpoint's: qkv rows = q_proj / k_proj / v_proj, expert rows = w1 / w3."""
    from safetensors import safe_open

    path = checkpoints["stories260K-moe8"][variant]
    _, model = _load(path, variant)
    layer = model.model.layers[1]
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        q = f.get_tensor("model.layers.1.self_attn.q_proj.weight")
        k = f.get_tensor("model.layers.1.self_attn.k_proj.weight")
        w3 = f.get_tensor("model.layers.1.block_sparse_moe.experts.5.w3.weight")
        scale_key = "weight_scale" if variant == "per-tensor-static" else "weight_scale_inv"
        s3 = f.get_tensor(f"model.layers.1.block_sparse_moe.experts.5.w3.{scale_key}")
    assert q.dtype == torch.float8_e4m3fn
    qkv = layer.self_attn.qkv_proj.weight
    assert torch.equal(qkv[:64].view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(qkv[64:96].view(torch.uint8), k.view(torch.uint8))
    i = layer.mlp.experts.i_local
    assert torch.equal(layer.mlp.experts.w13_weight[5, i:].view(torch.uint8), w3.view(torch.uint8))
    if variant == "block":  # bf16 scales of 2 x 1 blocks (172 x 64 weight), expanded per row (172 rows, TP 1)
        assert s3.dtype == torch.bfloat16 and s3.shape == (2, 1)
        assert torch.equal(layer.mlp.experts.w13_weight_scale_inv[5, i:], s3.float().repeat_interleave(128, 0)[:i])
    else:
        assert torch.equal(layer.mlp.experts.w13_weight_scale[5, i:], s3.float().expand(i))


def test_fp8_weights_take_a_quarter_of_fp32_bytes(checkpoints):
    """Every quantized projection stores 1 byte per weight (plus scales); embeddings and norms stay fp32."""
    from sglang.srt.model_loader.role_build import param_bytes

    mc = ModelConfig.from_path(checkpoints["stories260K"]["src"])
    full = load_model(mc, "auto", "cpu")
    fp8 = load_model(mc, "auto", "cpu", quantization="fp8")
    linear = sum(p.numel() for n, p in full.named_parameters() if n.endswith(("proj.weight", "experts.w13_weight",
                                                                              "experts.w2_weight")))
    scales = sum(p.numel() * 4 for n, p in fp8.named_parameters() if n.endswith("weight_scale"))
    assert param_bytes(full) - param_bytes(fp8) == linear * 3 - scales


def test_dummy_weights_with_fp8(checkpoints):
    """--load-format dummy --quantization fp8: e4m3 weights uniform in +-448, scales 1e-3 / 448 (dequantized values in
    +-1e-3 as the model-dtype dummy weights), a finite forward; the same seed gives the same weights."""
    mc = ModelConfig.from_path(checkpoints["stories260K-moe8"]["src"])
    a = load_model(mc, "dummy", "cpu", quantization="fp8")
    b = load_model(mc, "dummy", "cpu", quantization="fp8")
    w = a.model.layers[0].mlp.experts.w13_weight
    assert w.dtype == torch.float8_e4m3fn and w.float().abs().max() <= 448 and w.float().std() > 100
    assert torch.equal(w.view(torch.uint8), b.model.layers[0].mlp.experts.w13_weight.view(torch.uint8))
    assert torch.allclose(a.model.layers[0].self_attn.o_proj.weight_scale, torch.tensor(1e-3 / 448))
    _, logits = run(a, mc, [[1, 5, 9]])
    assert torch.isfinite(logits).all()


def test_quantization_config_in_checkpoint_is_validated_at_load(checkpoints, tmp_path):
    src = checkpoints["stories260K"]["block"]
    for f in os.listdir(src):
        (tmp_path / f).write_bytes(open(os.path.join(src, f), "rb").read())
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["quantization_config"]["weight_block_size"] = [128, 0]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="weight_block_size"):
        load_model(ModelConfig.from_path(str(tmp_path)), "auto", "cpu")
