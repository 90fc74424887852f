"""FP8 experts: e4m3 ``w13`` / ``w2`` with per-expert scales, loaded by :meth:`FusedMoE.expert_spec`.

Parameters :class:`Fp8MoEMethod` puts on a :class:`~sglang.srt.layers.moe.fused_moe.FusedMoE` (replacing the
model-dtype ones; ``E`` = this rank's experts, ``n`` = its share of the intermediate size ``I``):

* ``w13_weight`` ``[E, 2n, H]`` and ``w2_weight`` ``[E, H, n]`` float8_e4m3fn;
* per-channel schemes: ``w13_weight_scale`` ``[E, 2n]`` and ``w2_weight_scale`` ``[E, H]`` fp32 (a per-tensor
  checkpoint's gate / up / down scales fill their rows: no re-quantization); ``activation_scheme: static``:
  ``w13_input_scale`` / ``w2_input_scale`` ``[1]``, the largest over all experts (every EP / TP rank reads every
  expert's scale, so all ranks quantize activations alike);
* block-wise: ``w13_weight_scale_inv`` ``[E, ceil(2n / R), ceil(H / block_k)]`` and ``w2_weight_scale_inv``
  ``[E, ceil(H / block_n), ceil(n / block_k)]`` (``R`` as in :mod:`.fp8_linear`: ``block_n``, or 1 where ``n`` is not a
  multiple of it at TP 1).

HF names: ``experts.{e}.{gate,up,down}_proj.{weight,weight_scale,weight_scale_inv,input_scale}`` (Mixtral: ``w1`` /
``w3`` / ``w2``), mapped by the model's expert name table. The experts run
:func:`sglang.srt.layers.quantization.fp8_ops.fused_moe_fp8` (W8A8 grouped GEMMs on CUDA, the emulating reference on
CPU).
"""

from __future__ import annotations

import logging
from typing import Optional

import torch
from torch import nn

from sglang.srt.layers.quantization import fp8_ops
from sglang.srt.layers.quantization.base import MoEMethodBase, set_loader
from sglang.srt.layers.quantization.fp8_linear import (DUMMY_INPUT_SCALE, DUMMY_RANGE, _fill, as_stored,
                                                       block_rows_per_scale, check_block_cols, fill_dummy_fp8,
                                                       load_block_scale, load_channel_scale, load_fp8_weight,
                                                       quantize_rows_into)
from sglang.srt.layers.linear import materialize
from sglang.srt.layers.quantization.fp8_ref import FP8_DTYPE, FP8_MAX

logger = logging.getLogger(__name__)


class Fp8MoEMethod(MoEMethodBase):
    """FP8 experts of one MoE layer (module docstring); ``config``: the :class:`~.fp8_config.Fp8Config`."""

    def __init__(self, config):
        self.config = config
        self.block: Optional[tuple[int, int]] = config.weight_block_size if config.checkpoint_fp8 else None
        self.static = config.checkpoint_fp8 and config.activation_scheme == "static"
        self.rows_per_scale = {"w13": 1, "w2": 1}

    def create_weights(self, layer: nn.Module) -> None:
        """Replace the experts' weights by e4m3 ones and add their scales (module docstring). Raises ValueError when
        a TP split cuts the checkpoint's weight blocks."""
        e, n, h = layer.num_local_experts, layer.i_local, layer.hidden_size
        ckpt = self.config.checkpoint_fp8
        local = range(layer.expert_start, layer.expert_start + e)
        shards = {"w13": ("w1", "w3"), "w2": ("w2",)}
        shapes = {"w13": (2 * n, h), "w2": (h, n)}
        for kind in ("w13", "w2"):
            expected = tuple((x, s) for x in local for s in shards[kind])
            delattr(layer, f"{kind}_weight")
            w = nn.Parameter(torch.empty(e, *shapes[kind], dtype=FP8_DTYPE), requires_grad=False)
            layer.register_parameter(f"{kind}_weight", set_loader(w, self._load_weight(layer, kind), expected,
                                                                   fill_dummy_fp8))
            rows, cols = shapes[kind]
            if self.block is not None:
                bn, bk = self.block
                specs = [layer.expert_spec(s, layer.expert_start)[1] for s in shards[kind]]
                what = f"FusedMoE {kind}"
                if layer.moe_tp_size > 1:
                    for s in specs:
                        check_block_cols(s, bk, what)
                r = block_rows_per_scale(specs, rows, bn, layer.moe_tp_size, what)
                self.rows_per_scale[kind] = r
                s = nn.Parameter(torch.empty(e, -(-rows // r), -(-cols // bk), dtype=torch.float32),
                                 requires_grad=False)
                layer.register_parameter(f"{kind}_weight_scale_inv", set_loader(
                    s, self._load_scale(layer, kind), expected, _fill(DUMMY_RANGE / FP8_MAX)))
            else:
                s = nn.Parameter(torch.empty(e, rows, dtype=torch.float32), requires_grad=False)
                layer.register_parameter(f"{kind}_weight_scale", set_loader(
                    s, self._load_scale(layer, kind), expected if ckpt else (), _fill(DUMMY_RANGE / FP8_MAX)))
            if ckpt and self.block is None:
                every = tuple((x, s) for x in range(layer.num_experts) for s in shards[kind])
                a = nn.Parameter(torch.empty(1, dtype=torch.float32), requires_grad=False)
                layer.register_parameter(f"{kind}_input_scale", set_loader(
                    a, self._load_input_scale(layer, kind), every if self.static else (), _fill(DUMMY_INPUT_SCALE)))
        layer._fp8_input_scales = {"w13": {}, "w2": {}}

    # ---- loaders: (param, loaded, shard_id, expert_id), as FusedMoE.weight_loader ---------------------------------
    def _load_weight(self, layer, kind: str):
        def load(param, loaded, shard_id, expert_id):
            where = layer.expert_spec(shard_id, expert_id)
            if where is None:
                return  # another EP rank's expert: not read
            i, spec = where
            what = f"FusedMoE expert {expert_id} {shard_id}"
            if self.config.checkpoint_fp8:
                load_fp8_weight(param[i], loaded, spec, what)
            else:
                quantize_rows_into(param[i], getattr(layer, f"{kind}_weight_scale")[i], loaded, spec, what)
        return load

    def _load_scale(self, layer, kind: str):
        def load(param, loaded, shard_id, expert_id):
            where = layer.expert_spec(shard_id, expert_id)
            if where is None:
                return
            i, spec = where
            what = f"FusedMoE expert {expert_id} {shard_id}"
            if self.block is not None:
                load_block_scale(param[i], loaded, spec, self.block, self.rows_per_scale[kind], what)
            else:
                load_channel_scale(param[i], loaded, spec, what)
        return load

    def _load_input_scale(self, layer, kind: str):
        def load(param, loaded, shard_id, expert_id):
            layer.expert_spec(shard_id, expert_id)  # validates ids (other ranks' experts count too)
            t = materialize(as_stored(loaded)).float()
            if t.numel() != 1 or not torch.isfinite(t).all() or float(t.reshape(())) <= 0:
                raise ValueError(f"FusedMoE expert {expert_id} {shard_id} input_scale: need one positive value, got "
                                 f"shape {tuple(t.shape)}")
            layer._fp8_input_scales[kind][(expert_id, shard_id)] = float(t.reshape(()))
            with torch.no_grad():
                param.fill_(max(layer._fp8_input_scales[kind].values()))
        return load

    # ---- forward ---------------------------------------------------------------------------------------------
    def apply(self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        """This rank's FP8 experts (see :func:`sglang.srt.layers.quantization.fp8_ops.fused_moe_fp8`)."""
        if self.block is not None:
            return fp8_ops.fused_moe_fp8(x, layer.w13_weight, layer.w13_weight_scale_inv, layer.w2_weight,
                                         layer.w2_weight_scale_inv, topk_weights, topk_ids, self.block,
                                         self.rows_per_scale["w13"], self.rows_per_scale["w2"])
        return fp8_ops.fused_moe_fp8(x, layer.w13_weight, layer.w13_weight_scale, layer.w2_weight,
                                     layer.w2_weight_scale, topk_weights, topk_ids, None, 1, 1,
                                     layer.w13_input_scale if self.static else None,
                                     layer.w2_input_scale if self.static else None)
