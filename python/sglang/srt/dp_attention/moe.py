"""The MoE side of DP attention: experts sharded over the DP world on a model whose attention is replicated, and the
token exchange of ``--moe-a2a-backend none``.

Each DP rank runs attention, dense layers, embeddings and logits on its own tokens with replicated weights (the model
is built with ``tp_size=1``); :func:`shard_experts` then replaces every sparse MoE block's experts by a
:class:`DpGatheredFusedMoE` that holds this rank's expert shard of the ``(dp_size, moe_ep_size)`` layout of
:class:`~sglang.srt.layers.moe.fused_moe.FusedMoE` (experts split ``moe_ep_size`` ways, each expert's intermediate dim
over ``dp_size / moe_ep_size`` ranks). Its ``compute`` (the block's ``moe_experts`` stage) is SGLang's DP-attention
gather/scatter around the all-reduce EP of ``fused_moe.py``:

1. pad this rank's ``n`` rows of ``(x, topk_weights, topk_ids)`` to the step's rows per rank ``M`` (the largest token
   count over the DP ranks, agreed by the scheduler before the forward; the padded CUDA-graph batch in a replay) and
   all-gather them as one byte tensor: ``[dp_size * M, ...]``;
2. run the local experts on every gathered row (other ranks' experts contribute 0: a partial sum);
3. reduce-scatter the partial sums back: rank r receives rows ``[r*M, (r+1)*M)`` of the sum and keeps its ``n``.

Padding rows have weight 0, so a row's output depends on that row only and equals the single-process output up to
floating-point rounding (an expert's GEMM runs over other ranks' rows too; with ``moe_ep_size < dp_size`` the down
projection is a partial sum over ranks). A rank with no work runs the same
collectives with ``n = 0`` (:func:`run_idle`), so every rank issues the same sequence of collectives each step.

With an all-to-all backend (``--moe-a2a-backend nccl|tdist``, :mod:`.moe_a2a`) the blocks' stages dispatch each
rank's own tokens to the experts' owners instead, and this class's ``compute`` is not used (the same expert shard).
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch
from torch import nn

from sglang.srt.layers.moe.fused_moe import FusedMoE
from sglang.srt.layers.moe.sparse_moe_block import SparseMoeBlock

logger = logging.getLogger(__name__)


class DpForwardPadding:
    """The rows per rank ``M`` of the current forward's MoE all-gathers (set once per forward by the model runner;
    every MoE layer of that forward uses it). One object per worker, shared by its MoE layers; forwards run one at a
    time (on the overlap worker's thread with overlap scheduling)."""

    def __init__(self) -> None:
        self.rows: Optional[int] = None

    def set(self, rows: Optional[int]) -> None:
        """Rows per rank of the next forward(s): ``>= 1``, or None to agree in-band per layer (see :meth:`rows_for`).

        Raises:
            ValueError: ``rows < 1``.
        """
        if rows is not None and rows < 1:
            raise ValueError(f"DP attention: rows per rank must be >= 1, got {rows}")
        self.rows = rows

    def rows_for(self, n: int, comm: Any, device: torch.device) -> int:
        """``M`` for a layer whose local input has ``n`` rows: the value :meth:`set` gave, else the maximum of ``n``
        over the ranks, agreed in-band (one all-gather of a scalar and a host sync: only for callers that forward
        sub-batches without a step agreement, e.g. a split executor).

        Raises:
            RuntimeError: ``n`` exceeds the agreed rows (the step agreement and the batch disagree: a bug).
        """
        rows = self.rows
        if rows is None:
            counts = comm.all_gather(torch.tensor([n], dtype=torch.int64, device=device), dim=0)
            return max(int(counts.max().item()), 1)
        if n > rows:
            raise RuntimeError(f"DP attention: this rank has {n} MoE rows but the step agreed on at most {rows} "
                               "per rank")
        return rows


def pack_rows(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, rows: int) -> torch.Tensor:
    """One byte tensor ``[rows, H*es + 4k + 8k]`` uint8 of ``x`` ``[n, H]`` (its dtype, ``es`` bytes per element),
    ``topk_weights`` ``[n, k]`` (as fp32) and ``topk_ids`` ``[n, k]`` (as int64), padded with zero rows (weight 0)
    from ``n`` to ``rows``: a single all-gather moves all three. Raises ValueError when ``n > rows``."""
    n = x.shape[0]
    if n > rows:
        raise ValueError(f"pack_rows: {n} rows do not fit in {rows}")
    parts = [x.contiguous().view(torch.uint8), topk_weights.float().contiguous().view(torch.uint8),
             topk_ids.to(torch.int64).contiguous().view(torch.uint8)]
    width = sum(p.shape[1] for p in parts)
    buf = torch.zeros(rows, width, dtype=torch.uint8, device=x.device)
    col = 0
    for p in parts:
        buf[:n, col:col + p.shape[1]] = p
        col += p.shape[1]
    return buf


def unpack_rows(buf: torch.Tensor, hidden: int, top_k: int, dtype: torch.dtype) -> tuple:
    """Inverse of :func:`pack_rows`: ``buf`` ``[R, B]`` uint8 -> ``(x [R, hidden] dtype, topk_weights [R, k] fp32,
    topk_ids [R, k] int64)``."""
    hx = hidden * torch.empty((), dtype=dtype).element_size()
    x = buf[:, :hx].contiguous().view(dtype)
    w = buf[:, hx:hx + 4 * top_k].contiguous().view(torch.float32)
    ids = buf[:, hx + 4 * top_k:hx + 12 * top_k].contiguous().view(torch.int64)
    return x, w, ids


class DpGatheredFusedMoE(FusedMoE):
    """:class:`FusedMoE` of one DP rank: this rank's shard of the experts, computed on the tokens of every DP rank
    (see the module docstring). Parameters and their names, shapes and weight loader are FusedMoE's for
    ``(tp_rank=dp_rank, tp_size=dp_size, ep_size=moe_ep_size)``.

    Args:
        num_experts / top_k / hidden_size / intermediate_size / renormalize / params_dtype: as FusedMoE.
        dp_rank, dp_size, moe_ep_size: the rank, the DP world and the expert groups (``moe_ep_size | dp_size``).
        comm: a :class:`~sglang.srt.distributed.communicator.Communicator` over the DP world (all_gather,
            reduce_scatter).
        padding: the worker's :class:`DpForwardPadding`.
    """

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int, renormalize: bool,
                 params_dtype: Optional[torch.dtype], dp_rank: int, dp_size: int, moe_ep_size: int, comm: Any,
                 padding: DpForwardPadding):
        super().__init__(num_experts, top_k, hidden_size, intermediate_size, renormalize, params_dtype,
                         tp_rank=dp_rank, tp_size=dp_size, reduce_results=False, comm=None, ep_size=moe_ep_size)
        self.dp_comm, self.dp_padding = comm, padding

    def compute(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """x ``[n, H]`` with ``topk_weights`` ``[n, k]`` fp32 and global ``topk_ids`` ``[n, k]`` -> ``[n, H]`` in x's
        dtype: the complete MoE output of this rank's rows (every rank's experts summed). A collective over the DP
        world: every rank calls it for the same layer with its own ``n`` (0 on an idle rank)."""
        n = x.shape[0]
        rows = self.dp_padding.rows_for(n, self.dp_comm, x.device)
        gathered = self.dp_comm.all_gather(pack_rows(x, topk_weights, topk_ids, rows), dim=0)
        gx, gw, gids = unpack_rows(gathered, self.hidden_size, self.top_k, x.dtype)
        partial = super().compute(gx, gw, gids)  # [dp_size * rows, H]: this rank's experts, other experts weight 0
        return self.dp_comm.reduce_scatter(partial)[:n]

    def extra_repr(self) -> str:
        """FusedMoE's, plus the DP world."""
        return super().extra_repr() + f", dp_world={self.tp_size} (gathered tokens)"


def moe_blocks(model: nn.Module) -> list:
    """The sparse MoE blocks of ``model``'s decoder layers (the staged-model contract's ``decoder_layers``), in layer
    order: the order their collectives run in a forward."""
    return [layer.mlp for layer in model.decoder_layers if isinstance(getattr(layer, "mlp", None), SparseMoeBlock)]


def shard_experts(model: nn.Module, dp_rank: int, dp_size: int, moe_ep_size: int, comm: Any,
                  padding: DpForwardPadding) -> int:
    """Give every sparse MoE block of ``model`` (built with ``tp_size=1``, on any device, typically ``meta`` before
    allocation) a :class:`DpGatheredFusedMoE` of the same experts for this DP rank; returns how many blocks changed
    (0: a dense model, whose ranks share no collective).

    Raises:
        ValueError: a block built with tensor parallelism (the model must be built with ``tp_size=1``), or sizes the
            layout cannot split (``num_experts % moe_ep_size``, the intermediate size by ``dp_size / moe_ep_size``).
    """
    blocks = moe_blocks(model)
    for block in blocks:
        old = block.experts
        if block.tp_size != 1 or old.tp_size != 1:
            raise ValueError("DP attention shards the experts of a model built with tp_size=1; this block has "
                             f"tp_size={block.tp_size}")
        block.experts = DpGatheredFusedMoE(
            old.num_experts, old.top_k, old.hidden_size, old.i_local, old.renormalize, old.w13_weight.dtype,
            dp_rank, dp_size, moe_ep_size, comm, padding)
    if blocks:
        e = blocks[0].experts
        logger.info("DP attention: %d MoE layers, experts %d..%d of %d (intermediate %d local) on DP rank %d/%d",
                    len(blocks), e.expert_start, e.expert_start + e.num_local_experts - 1, e.num_experts, e.i_local,
                    dp_rank, dp_size)
    return len(blocks)


@torch.inference_mode()
def run_idle(model: nn.Module, dtype: torch.dtype, device: torch.device, a2a_mode: str = "normal") -> None:
    """The idle forward of a DP rank with no tokens this step (SGLang's ``ForwardMode.IDLE``): every MoE layer's
    gather / local experts / reduce-scatter with zero local rows, in layer order, so the ranks that do have tokens get
    this rank's experts and matching collectives (with an all-to-all dispatcher installed, the block's four stages
    with ``T = 0`` in the agreed ``a2a_mode``). Attention, dense layers and logits have no collectives under DP
    attention and are skipped."""
    for block in moe_blocks(model):
        ex = block.experts
        x = torch.empty(0, ex.hidden_size, dtype=dtype, device=device)
        if getattr(block, "a2a", None) is not None:
            from sglang.srt.dp_attention.moe_a2a import run_idle_stages

            run_idle_stages(block, x, a2a_mode)
            continue
        k = ex.top_k
        ex.compute(x, torch.empty(0, k, dtype=torch.float32, device=device),
                   torch.empty(0, k, dtype=torch.int64, device=device))
