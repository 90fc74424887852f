"""The FP8 scheme: ``--quantization fp8`` on a model-dtype checkpoint, or an FP8 checkpoint's ``quantization_config``.

Checkpoint formats read (``config.json`` -> ``quantization_config`` with ``quant_method: "fp8"``), as SGLang and
vLLM load them:

* per-tensor (e.g. the Llama-3.1-8B-Instruct-FP8 releases): every quantized projection ``P`` has ``P.weight``
  (float8_e4m3fn ``[out, in]``) and ``P.weight_scale`` (one float32; a per-output-channel ``[out]`` / ``[out, 1]``
  vector is read too), and with ``activation_scheme: "static"`` a calibrated ``P.input_scale`` (one float32);
  ``activation_scheme: "dynamic"`` scales activations per token at run time;
* block-wise (e.g. the Qwen3 FP8 releases; DeepSeek-AI, "DeepSeek-V3 Technical Report", 2024, sec. 3.3):
  ``weight_block_size: [block_n, block_k]`` (128 x 128) and ``P.weight_scale_inv`` of shape
  ``[ceil(out / block_n), ceil(in / block_k)]`` (float32 or bf16; the multiplier that dequantizes), with dynamic
  activation scales per token and ``block_k`` group.

Optional fields: ``fmt`` (``"e4m3"``; e5m2 weights are refused), ``ignored_layers`` / ``modules_to_not_convert``
(HF module names kept in the model dtype; an entry matches a module name exactly or as a dot-separated suffix).

Without a ``quantization_config``, ``--quantization fp8`` quantizes the model-dtype checkpoint at load: e4m3 weights
with one scale per output channel (``amax / 448`` over the whole row, so every TP rank gets the scales the
unsharded weight has) and dynamic per-token activation scales. Embeddings, the LM head and MoE routers stay in the
model dtype (as SGLang does).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from torch import nn

from sglang.srt.layers.quantization.base import LinearMethodBase, MoEMethodBase, QuantizationConfig

ACTIVATION_SCHEMES = ("static", "dynamic")


def _bad(fld: str, value: Any, fix: str) -> ValueError:
    return ValueError(f"config.json quantization_config.{fld}={value!r} is not supported: {fix}")


@dataclass(frozen=True)
class Fp8Config(QuantizationConfig):
    """FP8 (e4m3) weights, W8A8 GEMMs.

    Attributes:
        checkpoint_fp8: the checkpoint holds e4m3 weights and their scales (loaded as is); False: ``--quantization
            fp8`` quantizes a model-dtype checkpoint at load (per-output-channel scales).
        activation_scheme: ``"dynamic"`` (per token at run time) or ``"static"`` (the checkpoint's ``input_scale``).
        weight_block_size: ``(block_n, block_k)`` for block-wise scales, else None.
        ignored_layers: HF module names kept in the model dtype.
    """

    checkpoint_fp8: bool = False
    activation_scheme: str = "dynamic"
    weight_block_size: Optional[tuple[int, int]] = None
    ignored_layers: tuple[str, ...] = field(default=())
    name: str = "fp8"

    @classmethod
    def online(cls) -> "Fp8Config":
        """``--quantization fp8`` on a model-dtype checkpoint."""
        return cls()

    @classmethod
    def from_checkpoint(cls, qc: Any) -> "Fp8Config":
        """Parse and validate a checkpoint's ``quantization_config`` dict.

        Raises:
            ValueError: naming the field (``quant_method``, ``activation_scheme``, ``weight_block_size``, ``fmt``,
                ``ignored_layers`` / ``modules_to_not_convert``), its value and what is supported.
        """
        if not isinstance(qc, dict):
            raise ValueError(f"config.json quantization_config must be an object, got {type(qc).__name__}")
        method = qc.get("quant_method")
        if method is None:
            raise ValueError("config.json quantization_config has no quant_method field; an FP8 checkpoint has "
                             "\"quant_method\": \"fp8\"")
        if method != "fp8":
            raise _bad("quant_method", method, "this server loads FP8 checkpoints (\"fp8\") only; serve a bf16 "
                       "checkpoint (with --quantization fp8 to quantize it at load) instead")
        if "activation_scheme" not in qc:
            raise ValueError("config.json quantization_config has no activation_scheme field; an FP8 checkpoint "
                             "states \"static\" (with input_scale tensors) or \"dynamic\"")
        scheme = qc["activation_scheme"]
        if scheme not in ACTIVATION_SCHEMES:
            raise _bad("activation_scheme", scheme, "use \"static\" or \"dynamic\"")
        fmt = qc.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise _bad("fmt", fmt, "only e4m3 weights (float8_e4m3fn) are supported")
        block = qc.get("weight_block_size")
        if block is not None:
            if not (isinstance(block, (list, tuple)) and len(block) == 2
                    and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
                raise _bad("weight_block_size", block, "give two positive integers [block_n, block_k], e.g. [128, 128]")
            if scheme != "dynamic":
                raise _bad("activation_scheme", scheme, "block-wise weights (weight_block_size) take dynamic "
                           "activation scales only")
            block = (int(block[0]), int(block[1]))
        ignored: list[str] = []
        for key in ("ignored_layers", "modules_to_not_convert"):
            val = qc.get(key)
            if val is None:
                continue
            if not isinstance(val, (list, tuple)) or not all(isinstance(v, str) for v in val):
                raise _bad(key, val, "give a list of module names")
            ignored.extend(val)
        return cls(checkpoint_fp8=True, activation_scheme=scheme, weight_block_size=block,
                   ignored_layers=tuple(ignored))

    # ---- choosing methods ----------------------------------------------------------------------------------
    def is_ignored(self, hf_module: str) -> bool:
        """True when ``hf_module`` (e.g. ``model.layers.0.mlp.down_proj``) is listed in ``ignored_layers``: exactly, or
        an entry is a dot-separated suffix of it (``mlp.gate`` matches ``model.layers.3.mlp.gate``, not
        ``mlp.gate_proj``)."""
        return any(hf_module == e or hf_module.endswith("." + e) for e in self.ignored_layers)

    def _skipped(self, prefix: str, hf_names: tuple[str, ...]) -> bool:
        flags = {self.is_ignored(n) for n in hf_names}
        if len(flags) > 1:
            raise ValueError(f"quantization_config.ignored_layers lists some of {list(hf_names)} but not all; they "
                             f"are one packed layer here ({prefix}): list all of them or none")
        return flags == {True}

    def linear_method(self, layer: nn.Module, prefix: str, hf_names: tuple[str, ...]) -> Optional[LinearMethodBase]:
        """The FP8 method for column/row-parallel layers (QKV, gate_up, o, down, shared experts) that the checkpoint
        does not ignore; None for replicated layers (MoE routers and shared-expert gates stay in the model dtype)."""
        from sglang.srt.layers.linear import ReplicatedLinear
        from sglang.srt.layers.quantization.fp8_linear import Fp8LinearMethod

        if isinstance(layer, ReplicatedLinear) or self._skipped(prefix, hf_names):
            return None
        return Fp8LinearMethod(self)

    def moe_method(self, layer: nn.Module, prefix: str, hf_names: tuple[str, ...] = ()) -> Optional[MoEMethodBase]:
        """The FP8 experts method (None when the checkpoint ignores every expert tensor of the layer)."""
        from sglang.srt.layers.quantization.fp8_moe import Fp8MoEMethod

        if hf_names and self._skipped(prefix, hf_names):
            return None
        return Fp8MoEMethod(self)

    def describe(self) -> str:
        """E.g. ``fp8 (checkpoint, block-wise 128x128 weight scales, dynamic activation scales)``."""
        if not self.checkpoint_fp8:
            return "fp8 (quantized at load: per-channel weight scales, dynamic per-token activation scales)"
        w = f"block-wise {self.weight_block_size[0]}x{self.weight_block_size[1]}" if self.weight_block_size \
            else "per-tensor"
        return f"fp8 (checkpoint, {w} weight scales, {self.activation_scheme} activation scales)"
