"""Decode epilogue fusions, host side: which layers may use them, the deferred split-K sum, references.

Switch: ``SGLANG_DECODE_FUSE_EPILOGUE=1`` (default OFF until a same-run GPU A/B shows a win; read once when the
decode-GEMM table is tuned, :func:`sglang.srt.layers.decode_gemm.maybe_autotune`, and carried by the table, so a
CUDA graph keeps what it captured). With it on and the table picking the skinny GEMM for a (shape, batch bucket):

* a row-parallel projection whose output feeds a fused add + RMSNorm (o_proj -> post_attention_layernorm, down_proj
  -> the next layer's input_layernorm or the final norm) and whose config has split-K > 1 returns a
  :class:`SplitKPartials` instead of a tensor; :class:`~sglang.srt.layers.layernorm.RMSNorm` sums it inside the
  norm kernel (:func:`sgl_kernel.triton.decode_fuse.splitk_add_rmsnorm`): one kernel less per projection, and the
  residual stream bit-identical to the unfused path;
* the dense MLP's gate_up projection runs the skinny GEMM with SiLU-and-mul in its epilogue
  (:func:`sgl_kernel.triton.decode_fuse.skinny_gemm_silu`): one kernel and the ``[M, 2I]`` round trip less.

Where: only in the Llama-family decoder (:class:`~sglang.srt.models.llama.LlamaModel` and its layers with their own
``forward``, so Qwen2/3 and the MoE models' attention too), with one rank (no TP partial sums: those norms reduce
across ranks) and no communicating norm; the CUDA-graph runner enables it only for the sequential executor (a
sub-batch or AFD executor would slice or ship the projection output). :func:`mark_model` is the one place that
decides and sets the per-module flags; the table decides per (shape, bucket) whether the skinny kernel runs at all.
Technique: GEMM epilogue fusion (see :mod:`sgl_kernel.triton.decode_fuse`).
"""

from __future__ import annotations

import logging
import os
from typing import Optional, Set, Tuple

import torch
import torch.nn.functional as F

from sglang.srt.ops_ref import SplitKPartials, silu_and_mul_ref, splitk_add_rmsnorm_ref

__all__ = ["FUSE_ENV", "SplitKPartials", "fuse_enabled", "gate_up_silu_ref", "mark_model", "splitk_add_rmsnorm_ref"]

logger = logging.getLogger(__name__)

FUSE_ENV = "SGLANG_DECODE_FUSE_EPILOGUE"
Shape = Tuple[int, int, str]  # (N, K, dtype name), as sglang.srt.layers.decode_gemm


def fuse_enabled() -> bool:
    """``SGLANG_DECODE_FUSE_EPILOGUE`` is set to anything but ``""`` / ``0`` (default off).

    Raises:
        ValueError: a value other than ``0``, ``1`` or empty (names the variable and the allowed values).
    """
    raw = os.environ.get(FUSE_ENV, "0").strip()
    if raw not in ("", "0", "1"):
        raise ValueError(f"{FUSE_ENV}={raw!r}: use 0 (off, the default) or 1 (fused decode epilogues)")
    return raw == "1"


def gate_up_silu_ref(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Torch reference of the gate_up GEMM with SiLU-and-mul: ``silu_and_mul_ref(F.linear(x, w, bias))``; x
    ``[M, K]``, w ``[2I, K]`` -> ``[M, I]`` in x's dtype."""
    return silu_and_mul_ref(F.linear(x, w, bias))


def _plain_forward(mod: torch.nn.Module, base: type) -> bool:
    return isinstance(mod, base) and type(mod).forward is base.forward


def _norm_ok(norm: torch.nn.Module) -> bool:
    return getattr(norm, "comm", None) is None and getattr(norm, "sequence_parallel", None) is None


def mark_model(model: torch.nn.Module, on: bool) -> Tuple[Set[Shape], Set[Shape]]:
    """Set (``on``) or clear the fusion flags of ``model``'s Llama-family layers; returns the weight shapes
    ``(deferred, gated)`` that got a flag: ``deferred`` the row-parallel projections feeding a fused add + RMSNorm
    (``RowParallelLinear.defer_splitk_reduce``), ``gated`` the dense MLPs' gate_up projections
    (``DenseMLP.fuse_gate_silu``). A model of another structure, TP > 1 or a communicating norm gets no flag."""
    from sglang.srt.layers.linear import RowParallelLinear
    from sglang.srt.layers.moe.sparse_moe_block import DenseMLP
    from sglang.srt.models.llama import LlamaDecoderLayer, LlamaModel

    for mod in model.modules():  # clear first: a table without fusion (or None) leaves no flag behind
        if isinstance(mod, RowParallelLinear):
            mod.defer_splitk_reduce = False
        if isinstance(mod, DenseMLP):
            mod.fuse_gate_silu = False
    deferred: Set[Shape] = set()
    gated: Set[Shape] = set()
    if not on:
        return deferred, gated

    def shape(lin) -> Shape:
        w = lin.weight
        return (w.shape[0], w.shape[1], str(w.dtype).replace("torch.", ""))

    def defer(lin) -> None:  # quantized layers run their method's GEMM (no split-K partials to hand over)
        if isinstance(lin, RowParallelLinear) and lin.tp_size == 1 and lin.quant_method is None:
            lin.defer_splitk_reduce = True
            deferred.add(shape(lin))

    for lm in model.modules():
        if not _plain_forward(lm, LlamaModel) or not _norm_ok(lm.norm):
            continue
        for layer in lm.layers:
            if not _plain_forward(layer, LlamaDecoderLayer) or not _norm_ok(layer.input_layernorm) \
                    or not _norm_ok(layer.post_attention_layernorm):
                continue
            defer(layer.self_attn.o_proj)  # -> post_attention_layernorm(hidden, residual)
            mlp = layer.mlp
            if _plain_forward(mlp, DenseMLP) and mlp.gate_up_proj.tp_size == 1 \
                    and mlp.gate_up_proj.quant_method is None:
                defer(mlp.down_proj)  # -> the next input_layernorm or the final norm, both with the residual
                mlp.fuse_gate_silu = True
                gated.add(shape(mlp.gate_up_proj))
    return deferred, gated


def kernels_saved(model: torch.nn.Module, table, m: int) -> int:
    """Kernels one forward of ``m`` rows launches fewer with ``table`` installed on ``model`` (its fusion flags set
    by :func:`mark_model`) than unfused: one split-K reduce per deferred projection whose config at ``m`` rows has
    more than one non-empty split, one SiLU-and-mul per fused gate_up with a config at ``m``. CPU-checkable (host
    arithmetic only); the GPU A/B compares it with the CUDA graphs' node counts."""
    from sgl_kernel.triton.skinny_gemm import split_plan
    from sglang.srt.layers.linear import RowParallelLinear
    from sglang.srt.layers.moe.sparse_moe_block import DenseMLP

    if table is None:
        return 0
    saved = 0
    for mod in model.modules():
        if isinstance(mod, RowParallelLinear) and mod.defer_splitk_reduce:
            w = mod.weight
            cfg = table.lookup(w.shape[0], w.shape[1], w.dtype, m)
            saved += cfg is not None and split_plan(w.shape[1], cfg.block_k, cfg.split_k)[2] > 1
        elif isinstance(mod, DenseMLP) and mod.fuse_gate_silu:
            w = mod.gate_up_proj.weight
            cfg = table.lookup(w.shape[0], w.shape[1], w.dtype, m)
            saved += cfg is not None and cfg.split_k == 1
    return int(saved)
