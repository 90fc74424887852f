"""Device side of the device-driven M2N transport (MegaScale-Infer, Zhu et al. 2025, sec. 5: M2N without host
involvement per message; GPU-to-GPU writes + flags).

Two Triton kernels built from the Triton-distributed primitives of :mod:`sgl_kernel.tdist.primitives` (no second
signalling layer). Sequence numbers live on the device, in the endpoint's counter tensor ``ctr`` (int64
``[4 * world]``: ``[0, world)`` messages sent to each peer, ``[world, 2 world)`` received from each peer, then one
arrival word per peer for each kernel); the kernels read and advance them, so a launch's arguments never change
from message to message and a send / receive is CUDA-graph capturable (replays continue the sequences).

:func:`m2n_send_kernel` (sender, ``grid`` programs, to ``peer``): ``s = ctr[peer]``, slot ``s % slots``;

1. bounded wait (``ld.acquire.sys``) until the sender's ``acks[peer] >= s - slots + 1``: the peer consumed the
   message that used the slot before;
2. vector copy (16-byte loads/stores) of the column blocks from the local send buffer (blocks at the offsets of
   ``src_rows`` rows) into the peer's IPC-mapped ring slot, packed for ``rows`` (a launch argument, or an int64
   device scalar with ``ROWS_DEV``: a graph can send a row count computed on the device);
3. every program arrives on a counter (``atom.acq_rel.sys`` after a CTA barrier; ``+ 2**32`` when its wait gave
   up); the last one resets it and, only when every program's wait succeeded, advances ``ctr[peer]``, fences
   (``fence.sc.sys``) and release-stores ``(s + 1) << 32 | rows`` into the peer's flag word ``flags[me, slot]``
   (``st.release.sys``): a receiver that acquires the flag sees every program's payload, never a partial one.

Every thread spins on its own (the tdist wait); one scalar atomic read of the signal after the spin then decides
for the whole CTA (:func:`_uniform`), so threads that disagree at the budget's edge neither copy half a block nor
split around the CTA barriers of the release store (a hang).

:func:`m2n_recv_kernel` (receiver, from ``src``): ``r = ctr[world + src]``, slot ``r % slots``; every program spins
with ``ld.acquire.sys`` on ``flags[src, slot]`` until ``>= (r + 1) << 32`` (bounded by the heap's wall-clock budget:
on expiry the tdist error record names the kernel, the host raises from ``SymmetricHeap.check``, the kernel goes on
with 0 rows and advances nothing), copies the row count's column blocks to ``dst`` (at the offsets of ``cap_rows``
rows; ``cap_rows < 0``: packed); the last program to arrive writes ``rows_out`` (0 unless every program's wait
succeeded) and then advances ``ctr[world + src]`` and release-stores the ack ``r + 1`` into the sender's heap
(``ack + ack_delta``: tdist's ``symm_at`` arithmetic; the ring slot is free once the payload is copied out, so the
ack needs no later launch).

:func:`relayout_reference` is the torch reference of both copies.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sgl_kernel.tdist import primitives as P

M2N_WAIT_SITE = 13  # tdist.layout.WAIT_SITES code of these kernels (names them in the host's error)
ROWS_MASK = 0xFFFFFFFF


@triton.jit
def _copy_cols(src, dst, col_bytes, rows, src_rows, dst_rows, NCOL: tl.constexpr, BLOCK: tl.constexpr):
    """Copy ``rows`` rows of each column block from ``src`` (blocks at ``src_rows``-row offsets) to ``dst`` (blocks at
    ``dst_rows``-row offsets); int32 words, blocks padded to 16 bytes; programs split every block."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    soff = rows * 0
    doff = rows * 0
    for c in tl.static_range(NCOL):
        cb = tl.load(col_bytes + c)
        n4 = (rows * cb + 15) // 16 * 4  # int32 words of the padded block
        for start in range(pid * BLOCK, n4, nprog * BLOCK):
            offs = start + tl.arange(0, BLOCK)
            m = offs < n4
            v = tl.load(src + tl.multiple_of(soff, 4) + offs, mask=m)
            tl.store(dst + tl.multiple_of(doff, 4) + offs, v, mask=m)
        soff += (src_rows * cb + 15) // 16 * 4
        doff += (dst_rows * cb + 15) // 16 * 4


@triton.jit
def _uniform(sig, need):
    """After every thread's bounded :func:`~sgl_kernel.tdist.primitives.wait` on ``sig``: one value of ``*sig`` for
    the whole CTA (a scalar ``atom.acq_rel.sys`` add of 0, performed by one thread and broadcast by Triton) and
    whether it reached ``need``. The threads' own spins may disagree at the budget's edge (one timed out, another
    saw the signal); copying, counting and the barriers of the release store then all follow this one value."""
    v = P.atomic_add(sig, 0)
    return v, v >= need


@triton.jit
def _arrive_last(done, ok):
    """Every program arrives once on ``done`` (every thread's ``fence.acq_rel.sys``, a CTA barrier, then one
    ``atom.acq_rel.sys`` add of ``1``, plus ``2**32`` when this program's wait failed); returns (last, all_ok): True
    in the last program, which resets ``done`` to 0 for the next launch (stream-ordered after this one), and
    whether every program's wait succeeded (a program that gave up copied nothing: the last one must then publish
    nothing). The last program's later release store thus follows every program's copy, system-wide."""
    P.fence()
    tl.debug_barrier()
    old = P.atomic_add(done, tl.where(ok, 1, 1 + (1 << 32)).to(tl.int64))
    last = (old & 0xFFFFFFFF) == tl.num_programs(0) - 1
    if last:
        tl.store(done, 0)
    return last, ok & ((old >> 32) == 0)


@triton.jit
def message_rows(rows_ptr, rows_arg, s, max_rows, ROWS_DEV: tl.constexpr):
    """A message's row count (int64), clamped to [0, ``max_rows``]: read from the device word ``rows_ptr``
    (``ROWS_DEV``: decided by an earlier kernel, graph-capturable) or the launch argument ``rows_arg``; ``s``
    (an int64 tensor of the kernel) only gives the host value its type."""
    if ROWS_DEV:
        rows = tl.load(rows_ptr)
    else:
        rows = tl.cast(rows_arg, tl.int64) + s * 0
    return tl.minimum(tl.maximum(rows, 0), max_rows)


@triton.jit(do_not_specialize=["peer", "ring_delta", "flag_delta", "rows_arg", "src_rows", "max_rows", "cap32"])
def m2n_send_kernel(meta, ctr, peer, acks, flags, flag_delta, ring, ring_delta, send, rows_ptr, rows_arg, src_rows,
                    max_rows, col_bytes, cap32, WORLD: tl.constexpr, SLOTS: tl.constexpr, NCOL: tl.constexpr,
                    ROWS_DEV: tl.constexpr, BLOCK: tl.constexpr):
    """See the module docstring. ``meta``: the transport heap's meta; ``ctr``: ``*i64`` [4 * WORLD]; ``acks`` /
    ``flags``: ``*i64`` local heap bases (``flags + flag_delta`` is the peer's ``flags[me, 0]``); ``ring`` /
    ``send``: ``*i32`` (``ring + ring_delta`` is the peer's ring slot 0 for this sender, slot stride ``cap32`` words,
    a multiple of 4);
    ``rows_ptr``: ``*i64`` [1] (``ROWS_DEV``) else ``rows_arg``; rows are clamped to [0, max_rows]."""
    s = tl.load(ctr + peer)
    slot = s % SLOTS
    rows = message_rows(rows_ptr, rows_arg, s, max_rows, ROWS_DEV)
    need = tl.maximum(s - SLOTS + 1, 0)
    P.wait(acks + peer, need, meta, 13)  # bounded; a timed-out wait (peer dead or stalled) writes nothing into it
    tok, ok = _uniform(acks + peer, need)
    dst = P.consume_token(ring + tl.multiple_of(ring_delta + slot * cap32, 4), tok)
    src_r = tl.where(src_rows < 0, rows, src_rows)
    _copy_cols(send, dst, col_bytes, tl.where(ok, rows, 0), src_r, rows, NCOL, BLOCK)
    last, all_ok = _arrive_last(ctr + 2 * WORLD + peer, ok)
    if last:
        if all_ok:
            tl.store(ctr + peer, s + 1)
            P.quiet()
            P.st_release(flags + flag_delta + slot, ((s + 1) << 32) | rows)


@triton.jit(do_not_specialize=["src", "ack_delta", "cap_rows", "max_rows", "cap32"])
def m2n_recv_kernel(meta, ctr, src, flags, ack, ack_delta, ring, dst, rows_out, col_bytes, cap_rows, max_rows, cap32,
                    WORLD: tl.constexpr, SLOTS: tl.constexpr, NCOL: tl.constexpr, COPY: tl.constexpr,
                    BLOCK: tl.constexpr):
    """See the module docstring. ``flags``: ``*i64`` local ``flags[world, SLOTS]``; ``ack``: ``*i64`` this rank's
    ack word (``ack + ack_delta`` is ``src``'s ``acks[me]``); ``ring``: ``*i32`` local ``[world, SLOTS, cap32]``;
    ``dst``: ``*i32``; ``rows_out``: ``*i64`` [1]; ``col_bytes``: ``*i64`` [NCOL] bytes per row of each column."""
    r = tl.load(ctr + WORLD + src)
    slot = r % SLOTS
    expect = (r + 1) << 32
    P.wait(flags + src * SLOTS + slot, expect, meta, 13)
    token, ok = _uniform(flags + src * SLOTS + slot, expect)
    rows = tl.where(ok, token & 0xFFFFFFFF, 0)
    rows = tl.minimum(rows, max_rows)
    if COPY:
        srcp = P.consume_token(ring + tl.multiple_of((src * SLOTS + slot) * cap32, 4), token)
        _copy_cols(srcp, dst, col_bytes, rows, rows, tl.where(cap_rows < 0, rows, cap_rows), NCOL, BLOCK)
    last, all_ok = _arrive_last(ctr + 3 * WORLD + src, ok)
    if last:
        tl.store(rows_out, tl.where(all_ok, rows, 0))
        if all_ok:
            tl.store(ctr + WORLD + src, r + 1)
            P.st_release(ack + ack_delta, r + 1)


def relayout_reference(ring: torch.Tensor, rows: int, col_bytes: list[int], cap_rows: int,
                       src_rows: int = -1) -> torch.Tensor:
    """Torch reference of the kernels' copy: ``ring`` (uint8, column blocks at the offsets of ``src_rows`` rows,
    ``< 0``: packed for ``rows``; each padded to 16 bytes) -> a new uint8 tensor with ``rows`` rows of each block at
    the offsets for ``cap_rows`` rows (``cap_rows < 0``: ``rows``); bytes outside the copied blocks are 0."""
    cap = rows if cap_rows < 0 else cap_rows
    srows = rows if src_rows < 0 else src_rows
    out = torch.zeros(sum((cap * b + 15) // 16 * 16 for b in col_bytes), dtype=torch.uint8, device=ring.device)
    so = do = 0
    for b in col_bytes:
        n = (rows * b + 15) // 16 * 16
        out[do:do + n] = ring[so:so + n]
        so += (srows * b + 15) // 16 * 16
        do += (cap * b + 15) // 16 * 16
    return out


def flag_value(seq: int, rows: int) -> int:
    """The flag word of message ``seq`` (0-based, per sender and receiver) with ``rows`` rows. Raises ValueError for
    rows outside [0, 2**32) or a negative seq."""
    if not 0 <= rows <= ROWS_MASK or seq < 0:
        raise ValueError(f"M2N flag: rows={rows} must be in [0, 2**32) and seq={seq} >= 0")
    return ((seq + 1) << 32) | rows


def grid_for(nbytes: int, max_grid: int = 32, block: int = 1024) -> int:
    """Programs for a copy of ``nbytes`` (one per ``4 * block`` bytes, 1 .. ``max_grid``)."""
    return max(1, min(max_grid, -(-nbytes // (4 * block))))


def launch_send(meta: torch.Tensor, ctr: torch.Tensor, peer: int, acks: torch.Tensor, flags: torch.Tensor,
                flag_delta: int, ring: torch.Tensor, ring_delta: int, send: torch.Tensor, rows: int,
                rows_dev, src_rows: int, max_rows: int, col_bytes: torch.Tensor, world: int, slots: int, cap32: int,
                grid: int, block: int = 1024) -> None:
    """Launch :func:`m2n_send_kernel` on the current stream (``grid`` programs). ``ring`` / ``send``: int32 views
    (local ring base, packed send slot); ``flags`` / ``acks``: int64 views of the local heap's bases; ``rows_dev``:
    None (``rows`` rows) or an int64 [1] device tensor."""
    m2n_send_kernel[(grid,)](meta, ctr, peer, acks, flags, flag_delta, ring, ring_delta, send,
                             rows_dev if rows_dev is not None else ctr, rows, src_rows, max_rows, col_bytes, cap32,
                             WORLD=world, SLOTS=slots, NCOL=int(col_bytes.numel()),
                             ROWS_DEV=rows_dev is not None, BLOCK=block)


def launch_recv(meta: torch.Tensor, ctr: torch.Tensor, src: int, flags: torch.Tensor, ack: torch.Tensor,
                ack_delta: int, ring: torch.Tensor, dst: torch.Tensor, rows_out: torch.Tensor, col_bytes: torch.Tensor,
                cap_rows: int, max_rows: int, world: int, slots: int, cap32: int, copy: bool, grid: int,
                block: int = 1024) -> None:
    """Launch :func:`m2n_recv_kernel` on the current stream (``grid`` programs). ``ring`` / ``dst``: int32 views;
    ``flags``: int64 ``[world * slots]``; ``ack``: this rank's int64 ack word (stored ``ack_delta`` elements
    further, in ``src``'s mapped heap)."""
    m2n_recv_kernel[(grid,)](meta, ctr, src, flags, ack, ack_delta, ring, dst, rows_out, col_bytes, cap_rows, max_rows,
                             cap32, WORLD=world, SLOTS=slots, NCOL=int(col_bytes.numel()), COPY=copy, BLOCK=block)
