"""Token dispatcher over the Triton-distributed low-latency all-to-all (``sgl_kernel.tdist.all_to_all.AllToAll``).

The kernel (Zheng et al., "Triton-distributed", 2025, sec. 3.4-3.5; see ``docs/tdist.md``) keeps the per-destination
counts on the device: each rank announces its count row into every peer's count matrix, then copies its rows
straight into the peer's symmetric receive buffer at their final, source-ordered offset; combine is the same call
with the received counts. So both modes run without a count all-to-all on the host:

* LOW_LATENCY (decode; DeepEP's low-latency mode): one call of the ``pair_capacity`` object; received rows are
  compact in source order, valid up to ``sum(recv_counts)`` (a device value: rows past it are masked as padding, no
  host sync, CUDA-graph capturable). Combine: the same call on the combine object with ``send_counts =
  recv_counts``, rows come back in the sender's destination order.
* NORMAL (prefill; DeepEP's normal mode): the ranks all-gather their count rows over the group (the count exchange:
  every rank learns the whole ``ep x ep`` matrix, so all agree on the round count), the host reads them (one sync),
  then rows move in rounds of at most ``normal_capacity`` rows per (source, destination) pair through a second pair
  of objects sized from ``--chunked-prefill-size`` (one round for balanced routing; skewed routing takes more).

Buffers: one symmetric heap per dispatcher (CUDA IPC on GPU; host shared memory on CPU, see
``sgl_kernel.tdist.host_heap``) holding the four receive buffers; allocated once in ``__init__`` (collective).
On CPU the kernel runs under the Triton interpreter (``TRITON_INTERPRET=1``), one phase at a time with a gloo
barrier between phases (a process cannot spin on another process's launch inside the interpreter).
Fail closed: every device wait is bounded (``HeapConfig.wait_timeout_s``); the error record is checked at every
host sync (NORMAL mode) and, on CUDA, copied to pinned memory after every call and checked at the next dispatch.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Optional

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
    ungroup,
    weighted_sum,
)

logger = logging.getLogger(__name__)
NORMAL_BUFFER_CAP_BYTES = 256 << 20  # most bytes of one NORMAL-mode receive buffer (rounds beyond it)
HEAP_SLACK_BYTES = 1 << 20  # alignment of the four regions


def normal_capacity(config: DispatcherConfig) -> int:
    """Rows per (source, destination) pair of one NORMAL round: the balanced share of the largest prefill,
    ``ceil(max_tokens_normal * min(k, E/ep) / ep)``, at least ``pair_capacity`` and at most what fits
    :data:`NORMAL_BUFFER_CAP_BYTES` per receive buffer."""
    w = row_width(config.hidden_size, config.dtype)
    share = -(-config.max_tokens_normal * config.slots_per_rank // config.ep_size)
    cap_rows = max(1, NORMAL_BUFFER_CAP_BYTES // (config.ep_size * w * config.element_size))
    return max(config.pair_capacity, min(share, cap_rows))


def _spans(starts: list, counts: list, device: torch.device) -> torch.Tensor:
    """int64 indices ``starts[i] .. starts[i] + counts[i] - 1`` for every i, concatenated (host-known sizes, so no
    device -> host sync)."""
    total = sum(counts)
    if total == 0:
        return torch.empty(0, dtype=torch.int64, device=device)
    st = torch.tensor(starts, dtype=torch.int64, device=device)
    cn = torch.tensor(counts, dtype=torch.int64, device=device)
    first = torch.cumsum(cn, 0) - cn  # position of span i's first index in the output
    return torch.repeat_interleave(st - first, cn, output_size=total) + torch.arange(total, device=device)


@dataclass
class _State:
    """What combine needs from dispatch (private)."""

    plan: SendPlan
    topk_weights: torch.Tensor
    perm: torch.Tensor
    recv_counts: Optional[torch.Tensor] = None  # LOW_LATENCY: device int32 [ep]
    matrix: Any = None  # NORMAL: the host count matrix [ep][ep] (row = source)
    combined: bool = False


class TdistTokenDispatcher(TokenDispatcher):
    """:class:`~.base.TokenDispatcher` over ``sgl_kernel.tdist`` (module docstring). ``group``: the EP group (NCCL
    or gloo on GPU: only the heap's handle exchange and barriers use it; gloo on CPU).

    Raises:
        ValueError: a CPU device without ``TRITON_INTERPRET=1`` (the message names the fix).
        MissingPackageError: triton / sgl_kernel not installed (from the import).
    """

    name = "tdist"

    def __init__(self, config: DispatcherConfig, group: Any):
        super().__init__(config, group)
        from sgl_kernel.tdist.all_to_all import AllToAll
        from sgl_kernel.tdist.layout import HeapConfig

        self.device = torch.device(config.device)
        if self.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("--moe-a2a-backend tdist on CPU runs the Triton kernels under the interpreter: set "
                             "TRITON_INTERPRET=1 in the server's environment (correctness runs only), or use nccl")
        self.width = row_width(config.hidden_size, config.dtype)
        self.normal_cap = normal_capacity(config)
        heap_cfg = HeapConfig(data_bytes=self.buffer_bytes(config), signal_slots=1024)
        if self.device.type == "cuda":
            from sgl_kernel.tdist.heap import SymmetricHeap

            self.heap = SymmetricHeap.create(group, self.device, heap_cfg)
            self._err_host = torch.zeros(1, dtype=torch.int64, pin_memory=True)
        else:
            from sgl_kernel.tdist.host_heap import create_host_heap

            self.heap = create_host_heap(group, heap_cfg)
            self._err_host = None
        chunks = 1 if self.device.type != "cuda" else None
        dt, h, pc = config.dtype, config.hidden_size, config.pair_capacity
        self.ll_dispatch = AllToAll(self.heap, pc, self.width, dt, name="ep.ll.dispatch", chunks=chunks)
        self.ll_combine = AllToAll(self.heap, pc, h, dt, name="ep.ll.combine", chunks=chunks)
        self.n_dispatch = AllToAll(self.heap, self.normal_cap, self.width, dt, name="ep.normal.dispatch", chunks=chunks)
        self.n_combine = AllToAll(self.heap, self.normal_cap, h, dt, name="ep.normal.combine", chunks=chunks)
        logger.info("tdist token dispatcher: EP rank %d/%d on %s (%s heap), low-latency %d rows per peer, normal %d "
                    "rows per peer per round, %.1f MiB", config.ep_rank, config.ep_size, self.device,
                    self.heap.backend, pc, self.normal_cap, self.buffer_bytes(config) / 2**20)

    @staticmethod
    def buffer_bytes(config: DispatcherConfig) -> int:
        """The symmetric heap's data bytes: low-latency and normal receive buffers for dispatch and combine."""
        w, h, es = row_width(config.hidden_size, config.dtype), config.hidden_size, config.element_size
        rows_ll = config.ep_size * config.pair_capacity
        rows_n = config.ep_size * normal_capacity(config)
        return (rows_ll + rows_n) * (w + h) * es + HEAP_SLACK_BYTES

    # ---- the kernel call ------------------------------------------------------------------------------------
    def _call(self, op, x: torch.Tensor, send_counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One all-to-all of ``op`` (rows of x grouped by destination, ``send_counts`` int32 [ep] on the device);
        returns (the receive buffer view, recv_counts int32 [ep])."""
        if x.shape[0] == 0:  # the kernel wants a row to point at; nothing of it is read
            x = torch.zeros(1, x.shape[1], dtype=x.dtype, device=x.device)
        plan = op.prepare(x.contiguous(), send_counts)
        if self.device.type == "cuda":
            op._launch(plan, True, True, True, True)
            self._err_host.copy_(self.heap.error[:1], non_blocking=True)  # checked at the next dispatch
        else:
            from sgl_kernel.tdist.host_heap import run_phased

            run_phased(self.heap, op.stages(plan))
        return plan["out"], plan["recv_counts"]

    def _check_errors(self) -> None:
        """Raise if a device wait of an earlier call gave up (CUDA: the pinned copy, no sync)."""
        if self._err_host is not None and int(self._err_host[0]):
            self.heap.check()

    # ---- dispatch ---------------------------------------------------------------------------------------------
    def dispatch(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                 mode: DispatchMode) -> DispatchHandle:
        """See :meth:`~.base.TokenDispatcher.dispatch`."""
        mode = self.check_dispatch_inputs(x, topk_ids, topk_weights, mode)
        self._check_errors()
        cfg = self.config
        t, k = x.shape[0], cfg.top_k
        plan = plan_send(topk_ids, cfg.num_local_experts, cfg.ep_size)
        send = torch.empty(t * k, self.width, dtype=cfg.dtype, device=x.device)
        pack_rows(send, x, topk_weights, plan, k)
        if mode is DispatchMode.LOW_LATENCY:
            out, rc = self._call(self.ll_dispatch, send, plan.send_counts.to(torch.int32))
            valid = torch.arange(out.shape[0], device=out.device) < rc.clamp(min=0).sum()
            g = group_received(out, cfg.hidden_size, cfg.num_local_experts, valid)
            state = _State(plan, topk_weights, g.perm, recv_counts=rc)
            return DispatchHandle(mode, t, g.x, g.expert_ids, g.weights, g.counts, None, record_event(x.device), state)
        matrix = self._count_matrix(plan.send_counts, topk_ids)
        recv = self._normal_rounds(self.n_dispatch, send, matrix, forward=True)
        g = group_received(recv, cfg.hidden_size, cfg.num_local_experts)
        state = _State(plan, topk_weights, g.perm, matrix=matrix)
        return DispatchHandle(mode, t, g.x, g.expert_ids, g.weights, g.counts, recv.shape[0], record_event(x.device),
                              state)

    def _count_matrix(self, send_counts: torch.Tensor, topk_ids: torch.Tensor) -> list:
        """NORMAL's count exchange: all-gather every rank's count row (plus an out-of-range id flag); the one host
        read. Returns the ``ep x ep`` matrix (row = source). Raises ValueError on bad ids."""
        cfg = self.config
        bad = ((topk_ids < 0) | (topk_ids >= cfg.num_experts)).any().view(1).to(torch.int64)
        row = torch.cat([send_counts, bad])
        if dist.get_backend(self.group) == "gloo":
            row = row.cpu()  # gloo groups (CPU; ranks sharing one GPU) exchange host tensors
        rows = [torch.empty_like(row) for _ in range(cfg.ep_size)]
        dist.all_gather(rows, row, group=self.group)
        host = torch.stack(rows).tolist()
        if any(r[-1] for r in host):
            raise ValueError(f"dispatch: topk_ids outside [0, {cfg.num_experts}) on EP rank(s) "
                             f"{[i for i, r in enumerate(host) if r[-1]]}")
        return [r[:-1] for r in host]

    def _normal_rounds(self, op, rows: torch.Tensor, matrix: list, forward: bool) -> torch.Tensor:
        """Move ``rows`` in rounds of at most ``normal_cap`` rows per pair. forward: rows grouped by destination
        (``matrix[me]``), result grouped by source (``matrix[s][me]``); backward (combine): the reverse."""
        me, ep, cap = self.config.ep_rank, self.config.ep_size, self.normal_cap
        send_n = [matrix[me][d] for d in range(ep)] if forward else [matrix[s][me] for s in range(ep)]
        recv_n = [matrix[s][me] for s in range(ep)] if forward else [matrix[me][d] for d in range(ep)]
        rounds = -(-max(max(r) for r in matrix) // cap) if ep else 0
        out = torch.empty(sum(recv_n), rows.shape[1], dtype=rows.dtype, device=rows.device)
        s_off = [sum(send_n[:i]) for i in range(ep)]
        r_off = [sum(recv_n[:i]) for i in range(ep)]
        for i in range(rounds):
            lo = i * cap
            sc = [max(0, min(cap, n - lo)) for n in send_n]
            rc = [max(0, min(cap, n - lo)) for n in recv_n]
            x = rows[_spans([o + lo for o in s_off], sc, rows.device)]
            got, _ = self._call(op, x, torch.tensor(sc, dtype=torch.int32, device=rows.device))
            if sum(rc):
                out[_spans([o + lo for o in r_off], rc, rows.device)] = got[:sum(rc)]
        return out

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
        back = ungroup(expert_out, st.perm)
        if handle.mode is DispatchMode.LOW_LATENCY:
            ret, _ = self._call(self.ll_combine, back, st.recv_counts)
        else:
            ret = self._normal_rounds(self.n_combine, back, st.matrix, forward=False)
        out = weighted_sum(ret, st.plan, st.topk_weights, handle.num_tokens, cfg.top_k, cfg.dtype, weights_applied)
        return CombineHandle(out, event=record_event(expert_out.device))

    def close(self) -> None:
        """Free the symmetric heap (collective). Idempotent."""
        heap, self.heap = getattr(self, "heap", None), None
        if heap is not None:
            heap.close()
