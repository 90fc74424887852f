"""The contract between layers and quantization methods.

A :class:`QuantizationConfig` (frozen, built once before any worker starts from ``--quantization`` and the
checkpoint's ``quantization_config``) picks, once per layer at load, the method object that owns the layer's weights:
:meth:`QuantizationConfig.linear_method` for a :class:`~sglang.srt.layers.linear.LinearBase`,
:meth:`QuantizationConfig.moe_method` for a :class:`~sglang.srt.layers.moe.fused_moe.FusedMoE`. The method

1. :meth:`create_weights`: replaces the layer's model-dtype parameters by its own (e.g. an e4m3 weight and float32
   scales), each with a ``weight_loader`` that places its part of a checkpoint tensor by the layer's shard rule
   (:meth:`~sglang.srt.layers.linear.LinearBase.shard_spec`, :meth:`~sglang.srt.layers.moe.fused_moe.FusedMoE.
   expert_spec`), so weights and scales are sharded alike under TP / EP; ``expected_shards`` (what a complete
   checkpoint provides) and, for seeded random weights, ``dummy_init(param, generator)``;
2. :meth:`process_weights_after_loading`: anything that needs every tensor loaded;
3. :meth:`apply`: the layer's GEMM (linear) or expert computation (MoE) on the method's weights.

The layer keeps the method in ``layer.quant_method`` and calls ``apply`` from its forward; nothing else in the layers
branches on the quantization scheme. :func:`sglang.srt.layers.quantization.apply_quantization` makes the choice for a
whole model (by module name, so a checkpoint's ignored modules stay in the model dtype).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Optional

import torch
from torch import nn


class LinearMethodBase(ABC):
    """How one linear layer stores its weight and runs ``y = x @ W^T + b``."""

    @abstractmethod
    def create_weights(self, layer: nn.Module) -> None:
        """Register the method's parameters on ``layer`` (shapes from ``layer.out_local`` / ``layer.in_local``),
        replacing ``layer.weight``; called once, on the device (or ``meta``) the model is built on."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Called once after every checkpoint tensor (or the dummy fill) has been loaded; default: nothing."""

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        """``x [..., in_local] -> [..., out_local]`` in x's dtype (``bias`` [out_local] added when given)."""

    def decode_gemm_operands(self, layer: nn.Module) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """``(weight [N, K], per-output-channel scale [N])`` the decode-GEMM tuner may time a weight-streaming kernel
        on (:mod:`sglang.srt.layers.decode_gemm`), or None (the default: the method's own GEMM only)."""
        return None

    def weight_bytes(self, layer: nn.Module) -> int:
        """Bytes of the method's parameters on ``layer`` (for logs and the memory accounting tests)."""
        return sum(p.numel() * p.element_size() for p in layer.parameters(recurse=False))


class MoEMethodBase(ABC):
    """How a :class:`~sglang.srt.layers.moe.fused_moe.FusedMoE` stores its experts and runs them."""

    @abstractmethod
    def create_weights(self, layer: nn.Module) -> None:
        """Register the experts' parameters (replacing ``w13_weight`` / ``w2_weight``) with loaders that take
        ``(param, loaded, shard_id, expert_id)`` as the layer's own."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Called once after loading; default: nothing."""

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        """This rank's experts: x ``[N, H]``, local ``topk_ids`` / ``topk_weights`` ``[N, k]`` -> ``[N, H]`` in x's
        dtype (the contract of :func:`sglang.srt.ops_ref.fused_moe_ref`)."""


class QuantizationConfig(ABC):
    """A frozen quantization scheme: its name and the method for each layer (None: keep the model dtype)."""

    name: str = ""

    @abstractmethod
    def linear_method(self, layer: nn.Module, prefix: str, hf_names: tuple[str, ...]) -> Optional[LinearMethodBase]:
        """The method for linear layer ``layer`` named ``prefix`` (our module name) whose checkpoint tensors are the HF
        modules ``hf_names`` (one per shard of a packed layer), or None to keep it in the model dtype.

        Raises:
            ValueError: the checkpoint quantizes some shards of a packed layer and not others.
        """

    @abstractmethod
    def moe_method(self, layer: nn.Module, prefix: str) -> Optional[MoEMethodBase]:
        """The method for the experts ``layer`` named ``prefix``, or None."""

    @abstractmethod
    def describe(self) -> str:
        """One line for the startup log."""


def set_loader(param: nn.Parameter, loader: Any, shards: tuple, dummy_init: Any = None) -> nn.Parameter:
    """Attach the loader hooks a model's ``load_weights`` and ``init_dummy_weights`` use to ``param``; returns it."""
    param.weight_loader = loader
    param.expected_shards = shards
    if dummy_init is not None:
        param.dummy_init = dummy_init
    return param
