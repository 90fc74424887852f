"""FP8 linear layers: e4m3 weights with per-channel or block-wise float32 scales, loaded by the layer's shard rule.

Parameters :class:`Fp8LinearMethod` puts on a :class:`~sglang.srt.layers.linear.LinearBase` (replacing ``weight``):

* ``weight`` ``[out_local, in_local]`` float8_e4m3fn;
* per-channel schemes (``--quantization fp8``, per-tensor / per-channel checkpoints): ``weight_scale`` ``[out_local]``
  fp32. A per-tensor checkpoint scale of shard ``q`` fills that shard's rows, so a packed layer whose shards have
  different scales (q/k/v, gate/up) needs no re-quantization: the GEMM runs with one scale per row. With
  ``activation_scheme: static``, ``input_scale`` ``[1]`` fp32 holds the largest of the shards' ``input_scale`` s
  (they describe the same input);
* block-wise checkpoints: ``weight_scale_inv`` ``[ceil(out_local / R), ceil(in_local / block_k)]`` fp32 where
  ``R = block_n`` when every shard of the layer starts on a block boundary (the checkpoint's blocks, sliced along
  blocks under TP), else ``R = 1`` (each row keeps its block's scale: a packed layer whose shards are not multiples
  of ``block_n``, e.g. tiny models, at TP 1). A TP split that cuts a block is refused (it would need the activation
  groups of a row-parallel layer to straddle ranks).

Online quantization (``--quantization fp8`` on a model-dtype checkpoint) quantizes each checkpoint tensor in its
loader, on the layer's device, from the full rows (``amax`` over all input columns, also for row-parallel layers), so
the model-dtype weights are never held on the device and every TP rank has the scales of the unsharded weight.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch
from torch import nn

from sglang.srt.layers.linear import copy_checked, materialize
from sglang.srt.layers.quantization import fp8_ops
from sglang.srt.layers.quantization.base import LinearMethodBase, set_loader
from sglang.srt.layers.quantization.fp8_ref import FP8_DTYPE, FP8_MAX, quant_weight_per_channel, quantize_with_scale

logger = logging.getLogger(__name__)

DUMMY_RANGE = 1e-3  # as sglang.srt.model_loader.loader.DUMMY_RANGE: dummy FP8 weights dequantize into +-1e-3
DUMMY_INPUT_SCALE = 4.0 / FP8_MAX  # static activation scale of dummy weights (RMS-normed activations up to ~4)


def as_stored(loaded: Any) -> Any:
    """``loaded`` in its checkpoint dtype: a lazy checkpoint tensor read without the cast to the model dtype (FP8
    weights and their float32 / bf16 scales must not be rounded to bf16), a tensor as is."""
    stored = getattr(loaded, "stored", None)
    return stored() if callable(stored) else loaded


def fill_dummy_fp8(param: torch.Tensor, gen: torch.Generator, chunk_elems: int = 1 << 26) -> None:
    """Fill an e4m3 ``param`` with uniform values in [-448, 448] (rounded to e4m3) from ``gen``, a slab of dim 0 at a
    time (at most ``chunk_elems`` float32 temporaries)."""
    rows = max(1, chunk_elems // max(1, param[0].numel() if param.dim() else 1))
    with torch.no_grad():
        for start in range(0, param.shape[0], rows):
            part = param[start: start + rows]
            tmp = torch.empty(part.shape, dtype=torch.float32, device=param.device)
            tmp.uniform_(-FP8_MAX, FP8_MAX, generator=gen)
            part.copy_(tmp.to(FP8_DTYPE))


def numel(t: Any) -> int:
    """Element count of a tensor or a lazy checkpoint tensor (from its shape)."""
    return int(torch.Size(t.shape).numel())


def _fill(value: float):
    def init(param: torch.Tensor, gen: torch.Generator) -> None:
        with torch.no_grad():
            param.fill_(value)
    return init


def block_rows_per_scale(specs: list, out_local: int, block_n: int, tp_size: int, what: str) -> int:
    """``block_n`` when every shard spec starts on a block boundary of its checkpoint tensor and of the local weight
    (and ends on one, or at both tensors' ends), else 1 (scales expanded per row). Raises ValueError when ``tp_size >
    1`` and a shard's rows cut a block (naming the fix)."""
    aligned = all(s.dst_row % block_n == 0 and s.src_row % block_n == 0
                  and (s.rows % block_n == 0 or (s.src_row + s.rows == s.full_rows and s.dst_row + s.rows == out_local))
                  for s in specs)
    if not aligned and tp_size > 1:
        cut = next(s for s in specs if s.src_row % block_n or (s.rows % block_n and s.src_row + s.rows != s.full_rows))
        raise ValueError(f"{what}: tensor parallelism gives this rank {cut.rows} of the {cut.full_rows} output rows "
                         f"(from row {cut.src_row}), which cuts the checkpoint's {block_n}-row FP8 weight blocks; use "
                         f"a --tp-size that keeps every rank's share a multiple of {block_n} rows (for MoE experts "
                         "--ep-size splits experts instead of their rows)")
    return block_n if aligned else 1


def check_block_cols(spec, block_k: int, what: str) -> None:
    """Raise ValueError (naming the fix) when a row-parallel shard's input columns cut a ``block_k``-column block."""
    if spec.src_col % block_k or (spec.cols % block_k and spec.src_col + spec.cols != spec.full_cols):
        raise ValueError(f"{what}: tensor parallelism gives this rank input columns [{spec.src_col}, "
                         f"{spec.src_col + spec.cols}) of {spec.full_cols}, which cuts the checkpoint's "
                         f"{block_k}-column FP8 weight blocks; use a --tp-size that keeps every rank's share a multiple "
                         f"of {block_k}")


def load_block_scale(dst: torch.Tensor, loaded: Any, spec, block: tuple[int, int], rows_per_scale: int,
                     what: str) -> None:
    """Copy the part of a checkpoint block scale ``[ceil(full_rows / bn), ceil(full_cols / bk)]`` covering ``spec``
    into ``dst`` (the local scale rows of ``spec``'s output rows: block rows when ``rows_per_scale == bn``, one row per
    output row when 1). Raises ValueError on a wrong shape or a cut block."""
    bn, bk = block
    want = (-(-spec.full_rows // bn), -(-spec.full_cols // bk))
    t = as_stored(loaded)
    if tuple(t.shape) != want:
        raise ValueError(f"{what} weight_scale_inv: shape {tuple(t.shape)} != {want} (blocks of the "
                         f"[{spec.full_rows}, {spec.full_cols}] weight with weight_block_size [{bn}, {bk}])")
    check_block_cols(spec, bk, what)
    c0, c1 = spec.src_col // bk, -(-(spec.src_col + spec.cols) // bk)
    r0, r1 = spec.src_row // bn, -(-(spec.src_row + spec.rows) // bn)
    part = materialize(t.narrow(0, r0, r1 - r0)).float()[:, c0:c1]
    if rows_per_scale == 1:
        part = part.repeat_interleave(bn, 0)[spec.src_row - r0 * bn: spec.src_row - r0 * bn + spec.rows]
        copy_checked(dst.narrow(0, spec.dst_row, spec.rows), part, what + " weight_scale_inv")
    else:
        copy_checked(dst.narrow(0, spec.dst_row // bn, r1 - r0), part, what + " weight_scale_inv")


def load_channel_scale(dst: torch.Tensor, loaded: Any, spec, what: str) -> None:
    """Fill the rows of ``spec`` in a per-channel scale ``dst`` from a checkpoint ``weight_scale``: one value (per
    tensor) or one per output row (``[full_rows]`` / ``[full_rows, 1]``). Raises ValueError on another shape."""
    t = as_stored(loaded)
    if numel(t) == 1:
        val = materialize(t).float().reshape(())
        with torch.no_grad():
            dst.narrow(0, spec.dst_row, spec.rows).fill_(val.item())
        return
    if numel(t) != spec.full_rows or (t.dim() == 2 and t.shape[1] != 1) or t.dim() > 2:
        raise ValueError(f"{what} weight_scale: shape {tuple(t.shape)} is neither one value nor one per output row "
                         f"({spec.full_rows})")
    rows = spec.take_rows(t if t.dim() == 1 else t.narrow(1, 0, 1), what)
    copy_checked(dst.narrow(0, spec.dst_row, spec.rows), materialize(rows).float().reshape(-1), what + " weight_scale")


def load_fp8_weight(dst: torch.Tensor, loaded: Any, spec, what: str) -> None:
    """Copy the checkpoint's e4m3 weight block of ``spec`` into ``dst`` rows (no re-quantization). Raises ValueError
    when the checkpoint tensor is not e4m3 (a layer it kept in bf16 must be listed in ``ignored_layers``)."""
    t = as_stored(loaded)
    src = materialize(spec.take(t, what))
    if src.dtype != FP8_DTYPE:
        raise ValueError(f"{what}: the checkpoint weight is {src.dtype}, but quantization_config makes this layer FP8 "
                         "(float8_e4m3fn); list the module in quantization_config.ignored_layers if it is meant to "
                         "stay unquantized")
    copy_checked(dst.narrow(0, spec.dst_row, spec.rows), src, what)


def quantize_rows_into(dst_w: torch.Tensor, dst_s: torch.Tensor, loaded: Any, spec, what: str) -> None:
    """Online quantization of one checkpoint tensor: its rows of ``spec`` over all input columns moved to
    ``dst_w``'s device, per-row scales ``amax / 448``, this rank's columns quantized into ``dst_w`` rows and the scales
    into ``dst_s`` rows."""
    rows = materialize(spec.take_rows(loaded, what)).to(dst_w.device)
    if rows.dim() != 2 or rows.shape[1] != spec.full_cols:
        raise ValueError(f"{what}: loaded rows {tuple(rows.shape)} have no dim 1 of size {spec.full_cols}")
    _, s = quant_weight_per_channel(rows)
    q = quantize_with_scale(spec.take_cols(rows, what), s.unsqueeze(-1))
    copy_checked(dst_w.narrow(0, spec.dst_row, spec.rows), q, what)
    copy_checked(dst_s.narrow(0, spec.dst_row, spec.rows), s, what + " scale")


class Fp8LinearMethod(LinearMethodBase):
    """FP8 weights for one linear layer (module docstring); ``config``: the :class:`~.fp8_config.Fp8Config`."""

    def __init__(self, config):
        self.config = config
        self.block: Optional[tuple[int, int]] = config.weight_block_size if config.checkpoint_fp8 else None
        self.static = config.checkpoint_fp8 and config.activation_scheme == "static"
        self.rows_per_scale = 1

    def _specs(self, layer: nn.Module) -> list:
        return [layer.shard_spec(s) for s in layer.weight.expected_shards]

    def create_weights(self, layer: nn.Module) -> None:
        """Replace ``layer.weight`` by the e4m3 weight and add the scale parameters (module docstring). Raises
        ValueError when a TP split cuts the checkpoint's weight blocks."""
        shards = tuple(layer.weight.expected_shards)
        specs = self._specs(layer)
        out, inp = layer.out_local, layer.in_local
        name = type(layer).__name__
        fp8_ckpt = self.config.checkpoint_fp8
        del layer.weight
        w = nn.Parameter(torch.empty(out, inp, dtype=FP8_DTYPE), requires_grad=False)
        layer.register_parameter("weight", set_loader(w, self._load_weight(layer, fp8_ckpt), shards, fill_dummy_fp8))
        if self.block is not None:
            bn, bk = self.block
            for s in specs:
                if layer.tp_size > 1:
                    check_block_cols(s, bk, name)
            self.rows_per_scale = block_rows_per_scale(specs, out, bn, layer.tp_size, name)
            s = nn.Parameter(torch.empty(-(-out // self.rows_per_scale), -(-inp // bk), dtype=torch.float32),
                             requires_grad=False)
            layer.register_parameter("weight_scale_inv", set_loader(s, self._load_block_scale(layer), shards,
                                                                    _fill(DUMMY_RANGE / FP8_MAX)))
        else:
            s = nn.Parameter(torch.empty(out, dtype=torch.float32), requires_grad=False)
            layer.register_parameter("weight_scale", set_loader(s, self._load_scale(layer), shards if fp8_ckpt else (),
                                                                _fill(DUMMY_RANGE / FP8_MAX)))
        if fp8_ckpt and self.block is None:  # per-tensor checkpoints may carry input_scale (used when static)
            a = nn.Parameter(torch.empty(1, dtype=torch.float32), requires_grad=False)
            layer.register_parameter("input_scale", set_loader(a, self._load_input_scale(layer),
                                                               shards if self.static else (),
                                                               _fill(DUMMY_INPUT_SCALE)))
            layer._fp8_input_scales = {}

    # ---- loaders (each: (param, loaded full tensor, shard_id=None), as the layer's own) ---------------------------
    def _split(self, layer, loader, param, loaded, shard_id) -> bool:
        if shard_id is None:
            parts = layer.split_packed(as_stored(loaded) if self.config.checkpoint_fp8 else loaded)
            if parts is not None:
                for sid, part in parts:
                    loader(param, part, sid)
                return True
        return False

    def _load_weight(self, layer, fp8_ckpt: bool):
        def load(param, loaded, shard_id=None):
            if self._split(layer, load, param, loaded, shard_id):
                return
            spec, what = layer.shard_spec(shard_id), layer._name(shard_id)
            if fp8_ckpt:
                load_fp8_weight(param, loaded, spec, what)
            else:
                quantize_rows_into(param, layer.weight_scale, loaded, spec, what)
        return load

    def _load_scale(self, layer):
        def load(param, loaded, shard_id=None):
            if shard_id is None and len(layer.weight.expected_shards) > 1:  # one scale for a packed tensor
                for sid in layer.weight.expected_shards:
                    load(param, loaded, sid)
                return
            load_channel_scale(param, loaded, layer.shard_spec(shard_id), layer._name(shard_id))
        return load

    def _load_block_scale(self, layer):
        def load(param, loaded, shard_id=None):
            if shard_id is None and len(layer.weight.expected_shards) > 1:
                raise ValueError(f"{type(layer).__name__}: a packed weight_scale_inv is not supported; the checkpoint "
                                 "should hold one per projection")
            load_block_scale(param, loaded, layer.shard_spec(shard_id), self.block, self.rows_per_scale,
                             layer._name(shard_id))
        return load

    def _load_input_scale(self, layer):
        def load(param, loaded, shard_id=None):
            t = materialize(as_stored(loaded)).float()
            if t.numel() != 1 or not torch.isfinite(t).all() or float(t.reshape(())) <= 0:
                raise ValueError(f"{layer._name(shard_id)} input_scale: need one positive value, got shape "
                                 f"{tuple(t.shape)}")
            layer._fp8_input_scales[shard_id] = float(t.reshape(()))
            with torch.no_grad():
                param.fill_(max(layer._fp8_input_scales.values()))
        return load

    # ---- forward ---------------------------------------------------------------------------------------------
    def apply(self, layer: nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        """x ``[..., in_local]`` -> ``[..., out_local]`` in x's dtype (see :mod:`.fp8_ops` for the kernels)."""
        if self.block is not None:
            return fp8_ops.linear_block(x, layer.weight, layer.weight_scale_inv, self.block, self.rows_per_scale, bias)
        return fp8_ops.linear_per_channel(x, layer.weight, layer.weight_scale, bias,
                                          layer.input_scale if self.static else None,
                                          getattr(layer, "decode_gemm", None))

    def decode_gemm_operands(self, layer: nn.Module) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """Per-channel schemes: ``(weight, weight_scale)`` for the weight-streaming decode kernel; block-wise: None."""
        return None if self.block is not None else (layer.weight, layer.weight_scale)
