"""Torch references for tw-comm's fused ops (fp32 accumulation), used on CPU and as test oracles.

Semantics (TokenWeave, Gond et al. 2025, section 3.3): ``residual += allreduce(x); out = rmsnorm(residual) *
weight``. The sum over ranks and the residual add are done in fp32; residual is stored in its own dtype and the
norm is taken of the fp32 sum (as the kernels do).
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch
import torch.distributed as dist


def owned_range(tokens: int, world: int, rank: int) -> Tuple[int, int]:
    """Token rows [start, end) that ``rank`` owns in the two-shot split: balanced, any ``tokens`` >= 0.

    Same formula as tw-comm's ``owned_start``: start(q) = floor(tokens * q / world).
    """
    if world <= 0 or not 0 <= rank < world:
        raise ValueError(f"rank={rank} must be in [0, world={world})")
    return (tokens * rank) // world, (tokens * (rank + 1)) // world


def rmsnorm_fp32(s: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of an fp32 [T, H] tensor over H, times weight [H]; returns fp32 [T, H]."""
    s = s.float()
    return s * torch.rsqrt(s.pow(2).mean(dim=-1, keepdim=True) + eps) * weight.float()


def add_rmsnorm_fp32(
    total: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Given the fp32 AllReduce sum [T, H]: returns (new residual in residual.dtype, normed out in residual.dtype)."""
    s = total.float() + residual.float()
    return s.to(residual.dtype), rmsnorm_fp32(s, weight, eps).to(residual.dtype)


def allreduce_add_rmsnorm_ref(
    xs: Sequence[torch.Tensor], residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Single-process reference: xs = every rank's [T, H] input. Returns (new residual, out), both [T, H]."""
    total = torch.zeros(residual.shape, dtype=torch.float32, device=residual.device)
    for x in xs:
        total += x.float()
    return add_rmsnorm_fp32(total, residual, weight, eps)


def ar_norm_dist(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    group: Optional[dist.ProcessGroup] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """AR -> add -> RMSNorm over ``group`` (any backend; CPU with gloo). Inputs are not modified.

    Returns (new residual, out) [T, H] in x's dtype; the AllReduce runs in fp32.
    """
    total = x.float().clone()
    dist.all_reduce(total, group=group)
    return add_rmsnorm_fp32(total, residual, weight, eps)


def rs_norm_ag_dist(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    group: Optional[dist.ProcessGroup] = None,
    gather_residual: bool = True,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """ReduceScatter (whole token rows) -> residual add + RMSNorm on this rank's 1/N rows -> AllGather.

    The two-shot decomposition the tw-comm kernels implement; rows split by :func:`owned_range`, so ``T`` need
    not divide by the world size. ReduceScatter is a ``reduce`` of each rank's row range to its owner (gloo has
    no reduce_scatter); AllGather pads every range to ceil(T/N) rows. Returns (new residual, out) [T, H].
    ``gather_residual=False`` is the residual-sharded form (the kernels' ``residual_sharded``; TokenWeave sec. 3-4):
    only the normed rows are gathered and the new residual's rows outside this rank's range are a copy of the
    input's (only the owned rows are read or updated). Runs on any backend whose tensors live on x's device.
    """
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    tokens, hidden = x.shape
    xf = x.float()
    mine = None
    for q in range(world):
        s, e = owned_range(tokens, world, q)
        chunk = xf[s:e].clone()
        dist.reduce(chunk, dst=dist.get_global_rank(group, q) if group is not None else q, group=group)
        if q == rank:
            mine = chunk
    s, e = owned_range(tokens, world, rank)
    res_mine, out_mine = add_rmsnorm_fp32(mine, residual[s:e], weight, eps)
    stride = -(-tokens // world)
    parts = 2 if gather_residual else 1
    pad = torch.zeros((stride, parts, hidden), dtype=torch.float32, device=x.device)
    pad[: e - s, parts - 1] = out_mine.float()
    if gather_residual:
        pad[: e - s, 0] = res_mine.float()
    gathered = [torch.empty_like(pad) for _ in range(world)]
    dist.all_gather(gathered, pad, group=group)
    new_res = torch.empty_like(residual) if gather_residual else residual.clone()
    out = torch.empty_like(residual)
    for q in range(world):
        qs, qe = owned_range(tokens, world, q)
        if gather_residual:
            new_res[qs:qe] = gathered[q][: qe - qs, 0].to(residual.dtype)
        out[qs:qe] = gathered[q][: qe - qs, parts - 1].to(residual.dtype)
    if not gather_residual:
        new_res[s:e] = res_mine
    return new_res, out
