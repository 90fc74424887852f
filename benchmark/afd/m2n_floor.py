"""Same-run floor of the M2N latency benchmark (``benchmark/afd/m2n_latency.py``): the raw one-kernel peer
store of the same bytes as LL words (tag + data in one 8-byte store, :mod:`sgl_kernel.m2n.ll_kernels`'s wire format)
and one spinning kernel on the receiver, with none of M2N's bookkeeping (no ack wait, no header, no row count, no
copy out, no relayout; one slot, which strict ping-pong alternation makes safe). The M2N LL path minus this floor is
what the transport's bookkeeping costs; the floor minus the NVLink wire time is kernel boundaries and spin latency.

Runs on a ``cuda_push_ll`` endpoint's heap (its IPC-mapped LL ring; the endpoint must carry no M2N message while the
floor runs: the tags would collide). Every program keeps its own tag counter on the device, so K captured hops
replay correctly (no host argument changes per hop).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sgl_kernel.m2n.ll_kernels import LL_BLOCK, MASK32, _ll_wait


@triton.jit(do_not_specialize=["ring_delta", "n_words"])
def raw_ll_put_kernel(ring, ring_delta, src, n_words, ctr, BLOCK: tl.constexpr):
    """Program ``c`` stores its blocks (block ``b`` -> program ``b % G``) of ``src`` (``*i32`` [n_words]) as LL words
    at ``ring + ring_delta`` (``*i64``, the peer's slot) with tag ``ctr[c] + 1``; then advances ``ctr[c]``."""
    c = tl.program_id(0)
    G = tl.num_programs(0)
    offs = tl.arange(0, BLOCK)
    s = tl.load(ctr + c)
    tag = (s + 1) & MASK32
    dst = ring + tl.multiple_of(ring_delta, 2)
    for b in range(c, tl.cdiv(n_words, BLOCK), G):
        o = b * BLOCK + offs
        m = o < n_words
        v = tl.load(src + o, mask=m, other=0).to(tl.int64) & MASK32
        tl.store(dst + o, (tag << 32) | v, mask=m)
    tl.debug_barrier()
    tl.store(ctr + c, s + 1)


@triton.jit(do_not_specialize=["n_words"])
def raw_ll_wait_kernel(meta, ring, n_words, ctr, BLOCK: tl.constexpr):
    """Program ``c`` spins (bounded, :func:`~sgl_kernel.m2n.ll_kernels._ll_wait`) until its blocks of the local slot
    ``ring`` (``*i64``) carry tag ``ctr[c] + 1``; then advances ``ctr[c]``. Nothing is copied."""
    c = tl.program_id(0)
    G = tl.num_programs(0)
    offs = tl.arange(0, BLOCK)
    first = offs == 0
    r = tl.load(ctr + c)
    tag = (r + 1) & MASK32
    lim = n_words + r * 0
    for b in range(c, tl.cdiv(n_words, BLOCK), G):
        o = b * BLOCK + offs
        v, okb = _ll_wait(ring + o, o < lim, tag, meta, first, ring)
        lim = tl.where(okb, lim, 0)  # after a failed (timed-out) wait: no more spins
    tl.debug_barrier()
    tl.store(ctr + c, r + 1)


class RawLLFloor:
    """The floor's kernels bound to ``ep`` (an attached ``cuda_push_ll`` M2N endpoint) for messages of ``nbytes``
    (a multiple of 4) to / from ``peer``: :meth:`put` (send ``x``, a contiguous CUDA tensor of ``nbytes``) and
    :meth:`wait` (receive), each one launch on the current stream, graph-capturable. Raises ValueError when
    ``nbytes`` exceeds the LL slot or is not a multiple of 4."""

    def __init__(self, ep, peer: int, nbytes: int, grid: int) -> None:
        tr = ep.transport
        p = tr._peer(peer)
        if nbytes % 4 or nbytes > min(p["cap"], tr.cap):
            raise ValueError(f"raw LL floor: nbytes={nbytes} must be a multiple of 4 and fit the slot ({tr.cap})")
        self.tr, self.p, self.n, self.grid = tr, p, nbytes // 4, grid
        slots = ep.config.slots
        self.local = tr._ring64.view(-1)[peer * slots * (tr.cap // 4):]  # slot 0 of what ``peer`` writes here
        self.ctr = torch.zeros(2, grid, dtype=torch.int64, device=ep.device)

    def put(self, x: torch.Tensor) -> None:
        raw_ll_put_kernel[(self.grid,)](self.tr._ring64, self.p["ring_delta"], x.view(torch.int32), self.n,
                                        self.ctr[0], BLOCK=LL_BLOCK)

    def wait(self) -> None:
        raw_ll_wait_kernel[(self.grid,)](self.tr.heap.meta, self.local, self.n, self.ctr[1], BLOCK=LL_BLOCK)
