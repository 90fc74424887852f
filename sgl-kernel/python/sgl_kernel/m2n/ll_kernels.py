"""Low-latency (LL) device kernels of the ``cuda_push`` M2N transport (one-way latency).

MegaScale-Infer (Zhu et al. 2025, sec. 5) sends M2N messages as GPU-to-GPU writes followed by flags. The flag
protocol of :mod:`sgl_kernel.m2n.push_kernels` pays, per message and after the payload, a system fence in every
thread, a cross-CTA arrival atomic, a ``fence.sc.sys`` and then the release store of the flag -- all of it on the
critical path, and the receiver pays another arrival before its ack. Here every 4-byte payload word travels in one
8-byte word together with the message's tag (the LL idea of NCCL's low-latency protocol, NCCL docs "NCCL_PROTO";
also DeepEP's low-latency kernels): ``word = tag << 32 | data``; an aligned 8-byte store is single-copy atomic, so a
receiver that reads the expected tag also reads that word's data, whatever the order the NVLink writes land in. No
fence, no flag, no cross-CTA counter on either side; the wire carries 2x the payload (512 KB: ~2.6 us at
~400 GB/s, in exchange for ~3 serialized system-scope operations).

State, all per program (CTA) ``c`` of a grid of ``G`` programs fixed per transport (both sides use the same ``G``
and the same split of the ring slot into ``BLOCK``-word blocks, block ``b`` -> program ``b % G``, by position in the
slot, so program ``c`` of the sender only overwrites words that program ``c`` of the receiver has acked):

* ``ctr`` (int64 ``[G]`` per peer and direction, e.g. rows of a ``[2, world, max_grid]`` tensor): messages
  program ``c`` sent to / received from that peer. Tag of
  message ``s`` (0-based): ``(s + 1) mod 2**32`` (never 0, the heap's initial value; a reused slot holds the tag of
  ``s - slots``, never the awaited one): sequence numbers, so nothing is ever reset.
* receiver heap: ``hdr[src, slot, G]`` (int64; ``tag << 32 | rows``: each program reads its own copy, so a fast
  program's next message cannot overwrite the header a slow program still needs) and the LL ring
  ``[src, slot, cap_words]`` int64.
* sender heap: ``acks[peer, G]``: messages of ``peer``'s program ``c`` that were consumed.

:func:`m2n_ll_send_kernel` program ``c``: ``s = ctr[c]``; bounded wait until ``acks[peer, c] >= s - slots +
1``; 16-byte stores (two LL words) of its blocks into the peer's slot; header copy ``c`` (one relaxed store); a CTA
barrier, then ``ctr += 1``. :func:`m2n_ll_recv_kernel` program ``c``: ``r = ctr[c]``; bounded spin (volatile
loads; the CTA agrees through a block reduction, so every thread leaves a spin together and no barrier diverges)
on its header copy, then on each of its blocks until every word carries the tag; stores the data words to ``dst``
(column blocks at ``cap_rows``-row offsets, ``< 0``: packed), program 0 writes ``rows_out`` (a program whose wait
failed writes 0 there when its budget has run out, i.e. after program 0's store); a CTA barrier and one
``st.release.sys`` of ``r + 1`` into the sender's ``acks[me, c]``, then ``ctr += 1``. A wait that runs out of the
heap's wall-clock budget (or sees the abort word) records the tdist error (site 14) and the program stops: rows 0,
nothing acked or advanced; the host's ``check`` raises TimeoutError (the endpoint is then unusable).

:func:`ll_reference` is the torch reference of the ring contents.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from sgl_kernel.m2n.push_kernels import message_rows
from sgl_kernel.tdist import primitives as P

LL_SITE = 14  # tdist.layout.WAIT_SITES code of these kernels
LL_BLOCK = 1024  # LL words (int64) per program and step: 4 KB of payload, 8 KB on the wire
# most programs of one receiver's grid (SGLANG_M2N_LL_MAX_GRID overrides: ll_max_grid): 64 met <= 0.5x graphed NCCL
# send/recv at 32-512 KB on 2 H200s, 32 missed at 512 KB (benchmark/results/archive/afd/2026-11-27_m2n_low_latency_4xh200.md)
LL_MAX_GRID = 64
LL_MAX_GRID_ENV = "SGLANG_M2N_LL_MAX_GRID"
MASK32 = tl.constexpr(0xFFFFFFFF)
HDR_LANES = tl.constexpr(128)  # lanes of the header spin (the 4 warps' threads)
_INTERPRET = P._INTERPRET


@triton.jit
def _lane(x, first):
    """The value of scalar ``x`` in the thread that owns lane ``first`` (a block mask with one true lane), made uniform
    for the CTA by a block reduction (per-thread scalars such as timer reads or a spin's outcome may differ)."""
    return tl.max(tl.where(first, x.to(tl.int64), -(1 << 62)), axis=0)


@triton.jit
def _ll_wait(ptrs, m, tag, meta, first, sig):
    """Spin (volatile loads) until every masked LL word at ``ptrs`` carries ``tag`` in its high 32 bits; returns
    (words, ok) with ``ok`` uniform for the CTA. Bounded like tdist's wait: the budget (ns of ``%globaltimer``,
    ``meta[2 + world]``) and the abort word are checked every 32 polls; on expiry the error record names site 14
    and ``sig``'s heap offset. Under TRITON_INTERPRET=1 a missing tag is recorded at once (reason 3)."""
    me = tl.load(meta).to(tl.int32)
    world = tl.load(meta + 1).to(tl.int32)
    errp = tl.load(meta + 2 + me).to(tl.pointer_type(tl.int64))
    v = tl.load(ptrs, mask=m, other=0, volatile=True)
    miss = tl.sum(tl.where(m & (((v >> 32) & MASK32) != tag), 1, 0), axis=0)
    if _INTERPRET:
        if miss > 0:
            P._wait_failed(errp, meta, me, world, 14, sig, tag, 0, tl.where(tl.load(errp) != 0, 2, 3), 0, 0)
        ok = miss == 0
    else:
        t0 = P._globaltimer()
        budget = tl.load(meta + 2 + world)
        it = 0
        stop = _lane(miss * 0, first)
        while (miss > 0) & (stop == 0):
            v = tl.load(ptrs, mask=m, other=0, volatile=True)
            it += 1
            late = it * 0
            if (it & 31) == 0:
                ns = P._globaltimer() - t0
                late = tl.where(ns > budget, 1, 0) + tl.where(tl.load(errp, volatile=True) != 0, 2, 0)
            miss = tl.sum(tl.where(m & (((v >> 32) & MASK32) != tag), 1, 0), axis=0)
            stop = _lane(late, first)
        ok = miss == 0
        if not ok:  # uniform: every thread records (one CAS wins); reason 1 timed out, 2 a peer aborted
            P._wait_failed(errp, meta, me, world, 14, sig, tag, 0, tl.where((stop & 1) != 0, 1, 2), 0,
                           P._globaltimer() - t0)
    return v, ok


@triton.jit
def _st_first(ptr, value, cond):
    """``st.relaxed.sys.global.b64`` of ``value`` to scalar ``ptr`` by thread 0 only, when ``cond``; no barrier."""
    if _INTERPRET:
        if cond:
            tl.store(ptr, tl.cast(value, tl.int64))
    else:
        tl.inline_asm_elementwise(
            "{ .reg .pred p, q; .reg .b32 t; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; setp.ne.s32 q, $3, 0; "
            "and.pred p, p, q; @p st.relaxed.sys.global.b64 [$1], $2; mov.b32 $0, 0; }",
            "=r,l,l,r", [ptr, tl.cast(value, tl.int64), cond.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _first_block(off, c, G, BLOCK: tl.constexpr):
    """First block index >= ``off // BLOCK`` that belongs to program ``c`` (block ``b`` -> program ``b % G``)."""
    lo = off // BLOCK
    return lo + ((c - lo % G) % G + G) % G


@triton.jit(do_not_specialize=["peer", "ring_delta", "hdr_delta", "rows_arg", "src_rows", "max_rows", "cap_words"])
def m2n_ll_send_kernel(meta, ctr, peer, acks, hdr, hdr_delta, ring, ring_delta, send, rows_ptr, rows_arg, src_rows,
                       max_rows, col_bytes, cap_words, WORLD: tl.constexpr, SLOTS: tl.constexpr,
                       NCOL: tl.constexpr, ROWS_DEV: tl.constexpr, BLOCK: tl.constexpr):
    """See the module docstring. ``ctr``: ``*i64`` [G] (this pair's send counters); ``acks``: ``*i64`` [G] (the
    local ack words of ``peer``); ``hdr``:
    ``*i64`` local header base (``hdr + hdr_delta`` is the peer's ``hdr[me, 0, 0]``); ``ring``: ``*i64`` (``ring +
    ring_delta`` is the peer's LL slot 0 for this sender, slot stride ``cap_words``); ``send``: ``*i32`` packed for
    ``src_rows`` (< 0: ``rows``); ``rows_ptr``: ``*i64`` [1] (``ROWS_DEV``) else ``rows_arg``; rows clamped to
    [0, max_rows]."""
    c = tl.program_id(0)
    G = tl.num_programs(0)
    offs = tl.arange(0, BLOCK)
    first = offs == 0
    s = tl.load(ctr + c)
    slot = s % SLOTS
    tag = (s + 1) & MASK32
    rows = message_rows(rows_ptr, rows_arg, s, max_rows, ROWS_DEV)
    need = tl.maximum(s - SLOTS + 1, 0)
    tok = P.wait(acks + c, need, meta, 14)  # bounded; this program's words of the slot are free after it
    ok = _lane(tok >= need, first) != 0
    n = tl.where(ok, rows, 0)
    dst = P.consume_token(ring + tl.multiple_of(ring_delta + slot * cap_words, 2), tok)  # 16-byte aligned
    src_r = tl.where(src_rows < 0, rows, src_rows)
    soff = rows * 0
    doff = rows * 0
    for col in tl.static_range(NCOL):
        cb = tl.load(col_bytes + col)
        n4 = (n * cb + 15) // 16 * 4
        for b in range(_first_block(doff, c, G, BLOCK), (doff + n4 + BLOCK - 1) // BLOCK, G):
            o = b * BLOCK + offs - doff
            msk = (o >= 0) & (o < n4)
            v = tl.load(send + tl.multiple_of(soff, 4) + o, mask=msk, other=0).to(tl.int64) & MASK32
            tl.store(dst + tl.multiple_of(doff, 4) + o, (tag << 32) | v, mask=msk)
        soff += (src_r * cb + 15) // 16 * 4
        doff += (rows * cb + 15) // 16 * 4
    _st_first(hdr + hdr_delta + slot * G + c, (tag << 32) | rows, ok)
    tl.debug_barrier()  # every thread read ``s`` before it advances
    if ok:
        tl.store(ctr + c, s + 1)


@triton.jit(do_not_specialize=["src", "ack_delta", "cap_rows", "max_rows", "cap_words"])
def m2n_ll_recv_kernel(meta, ctr, src, hdr, ack, ack_delta, ring, dst, rows_out, col_bytes, cap_rows, max_rows,
                       cap_words, WORLD: tl.constexpr, SLOTS: tl.constexpr, NCOL: tl.constexpr,
                       BLOCK: tl.constexpr):
    """See the module docstring. ``ctr``: ``*i64`` [G] (receive counters from ``src``); ``hdr``: ``*i64`` local
    ``[WORLD, SLOTS, G]``; ``ack``: ``*i64`` local ``acks[me,
    0]`` (``ack + ack_delta`` is ``src``'s ``acks[me, 0]``); ``ring``: ``*i64`` local ``[WORLD, SLOTS, cap_words]``;
    ``dst``: ``*i32``; ``rows_out``: ``*i64`` [1]; ``col_bytes``: ``*i64`` [NCOL]."""
    c = tl.program_id(0)
    G = tl.num_programs(0)
    offs = tl.arange(0, BLOCK)
    first = offs == 0
    r = tl.load(ctr + c)
    slot = r % SLOTS
    tag = (r + 1) & MASK32
    hp = hdr + (src * SLOTS + slot) * G + c
    ho = tl.arange(0, HDR_LANES)  # the header: one lane per thread (every thread needs the row count)
    hv, ok = _ll_wait(hp + ho * 0, ho >= 0, tag, meta, ho == 0, hp)
    rows = tl.where(ok, tl.minimum(tl.max(hv & MASK32, axis=0), max_rows), 0)
    base = ring + tl.multiple_of((src * SLOTS + slot) * cap_words, 2)  # slots are 16-byte aligned
    out_rows = tl.where(cap_rows < 0, rows, cap_rows)
    soff = rows * 0
    doff = rows * 0
    for col in tl.static_range(NCOL):
        cb = tl.load(col_bytes + col)
        n4 = (rows * cb + 15) // 16 * 4
        for b in range(_first_block(soff, c, G, BLOCK), (soff + n4 + BLOCK - 1) // BLOCK, G):
            o = b * BLOCK + offs - soff
            msk = (o >= 0) & (o < tl.where(ok, n4, 0))  # after a failed wait: no more spins
            v, okb = _ll_wait(base + tl.multiple_of(soff, 4) + o, msk, tag, meta, first, base)
            ok = ok & okb
            tl.store(dst + tl.multiple_of(doff, 4) + o, (v & MASK32).to(tl.int32), mask=msk & (o < tl.where(okb, n4, 0)))
        soff += n4
        doff += (out_rows * cb + 15) // 16 * 4
    if (c == 0) | (not ok):  # a failed program stores 0 after its budget ran out: long after program 0's rows
        tl.store(rows_out, tl.where(ok, rows, 0))
    if ok:
        P.st_release(ack + ack_delta + c, r + 1)  # a CTA barrier, then thread 0: every read above is done
        tl.store(ctr + c, r + 1)


def ll_reference(send: torch.Tensor, rows: int, col_bytes: list[int], seq: int, src_rows: int = -1) -> torch.Tensor:
    """Torch reference of a sent message's LL words: ``send`` (uint8, column blocks at ``src_rows``-row offsets, < 0:
    packed for ``rows``; each padded to 16 bytes) -> int64 ``[n]`` words ``tag << 32 | data`` of the payload packed
    for ``rows`` (tag ``(seq + 1) mod 2**32``; data: each little-endian 4-byte word, zero-extended)."""
    srows = rows if src_rows < 0 else src_rows
    parts, so = [], 0
    for b in col_bytes:
        n = (rows * b + 15) // 16 * 16
        parts.append(send[so:so + n])
        so += (srows * b + 15) // 16 * 16
    data = torch.cat(parts).view(torch.int32).to(torch.int64) & 0xFFFFFFFF if parts else torch.zeros(0, dtype=torch.int64)
    return (((seq + 1) & 0xFFFFFFFF) << 32) | data


def ll_max_grid() -> int:
    """The most programs of a receiver's LL grid: ``SGLANG_M2N_LL_MAX_GRID`` (1-1024) or :data:`LL_MAX_GRID`. Every
    rank of a group must use the same value (the hello carries it).

    Raises:
        ValueError: the variable is not an integer in 1-1024.
    """
    raw = os.environ.get(LL_MAX_GRID_ENV, "").strip()
    if not raw:
        return LL_MAX_GRID
    if not raw.isdigit() or not 1 <= int(raw) <= 1024:
        raise ValueError(f"{LL_MAX_GRID_ENV}={raw!r}: use an integer from 1 to 1024 (default {LL_MAX_GRID})")
    return int(raw)


def ll_grid(cap_bytes: int, max_grid: int = LL_MAX_GRID, block: int = LL_BLOCK) -> int:
    """The fixed grid of a receiver with ``cap_bytes`` of ring slot (one program per ``4 * block`` payload bytes,
    1 .. ``max_grid``); both sides of a pair use it."""
    return max(1, min(max_grid, -(-cap_bytes // (4 * block))))


def launch_ll_send(meta, ctr, peer: int, acks, hdr, hdr_delta: int, ring, ring_delta: int, send, rows: int, rows_dev,
                   src_rows: int, max_rows: int, col_bytes, world: int, slots: int, cap_words: int, grid: int,
                   block: int = LL_BLOCK) -> None:
    """Launch :func:`m2n_ll_send_kernel` (``grid`` programs, the receiver's :func:`ll_grid`) on the current stream.
    ``ring``: int64 view of the local LL ring; ``send``: int32 view of the packed payload; ``rows_dev``: None or an
    int64 [1] device tensor."""
    m2n_ll_send_kernel[(grid,)](meta, ctr, peer, acks, hdr, hdr_delta, ring, ring_delta, send,
                                rows_dev if rows_dev is not None else ctr, rows, src_rows, max_rows, col_bytes,
                                cap_words, WORLD=world, SLOTS=slots, NCOL=int(col_bytes.numel()),
                                ROWS_DEV=rows_dev is not None, BLOCK=block)


def launch_ll_recv(meta, ctr, src: int, hdr, ack, ack_delta: int, ring, dst, rows_out, col_bytes, cap_rows: int,
                   max_rows: int, world: int, slots: int, cap_words: int, grid: int, block: int = LL_BLOCK) -> None:
    """Launch :func:`m2n_ll_recv_kernel` (``grid`` programs) on the current stream. ``hdr``: int64 local headers;
    ``ack``: int64 ``acks[me, :]`` (stored ``ack_delta`` elements further, in ``src``'s heap); ``ring``: int64
    local LL ring; ``dst``: int32 view."""
    m2n_ll_recv_kernel[(grid,)](meta, ctr, src, hdr, ack, ack_delta, ring, dst, rows_out, col_bytes, cap_rows,
                                max_rows, cap_words, WORLD=world, SLOTS=slots, NCOL=int(col_bytes.numel()),
                                BLOCK=block)
