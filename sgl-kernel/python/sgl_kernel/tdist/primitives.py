"""OpenSHMEM-style device primitives for Triton kernels (Zheng et al., "Triton-distributed", 2025, sec. 2-3, Table 1).

All are ``@triton.jit`` device functions over the symmetric heap of :mod:`sgl_kernel.tdist.heap`. A kernel receives
``meta`` (int64 ``[rank, world, base_0 .. base_{world-1}, wait_budget_ns]``) and calls these functions with *local*
heap pointers;
``symm_at`` turns them into a peer's. Signals are int64 slots (``*i64``) that are set to an epoch or counted up, never
reset (see layout.py).

Memory ordering (PTX ISA memory consistency model, scope ``.sys`` everywhere: peers are other processes, possibly
other GPUs, so ``.gpu`` scope would not be enough):

* ``ld_acquire``: ``ld.acquire.sys.global``: later loads/stores of this thread are not performed before it;
  if it reads a value written by a release, everything before that release is visible after it.
* ``st_release`` / ``red_release``: ``st.release.sys`` / ``red.release.sys.add``: earlier loads/stores of this
  thread (and, cumulatively, what it observed, e.g. its CTA's stores ordered by a ``bar.sync``) are visible to any
  thread that acquires the value.
* signal writers (``signal_op``, ``notify``, ``putmem_signal``) first ``bar.sync`` the CTA, then *one* thread
  (``%tid.x == 0``) issues the release, so a signal never overtakes any thread's data of the same CTA and an ``add``
  is applied exactly once per CTA.
* ``fence``: ``fence.acq_rel.sys``; ``quiet``: ``bar.sync`` + ``fence.sc.sys``: all puts issued by the CTA so far
  are ordered before anything after it (our puts are plain stores, so this is completion in the OpenSHMEM sense).

Waits are bounded (fail closed, never a hang): ``meta`` ends with a budget in nanoseconds; a wait that runs out
records kernel site, signal and values in its rank's error record (heap slot 0..7, layout.py ``ERR_*``), aborts the
group (every rank's waits then give up at once) and returns; the host raises from ``SymmetricHeap.check()``.

Triton has no scoped acquire load / release store, so those are ``tl.inline_asm_elementwise``. Under
``TRITON_INTERPRET=1`` (numpy, one program at a time, sequentially consistent) each primitive falls back to plain
loads/stores/atomics with the same meaning, so the kernels can be checked on CPU.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

_INTERPRET = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")

# signal_op operations and signal_wait_until comparisons (NVSHMEM's names)
SIGNAL_SET = tl.constexpr(0)
SIGNAL_ADD = tl.constexpr(1)
CMP_EQ = tl.constexpr(0)
CMP_NE = tl.constexpr(1)
CMP_GT = tl.constexpr(2)
CMP_GE = tl.constexpr(3)
CMP_LT = tl.constexpr(4)
CMP_LE = tl.constexpr(5)


# ---- identity and address translation ------------------------------------------------------------------------------
@triton.jit
def rank(meta):
    """This rank's index in the group (int32 scalar), read from ``meta[0]``. No ordering."""
    return tl.load(meta).to(tl.int32)


@triton.jit
def num_ranks(meta):
    """Number of ranks in the group (int32 scalar), read from ``meta[1]``. No ordering."""
    return tl.load(meta + 1).to(tl.int32)


@triton.jit
def symm_at(ptr, peer, meta):
    """Peer ``peer``'s address of the symmetric object at local heap address ``ptr`` (scalar or block of pointers).

    ``ptr + (base[peer] - base[me]) / sizeof(elem)``: heap bases are 256-byte aligned (checked by SymmetricHeap),
    so the byte delta divides every element size and the element delta is a multiple of 16; the
    ``tl.multiple_of`` hint says so, so the translated pointer keeps the alignment of ``ptr`` and 16-byte vector
    loads/stores stay vectorized. Pure address arithmetic, no memory access to the target, no ordering.
    """
    me = tl.load(meta).to(tl.int32)
    delta = tl.load(meta + 2 + peer) - tl.load(meta + 2 + me)
    esize: tl.constexpr = ptr.dtype.element_ty.primitive_bitwidth // 8
    return ptr + tl.multiple_of(delta // esize, 16)


@triton.jit
def remote_ptr(ptr, peer, meta):
    """Alias of :func:`symm_at` (NVSHMEM's ``nvshmem_ptr``)."""
    return symm_at(ptr, peer, meta)


# ---- scoped loads, stores, reductions ------------------------------------------------------------------------------
@triton.jit
def ld_acquire(ptr):
    """``ld.acquire.sys.global`` of an int64 (``*i64``) or int32 (``*i32``) address, executed by every thread.

    Acquire at system scope: no later memory access of the thread is performed before it, and a value written by a
    ``.sys`` release makes everything ordered before that release visible. Returns the loaded value.
    """
    if _INTERPRET:
        return tl.load(ptr, volatile=True)
    elif ptr.dtype.element_ty.primitive_bitwidth == 64:
        return tl.inline_asm_elementwise("ld.acquire.sys.global.b64 $0, [$1];", "=l,l", [ptr], dtype=tl.int64,
                                         is_pure=False, pack=1)
    else:
        return tl.inline_asm_elementwise("ld.acquire.sys.global.b32 $0, [$1];", "=r,l", [ptr], dtype=tl.int32,
                                         is_pure=False, pack=1)


@triton.jit
def st_release(ptr, value):
    """``st.release.sys.global.b64`` of int64 ``value`` to a scalar ``*i64`` address by thread 0 of the CTA, after a
    ``bar.sync`` of the CTA (so every thread's earlier stores are ordered before it, by cumulativity).

    Release at system scope: whoever reads ``value`` with an acquire sees all writes ordered before it.
    """
    if _INTERPRET:
        tl.atomic_xchg(ptr, tl.cast(value, tl.int64))
    else:
        tl.debug_barrier()
        tl.inline_asm_elementwise(
            "{ .reg .pred p; .reg .b32 t; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; "
            "@p st.release.sys.global.b64 [$1], $2; mov.b32 $0, 0; }",
            "=r,l,l", [ptr, tl.cast(value, tl.int64)], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def red_release(ptr, value):
    """``red.release.sys.global.add.u64``: add int64 ``value`` to a scalar ``*i64`` address once (thread 0, after a
    CTA ``bar.sync``), with release semantics at system scope; returns nothing (a reduction, not an atomic)."""
    if _INTERPRET:
        tl.atomic_add(ptr, tl.cast(value, tl.int64))
    else:
        tl.debug_barrier()
        tl.inline_asm_elementwise(
            "{ .reg .pred p; .reg .b32 t; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; "
            "@p red.release.sys.global.add.u64 [$1], $2; mov.b32 $0, 0; }",
            "=r,l,l", [ptr, tl.cast(value, tl.int64)], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def atomic_add(ptr, value):
    """``atom.acq_rel.sys.global.add`` (Triton's ``tl.atomic_add`` with sem="acq_rel", scope="sys"): returns the old
    value; acquire and release at system scope. One thread performs a scalar atomic (Triton's masking)."""
    return tl.atomic_add(ptr, tl.cast(value, ptr.dtype.element_ty), sem="acq_rel", scope="sys")


@triton.jit
def atomic_cas(ptr, compare, value):
    """``atom.acq_rel.sys.global.cas``: if ``*ptr == compare`` store ``value``; returns the old value; acquire and
    release at system scope. ``compare`` / ``value`` are cast to the pointed-to type first (an int launch argument
    arrives as i32 while signals are i64; Triton's atomic_cas rejects mixed types)."""
    elt = ptr.dtype.element_ty
    return tl.atomic_cas(ptr, tl.cast(compare, elt), tl.cast(value, elt), sem="acq_rel", scope="sys")


@triton.jit
def fence():
    """``fence.acq_rel.sys``: this thread's memory accesses before it are ordered before those after it, system-wide
    (a lightweight fence; combine with a flag store for message passing)."""
    if not _INTERPRET:
        tl.inline_asm_elementwise("fence.acq_rel.sys; mov.b32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False,
                                  pack=1)


@triton.jit
def quiet():
    """Completion of every put the CTA issued so far: ``bar.sync`` then ``fence.sc.sys`` (sequentially consistent
    fence at system scope) in every thread. After it, the puts are visible to any observer ordered after this CTA."""
    if not _INTERPRET:
        tl.debug_barrier()
        tl.inline_asm_elementwise("fence.sc.sys; mov.b32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)


# ---- signals -------------------------------------------------------------------------------------------------------
@triton.jit
def signal_op(sig, value, op: tl.constexpr):
    """Release-write ``value`` into the (local or :func:`symm_at`-translated) signal ``sig`` (``*i64``):
    ``op=SIGNAL_SET`` stores it (:func:`st_release`), ``SIGNAL_ADD`` adds it once (:func:`red_release`)."""
    if op == 0:
        st_release(sig, value)
    else:
        red_release(sig, value)


@triton.jit
def notify(sig, peer, meta, value, op: tl.constexpr):
    """:func:`signal_op` on peer ``peer``'s copy of local signal ``sig`` (release at system scope)."""
    signal_op(symm_at(sig, peer, meta), value, op)


@triton.jit
def _cmp(v, value, cmp: tl.constexpr):
    if cmp == 0:
        r = v == value
    elif cmp == 1:
        r = v != value
    elif cmp == 2:
        r = v > value
    elif cmp == 3:
        r = v >= value
    elif cmp == 4:
        r = v < value
    else:
        r = v <= value
    return r


@triton.jit
def _globaltimer():
    """``%globaltimer``: the GPU's wall clock in nanoseconds (keeps running while the context is switched out)."""
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _error_record(errp, site, off, value, seen, reason, cmp, ns):
    """Fill this rank's error record (layout.py ERR_*) once: every calling thread CASes ``errp[1]`` (site) from 0;
    only the winner stores the details. Inline PTX without barriers, so it is safe on a divergent path (only the
    threads whose wait failed execute it)."""
    if _INTERPRET:
        if tl.load(errp + 1) == 0:
            tl.store(errp + 1, tl.cast(site, tl.int64))
            tl.store(errp + 2, tl.cast(off, tl.int64))
            tl.store(errp + 3, tl.cast(value, tl.int64))
            tl.store(errp + 4, tl.cast(seen, tl.int64))
            tl.store(errp + 5, tl.cast(reason, tl.int64))
            tl.store(errp + 6, tl.cast(cmp, tl.int64))
            tl.store(errp + 7, tl.cast(ns, tl.int64))
    else:
        tl.inline_asm_elementwise(
            "{ .reg .pred p; .reg .b64 old, zero; mov.b64 zero, 0; "
            "atom.relaxed.sys.global.cas.b64 old, [$1+8], zero, $2; setp.eq.s64 p, old, 0; "
            "@p st.relaxed.sys.global.b64 [$1+16], $3; @p st.relaxed.sys.global.b64 [$1+24], $4; "
            "@p st.relaxed.sys.global.b64 [$1+32], $5; @p st.relaxed.sys.global.b64 [$1+40], $6; "
            "@p st.relaxed.sys.global.b64 [$1+48], $7; @p st.relaxed.sys.global.b64 [$1+56], $8; mov.b32 $0, 0; }",
            "=r,l,l,l,l,l,l,l,l",
            [errp, tl.cast(site, tl.int64), tl.cast(off, tl.int64), tl.cast(value, tl.int64),
             tl.cast(seen, tl.int64), tl.cast(reason, tl.int64), tl.cast(cmp, tl.int64), tl.cast(ns, tl.int64)],
            dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _store_sys(ptr, value):
    """``st.relaxed.sys.global.b64`` by every calling thread, no barrier (safe on a divergent path)."""
    if _INTERPRET:
        tl.store(ptr, tl.cast(value, tl.int64))
    else:
        tl.inline_asm_elementwise("st.relaxed.sys.global.b64 [$1], $2; mov.b32 $0, 0;", "=r,l,l",
                                  [ptr, tl.cast(value, tl.int64)], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _wait_failed(errp, meta, me, world, site, sig, value, seen, reason, cmp, ns):
    """A wait gave up: record it in this rank's error record; if it timed out (reason 1) and no rank aborted the
    group yet, set the abort word ``1 + me`` in every rank's record (so their waits give up too)."""
    off = sig.to(tl.int64) - tl.load(meta + 2 + me)
    _error_record(errp, site, off, value, seen, reason, cmp, ns)
    if (reason == 1) | (reason == 3):
        for p in range(0, world):
            _store_sys(symm_at(errp, p, meta), me + 1)


@triton.jit
def signal_wait_until(sig, cmp: tl.constexpr, value, meta, site: tl.constexpr):
    """Spin with :func:`ld_acquire` (every thread) until ``*sig <cmp> value``; returns the last value read (the
    token for :func:`consume_token`). Acquire at system scope: the data the signaller released is visible after it.

    Bounded (fail closed): ``meta[2 + world]`` is the budget in nanoseconds of ``%globaltimer`` (wall clock, so time
    spent switched out on a time-sliced GPU counts). Every 1024 polls the thread also reads its rank's abort word
    (heap slot 0). On expiry, or when a peer aborted the group, the wait records ``site`` (constexpr kernel code of
    layout.WAIT_SITES), the signal's heap offset, the awaited and last values in its rank's error record, sets the
    abort word on every rank (expiry only) and returns the unsatisfied value; the kernel then runs on with garbage
    and the host's :meth:`SymmetricHeap.check` raises naming kernel, rank and signal. ``sig`` may be any global
    int64 address (a heap signal is named by the host; another address is reported by offset).
    Under ``TRITON_INTERPRET=1`` (one thread, nothing else can change ``*sig`` during the wait) an unsatisfied
    condition is recorded at once (reason 3: would wait forever) instead of spinning forever."""
    me = tl.load(meta).to(tl.int32)
    world = tl.load(meta + 1).to(tl.int32)
    errp = tl.load(meta + 2 + me).to(tl.pointer_type(tl.int64))
    v = ld_acquire(sig)
    if _INTERPRET:
        if not _cmp(v, value, cmp):
            reason = 3
            if tl.load(errp) != 0:
                reason = 2
            _wait_failed(errp, meta, me, world, site, sig, value, v, reason, cmp, 0)
    else:
        done = _cmp(v, value, cmp)
        t0 = _globaltimer()
        budget = tl.load(meta + 2 + world)
        it = 0
        while not done:
            v = ld_acquire(sig)
            done = _cmp(v, value, cmp)
            it += 1
            if (it & 1023) == 0:
                aborted = tl.load(errp, volatile=True) != 0
                ns = _globaltimer() - t0
                late = ns > budget
                if (aborted | late) & (not done):
                    reason = tl.where(aborted, 2, 1)
                    _wait_failed(errp, meta, me, world, site, sig, value, v, reason, cmp, ns)
                done = done | aborted | late
    return v


@triton.jit
def wait(sig, value, meta, site: tl.constexpr):
    """:func:`signal_wait_until` with ``>=`` (the epoch/counter convention of layout.py); returns the token.
    Bounded: see :func:`signal_wait_until` (``site`` names the calling kernel in the host's error)."""
    return signal_wait_until(sig, 3, value, meta, site)


@triton.jit
def consume_token(x, token):
    """``x`` made data-dependent on ``token`` (a :func:`wait` result), so loads through ``x`` cannot be scheduled
    before the wait (Triton-distributed's ``consume_token``). Implemented as ``x + z`` where ``z`` is a zero produced
    by a non-pure inline asm that reads ``token``; no memory access, no fence."""
    if _INTERPRET:
        return x
    else:
        z = tl.inline_asm_elementwise("mov.b32 $0, 0; // consume_token $1", "=r,l", [tl.cast(token, tl.int64)],
                                      dtype=tl.int32, is_pure=False, pack=1)
        return x + tl.multiple_of(z, 16)  # z == 0: keeps x's alignment, so loads through x stay vectorized


# ---- one-sided block copies (every thread of the CTA takes part) -----------------------------------------------------
@triton.jit
def _copy(dst, src, n, BLOCK: tl.constexpr):
    for start in range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        m = offs < n
        tl.store(dst + offs, tl.load(src + offs, mask=m), mask=m)


@triton.jit
def putmem_nbi(dst, src, n, peer, meta, BLOCK: tl.constexpr):
    """Block-level put, non-blocking: copy ``n`` elements from ``src`` (any local memory) to peer ``peer``'s copy of
    local heap address ``dst``. Plain weak stores: not ordered; follow with :func:`quiet` or a signal."""
    _copy(symm_at(dst, peer, meta), src, n, BLOCK)


@triton.jit
def putmem(dst, src, n, peer, meta, BLOCK: tl.constexpr):
    """Block-level put, blocking: :func:`putmem_nbi` then :func:`quiet` (the data is visible system-wide after it)."""
    putmem_nbi(dst, src, n, peer, meta, BLOCK)
    quiet()


@triton.jit
def getmem_nbi(dst, src, n, peer, meta, BLOCK: tl.constexpr):
    """Block-level get: copy ``n`` elements from peer ``peer``'s copy of heap address ``src`` into local ``dst``.
    Weak loads: the caller orders them after the peer's release with :func:`wait` / :func:`consume_token`."""
    _copy(dst, symm_at(src, peer, meta), n, BLOCK)


@triton.jit
def getmem(dst, src, n, peer, meta, BLOCK: tl.constexpr):
    """Blocking :func:`getmem_nbi`: the CTA's copied data is complete (``bar.sync`` + fence) on return."""
    getmem_nbi(dst, src, n, peer, meta, BLOCK)
    quiet()


@triton.jit
def putmem_signal(dst, src, n, sig, value, op: tl.constexpr, peer, meta, BLOCK: tl.constexpr):
    """Put ``n`` elements to peer ``peer`` then signal its copy of ``sig`` (``op`` SET/ADD ``value``) with a
    ``.sys`` release after a CTA barrier: a peer that waits on the signal sees the whole block's data."""
    putmem_nbi(dst, src, n, peer, meta, BLOCK)
    notify(sig, peer, meta, value, op)


@triton.jit
def barrier_all(meta, sig, epoch):
    """Device-side barrier of all ranks, for a kernel run by one CTA per rank. ``sig`` (local ``*i64``) is a block of
    ``world`` slots reserved for this barrier; ``epoch`` grows by one per use (never reset). Every rank release-stores
    ``epoch`` into slot ``me`` of every peer, then acquires until all of its own ``world`` slots are >= epoch: all
    memory operations before the barrier on any rank are visible after it on every rank."""
    me = rank(meta)
    world = num_ranks(meta)
    for p in range(0, world):
        st_release(symm_at(sig + me, p, meta), epoch)
    for p in range(0, world):
        wait(sig + p, epoch, meta, 2)
