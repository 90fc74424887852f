"""The expert layer of a sparse MoE block: stacked SwiGLU experts and their torch reference.

Each expert e computes ``w2[e] @ (silu(w1[e] @ x) * (w3[e] @ x))`` (SwiGLU,
Shazeer 2020); a token's output is the routing-weighted sum over its top-k
experts (Shazeer et al. 2017, eq. 1). ``w1`` (gate) and ``w3`` (up) are stacked
into ``w13 = [w1; w3]`` so that a fused kernel runs one GEMM for both.
Tensor parallelism splits the intermediate size I of every expert (like a
column-then-row parallel MLP); the partial outputs are all-reduced.
Expert parallelism (``ep_size > 1``) splits the experts into ``ep_size`` contiguous
groups; ``tp_size / ep_size`` ranks share a group and split its I. Every rank runs
the router on all tokens and computes only its experts' (partial) contributions, so
the sum over the whole TP group is the full output: token "routing" is one
all-reduce of partial outputs (simple and exact). ``--moe-a2a-backend nccl|tdist`` replaces it with an
all-to-all dispatch/combine (GShard, Lepikhin et al. 2020, sec. 3.2): :meth:`FusedMoE.compute_rows` runs the
local experts on the received rows only (see :mod:`sglang.srt.layers.moe.ep_a2a`).
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch
from torch import nn

from sglang.srt.layers import ops
from sglang.srt.ops_ref import fused_moe_ref  # noqa: F401  (re-exported)
from sglang.srt.layers.linear import ShardSpec, check_tp, copy_checked, divide

logger = logging.getLogger(__name__)


class FusedMoE(nn.Module):
    """Stacked experts plus routing: ``forward(x [N, H], router_logits [N, E]) -> [N, H]``.

    Args:
        num_experts: E; top_k: experts per token; hidden_size: H;
        intermediate_size: I per expert (full; this rank holds I/tp_size).
        renormalize: renormalize the top-k weights (see :func:`~sglang.srt.layers.moe.router.select_experts`).
        params_dtype: weight dtype. tp_rank/tp_size: the TP group.
        reduce_results: all-reduce the output over TP with ``comm.all_reduce`` (needed when tp_size > 1;
            False when a following RMSNorm fuses the reduction).
        ep_size: expert-parallel groups (a divisor of tp_size and of num_experts). Rank r holds experts
            ``[ep_rank*E/ep, (ep_rank+1)*E/ep)`` with ``ep_rank = r // (tp/ep)`` and the
            ``r % (tp/ep)``-th slice of their I.
    Parameters: ``w13_weight`` [E/ep, 2I/(tp/ep), H], ``w2_weight`` [E/ep, H, I/(tp/ep)].
    ``param.weight_loader(param, loaded_weight, shard_id, expert_id)`` takes one
    HF expert tensor (global ``expert_id``): shard_id "w1" (gate, [I, H]), "w3" (up, [I, H]) or "w2"
    (down, [H, I]); tensors of other ranks' experts are skipped without being read.
    ``param.expected_shards`` lists the (expert_id, shard_id) pairs this rank needs.
    Kernels: routing and experts run :func:`sglang.srt.layers.ops.fused_topk` and
    :func:`sglang.srt.layers.ops.fused_moe` (Triton on CUDA: no host synchronisation, so the layer can be
    captured in a CUDA graph; :func:`~sglang.srt.layers.moe.router.select_experts` and :func:`fused_moe_ref` elsewhere).
    """

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 renormalize: bool = True, params_dtype: Optional[torch.dtype] = None, tp_rank: int = 0,
                 tp_size: int = 1, reduce_results: bool = True, comm: Any = None, ep_size: int = 1):
        super().__init__()
        check_tp(tp_rank, tp_size)
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok={top_k} must be in [1, num_experts={num_experts}]")
        if ep_size < 1 or tp_size % ep_size:
            raise ValueError(f"ep_size={ep_size} must divide tp_size={tp_size}")
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.hidden_size = hidden_size
        self.tp_rank, self.tp_size, self.reduce_results, self.comm = tp_rank, tp_size, reduce_results, comm
        self.ep_size = ep_size
        self.moe_tp_size = tp_size // ep_size
        self.moe_tp_rank, self.ep_rank = tp_rank % self.moe_tp_size, tp_rank // self.moe_tp_size
        self.num_local_experts = divide(num_experts, ep_size, "num_experts (by ep_size)")
        self.expert_start = self.ep_rank * self.num_local_experts
        self.i_local = divide(intermediate_size, self.moe_tp_size, "moe intermediate_size (by tp_size/ep_size)")
        e_loc = self.num_local_experts
        self.w13_weight = nn.Parameter(torch.empty(e_loc, 2 * self.i_local, hidden_size, dtype=params_dtype),
                                       requires_grad=False)
        self.w2_weight = nn.Parameter(torch.empty(e_loc, hidden_size, self.i_local, dtype=params_dtype),
                                      requires_grad=False)
        local = range(self.expert_start, self.expert_start + e_loc)
        for p, shards in ((self.w13_weight, ("w1", "w3")), (self.w2_weight, ("w2",))):
            p.weight_loader = self.weight_loader
            p.expected_shards = tuple((e, s) for e in local for s in shards)
        # the quantization method chosen once at load (sglang.srt.layers.quantization), which then owns the expert
        # weights and runs the experts; None: the model-dtype weights above
        self.quant_method: Optional[Any] = None

    def expert_spec(self, shard_id: str, expert_id: int) -> Optional[tuple[int, ShardSpec]]:
        """Where HF expert tensor ``(expert_id, shard_id)`` lands: ``(local expert index, ShardSpec)`` within that
        expert's ``[2I/tp, H]`` (``w1``: gate rows first, ``w3``: up rows after them) or ``[H, I/tp]`` (``w2``:
        this rank's input columns) slice; None for another EP rank's expert (its tensors are not read).
        Raises ValueError on a bad expert_id or shard_id."""
        if not 0 <= expert_id < self.num_experts:
            raise ValueError(f"FusedMoE: expert_id={expert_id} outside [0, {self.num_experts})")
        local_id = expert_id - self.expert_start
        if not 0 <= local_id < self.num_local_experts:
            return None  # another EP rank's expert: not read
        n, r, full, h = self.i_local, self.moe_tp_rank, self.i_local * self.moe_tp_size, self.hidden_size
        if shard_id in ("w1", "w3"):
            return local_id, ShardSpec(0 if shard_id == "w1" else n, n, r * n, full, 0, h, h)
        if shard_id == "w2":
            return local_id, ShardSpec(0, h, 0, h, r * n, n, full)
        raise ValueError(f"FusedMoE: shard_id={shard_id!r} must be 'w1', 'w2' or 'w3'")

    def weight_loader(self, param: nn.Parameter, loaded_weight: Any, shard_id: str, expert_id: int) -> None:
        """Copy this rank's slice of one HF expert tensor (see the class docstring and :meth:`expert_spec`); other
        ranks' experts are skipped unread. Raises ValueError on a bad expert_id, shard_id or shape."""
        where = self.expert_spec(shard_id, expert_id)
        if where is None:
            return
        local_id, spec = where
        what = f"FusedMoE expert {expert_id} {shard_id}"
        copy_checked(param[local_id].narrow(0, spec.dst_row, spec.rows), spec.take(loaded_weight, what), what)

    def route(self, router_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k routing of router_logits ``[N, E]``: ``(topk_weights [N, k] fp32, topk_ids [N, k] int64)`` with
        global expert ids (see :func:`~sglang.srt.ops_ref.select_experts`)."""
        return ops.fused_topk(router_logits, self.top_k, self.renormalize)

    def compute(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """This rank's experts: x ``[N, H]`` with global ``topk_ids``/``topk_weights`` ``[N, k]`` -> ``[N, H]`` in
        x's dtype, the weighted sum over the local experts only (a partial sum over TP/EP ranks; other
        ranks' experts get weight 0)."""
        if self.ep_size > 1:  # other ranks' experts get weight 0 (their rows add nothing here)
            local_ids = topk_ids - self.expert_start
            mine = (local_ids >= 0) & (local_ids < self.num_local_experts)
            topk_weights = topk_weights.masked_fill(~mine, 0.0)
            topk_ids = local_ids.clamp(0, self.num_local_experts - 1)
        if self.quant_method is not None:
            return self.quant_method.apply(self, x, topk_weights, topk_ids)
        return ops.fused_moe(x, self.w13_weight, self.w2_weight, topk_weights, topk_ids)

    def compute_rows(self, rows: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor:
        """Expert parallelism by all-to-all: rows ``[R, H]`` received for this rank's experts, ``local_ids`` [R] int64
        local expert ids (``-1``: a padding row) -> ``[R, H]`` in rows' dtype, row i = local expert ``local_ids[i]``
        applied to ``rows[i]``, unweighted (the combine applies the routing weights); padding rows give zeros and
        cost nothing (the fused-MoE kernel skips negative ids). Runs :func:`sglang.srt.layers.ops.fused_moe` with one
        slot per row (no host sync on CUDA).
        Raises ValueError when this rank splits its experts' intermediate dim (``tp_size != ep_size``)."""
        if self.moe_tp_size != 1:
            raise ValueError(f"compute_rows needs whole experts per rank (ep_size == tp_size), got "
                             f"ep_size={self.ep_size}, tp_size={self.tp_size}")
        quant = getattr(self, "quant_method", None)  # a quantization method that owns the expert GEMMs
        if quant is not None:  # any kernel: padding rows as weight-0 rows of expert 0
            valid = (local_ids >= 0).to(torch.float32).unsqueeze(1)
            return quant.apply(self, rows, valid, local_ids.clamp(min=0).unsqueeze(1))
        ones = torch.ones(rows.shape[0], 1, dtype=torch.float32, device=rows.device)
        return ops.fused_moe(rows, self.w13_weight, self.w2_weight, ones, local_ids.unsqueeze(1))

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """x ``[N, H]``, router_logits ``[N, E]`` -> ``[N, H]`` in x's dtype: :meth:`route`, :meth:`compute`, then
        an all-reduce over TP when ``reduce_results`` (ValueError without ``comm``)."""
        topk_weights, topk_ids = self.route(router_logits)
        out = self.compute(x, topk_weights, topk_ids)
        if self.tp_size > 1 and self.reduce_results:
            if self.comm is None:
                raise ValueError("FusedMoE with tp_size > 1 needs a comm object to all-reduce its output")
            out = self.comm.all_reduce(out)
        return out

    def extra_repr(self) -> str:
        """Expert counts and range, top_k and sizes for ``repr``."""
        return f"experts={self.num_experts} (local {self.expert_start}..{self.expert_start + self.num_local_experts - 1}), " \
               f"top_k={self.top_k}, hidden={self.hidden_size}, intermediate_local={self.i_local}, " \
               f"renormalize={self.renormalize}"


