"""Write an FP8 checkpoint in either published layout from a model-dtype HF checkpoint (tests, and as a tool).

``python -m sglang.srt.layers.quantization.fp8_checkpoint --model-path SRC --output DST --scheme per-tensor``
(``--activation-scheme static|dynamic``) or ``--scheme block`` (``--block-size 128 128``, ``--scale-dtype bfloat16``).

* ``per-tensor`` (as the Llama-3.1-8B-Instruct-FP8 releases): every attention / MLP / expert projection ``P``
  becomes ``P.weight`` float8_e4m3fn with one float32 ``P.weight_scale`` (0-d, ``amax / 448``); with
  ``--activation-scheme static`` also ``P.input_scale`` = the amax of the projection's input over a calibration run of
  the model-dtype model on a few prompts, / 448 (experts: over the tokens routed to each expert);
* ``block`` (as the Qwen3 FP8 releases; DeepSeek-V3 sec. 3.3): ``P.weight`` e4m3 and ``P.weight_scale_inv``
  ``[ceil(out / bn), ceil(in / bk)]`` (bf16 by default, as Qwen's; the weight is quantized with the rounded scale),
  dynamic activations.

Embeddings, the LM head, norms and MoE routers (``mlp.gate``, ``shared_expert_gate``) are copied unchanged.
``config.json`` gets the matching ``quantization_config``; every other file of the source folder is copied.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shutil
from typing import Optional, Sequence

import torch

from sglang.srt.layers.quantization.fp8_ref import (amax_scale, quant_weight_block,
                                                    quant_weight_per_tensor, quantize_with_scale)

logger = logging.getLogger(__name__)

# attention, MLP and expert projections (HF names); not routers (mlp.gate), shared_expert_gate, embeddings, lm_head
QUANTIZED_RE = re.compile(r"\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$")
CALIBRATION_TEXTS = (  # short children's-story sentences (the stories260K domain), distinct from the test prompts
    "Mia had a small blue boat. She took it to the pond and watched it float on the water.",
    "The big bear was hungry. He looked for honey in the old tree, but the bees were angry.",
    "Ben and his mom baked a cake. It was warm and sweet, and they shared it with their friends.",
    "A little bird sat on the fence and sang a happy song. The sun was bright and the sky was blue.",
    "Sam found a shiny rock in the garden. He showed it to his sister and she smiled.",
    "It was a rainy day. Anna wore her red boots and jumped in every puddle on the way home.",
    "The cat and the dog were friends. They played with a ball all day and then slept by the fire.",
    "Grandpa told a story about a brave knight who helped a sad dragon find its way back home.",
)


def _block_quant(w: torch.Tensor, block: tuple[int, int], scale_dtype: torch.dtype):
    q, s = quant_weight_block(w, *block)
    if scale_dtype != torch.float32:  # store the scale as published (bf16) and quantize with exactly that scale
        s = s.to(scale_dtype)
        sf = s.float().repeat_interleave(block[0], 0)[: w.shape[0]].repeat_interleave(block[1], 1)[:, : w.shape[1]]
        q = quantize_with_scale(w, sf)
    return q, s


def calibrate_input_scales(src: str, texts: Sequence[str] = CALIBRATION_TEXTS) -> dict[str, float]:
    """Static activation scales for every quantized projection: run the model-dtype model (fp32, CPU) on ``texts``
    and return HF module name -> ``amax(input) / 448``."""
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.layers.linear import LinearBase, ReplicatedLinear
    from sglang.srt.layers.moe.fused_moe import FusedMoE
    from sglang.srt.model_loader.loader import load_model
    from sglang.srt.utils.common import get_tokenizer
    from sglang.test.model_harness import ModelHarness

    mc = ModelConfig.from_path(src, dtype="float32", device="cpu")
    model = load_model(mc, "auto", "cpu")
    amax: dict[str, float] = {}

    def note(name: str, value: float) -> None:
        amax[name] = max(amax.get(name, 0.0), value)

    hooks = []
    for name, mod in model.named_modules():
        if isinstance(mod, LinearBase) and not isinstance(mod, ReplicatedLinear):
            hf = {model.hf_weight_name(f"{name}.weight", s)[:-7] for s in mod.weight.expected_shards}

            def hook(m, args, hf=hf):
                for n in hf:
                    note(n, float(args[0].abs().max()))
            hooks.append(mod.register_forward_pre_hook(hook))
        elif isinstance(mod, FusedMoE):
            orig = mod.compute

            def compute(x, topk_weights, topk_ids, mod=mod, name=name, orig=orig):
                n_i = mod.i_local
                for e in torch.unique(topk_ids).tolist():
                    rows = (topk_ids == e).any(dim=-1)
                    xe = x[rows]
                    gu = xe.float() @ mod.w13_weight[e].float().t()
                    act = torch.nn.functional.silu(gu[:, :n_i]) * gu[:, n_i:]
                    for shard, val in (("w1", xe), ("w3", xe), ("w2", act)):
                        kind = "w2" if shard == "w2" else "w13"
                        note(model.hf_weight_name(f"{name}.{kind}_weight", (e, shard))[:-7], float(val.abs().max()))
                return orig(x, topk_weights, topk_ids)
            mod.compute = compute
    tok = get_tokenizer(src)
    for i, text in enumerate(texts):
        ids = tok.encode(text)
        ModelHarness(model, mc, max_reqs=1, max_len=len(ids) + 1).step([(f"c{i}", ids)])
    for h in hooks:
        h.remove()
    for name, mod in model.named_modules():  # experts no calibration token reached: their layer's largest scale
        if isinstance(mod, FusedMoE):
            for kind, shards in (("w13", ("w1", "w3")), ("w2", ("w2",))):
                names = [model.hf_weight_name(f"{name}.{kind}_weight", (e, s))[:-7]
                         for e in range(mod.num_experts) for s in shards]
                top = max((amax[n] for n in names if n in amax), default=1.0)
                for n in names:
                    amax.setdefault(n, top)
    return {k: float(amax_scale(torch.tensor(v))) for k, v in amax.items()}


def write_fp8_checkpoint(src: str, dst: str, scheme: str = "per-tensor", activation_scheme: str = "dynamic",
                         block: tuple[int, int] = (128, 128), scale_dtype: torch.dtype = torch.bfloat16,
                         ignored: Sequence[str] = ()) -> dict:
    """Write the FP8 checkpoint of ``src`` (a model-dtype HF folder with ``model.safetensors``) to ``dst``; returns
    the ``quantization_config`` written. ``ignored``: HF module names to keep in the model dtype (listed in
    ``ignored_layers``).

    Raises:
        ValueError: an unknown scheme, static activations with block scales, or no safetensors in ``src``.
    """
    from safetensors.torch import load_file, save_file

    from sglang.srt.model_loader.loader import safetensors_files

    if scheme not in ("per-tensor", "block"):
        raise ValueError(f"scheme={scheme!r}: use per-tensor or block")
    if scheme == "block" and activation_scheme != "dynamic":
        raise ValueError("block-wise FP8 checkpoints use dynamic activation scales")
    os.makedirs(dst, exist_ok=True)
    input_scales = calibrate_input_scales(src) if activation_scheme == "static" else {}
    state: dict[str, torch.Tensor] = {}
    for file in safetensors_files(src):
        state.update(load_file(file))
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        module = name[: -len(".weight")]
        if not QUANTIZED_RE.search(name) or module in ignored:
            out[name] = t.contiguous()
            continue
        w = t.float()
        if scheme == "block":
            out[name], out[module + ".weight_scale_inv"] = _block_quant(w, block, scale_dtype)
        else:
            out[name], out[module + ".weight_scale"] = quant_weight_per_tensor(w)
            if activation_scheme == "static":
                if module not in input_scales:
                    raise ValueError(f"calibration saw no input for {module}")
                out[module + ".input_scale"] = torch.tensor(input_scales[module], dtype=torch.float32)
    save_file({k: v.contiguous() for k, v in out.items()}, os.path.join(dst, "model.safetensors"))
    for f in os.listdir(src):
        if f.endswith(".safetensors") or f == "model.safetensors.index.json" or f == "config.json":
            continue
        if os.path.isfile(os.path.join(src, f)):
            shutil.copy(os.path.join(src, f), os.path.join(dst, f))
    with open(os.path.join(src, "config.json")) as fh:
        cfg = json.load(fh)
    qc = {"quant_method": "fp8", "activation_scheme": activation_scheme, "fmt": "e4m3"}
    if scheme == "block":
        qc["weight_block_size"] = list(block)
    if ignored or scheme == "per-tensor":
        qc["ignored_layers"] = ["lm_head", *ignored]
    cfg["quantization_config"] = qc
    with open(os.path.join(dst, "config.json"), "w") as fh:
        json.dump(cfg, fh, indent=2)
    logger.info("wrote %s (%s, %s activations) from %s", dst, scheme, activation_scheme, src)
    return qc


def main(argv: Optional[Sequence[str]] = None) -> None:
    """The command line (module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-path", required=True)
    p.add_argument("--output", required=True)
    p.add_argument("--scheme", choices=("per-tensor", "block"), default="per-tensor")
    p.add_argument("--activation-scheme", choices=("static", "dynamic"), default="dynamic")
    p.add_argument("--block-size", type=int, nargs=2, default=(128, 128))
    p.add_argument("--scale-dtype", choices=("float32", "bfloat16"), default="bfloat16")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    write_fp8_checkpoint(a.model_path, a.output, a.scheme, a.activation_scheme, tuple(a.block_size),
                         getattr(torch, a.scale_dtype))


if __name__ == "__main__":
    main()
