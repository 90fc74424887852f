"""Low-latency all-to-all with variable counts per destination, for expert-parallel dispatch and combine
(Zheng et al., "Triton-distributed", 2025, sec. 3.4-3.5 low-latency all-to-all; counts stay on the device, as in
DeepEP's low-latency mode, so no host synchronization is needed for variable sizes).

Semantics of ``torch.distributed.all_to_all_single`` with split sizes: rank r's input rows are grouped by
destination (``send_counts[d]`` rows for d = 0..world-1, a device int32 tensor); rank d receives, in source order,
the rows every source sent it, compacted into ``out[0:sum(recv_counts)]``, plus ``recv_counts`` (device int32).
Combine is the same call with ``send_counts = recv_counts`` of the dispatch: rows come back in the original order.

Each row moves once: one kernel, program (j, c) serves destination ``dest = (me + j) % world`` with chunk c of the
rows, and copies them (16-byte vector loads and stores) straight into ``dest``'s symmetric receive buffer ``recv``
([world * capacity, H] in the heap) at their final, source-ordered offset. ``recv`` *is* the output (no second copy).
The offset needs the counts every source sends ``dest``, so a call runs in phases (epoch ``e``, kept per program in
device memory, so no launch argument changes between calls and the call is CUDA-graph capturable):

1. announce (program (j, 0)): write this rank's ``send_counts`` row into ``dest``'s count matrix ``cmat[e % 2][me]``
   (int64 heap signals), then release-SET ``dest``'s ``cflag[me] = e``. It doubles as the credit "this rank entered
   call e, so the consumers of its previous output (stream-ordered before the call) are done with ``recv``";
2. send: wait ``cflag[p] >= e`` for every p (ld.acquire.sys, bounded), read the offset
   ``sum_{s < me} cmat[s][dest]`` and copy chunk c to ``dest``; then red.release.sys ``dest``'s ``arrive[me] += 1``;
3. finish: wait ``arrive[src] >= e * CHUNKS`` for ``src = (me - j) % world``; program (j, 0) writes
   ``recv_counts[src]``;
4. bump: store ``e`` as the program's epoch.

On the GPU the four phases run in ONE launch (every program announces before it waits, all programs are resident:
grid ``world * CHUNKS`` CTAs). The one-process simulation (``TRITON_INTERPRET=1``) launches them one phase at a time
(:meth:`AllToAll.stages`), because a simulated rank cannot spin on another rank's launch. ``cmat`` is double
buffered by epoch parity: a peer can be at most one call ahead (its call e + 1 waits for this rank's announce of
e + 1, which follows this rank's call e), so call e + 1's announce never overwrites counts call e still reads.

A count above ``capacity`` (or negative) is not sent and counts 0 in every offset; the receiver sets
``recv_counts[s] = -1``, and :meth:`AllToAll.__call__` raises after the call when ``check=True`` (fail closed; the
check costs one device->host copy). Every wait is bounded (primitives.signal_wait_until): a dead peer makes the
waits give up after ``HeapConfig.wait_timeout_s`` and :meth:`SymmetricHeap.check` raises, instead of a hang.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from sgl_kernel.tdist import primitives as P
from sgl_kernel.tdist.common import check_tensor

# CTAs per destination by world size. World 2: 64, from the one-copy kernel on 2 x H200 (2026-11-26,
# 1024 x 7168 bf16, random counts: 16 -> 0.068 ms, 32 -> 0.082, 64 -> 0.041; NCCL all_to_all_single 0.072; the
# earlier two-copy kernel on 2 x H100 had 32 as its best). Other worlds keep ~64 CTAs in all (not measured).
DEFAULT_CTAS = {1: 32, 2: 64, 4: 16, 8: 8}


def default_ctas(world: int) -> int:
    """CTAs per destination used when AllToAll is built without ``chunks`` (see :data:`DEFAULT_CTAS`)."""
    return DEFAULT_CTAS.get(world, max(4, 64 // max(world, 1)))


@triton.jit
def _valid(c, capacity):
    """A count as used in offsets: 0 when it was refused (above capacity or negative)."""
    return tl.where((c >= 0) & (c <= capacity), c, 0)


@triton.jit
def _chunk_copy(dst, src, n_elems, c, CHUNKS: tl.constexpr, BLOCK: tl.constexpr):
    """Chunk ``c`` of ``CHUNKS`` of an ``n_elems``-element span; chunks start on 16-element boundaries."""
    per = tl.cdiv(tl.cdiv(n_elems, CHUNKS), 16) * 16
    lo = c * per
    n = tl.maximum(tl.minimum(per, n_elems - lo), 0)
    dst = dst + lo
    src = src + lo
    for start in range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        m = offs < n
        tl.store(dst + offs, tl.load(src + offs, mask=m), mask=m)


@triton.jit
def a2a_kernel(meta, x, send_counts, recv, cmat, cflag, arrive, recv_counts, epochs, H, capacity,
               CHUNKS: tl.constexpr, BLOCK: tl.constexpr, WPAD: tl.constexpr,
               ANNOUNCE: tl.constexpr, SEND: tl.constexpr, FINISH: tl.constexpr, BUMP: tl.constexpr):
    """Program (j, c) of the all-to-all (module docstring; the phase flags select what this launch does).

    x: [S, H] contiguous; send_counts: int32 [world]; recv: heap [world * capacity, H]; cmat: heap int64
    [2, world, world]; cflag, arrive: heap int64 [world]; recv_counts: int32 [world]; epochs: int64
    [world * CHUNKS] (this rank's, not in the heap); WPAD: power of two >= world."""
    j = tl.program_id(0)
    c = tl.program_id(1)
    me = P.rank(meta)
    world = P.num_ranks(meta)
    dest = (me + j) % world
    src = (me + world - j) % world
    slot = epochs + j * CHUNKS + c
    e = tl.load(slot) + 1
    cm = cmat + (e % 2) * world * world
    if ANNOUNCE:
        if c == 0:
            w_offs = tl.arange(0, WPAD)
            row = tl.load(send_counts + w_offs, mask=w_offs < world, other=0).to(tl.int64)
            tl.store(P.symm_at(cm + me * world, dest, meta) + w_offs, row, mask=w_offs < world)
            P.notify(cflag + me, dest, meta, e, P.SIGNAL_SET)
    if SEND:
        tok = e
        for p in range(0, world):
            tok = P.wait(cflag + p, e, meta, 7)
        cmt = P.consume_token(cm, tok)
        start_row = tl.zeros((), tl.int64)
        dst_row = tl.zeros((), tl.int64)
        for d in range(0, world):
            start_row += tl.where(d < dest, tl.maximum(tl.load(send_counts + d).to(tl.int64), 0), 0)  # rows in x
            dst_row += tl.where(d < me, _valid(tl.load(cmt + d * world + dest, volatile=True), capacity), 0)
        cnt = _valid(tl.load(send_counts + dest).to(tl.int64), capacity)
        dst = P.symm_at(recv + dst_row * H, dest, meta)
        _chunk_copy(dst, x + start_row * H, cnt * H, c, CHUNKS, BLOCK)
        P.notify(arrive + me, dest, meta, 1, P.SIGNAL_ADD)
    if FINISH:
        if c == 0:
            tok = P.wait(arrive + src, e * CHUNKS, meta, 8)
            v = tl.load(P.consume_token(cm, tok) + src * world + me, volatile=True)
            tl.store(recv_counts + src, tl.where((v >= 0) & (v <= capacity), v, -1).to(tl.int32))
    if BUMP:
        tl.debug_barrier()
        tl.store(slot, e)


class AllToAll:
    """Host side of the low-latency all-to-all on a :class:`~sgl_kernel.tdist.heap.SymmetricHeap`.

    Args: heap; capacity (most rows one source sends one destination per call) and hidden (H) size the receive
    buffer (``world * capacity * hidden`` elements of ``dtype`` per rank); chunks: CTAs per destination (None:
    :func:`default_ctas` of the world size; must be equal on every rank); block / num_warps: elements one CTA copies
    per loop step and its warps (4096 / 4: 32 elements, four 16-byte loads in flight per thread; the 2 x H100 runs
    measured 2048 / 4 before the one-copy kernel, and benchmark/tdist/bench_kernels.py's 'pieces' variant sweeps both). Construction
    allocates heap regions in
    the same order on every rank (call it on every rank). Usable as the same-node GPU transport of an M2N
    (many-to-many) exchange: one object per direction. Raises ValueError for sizes < 1.
    """

    def __init__(self, heap, capacity: int, hidden: int, dtype: torch.dtype = torch.bfloat16, *,
                 name: str = "a2a", chunks: Optional[int] = None, block: int = 4096, num_warps: int = 4):
        chunks = default_ctas(heap.world) if chunks is None else chunks
        if capacity < 1 or hidden < 1 or chunks < 1:
            raise ValueError(f"capacity={capacity}, hidden={hidden}, chunks={chunks} must all be >= 1")
        if block < 128 or block & (block - 1) or num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"block={block} must be a power of two >= 128 and num_warps={num_warps} in 1..16 "
                             "(a power of two)")
        self.block, self.num_warps = block, num_warps
        self.heap, self.capacity, self.hidden, self.dtype, self.name, self.chunks = (
            heap, capacity, hidden, dtype, name, chunks)
        w = heap.world
        self.recv = heap.tensor(f"{name}.recv", (w * capacity, hidden), dtype)
        self.cmat = heap.signals(f"{name}.cmat", 2 * w * w)
        self.cflag = heap.signals(f"{name}.cflag", w)
        self.arrive = heap.signals(f"{name}.arrive", w)
        self.epochs = torch.zeros(w * chunks, dtype=torch.int64, device=heap.device)
        self.wpad = triton.next_power_of_2(w)

    def __call__(self, x: torch.Tensor, send_counts: torch.Tensor, out: Optional[torch.Tensor] = None,
                 check: bool = False):
        """Exchange rows; returns ``(out, recv_counts)``.

        x: [S, H] contiguous (dtype = self.dtype, on the heap's device), rows grouped by destination; send_counts:
        int32 [world] on the heap's device, sum <= S (not checked on the device path unless check=True).
        Returns ``out`` = this rank's receive buffer, a [world * capacity, H] view of the heap (rows past
        sum(recv_counts) are stale): valid until this rank's next call of this object; work that reads it must be
        stream-ordered before that call. out: optional [world * capacity, H] contiguous buffer the received rows are
        copied into (a second copy; leave None for the one-copy path). Enqueues one kernel, no host sync (unless
        check). check=True synchronizes and raises ValueError if any count exceeded capacity or the send counts do
        not fit x."""
        plan = self.prepare(x, send_counts, out)
        self._launch(plan, True, True, True, True)
        if out is not None:
            out.copy_(self.recv)
            plan["out"] = out
        if check:
            self.check(plan)
        return plan["out"], plan["recv_counts"]

    def prepare(self, x, send_counts, out=None):
        """Validate; returns the plan dict (x, send_counts, out, recv_counts). Raises ValueError on bad input."""
        h = self.heap
        check_tensor("x", x, 2, h.device, self.dtype)
        check_tensor("send_counts", send_counts, 1, h.device, torch.int32)
        if x.shape[1] != self.hidden or not x.is_contiguous():
            raise ValueError(f"all_to_all: x {tuple(x.shape)} must be contiguous with H={self.hidden}")
        if send_counts.numel() != h.world:
            raise ValueError(f"all_to_all: send_counts has {send_counts.numel()} entries, world={h.world}")
        rows = h.world * self.capacity
        if out is not None and (tuple(out.shape) != (rows, self.hidden) or out.dtype != x.dtype
                                or not out.is_contiguous()):
            raise ValueError(f"all_to_all: out must be contiguous [{rows}, {self.hidden}] {x.dtype}")
        recv_counts = torch.empty(h.world, dtype=torch.int32, device=x.device)
        return dict(x=x, send_counts=send_counts, out=self.recv, recv_counts=recv_counts)

    def _launch(self, plan, announce: bool, send: bool, finish: bool, bump: bool) -> None:
        h = self.heap
        a2a_kernel[(h.world, self.chunks)](h.meta, plan["x"], plan["send_counts"], self.recv, self.cmat,
                                           self.cflag, self.arrive, plan["recv_counts"], self.epochs, self.hidden,
                                           self.capacity, CHUNKS=self.chunks, BLOCK=self.block, WPAD=self.wpad,
                                           ANNOUNCE=announce, SEND=send, FINISH=finish, BUMP=bump,
                                           num_warps=self.num_warps)

    def stages(self, plan):
        """The call as four separate launches ``[(name, fn)]`` (announce, send, finish, bump) for the one-process
        simulation, where every rank must run a phase before any rank runs the next (see the module docstring);
        on a GPU with one process per rank, :meth:`__call__` runs them as one launch."""
        return [(n, (lambda f=f: self._launch(plan, *f))) for n, f in (
            ("announce", (True, False, False, False)), ("send", (False, True, False, False)),
            ("finish", (False, False, True, False)), ("bump", (False, False, False, True)))]

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
