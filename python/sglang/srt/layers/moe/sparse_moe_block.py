"""The sparse MoE block of Mixtral / Qwen-MoE decoders, as four stages (route, dispatch, experts,
combine) that executors can run apart (see :mod:`sglang.srt.layers.stages`).

Routing follows Shazeer et al. 2017 (sec. 2.1, eq. 1) with Mixtral's renormalized top-k (Jiang et al.
2024, sec. 2.1); Qwen2-MoE adds a shared expert gated by ``sigmoid(shared_expert_gate(x))``
(Qwen2 Technical Report, sec. 2.2.2).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from sglang.srt.layers.activation import SiluAndMul
from sglang.srt.layers.linear import MergedColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from sglang.srt.layers.moe.fused_moe import FusedMoE
from sglang.srt.layers.stages import MoeState, moe_dispatch_mode


class DenseMLP(nn.Module):
    """SwiGLU MLP: ``down(silu(gate(x)) * up(x))``, x ``[N, H]`` -> ``[N, H]``.

    Raises ValueError for a ``hidden_act`` other than "silu".
    """

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False, hidden_act: str = "silu",
                 params_dtype: Optional[torch.dtype] = None, tp_rank: int = 0, tp_size: int = 1, comm: Any = None,
                 reduce_results: bool = True):
        super().__init__()
        if hidden_act != "silu":
            raise ValueError(f"hidden_act={hidden_act!r} is not supported; only 'silu'")
        tp = dict(params_dtype=params_dtype, tp_rank=tp_rank, tp_size=tp_size)
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias=bias, **tp)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias, comm=comm,
                                           reduce_results=reduce_results, **tp)
        self.act_fn = SiluAndMul()
        # epilogue fusion (SGLANG_DECODE_FUSE_EPILOGUE): set by sglang.srt.layers.decode_fuse.mark_model; where the
        # gate_up layer's decode-GEMM table picks the skinny kernel, SiLU-and-mul runs in its epilogue
        self.fuse_gate_silu = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x ``[N, H]`` -> ``[N, H]`` (a partial sum over TP ranks when ``reduce_results`` is False; with the epilogue
        fusion flags possibly a :class:`~sglang.srt.layers.decode_fuse.SplitKPartials`)."""
        gu = self.gate_up_proj
        if self.fuse_gate_silu and gu.decode_gemm is not None and gu.sequence_parallel is None:
            from sglang.srt.layers import ops

            act = ops.gate_up_silu(x, gu.weight, gu.bias, gu.decode_gemm)
            if act is not None:
                return self.down_proj(act)
        return self.down_proj(self.act_fn(gu(x)))


class SparseMoeBlock(nn.Module):
    """Router (``gate``: [E, H]) + :class:`FusedMoE` ``experts`` (+ optional ``shared_expert``).

    ``forward(x [N, H], forward_batch=None) -> [N, H]`` = ``combine(experts(dispatch(route(x))))``: the routed
    experts' weighted sum plus, when a shared expert exists, ``sigmoid(shared_expert_gate(x)) * shared_expert(x)``.
    With ``reduce_results=False`` both terms are TP partial sums (the gate scale is replicated, so the sum
    stays linear) and the following norm reduces them.

    ``a2a``: None (the all-reduce expert parallelism of :class:`FusedMoE`), or an
    :class:`~sglang.srt.layers.moe.ep_a2a.EpA2aMoe` installed on the built model when the plan asks for expert
    parallelism by all-to-all; the route/dispatch/experts/combine stages then move tokens between EP ranks.
    """

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int, renormalize: bool,
                 params_dtype: Optional[torch.dtype], shared_intermediate_size: int = 0, hidden_act: str = "silu",
                 tp_rank: int = 0, tp_size: int = 1, comm: Any = None, reduce_results: bool = True,
                 ep_size: int = 1):
        super().__init__()
        self.gate = ReplicatedLinear(hidden_size, num_experts, bias=False, params_dtype=params_dtype)
        self.experts = FusedMoE(num_experts, top_k, hidden_size, intermediate_size, renormalize, params_dtype,
                                tp_rank, tp_size, comm=comm, reduce_results=False, ep_size=ep_size)
        self.tp_size, self.comm, self.reduce_results = tp_size, comm, reduce_results
        self.shared_expert = self.shared_expert_gate = None
        if shared_intermediate_size > 0:
            self.shared_expert = DenseMLP(hidden_size, shared_intermediate_size, False, hidden_act, params_dtype,
                                          tp_rank, tp_size, comm, reduce_results=False)
            self.shared_expert_gate = ReplicatedLinear(hidden_size, 1, bias=False, params_dtype=params_dtype)
        self.a2a = None  # EpA2aMoe when expert parallelism runs by all-to-all (sglang.srt.expert_parallel.install)

    # ---- stages ------------------------------------------------------------------------------------------
    def route(self, x: torch.Tensor, moe: MoeState) -> None:
        """Stage ``moe_route``: x ``[T, H]`` -> ``moe.topk_weights`` [T, k] fp32, ``moe.topk_ids`` [T, k] int64."""
        if self.a2a is not None:  # only the tokens this rank dispatches
            self.a2a.route(self, x, moe)
            return
        moe.x = x
        moe.topk_weights, moe.topk_ids = self.experts.route(self.gate(x))

    def dispatch(self, moe: MoeState) -> None:
        """Stage ``moe_dispatch``: every expert is local, so nothing moves (remote executors replace it); with
        ``a2a``, the all-to-all dispatch (``moe.dispatched`` = its handle)."""
        if self.a2a is not None:
            self.a2a.dispatch(self, moe)
            return
        moe.dispatched = None

    def run_experts(self, moe: MoeState) -> None:
        """Stage ``moe_experts``: ``moe.expert_out`` [T, H] = this rank's experts' weighted sum (a TP partial sum);
        with ``a2a``, the local experts on the received rows (``[R, H]``, unweighted)."""
        if self.a2a is not None:
            self.a2a.run_experts(self, moe)
            return
        moe.expert_out = self.experts.compute(moe.x, moe.topk_weights, moe.topk_ids)

    def combine(self, moe: MoeState) -> torch.Tensor:
        """Stage ``moe_combine``: expert output (+ gated shared expert), all-reduced when ``reduce_results`` (with
        ``a2a``: the combined rows in token order, all-reduced only when the token scope leaves TP partial sums);
        returns ``[T, H]`` and clears the scratch."""
        if self.a2a is not None:
            out = self.a2a.combine(self, moe)
            partial = self.a2a.scope.output_partial
        else:
            out, partial = moe.expert_out, True
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(moe.x)) * self.shared_expert(moe.x)
        if self.tp_size > 1 and self.reduce_results and partial:
            if self.comm is None:
                raise ValueError("SparseMoeBlock with tp_size > 1 needs a comm object to all-reduce its output")
            out = self.comm.all_reduce(out)
        moe.x = moe.topk_weights = moe.topk_ids = moe.expert_out = moe.dispatched = None
        return out

    def forward(self, x: torch.Tensor, forward_batch: Any = None) -> torch.Tensor:
        """x ``[N, H]`` -> ``[N, H]``: the four stages in order (see the class docstring); ``forward_batch`` picks the
        all-to-all mode (:func:`~sglang.srt.layers.stages.moe_dispatch_mode`; None: normal)."""
        moe = MoeState(dispatch_mode=moe_dispatch_mode(forward_batch))
        self.route(x, moe)
        self.dispatch(moe)
        self.run_experts(moe)
        return self.combine(moe)
