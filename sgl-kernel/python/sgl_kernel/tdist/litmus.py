"""Small kernels that exercise every primitive of :mod:`sgl_kernel.tdist.primitives` (ordering litmus tests).

Used by the GPU tests (ranks as processes, one or more GPUs), the CPU AOT-compile tests (PTX must contain the scoped
instructions) and the interpreter tests. Each launches with one CTA per call unless stated.
"""

from __future__ import annotations

import triton
import triton.language as tl

from sgl_kernel.tdist import primitives as P


@triton.jit
def mp_producer_kernel(meta, data, src, sig, n, epoch, peer, BLOCK: tl.constexpr):
    """Message passing, writer side: put ``n`` float32 from ``src`` into peer's ``data`` then SET peer's ``sig`` to
    ``epoch`` (putmem_signal: weak stores, CTA barrier, st.release.sys)."""
    P.putmem_signal(data, src, n, sig, epoch, P.SIGNAL_SET, peer, meta, BLOCK)


@triton.jit
def mp_consumer_kernel(meta, data, out, sig, n, epoch, BLOCK: tl.constexpr):
    """Message passing, reader side: wait (ld.acquire.sys) until local ``sig >= epoch``, then copy local ``data`` to
    ``out`` through consume_token'd pointers. Correct ordering means ``out`` never holds stale data."""
    tok = P.wait(sig, epoch, meta, 9)
    for start in range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        m = offs < n
        ptrs = P.consume_token(data + offs, tok)
        tl.store(out + offs, tl.load(ptrs, mask=m), mask=m)


@triton.jit
def pingpong_kernel(meta, sig, data, log, iters, base, peer, BLOCK: tl.constexpr):
    """Signal reuse: ``iters`` rounds between this rank and ``peer`` in one launch. Round i (epoch e = base + 1 + i):
    the lower rank of the pair writes e into peer's ``data[0:BLOCK]`` and SETs peer's ``sig`` to e, then waits for its
    own ``sig >= e`` (the answer); the higher rank waits for e, checks the data is exactly e (acquire makes the put
    visible) and answers the same way. ``log[0]`` counts rounds whose data was stale (must stay 0); ``log[1]`` gets the last epoch seen."""
    me = P.rank(meta)
    offs = tl.arange(0, BLOCK)
    bad = 0
    last = tl.full((), 0, tl.int64) + base  # int64 whatever width the launcher gives base (0 -> i32)
    for i in range(0, iters):
        e = base + 1 + i
        if me < peer:
            tl.store(P.symm_at(data + offs, peer, meta), tl.full([BLOCK], 0, tl.int64) + e)
            P.notify(sig, peer, meta, e, P.SIGNAL_SET)
            tok = P.wait(sig, e, meta, 10)
            got = tl.load(P.consume_token(data + offs, tok))
        else:
            tok = P.wait(sig, e, meta, 10)
            got = tl.load(P.consume_token(data + offs, tok))  # read before answering: rank 0 overwrites it next
            tl.store(P.symm_at(data + offs, peer, meta), tl.full([BLOCK], 0, tl.int64) + e)
            P.notify(sig, peer, meta, e, P.SIGNAL_SET)
        bad += tl.sum((got != e).to(tl.int32))
        last = tok
    tl.store(log, bad.to(tl.int64))
    tl.store(log + 1, last.to(tl.int64))


@triton.jit
def counter_kernel(meta, counter, old_out, cas_out, peer, compare, value):
    """Atomics on a peer: ``old_out[pid] = atomic_add(peer counter[0], 1)`` (acq_rel.sys), and one CAS of counter[1]
    from ``compare`` to ``value`` whose old value goes to ``cas_out[pid]``; then a red.release add of 1 to counter[2]
    and fence/quiet. Launch with a grid of G CTAs: counter[0] grows by exactly G, counter[2] by G."""
    pid = tl.program_id(0)
    c = P.symm_at(counter, peer, meta)
    tl.store(old_out + pid, P.atomic_add(c, 1))
    tl.store(cas_out + pid, P.atomic_cas(c + 1, compare, value))
    P.fence()
    P.red_release(c + 2, 1)
    P.quiet()


@triton.jit
def get_kernel(meta, dst, src, n, peer, BLOCK: tl.constexpr):
    """getmem: copy ``n`` int64 from peer's heap ``src`` into local ``dst`` (blocking, quiet at the end)."""
    P.getmem(dst, src, n, peer, meta, BLOCK)


@triton.jit
def put_kernel(meta, dst, src, n, peer, BLOCK: tl.constexpr):
    """putmem: copy ``n`` int64 from local ``src`` into peer's heap ``dst`` (blocking, quiet at the end)."""
    P.putmem(dst, src, n, peer, meta, BLOCK)


@triton.jit
def barrier_kernel(meta, sig, epoch, out):
    """barrier_all over all ranks (one CTA per rank); writes this rank's rank/num_ranks into out[0:2]."""
    P.barrier_all(meta, sig, epoch)
    tl.store(out, P.rank(meta).to(tl.int64))
    tl.store(out + 1, P.num_ranks(meta).to(tl.int64))


@triton.jit
def pingpong_cta_kernel(meta, sig, data, log, iters, BLOCK: tl.constexpr):
    """Message-passing litmus at full concurrency: launch with grid (2,); CTA 0 and CTA 1 (resident together on two
    SMs) play the two sides of :func:`pingpong_kernel` on local memory: per round e, a side writes ``BLOCK`` int64
    (every thread several elements) into the other's mailbox ``data[other]``, SETs ``sig[other] = e``
    (bar.sync + st.release.sys), and the other side waits (ld.acquire.sys) and checks every element is e. Unlike the
    cross-process version on a shared GPU (where contexts take turns), the two CTAs really run at the same time, so
    a missing barrier or a weak release would show up as stale elements. ``log[pid]`` = stale elements seen.
    ``meta`` is only used by the bounded waits (budget, error record of the calling rank)."""
    pid = tl.program_id(0)
    other = 1 - pid
    offs = tl.arange(0, BLOCK)
    bad = 0
    for i in range(0, iters):
        e = i + 1
        if pid == 0:
            tl.store(data + other * BLOCK + offs, tl.full([BLOCK], 0, tl.int64) + e)
            P.signal_op(sig + other, e, P.SIGNAL_SET)
            tok = P.wait(sig + pid, e, meta, 11)
            got = tl.load(P.consume_token(data + pid * BLOCK + offs, tok))
        else:
            tok = P.wait(sig + pid, e, meta, 11)
            got = tl.load(P.consume_token(data + pid * BLOCK + offs, tok))
            tl.store(data + other * BLOCK + offs, tl.full([BLOCK], 0, tl.int64) + e)
            P.signal_op(sig + other, e, P.SIGNAL_SET)
        bad += tl.sum((got != e).to(tl.int32))
    tl.store(log + pid, bad.to(tl.int64))
