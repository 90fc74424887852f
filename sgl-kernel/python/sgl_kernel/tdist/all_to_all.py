"""Low-latency all-to-all with variable counts per destination, for expert-parallel dispatch and combine
(Zheng et al., "Triton-distributed", 2025, sec. 3.4-3.5 low-latency all-to-all; counts stay on the device, as in
DeepEP's low-latency mode, so no host synchronization is needed for variable sizes).

Semantics of ``torch.distributed.all_to_all_single`` with split sizes: rank r's input rows are grouped by
destination (``send_counts[d]`` rows for d = 0..world-1, a device int32 tensor); rank d receives, in source order,
the rows every source sent it, compacted into ``out[0:sum(recv_counts)]``, plus ``recv_counts`` (device int32).
Combine is the same call with ``send_counts = recv_counts`` of the dispatch: rows come back in the original order.

Send kernel, program (j, c): destination ``(me + j) % world``; wait until it released its slot of the previous call;
put chunk c of the rows into the destination's heap slot ``slots[me]`` ([world, capacity, H]); chunk 0 also writes
the count; every program then adds 1 (red.release.sys) to the destination's ``arrive[me]``. Receive kernel, program
(s, c): wait ``arrive[s']`` for every source s' <= s (to know the output offset), copy chunk c of slot s to the
output. Then common.release_kernel. A count above ``capacity`` is not sent: the sender stores -1 as the count, the
receiver sets ``recv_counts[s] = -1`` and copies nothing, and :meth:`AllToAll.__call__` raises after the call when
``check=True`` (fail closed; the check costs one device->host copy).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from sgl_kernel.tdist import primitives as P
from sgl_kernel.tdist.common import check_tensor, copy_span, release_kernel


@triton.jit
def a2a_send_kernel(meta, x, send_counts, slots, counts, arrive, ready, state, H, capacity,
                    CHUNKS: tl.constexpr, BLOCK: tl.constexpr):
    """Dispatch side: see module docstring. x: [S, H] contiguous; send_counts: int32 [world]."""
    j = tl.program_id(0)
    c = tl.program_id(1)
    me = P.rank(meta)
    world = P.num_ranks(meta)
    dest = (me + j) % world
    start_row = 0
    for d in range(0, world):
        start_row += tl.where(d < dest, tl.load(send_counts + d), 0)
    cnt = tl.load(send_counts + dest)
    ok = cnt <= capacity
    P.wait(ready + dest, tl.load(state), meta, 7)
    n_elems = tl.where(ok, cnt, 0).to(tl.int64) * H
    per = tl.cdiv(tl.cdiv(n_elems, CHUNKS), 16) * 16  # chunks start on 16-element boundaries (vector copies)
    lo = c * per
    n = tl.maximum(tl.minimum(per, n_elems - lo), 0)
    dst = slots + me.to(tl.int64) * capacity * H + lo
    copy_span(P.symm_at(dst, dest, meta), x + start_row.to(tl.int64) * H + lo, n, BLOCK)
    if c == 0:
        tl.store(P.symm_at(counts + me, dest, meta), tl.where(ok, cnt, -1).to(tl.int64))
    P.notify(arrive + me, dest, meta, 1, P.SIGNAL_ADD)


@triton.jit
def a2a_recv_kernel(meta, slots, counts, arrive, out, recv_counts, state, H, capacity,
                    CHUNKS: tl.constexpr, BLOCK: tl.constexpr):
    """Receive side: program (s, c) copies chunk c of source s's slot to ``out`` at the source-ordered offset."""
    s = tl.program_id(0)
    c = tl.program_id(1)
    start_row = tl.zeros((), tl.int64)
    cnt = tl.zeros((), tl.int64)
    target = tl.load(state + 1) + CHUNKS  # every source adds CHUNKS per call (cumulative, never reset)
    for p in range(0, s + 1):
        tok = P.wait(arrive + p, target, meta, 8)
        v = tl.load(P.consume_token(counts + p, tok), volatile=True)
        vv = tl.maximum(v, 0)
        start_row += tl.where(p < s, vv, 0)
        cnt = tl.where(p < s, cnt, vv)
    if c == 0:
        tl.store(recv_counts + s, tl.load(counts + s, volatile=True).to(tl.int32))
    n_elems = cnt * H
    per = tl.cdiv(tl.cdiv(n_elems, CHUNKS), 16) * 16  # chunks start on 16-element boundaries (vector copies)
    lo = c * per
    n = tl.maximum(tl.minimum(per, n_elems - lo), 0)
    copy_span(out + start_row * H + lo, slots + s.to(tl.int64) * capacity * H + lo, n, BLOCK)


class AllToAll:
    """Host side of the low-latency all-to-all on a :class:`~sgl_kernel.tdist.heap.SymmetricHeap`.

    Args: heap; capacity (most rows one source sends one destination per call) and hidden (H) size the slots
    (``world * capacity * hidden`` elements of ``dtype`` per rank); chunks: CTAs per peer. Usable as the same-node
    GPU transport of an M2N (many-to-many) exchange: one object per direction.
    """

    def __init__(self, heap, capacity: int, hidden: int, dtype: torch.dtype = torch.bfloat16, *,
                 name: str = "a2a", chunks: int = 16):
        if capacity < 1 or hidden < 1 or chunks < 1:
            raise ValueError(f"capacity={capacity}, hidden={hidden}, chunks={chunks} must all be >= 1")
        self.heap, self.capacity, self.hidden, self.dtype, self.name, self.chunks = (
            heap, capacity, hidden, dtype, name, chunks)
        self.slots = heap.tensor(f"{name}.slots", (heap.world, capacity, hidden), dtype)
        self.counts = heap.signals(f"{name}.counts", heap.world)
        self.arrive = heap.signals(f"{name}.arrive", heap.world)
        self.ready = heap.signals(f"{name}.ready", heap.world)
        self.state = heap.counters(name)  # device epochs (common.release_kernel), shared by ops of this name

    def __call__(self, x: torch.Tensor, send_counts: torch.Tensor, out: Optional[torch.Tensor] = None,
                 check: bool = False):
        """Exchange rows; returns ``(out, recv_counts)``.

        x: [S, H] contiguous (dtype = self.dtype), rows grouped by destination; send_counts: int32 [world] on the
        heap's device, sum <= S (not checked on the device path unless check=True); out: optional
        [world * capacity, H] buffer (rows past sum(recv_counts) are left untouched). check=True synchronizes and
        raises ValueError if any count exceeded capacity or the send counts do not fit x.
        """
        plan = self.prepare(x, send_counts, out)
        self.send(plan)
        self.recv(plan)
        self.release(plan)
        if check:
            self.check(plan)
        return plan["out"], plan["recv_counts"]

    def prepare(self, x, send_counts, out=None):
        """Validate and take the epoch (split for simulation: every rank's :meth:`send`, then :meth:`recv`,
        :meth:`release`)."""
        h = self.heap
        check_tensor("x", x, 2, h.device, self.dtype)
        check_tensor("send_counts", send_counts, 1, h.device, torch.int32)
        if x.shape[1] != self.hidden or not x.is_contiguous():
            raise ValueError(f"all_to_all: x {tuple(x.shape)} must be contiguous with H={self.hidden}")
        if send_counts.numel() != h.world:
            raise ValueError(f"all_to_all: send_counts has {send_counts.numel()} entries, world={h.world}")
        rows = h.world * self.capacity
        if out is None:
            out = torch.empty(rows, self.hidden, dtype=x.dtype, device=x.device)
        elif tuple(out.shape) != (rows, self.hidden) or out.dtype != x.dtype or not out.is_contiguous():
            raise ValueError(f"all_to_all: out must be contiguous [{rows}, {self.hidden}] {x.dtype}")
        recv_counts = torch.empty(h.world, dtype=torch.int32, device=x.device)
        epoch = h.epochs.next(f"{self.name}.call")
        target = h.epochs.advance(f"{self.name}.arrive", self.chunks)
        return dict(x=x, send_counts=send_counts, out=out, recv_counts=recv_counts, epoch=epoch, target=target)

    def send(self, plan) -> None:
        """Put this rank's rows into every destination's slot and signal."""
        h = self.heap
        a2a_send_kernel[(h.world, self.chunks)](h.meta, plan["x"], plan["send_counts"], self.slots, self.counts,
                                                self.arrive, self.ready, self.state, self.hidden,
                                                self.capacity, CHUNKS=self.chunks, BLOCK=2048, num_warps=4)

    def recv(self, plan) -> None:
        """Wait for every source and compact the received rows into ``out``."""
        h = self.heap
        a2a_recv_kernel[(h.world, self.chunks)](h.meta, self.slots, self.counts, self.arrive, plan["out"],
                                                plan["recv_counts"], self.state, self.hidden, self.capacity,
                                                CHUNKS=self.chunks, BLOCK=2048, num_warps=4)

    def release(self, plan) -> None:
        """Tell every source its slot here may be overwritten by the next call."""
        release_kernel[(1,)](self.heap.meta, self.ready, self.state, self.chunks)

    def check(self, plan) -> None:
        """Synchronizing check (fail closed): ValueError if a source's count exceeded capacity or the send counts
        do not fit x."""
        sc = plan["send_counts"].tolist()
        if any(c < 0 for c in sc) or sum(sc) > plan["x"].shape[0]:
            raise ValueError(f"all_to_all: send_counts={sc} must be >= 0 and sum to <= {plan['x'].shape[0]} rows")
        rc = plan["recv_counts"].tolist()
        if any(c < 0 for c in rc) or any(c > self.capacity for c in sc):
            raise ValueError(f"all_to_all: a count exceeded capacity={self.capacity} (send {sc}, recv {rc}); "
                             f"build AllToAll with a larger capacity")
