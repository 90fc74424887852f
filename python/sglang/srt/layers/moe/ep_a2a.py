"""Expert parallelism by all-to-all in the MoE block's stages: route -> dispatch -> experts -> combine.

When a worker's plan has a :class:`~sglang.srt.deployment.plan.MoeA2aSpec`, every
:class:`~sglang.srt.layers.moe.sparse_moe_block.SparseMoeBlock` gets an :class:`EpA2aMoe` (``block.a2a``; the
install is :func:`sglang.srt.expert_parallel.install.install_moe_a2a`, no model file changes) and its stages become:

* ``moe_route``: the router on the tokens this rank dispatches (its :class:`TokenScope` range);
* ``moe_dispatch``: :meth:`TokenDispatcher.dispatch` of those tokens, in the batch's mode
  (:func:`~sglang.srt.layers.stages.moe_dispatch_mode`; low-latency falls back to normal above its capacity);
* ``moe_experts``: the local experts on the received rows only (the fused-MoE kernel / its torch reference);
* ``moe_combine``: :meth:`TokenDispatcher.combine` back to token order, then the scope's assembly into the layer's
  ``[T, H]`` output (+ the shared expert and the all-reduce, as without all-to-all).

GShard's dispatch/combine (Lepikhin et al. 2020, sec. 3.2); DeepSeek-V3 (tech report, sec. 3.4) and DeepEP (2025)
for the separate prefill (normal) and decode (low-latency) modes.

Token scopes (how the attention layout meets the EP group; the ``dp-attention`` deployment picks the other one):

* :class:`TpSliceScope` (TP attention): after the post-attention norm every TP rank holds all T tokens, complete
  (the norm's all-reduce already reduced them: that all-reduce plays the reduce-scatter, each rank keeps its
  slice ``[T * r / tp, T * (r + 1) / tp)``). Each token is dispatched by exactly one rank. The layer output is the
  combined slice in place and zeros elsewhere, a partial sum over the TP group, so the next norm's all-reduce
  (or the block's own, when not fused) is the all-gather. No collective is added.
* :class:`LocalTokensScope` (DP attention): every rank dispatches all of its own tokens and gets them back
  complete; the output is not a partial sum.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from typing import Any

import torch

from sglang.srt.layers.moe.token_dispatcher.base import DispatchMode, TokenDispatcher
from sglang.srt.layers.stages import MoeState

logger = logging.getLogger(__name__)


class TokenScope(ABC):
    """Which of a layer's T tokens this rank dispatches and how the combined rows become the layer output."""

    name = "abstract"
    output_partial = False  # the layer output is a partial sum over the TP group (reduced after the block)
    same_count_everywhere = False  # every EP rank knows every rank's count from T alone (capacity fallback is safe)

    @abstractmethod
    def local_range(self, num_tokens: int) -> tuple[int, int]:
        """``(lo, hi)``: the rows of the layer's ``[T, H]`` input this rank dispatches."""

    @abstractmethod
    def max_local(self, num_tokens: int) -> int:
        """The most tokens any EP rank dispatches for a layer input of T tokens (known everywhere when
        :attr:`same_count_everywhere`; otherwise this rank's own count)."""

    @abstractmethod
    def assemble(self, local_out: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """The layer's routed-expert output ``[T, H]`` from this rank's combined rows ``[hi - lo, H]``."""


class TpSliceScope(TokenScope):
    """TP attention: rank r of ``tp`` dispatches rows ``[T * r // tp, T * (r + 1) // tp)``; the output is that
    slice in place, zeros elsewhere (a TP partial sum; module docstring)."""

    name = "tp_slice"
    output_partial = True
    same_count_everywhere = True

    def __init__(self, tp_rank: int, tp_size: int):
        if not 0 <= tp_rank < tp_size:
            raise ValueError(f"tp_rank={tp_rank} must be in [0, tp_size={tp_size})")
        self.tp_rank, self.tp_size = tp_rank, tp_size

    def local_range(self, num_tokens: int) -> tuple[int, int]:
        """This rank's contiguous share (sizes differ by at most one across ranks)."""
        return num_tokens * self.tp_rank // self.tp_size, num_tokens * (self.tp_rank + 1) // self.tp_size

    def max_local(self, num_tokens: int) -> int:
        """``ceil(T / tp)``."""
        return -(-num_tokens // self.tp_size)

    def assemble(self, local_out: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """Zeros ``[T, H]`` with this rank's slice filled in."""
        if self.tp_size == 1:
            return local_out
        lo, hi = self.local_range(num_tokens)
        out = torch.zeros(num_tokens, local_out.shape[1], dtype=local_out.dtype, device=local_out.device)
        out[lo:hi] = local_out
        return out


class LocalTokensScope(TokenScope):
    """DP attention: every rank dispatches all its own tokens; the output is complete (not a partial sum)."""

    name = "local"

    def local_range(self, num_tokens: int) -> tuple[int, int]:
        """All rows."""
        return 0, num_tokens

    def max_local(self, num_tokens: int) -> int:
        """This rank's own count (other ranks' counts are not known from T)."""
        return num_tokens

    def assemble(self, local_out: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """The combined rows themselves."""
        return local_out


def make_token_scope(name: str, tp_rank: int, tp_size: int) -> TokenScope:
    """The scope called ``name`` (``tp_slice`` | ``local``). Raises ValueError for another name."""
    if name == "tp_slice":
        return TpSliceScope(tp_rank, tp_size)
    if name == "local":
        return LocalTokensScope()
    raise ValueError(f"token scope {name!r}: choose tp_slice (TP attention) or local (DP attention)")


class EpA2aMoe:
    """The all-to-all stages of a :class:`SparseMoeBlock` (module docstring). One per block, all sharing one
    :class:`TokenDispatcher` (the rank's buffers) and one :class:`TokenScope`."""

    def __init__(self, dispatcher: TokenDispatcher, scope: TokenScope):
        self.dispatcher, self.scope = dispatcher, scope

    def resolve_mode(self, requested: Any, num_tokens: int) -> DispatchMode:
        """The mode of a layer input of ``num_tokens`` tokens: ``requested`` (None: normal), except low-latency above
        the dispatcher's capacity, which becomes normal when every rank can tell (TP slice) and raises ValueError
        otherwise (the caller must agree on the mode across ranks)."""
        mode = DispatchMode(requested or DispatchMode.NORMAL)
        cap = self.dispatcher.config.max_tokens_low_latency
        n = self.scope.max_local(num_tokens)
        if mode is DispatchMode.LOW_LATENCY and n > cap:
            if not self.scope.same_count_everywhere:
                raise ValueError(f"low-latency dispatch of {n} tokens exceeds the per-rank capacity {cap}; the "
                                 "caller must choose normal mode on every rank for this batch")
            return DispatchMode.NORMAL
        return mode

    # ---- stages (called by SparseMoeBlock) -------------------------------------------------------------------
    def route(self, block: Any, x: torch.Tensor, moe: MoeState) -> None:
        """``moe_route``: top-k of this rank's tokens (``moe.topk_*`` cover rows ``local_range(T)`` of x)."""
        moe.x = x
        lo, hi = self.scope.local_range(x.shape[0])
        xl = x[lo:hi]
        moe.topk_weights, moe.topk_ids = block.experts.route(block.gate(xl))

    def dispatch(self, block: Any, moe: MoeState) -> None:
        """``moe_dispatch``: send this rank's (token, slot) pairs; ``moe.dispatched`` = the handle."""
        t = moe.x.shape[0]
        lo, hi = self.scope.local_range(t)
        mode = self.resolve_mode(moe.dispatch_mode, t)
        moe.dispatched = self.dispatcher.dispatch(moe.x[lo:hi], moe.topk_ids, moe.topk_weights, mode)

    def run_experts(self, block: Any, moe: MoeState) -> None:
        """``moe_experts``: the local experts on the received rows (``moe.expert_out`` [R, H], unweighted)."""
        handle = moe.dispatched
        handle.wait()
        moe.expert_out = block.experts.compute_rows(handle.recv_x, handle.recv_expert_ids)

    def combine(self, block: Any, moe: MoeState) -> torch.Tensor:
        """``moe_combine`` (routed part): weighted rows back to token order, assembled to ``[T, H]``."""
        local = self.dispatcher.combine(moe.expert_out, moe.dispatched).wait()
        return self.scope.assemble(local, moe.x.shape[0])
