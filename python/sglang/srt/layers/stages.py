"""The stage contract of a decoder layer: what executors run, one stage at a time.

A decoder layer (pre-norm, residual stream carried separately) is a fixed sequence of stages, each a
method ``layer.run_stage(name, state)`` that reads and updates a :class:`LayerState`:

==========================  ==============================================================================
``input_norm``              norm + comm: ``hidden, residual = norm(allreduce(hidden) + residual)`` (the first
                            layer only norms; its input, the embedding, is complete)
``attention``               QKV projection, RoPE, paged attention over the batch's KV, output projection
                            (a TP partial sum when the norms fuse the all-reduce)
``post_attention_norm``     norm + comm, as ``input_norm``
``mlp``                     dense MLP (partial sum) -- or, for MoE layers, the four stages below
``moe_route``               router logits and top-k: ``state.moe.topk_weights/topk_ids`` (+ shared expert input)
``moe_dispatch``            send each token to the workers owning its experts (local: no-op)
``moe_experts``             this worker's experts on the tokens it received
``moe_combine``             weighted sum back to token order (+ gated shared expert): ``state.hidden``
==========================  ==============================================================================

Executors (``sglang.srt.model_executor.executors``) iterate over :meth:`stage_names` and may run a
stage elsewhere -- the norm+comm stages on a communication stream (TokenWeave), dispatch/combine over
an M2N transport to remote FFN workers (MegaScale-Infer) -- without any change to model files. This
module imports nothing from the executors; model files import only this contract.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch

NORM_STAGES = ("input_norm", "post_attention_norm")
DENSE_STAGES = ("input_norm", "attention", "post_attention_norm", "mlp")
MOE_STAGES = ("moe_route", "moe_dispatch", "moe_experts", "moe_combine")


@dataclass
class MoeState:
    """Scratch of one MoE layer between its stages (all on the compute device).

    ``x``: [T, H] the tokens' normed hidden states; ``topk_weights`` [T, k] fp32; ``topk_ids`` [T, k]
    int64 (global expert ids); ``expert_out`` [T, H] this worker's weighted expert sum (a partial sum
    over workers/ranks); ``dispatched``: transport-specific data between dispatch and combine
    (None locally). With expert parallelism by all-to-all (``--moe-a2a-backend``) the routing tensors cover
    only the tokens this rank dispatches, ``dispatched`` is the dispatcher's
    :class:`~sglang.srt.layers.moe.token_dispatcher.base.DispatchHandle` and ``expert_out`` holds one row per
    received (token, slot) pair. ``dispatch_mode``: ``"normal"`` or ``"low_latency"`` (DeepEP's two modes, see
    :func:`moe_dispatch_mode`); set from the (sub-)batch when the layer state is made.
    """

    x: Optional[torch.Tensor] = None
    topk_weights: Optional[torch.Tensor] = None
    topk_ids: Optional[torch.Tensor] = None
    expert_out: Optional[torch.Tensor] = None
    dispatched: Any = None
    dispatch_mode: Optional[str] = None


def moe_dispatch_mode(forward_batch: Any) -> str:
    """The all-to-all mode of a batch's MoE layers: ``forward_batch.moe_dispatch_mode`` when set (a caller that must
    agree on the mode across ranks, e.g. DP attention, sets it), else ``"low_latency"`` for decode batches and
    ``"normal"`` for everything else (prefill, mixed, idle, or no batch). The dispatcher falls back to normal when
    a low-latency batch exceeds its token capacity (see :mod:`sglang.srt.layers.moe.ep_a2a`)."""
    explicit = getattr(forward_batch, "moe_dispatch_mode", None)
    if explicit is not None:
        return str(explicit)
    mode = getattr(forward_batch, "forward_mode", None)
    return "low_latency" if mode is not None and mode.is_decode() else "normal"


@dataclass
class LayerState:
    """What flows between the stages of one (sub-)batch: ``hidden`` [T, H], ``residual`` [T, H] or None
    before the first layer's input norm, ``positions`` [T] int64, the (sub-)``forward_batch``, and the
    MoE scratch. T is the (sub-)batch's token count; tensors live on the model's device."""

    hidden: torch.Tensor
    residual: Optional[torch.Tensor]
    positions: torch.Tensor
    forward_batch: Any
    moe: MoeState = field(default_factory=MoeState)

    def __post_init__(self) -> None:
        if self.moe.dispatch_mode is None:
            self.moe.dispatch_mode = moe_dispatch_mode(self.forward_batch)
