"""Device-side bookkeeping every dispatcher backend shares: which rank each (token, slot) goes to, the packed row
format, the grouping of received rows by local expert, and the weighted sum back to token order.

All functions are plain torch ops with sizes known from shapes (no host synchronisation), so the low-latency path
is CUDA-graph capturable. Notation: T tokens, k slots per token, P = T * k pairs (pair ``p = t * k + j``), ep ranks,
E_loc = E / ep experts per rank.

Packed row (what travels in a dispatch): ``W = row_width(H, dtype)`` elements of the model dtype: the H hidden
values, then padding, then a 16-byte trailer at the end of the row (16-byte aligned): the destination's *local*
expert id (int32; -1 marks an empty low-latency slot) and the routing weight (fp32), then 8 unused bytes. One row,
one message: the metadata needs no second collective and stays bit-exact (collectives copy bytes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

TRAILER_BYTES = 16


def row_width(hidden: int, dtype: torch.dtype) -> int:
    """Elements of one packed row: H values plus the 16-byte trailer, rounded up to 16 bytes."""
    es = torch.empty((), dtype=dtype).element_size()
    nbytes = -(-(hidden * es + TRAILER_BYTES) // 16) * 16
    return nbytes // es


def trailer(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Views ``(local_expert_ids int32 [R], weights fp32 [R])`` of the trailers of packed rows ``[R, W]``
    (contiguous)."""
    b = rows.view(torch.uint8)
    nb = b.shape[1]
    m = b[:, nb - TRAILER_BYTES: nb - TRAILER_BYTES + 8].view(torch.int32)
    return m[:, 0], m[:, 1].view(torch.float32)


@dataclass
class SendPlan:
    """Where this rank's pairs go (device tensors).

    Attributes:
        order: [P] int64 pair indices sorted by destination rank (stable: token order within a destination).
        dest: [P] int64 destination rank of ``order[i]``.
        local_ids: [P] int32 the destination's local expert id of ``order[i]``.
        send_counts: [ep] int64 pairs per destination.
        slot: [P] int64 row of ``order[i]`` in a fixed ``[ep * pair_capacity]`` layout (destination-major), or None.
    """

    order: torch.Tensor
    dest: torch.Tensor
    local_ids: torch.Tensor
    send_counts: torch.Tensor
    slot: Optional[torch.Tensor] = None


def plan_send(topk_ids: torch.Tensor, num_local_experts: int, ep_size: int,
              pair_capacity: Optional[int] = None) -> SendPlan:
    """The :class:`SendPlan` of ``topk_ids`` [T, k] (global ids; expert e lives on rank ``e // E_loc``).
    ``pair_capacity``: also compute the fixed-layout ``slot`` (low-latency mode)."""
    flat = topk_ids.reshape(-1).to(torch.int64)
    dest_all = torch.div(flat, num_local_experts, rounding_mode="floor")
    order = torch.argsort(dest_all, stable=True)
    dest = dest_all[order]
    local_ids = (flat[order] - dest * num_local_experts).to(torch.int32)
    counts = torch.zeros(ep_size, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, dest_all.clamp(0, ep_size - 1), torch.ones_like(dest_all))
    slot = None
    if pair_capacity is not None:
        start = torch.cumsum(counts, 0) - counts
        pos = torch.arange(flat.numel(), device=flat.device) - start[dest]
        slot = dest * pair_capacity + pos
    return SendPlan(order, dest, local_ids, counts, slot)


def pack_rows(out: torch.Tensor, x: torch.Tensor, topk_weights: torch.Tensor, plan: SendPlan, top_k: int,
              rows: Optional[torch.Tensor] = None) -> None:
    """Write the packed rows of ``plan``'s pairs into ``out`` [*, W] (x [T, H], topk_weights [T, k] fp32).

    ``rows``: the rows of ``out`` to write (``plan.slot`` in the fixed layout); None: rows ``0 .. P-1`` in
    ``plan.order`` order (the compact layout)."""
    h = x.shape[1]
    tok = torch.div(plan.order, top_k, rounding_mode="floor")
    ids, w = trailer(out)
    wsel = topk_weights.reshape(-1)[plan.order]
    if rows is None:
        n = plan.order.numel()
        out[:n, :h] = x[tok]
        ids[:n] = plan.local_ids
        w[:n] = wsel
    else:
        out[rows, :h] = x[tok]
        ids[rows] = plan.local_ids
        w[rows] = wsel


@dataclass
class Grouped:
    """Received rows grouped by local expert (see :class:`~.base.DispatchHandle`): ``x`` [R, H], ``expert_ids`` [R]
    int64 (-1 padding), ``weights`` [R] fp32, ``counts`` [E_loc] int64, and ``perm`` [R] int64: grouped row i is
    received row ``perm[i]``."""

    x: torch.Tensor
    expert_ids: torch.Tensor
    weights: torch.Tensor
    counts: torch.Tensor
    perm: torch.Tensor


def group_received(rows: torch.Tensor, hidden: int, num_local_experts: int,
                   valid: Optional[torch.Tensor] = None) -> Grouped:
    """Group packed received rows ``[R, W]`` by their trailer's local expert id (stable; invalid rows, id < 0 or
    ``valid`` False, last with id -1 and weight 0)."""
    ids32, w = trailer(rows)
    ids = ids32.to(torch.int64)
    ok = (ids >= 0) & (ids < num_local_experts)
    if valid is not None:
        ok = ok & valid
    key = torch.where(ok, ids, num_local_experts)
    perm = torch.argsort(key, stable=True)
    counts = torch.zeros(num_local_experts + 1, dtype=torch.int64, device=rows.device)
    counts.scatter_add_(0, key, torch.ones_like(key))
    okp = ok[perm]
    return Grouped(x=rows[perm, :hidden], expert_ids=torch.where(okp, ids[perm], -1),
                   weights=torch.where(okp, w[perm], 0.0), counts=counts[:num_local_experts], perm=perm)


def ungroup(expert_out: torch.Tensor, perm: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Expert outputs in grouped order ``[R, H]`` back to received order (``out[perm[i]] = expert_out[i]``)."""
    if out is None:
        out = torch.empty_like(expert_out)
    out[perm] = expert_out
    return out


def weighted_sum(returned: torch.Tensor, plan: SendPlan, topk_weights: torch.Tensor, num_tokens: int, top_k: int,
                 dtype: torch.dtype, weights_applied: bool, rows: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``[T, H]`` in ``dtype``: per token the fp32 sum over its k slots of ``weight * expert output``.

    ``returned``: the expert outputs as they came back, one row per pair: rows ``0 .. P-1`` in ``plan.order``
    order (compact), or at ``rows`` (``plan.slot``, fixed layout). ``weights_applied``: the rows are already
    weighted (only sum)."""
    h = returned.shape[1]
    p = num_tokens * top_k
    y = returned[:p] if rows is None else returned[rows]
    per_pair = torch.empty(p, h, dtype=torch.float32, device=returned.device)
    per_pair[plan.order] = y.float()
    per_pair = per_pair.view(num_tokens, top_k, h)
    if not weights_applied:
        per_pair = per_pair * topk_weights.to(torch.float32).unsqueeze(-1)
    return per_pair.sum(dim=1).to(dtype)
