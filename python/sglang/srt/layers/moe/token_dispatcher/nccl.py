"""Token dispatcher over ``torch.distributed.all_to_all_single`` (NCCL on GPU, gloo on CPU).

NORMAL mode (GShard's dispatch/combine, Lepikhin et al. 2020, sec. 3.2, with DeepEP's count-first layout): the ranks
exchange their per-destination pair counts (one tiny all-to-all of ep int64), the host reads them (the one sync),
then one all-to-all with exact split sizes moves the packed rows (hidden + trailer, see :mod:`.routing`); the combine
is the reverse all-to-all of the expert outputs with the splits swapped. LOW_LATENCY mode (DeepEP's low-latency
kernels, decode): every rank sends every other rank a fixed ``pair_capacity`` rows (empty slots marked in their
trailer), so one equal-split all-to-all needs no count exchange and no host sync and can be captured in a CUDA graph
(NCCL collectives are capturable); the fixed buffers are allocated once, ``max_inflight`` sets used round-robin.

gloo implements ``all_to_all_single`` with split sizes for every dtype used here (checked on torch 2.13), so the
CPU path is the same code with one rank per process. CUDA tensors over a gloo group (``--tp-ranks-share-gpu``, the
correctness-only mode where ranks share one GPU and CUDA graphs are off) are staged through host memory.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from sglang.srt.layers.moe.token_dispatcher.base import (
    CombineHandle,
    DispatcherConfig,
    DispatchHandle,
    DispatchMode,
    TokenDispatcher,
    record_event,
)
from sglang.srt.layers.moe.token_dispatcher.routing import (
    SendPlan,
    group_received,
    pack_rows,
    plan_send,
    row_width,
    trailer,
    ungroup,
    weighted_sum,
)

logger = logging.getLogger(__name__)


@dataclass
class _State:
    """What combine needs from dispatch (private)."""

    plan: SendPlan
    topk_weights: torch.Tensor
    perm: torch.Tensor
    send_splits: Any = None  # NORMAL: host lists
    recv_splits: Any = None
    buffers: Any = None  # LOW_LATENCY: the buffer set of the call
    combined: bool = False


class NcclTokenDispatcher(TokenDispatcher):
    """:class:`~.base.TokenDispatcher` over ``all_to_all_single`` (module docstring). ``group``: the EP group
    (NCCL on GPU, gloo on CPU)."""

    name = "nccl"

    def __init__(self, config: DispatcherConfig, group: Any):
        super().__init__(config, group)
        if group is not None and dist.get_world_size(group) != config.ep_size:
            raise ValueError(f"EP group has {dist.get_world_size(group)} ranks, config.ep_size={config.ep_size}")
        self.device = torch.device(config.device)
        self._stage_on_host = self.device.type == "cuda" and group is not None and dist.get_backend(group) == "gloo"
        self.width = row_width(config.hidden_size, config.dtype)
        rows, h, dt = config.recv_capacity, config.hidden_size, config.dtype
        self._sets = [dict(send=torch.zeros(rows, self.width, dtype=dt, device=self.device),
                           recv=torch.zeros(rows, self.width, dtype=dt, device=self.device),
                           csend=torch.zeros(rows, h, dtype=dt, device=self.device),
                           crecv=torch.zeros(rows, h, dtype=dt, device=self.device))
                      for _ in range(config.max_inflight)]
        self._next = 0
        logger.info("nccl token dispatcher: EP rank %d/%d, %d local experts, low-latency capacity %d tokens "
                    "(%d rows per peer), %d buffer sets, %.1f MiB", config.ep_rank, config.ep_size,
                    config.num_local_experts, config.max_tokens_low_latency, config.pair_capacity,
                    config.max_inflight, self.buffer_bytes(config) / 2**20)

    @staticmethod
    def buffer_bytes(config: DispatcherConfig) -> int:
        """``max_inflight`` sets of low-latency send/receive buffers for dispatch (packed rows) and combine."""
        w = row_width(config.hidden_size, config.dtype)
        return config.max_inflight * config.recv_capacity * 2 * (w + config.hidden_size) * config.element_size

    def _a2a(self, out: torch.Tensor, inp: torch.Tensor, out_splits=None, in_splits=None) -> None:
        """``all_to_all_single`` over the EP group (through host memory for CUDA tensors on a gloo group)."""
        if not self._stage_on_host:
            dist.all_to_all_single(out, inp, out_splits, in_splits, group=self.group)
            return
        host_out = torch.empty(out.shape, dtype=out.dtype)
        dist.all_to_all_single(host_out, inp.cpu(), out_splits, in_splits, group=self.group)
        out.copy_(host_out)

    # ---- dispatch ---------------------------------------------------------------------------------------------
    def dispatch(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                 mode: DispatchMode) -> DispatchHandle:
        """See :meth:`~.base.TokenDispatcher.dispatch`."""
        mode = self.check_dispatch_inputs(x, topk_ids, topk_weights, mode)
        if mode is DispatchMode.NORMAL:
            return self._dispatch_normal(x, topk_ids, topk_weights)
        return self._dispatch_low_latency(x, topk_ids, topk_weights)

    def _dispatch_normal(self, x, topk_ids, topk_weights) -> DispatchHandle:
        cfg = self.config
        ep, t = cfg.ep_size, x.shape[0]
        plan = plan_send(topk_ids, cfg.num_local_experts, ep)
        recv_counts = torch.empty_like(plan.send_counts)
        self._a2a(recv_counts, plan.send_counts)
        bad = ((topk_ids < 0) | (topk_ids >= cfg.num_experts)).any().view(1).to(torch.int64)
        host = torch.cat([plan.send_counts, recv_counts, bad]).tolist()  # the one host sync of NORMAL mode
        send_splits, recv_splits = host[:ep], host[ep:2 * ep]
        if host[-1]:
            raise ValueError(f"dispatch: topk_ids outside [0, {cfg.num_experts}) on EP rank {cfg.ep_rank}")
        send = torch.empty(t * cfg.top_k, self.width, dtype=cfg.dtype, device=x.device)
        pack_rows(send, x, topk_weights, plan, cfg.top_k)
        recv = torch.empty(sum(recv_splits), self.width, dtype=cfg.dtype, device=x.device)
        self._a2a(recv, send, recv_splits, send_splits)
        g = group_received(recv, cfg.hidden_size, cfg.num_local_experts)
        state = _State(plan, topk_weights, g.perm, send_splits, recv_splits)
        return DispatchHandle(DispatchMode.NORMAL, t, g.x, g.expert_ids, g.weights, g.counts,
                              num_recv=recv.shape[0], event=record_event(x.device), state=state)

    def _dispatch_low_latency(self, x, topk_ids, topk_weights) -> DispatchHandle:
        cfg = self.config
        bufs = self._sets[self._next]
        self._next = (self._next + 1) % len(self._sets)
        plan = plan_send(topk_ids, cfg.num_local_experts, cfg.ep_size, cfg.pair_capacity)
        ids, _ = trailer(bufs["send"])
        ids.fill_(-1)
        pack_rows(bufs["send"], x, topk_weights, plan, cfg.top_k, rows=plan.slot)
        self._a2a(bufs["recv"], bufs["send"])
        g = group_received(bufs["recv"], cfg.hidden_size, cfg.num_local_experts)
        state = _State(plan, topk_weights, g.perm, buffers=bufs)
        return DispatchHandle(DispatchMode.LOW_LATENCY, x.shape[0], g.x, g.expert_ids, g.weights, g.counts,
                              num_recv=None, event=record_event(x.device), state=state)

    # ---- combine ----------------------------------------------------------------------------------------------
    def combine(self, expert_out: torch.Tensor, handle: DispatchHandle, *,
                weights_applied: bool = False) -> CombineHandle:
        """See :meth:`~.base.TokenDispatcher.combine`."""
        cfg = self.config
        st: _State = handle.state
        if not isinstance(st, _State) or st.combined:
            raise ValueError("combine: the handle was already combined (or comes from another dispatcher)")
        if tuple(expert_out.shape) != tuple(handle.recv_x.shape) or expert_out.dtype != cfg.dtype:
            raise ValueError(f"combine: expert_out must be {tuple(handle.recv_x.shape)} {cfg.dtype}, got "
                             f"{tuple(expert_out.shape)} {expert_out.dtype}")
        st.combined = True
        t, k = handle.num_tokens, cfg.top_k
        if handle.mode is DispatchMode.NORMAL:
            back = ungroup(expert_out, st.perm)
            ret = torch.empty(t * k, cfg.hidden_size, dtype=cfg.dtype, device=expert_out.device)
            self._a2a(ret, back, st.send_splits, st.recv_splits)
            out = weighted_sum(ret, st.plan, st.topk_weights, t, k, cfg.dtype, weights_applied)
        else:
            bufs = st.buffers
            ungroup(expert_out, st.perm, out=bufs["csend"])
            self._a2a(bufs["crecv"], bufs["csend"])
            out = weighted_sum(bufs["crecv"], st.plan, st.topk_weights, t, k, cfg.dtype, weights_applied,
                               rows=st.plan.slot)
        return CombineHandle(out, event=record_event(expert_out.device))

    def close(self) -> None:
        """Drop the buffers (no collective needed)."""
        self._sets = []
