"""Weight quantization: ``--quantization`` and checkpoints with a ``quantization_config`` (SGLang's names).

One scheme today, FP8 (e4m3) weights with W8A8 GEMMs (:mod:`.fp8_config`): ``--quantization fp8`` quantizes a
model-dtype checkpoint at load; a checkpoint whose ``config.json`` has ``quantization_config.quant_method: "fp8"``
loads as published (per-tensor or 128 x 128 block-wise scales), with or without the flag.

* :func:`resolve_quant_config`: the flag and the checkpoint's ``config.json`` -> a frozen config (or None);
  refuses unknown methods and malformed fields, naming them;
* :func:`check_quantization`: the launcher's check before any worker starts (the config, and a TP / EP split that
  cuts FP8 weight blocks: the model is built on ``meta`` for the ranks that differ, running the very code that would
  fail at load); :func:`quant_config_of` gives the deployment plan the scheme a launch will load;
* :func:`apply_quantization`: chooses the method of every linear / MoE layer of a model (built on ``meta``) once;
  :func:`finish_loading`: their post-load step.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch
from torch import nn

from sglang.srt.layers.quantization.base import LinearMethodBase, MoEMethodBase, QuantizationConfig

logger = logging.getLogger(__name__)

QUANTIZATION_METHODS = ("fp8",)

__all__ = ["QUANTIZATION_METHODS", "QuantizationConfig", "LinearMethodBase", "MoEMethodBase",
           "resolve_quant_config", "quant_config_of", "check_quantization", "apply_quantization", "finish_loading"]


def check_flag(quantization: Optional[str]) -> None:
    """Raise ValueError unless ``--quantization`` is unset or one of :data:`QUANTIZATION_METHODS`."""
    if quantization is not None and quantization not in QUANTIZATION_METHODS:
        raise ValueError(f"--quantization={quantization!r} is not supported; supported: "
                         f"{', '.join(QUANTIZATION_METHODS)} (or omit it: an FP8 checkpoint is detected from its "
                         "config.json)")


def resolve_quant_config(hf_config: dict, quantization: Optional[str]) -> Optional[QuantizationConfig]:
    """The scheme for a model: its checkpoint's ``quantization_config`` when present (``--quantization`` may be
    omitted, as in SGLang), else ``--quantization`` applied at load, else None (the model dtype).

    Raises:
        ValueError: an unsupported ``--quantization`` value, or a malformed / unsupported ``quantization_config``
            (the message names the field).
    """
    from sglang.srt.layers.quantization.fp8_config import Fp8Config

    check_flag(quantization)
    qc = hf_config.get("quantization_config")
    if qc is not None:
        return Fp8Config.from_checkpoint(qc)
    if quantization == "fp8":
        return Fp8Config.online()
    return None


def _linear_hf_names(model: nn.Module, name: str, mod: nn.Module) -> tuple[str, ...]:
    to_hf = getattr(model, "hf_weight_name", None)
    shards = getattr(mod.weight, "expected_shards", (None,))
    if to_hf is None:
        return (name,)
    return tuple(dict.fromkeys(to_hf(f"{name}.weight", s)[: -len(".weight")] for s in shards))


def _expert_hf_names(model: nn.Module, name: str, mod: nn.Module) -> tuple[str, ...]:
    to_hf = getattr(model, "hf_weight_name", None)
    if to_hf is None:
        return ()
    out = []
    for kind, shards in (("w13", ("w1", "w3")), ("w2", ("w2",))):
        for e in range(mod.num_experts):
            for s in shards:
                out.append(to_hf(f"{name}.{kind}_weight", (e, s))[: -len(".weight")])
    return tuple(out)


def apply_quantization(model: nn.Module, config: Optional[QuantizationConfig]) -> int:
    """Choose and install the method of every :class:`~sglang.srt.layers.linear.LinearBase` and
    :class:`~sglang.srt.layers.moe.fused_moe.FusedMoE` of ``model`` (``config.linear_method`` / ``moe_method`` by
    module name and HF names); each method's ``create_weights`` replaces the layer's parameters. Call it on a model
    built on ``meta`` (no model-dtype weights are ever allocated for quantized layers). Returns the number of
    quantized layers (0 when ``config`` is None).

    Raises:
        ValueError: from the methods (e.g. a TP split that cuts FP8 weight blocks, a partly ignored packed layer).
    """
    from sglang.srt.layers.linear import LinearBase
    from sglang.srt.layers.moe.fused_moe import FusedMoE

    if config is None:
        return 0
    count = 0
    for name, mod in list(model.named_modules()):
        method = None
        if isinstance(mod, LinearBase) and getattr(mod, "weight", None) is not None:
            method = config.linear_method(mod, name, _linear_hf_names(model, name, mod))
        elif isinstance(mod, FusedMoE):
            method = config.moe_method(mod, name, _expert_hf_names(model, name, mod))
        if method is not None:
            method.create_weights(mod)
            mod.quant_method = method
            count += 1
    return count


def finish_loading(model: nn.Module) -> None:
    """Run every installed method's ``process_weights_after_loading`` once the weights are in, log the weight bytes by
    dtype, and on CUDA return the allocator's cached blocks (load-time temporaries) so the KV budget, which reads
    the free device memory, counts the smaller weights."""
    methods = 0
    for mod in model.modules():
        qm = getattr(mod, "quant_method", None)
        if qm is not None:
            qm.process_weights_after_loading(mod)
            methods += 1
    if not methods:
        return
    by_dtype: dict[str, int] = {}
    seen = set()
    for p in model.parameters():
        if id(p) in seen or p.is_meta:
            continue
        seen.add(id(p))
        key = str(p.dtype).replace("torch.", "")
        by_dtype[key] = by_dtype.get(key, 0) + p.numel() * p.element_size()
    logger.info("quantized %d layers; parameter bytes by dtype: %s", methods,
                ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in sorted(by_dtype.items())))
    if any(p.is_cuda for p in model.parameters()):
        torch.cuda.empty_cache()


def check_quantization(args: Any) -> Optional[QuantizationConfig]:
    """The launcher's check, before any worker starts: resolve the scheme from ``--quantization`` and the model's
    ``config.json``, and for block-wise FP8 build the model with the scheme on ``meta`` for the TP ranks whose shards
    differ (0, 1, last), so a split that cuts FP8 weight blocks fails here with the load's own message. Returns the
    config (None: no quantization). (Techniques that cannot take quantized weights are refused by the deployment
    plan's model check, :func:`sglang.srt.deployment.compose.check_model`.)

    Raises:
        ValueError: naming the flag or ``quantization_config`` field and the fix.
    """
    config = quant_config_of(args)
    if config is None or getattr(config, "weight_block_size", None) is None or args.tp_size == 1:
        return config
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.models.registry import get_model_class

    mc = ModelConfig.from_path(args.model_path, args.context_length, args.dtype, "cpu")
    cls = get_model_class(mc.architecture)
    for rank in sorted({0, 1, args.tp_size - 1}):
        with torch.device("meta"):
            model = cls(mc, tp_rank=rank, tp_size=args.tp_size, comm=None, ep_size=args.ep_size)
            apply_quantization(model, config)
    return config


def quant_config_of(args: Any) -> Optional[QuantizationConfig]:
    """The scheme ``args`` (``ServerArgs``: ``--quantization``, ``--model-path``) will load (reads config.json).

    Raises:
        ValueError: as :func:`resolve_quant_config`, or no config.json at ``--model-path``.
    """
    from sglang.srt.configs.model_config import ModelConfig

    check_flag(args.quantization)
    mc = ModelConfig.from_path(args.model_path, args.context_length, args.dtype, "cpu")
    return resolve_quant_config(mc.hf_config, args.quantization)
