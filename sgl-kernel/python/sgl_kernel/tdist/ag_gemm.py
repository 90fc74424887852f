"""AllGather-GEMM with tile-level overlap (Zheng et al., "Triton-distributed", 2025, sec. 2.3, 3.2 and 3.7).

``C = all_gather(A) @ B``: every rank holds a row shard ``A_r`` ([M_r, K], token-sharded activations, uneven M_r
allowed) and the same-K column slice ``B`` ([K, N_local] of a column-parallel weight). The *producer* pushes this
rank's shard into every peer's gather buffer (symmetric heap) and signals per segment; the *consumer* GEMM gives each
output tile a segment, waits on that segment's signal (``wait`` + ``consume_token``) and computes. Tiles are ordered
so that each rank starts on its own rows (read straight from ``A_r``, no wait) and then goes round the ring
``me+1, me+2, ...`` (sec. 3.7 swizzle), so communication of later segments hides behind compute of earlier ones.

Producer modes: ``"sm"`` (a Triton kernel, ``world-1`` x ``chunks`` CTAs on a side stream: putmem_nbi + red.release
signal per chunk) and ``"ce"`` (copy engine: ``cudaMemcpyAsync`` per peer, then ``cuStreamWriteValue64`` which is
preceded by a system-wide fence, see tdist/stream_ops.py). Buffer reuse without barriers: see common.release_kernel.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import triton
import triton.language as tl

from sgl_kernel.tdist import primitives as P
from sgl_kernel.tdist.common import (cached_i32, cdiv, check_rows, check_tensor, copy_span, release_kernel,
                                     ring_tile_segment)


@triton.jit
def ag_producer_kernel(meta, a_local, gather, seg_sig, ready, n_elems, dst_off, state,
                       CHUNKS: tl.constexpr, BLOCK: tl.constexpr):
    """SM producer. Program (j, c): destination ``(me + 1 + j) % world``; wait until it released its gather buffer
    (``ready[dest] >= state[0]``, the previous call's epoch), copy chunk ``c`` of the ``n_elems`` contiguous
    elements of ``a_local`` to the destination's ``gather + dst_off``, then add 1 (red.release.sys) to the
    destination's ``seg_sig[me]``."""
    j = tl.program_id(0)
    c = tl.program_id(1)
    me = P.rank(meta)
    world = P.num_ranks(meta)
    dest = (me + 1 + j) % world
    P.wait(ready + dest, tl.load(state), meta, 3)
    per = tl.cdiv(tl.cdiv(n_elems, CHUNKS), 16) * 16  # chunks start on 16-element boundaries (vector copies)
    start = c * per
    n = tl.minimum(per, n_elems - start)
    n = tl.maximum(n, 0)
    copy_span(P.symm_at(gather + dst_off + start, dest, meta), a_local + start, n, BLOCK)
    P.notify(seg_sig + me, dest, meta, 1, P.SIGNAL_ADD)


@triton.jit(do_not_specialize=["tsel", "tinc"])
def ag_gemm_consumer_kernel(meta, a_local, gather, b, c, seg_sig, row_off, tiles, state, tsel, tinc, N, K,
                            stride_bk, stride_bn, stride_cm,
                            BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr = False):
    """Consumer GEMM. ``pid = m_tile * n_tiles + n_tile`` with m tiles numbered in swizzled segment order (own
    segment first). A tile of segment s != me waits ``seg_sig[s] >= state[tsel] + tinc`` (the SM producer's
    cumulative chunk count: tsel=1, tinc=chunks; the copy engine's epoch: tsel=0, tinc=1; ld.acquire.sys) and reads
    its A rows
    from ``gather`` through consume_token'd pointers; own-segment tiles read ``a_local``. fp32 accumulation."""
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(N, BN)
    pid_m = pid // n_tiles
    pid_n = pid % n_tiles
    me = P.rank(meta)
    world = P.num_ranks(meta)
    seg, lt = ring_tile_segment(pid_m, tiles, me, world, 0)
    r0 = tl.load(row_off + seg)
    r1 = tl.load(row_off + seg + 1)
    rows_local = lt * BM + tl.arange(0, BM)
    m_mask = rows_local < (r1 - r0)
    cols = pid_n * BN + tl.arange(0, BN)
    n_mask = cols < N
    ks = tl.arange(0, BK)
    if seg == me:
        a_ptrs = a_local + rows_local[:, None].to(tl.int64) * K + ks[None, :]
    else:
        tok = P.wait(seg_sig + seg, tl.load(state + tsel) + tinc, meta, 4)
        a_ptrs = P.consume_token(gather + (r0 + rows_local[:, None]).to(tl.int64) * K + ks[None, :], tok)
    b_ptrs = b + ks[:, None].to(tl.int64) * stride_bk + cols[None, :].to(tl.int64) * stride_bn
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        k_mask = (k0 + ks) < K
        a = tl.load(a_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        bb = tl.load(b_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        if IEEE:  # fp32 inputs: full fp32 products (no TF32), like torch's default matmul
            acc = tl.dot(a, bb, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, bb, acc)
        a_ptrs += BK
        b_ptrs += BK * stride_bk
    c_ptrs = c + (r0 + rows_local[:, None]).to(tl.int64) * stride_cm + cols[None, :]
    tl.store(c_ptrs, acc.to(c.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


class AgGemm:
    """Host side of AllGather-GEMM on one :class:`~sgl_kernel.tdist.heap.SymmetricHeap` (one object per op site).

    Args: heap; max_rows (largest total M) and k (hidden size) size the gather buffer (``max_rows * k`` elements of
    ``dtype`` in the heap); producer ``"sm"`` or ``"ce"``; chunks (SM producer CTAs per peer); tile sizes.
    Construction allocates heap regions and signals, so it is collective in the bookkeeping sense: every rank must
    build the same AgGemm objects in the same order.
    """

    def __init__(self, heap, max_rows: int, k: int, dtype: torch.dtype = torch.bfloat16, *, name: str = "ag_gemm",
                 producer: str = "sm", chunks: int = 4, bm: int = 128, bn: int = 128, bk: int = 64,
                 num_warps: int = 8, num_stages: int = 3):
        if producer not in ("sm", "ce"):
            raise ValueError(f"producer={producer!r} must be 'sm' (Triton copy kernel) or 'ce' (copy engine)")
        if max_rows < 1 or k < 1:
            raise ValueError(f"max_rows={max_rows} and k={k} must be >= 1")
        if chunks < 1:
            raise ValueError(f"chunks={chunks} must be >= 1")
        self.heap, self.k, self.dtype, self.name, self.producer = heap, k, dtype, name, producer
        self.max_rows, self.chunks = max_rows, chunks
        self.tile = dict(BM=bm, BN=bn, BK=bk)
        self.launch = dict(num_warps=num_warps, num_stages=num_stages)
        self.gather = heap.tensor(f"{name}.gather", (max_rows, k), dtype)
        self.seg_sig = heap.signals(f"{name}.seg.{producer}", heap.world)
        self.ready = heap.signals(f"{name}.ready", heap.world)
        self._side = None
        self._dev_meta: dict = {}  # row offsets / tile counts per shape, on the device (cached_i32)
        self.state = heap.counters(name)  # device epochs (common.release_kernel), shared by ops of this name
        self._target = (1, chunks) if producer == "sm" else (0, 1)  # consumer's (tsel, tinc)

    def __call__(self, a: torch.Tensor, b: torch.Tensor, rows: Sequence[int], out: Optional[torch.Tensor] = None):
        """``all_gather(a) @ b`` -> [sum(rows), N] in a's dtype.

        a: [rows[rank], K] contiguous, this rank's shard (dtype = self.dtype); b: [K, N] (any strides, e.g.
        ``weight.t()`` of an [N, K] weight); rows: every rank's row count, identical on all ranks; out: optional
        [sum(rows), N] output. All ranks must call together. Raises ValueError on bad shapes/dtypes/devices or
        rows above max_rows. The producer runs on a side stream (SM mode) or the copy engine (CE mode) concurrently
        with the consumer GEMM on the current stream; the current stream joins both before returning.
        """
        plan = self.prepare(a, b, rows, out)
        dev = a.device
        if dev.type != "cuda" or self.heap.world == 1:
            self.produce(plan)
            self.consume(plan)
        elif self.producer == "ce":
            self.produce(plan)
            self.consume(plan)
            torch.cuda.current_stream(dev).wait_stream(self._side_stream(dev))
        else:
            # the producer is submitted before the consumer on a high-priority stream, so its few CTAs are dispatched
            # first even when the consumer grid exceeds the resident capacity (consumer CTAs spinning on a peer's
            # segment must not keep this rank's producer off the SMs: with every rank doing so that is a cycle); it
            # only waits on releases of the previous call, so it always finishes (producer="ce" needs no SMs at all)
            main = torch.cuda.current_stream(dev)
            side = self._side_stream(dev)
            side.wait_stream(main)
            with torch.cuda.stream(side):
                self.produce(plan)
            self.consume(plan)  # no record_stream for a: main joins side below, before a can be freed
            main.wait_stream(side)
        self.release(plan)
        return plan["out"]

    def prepare(self, a: torch.Tensor, b: torch.Tensor, rows: Sequence[int], out: Optional[torch.Tensor] = None):
        """Validate, allocate ``out`` and take this call's epoch (the steps are split for one-process simulation:
        run every rank's :meth:`produce` before any rank's :meth:`consume`, then :meth:`release`)."""
        h = self.heap
        check_tensor("a", a, 2, h.device, self.dtype)
        check_tensor("b", b, 2, h.device, self.dtype)
        rows = check_rows(rows, h.world, h.rank, a.shape[0], "ag_gemm")
        if a.shape[1] != self.k or b.shape[0] != self.k:
            raise ValueError(f"ag_gemm: a {tuple(a.shape)} and b {tuple(b.shape)} must have K={self.k}")
        if not a.is_contiguous():
            raise ValueError("ag_gemm: a must be contiguous (call .contiguous())")
        total = sum(rows)
        if total > self.max_rows:
            raise ValueError(f"ag_gemm: total rows {total} > max_rows={self.max_rows}; build AgGemm with more rows")
        n = b.shape[1]
        if out is None:
            out = torch.empty(total, n, dtype=a.dtype, device=a.device)
        elif tuple(out.shape) != (total, n) or out.dtype != a.dtype or out.stride(1) != 1:
            raise ValueError(f"ag_gemm: out must be [{total}, {n}] {a.dtype} with unit column stride")
        row_off = [0]
        for r in rows:
            row_off.append(row_off[-1] + r)
        tiles = [cdiv(r, self.tile["BM"]) for r in rows]
        epoch = h.epochs.next(f"{self.name}.call")
        target = h.epochs.advance(f"{self.name}.seg", self.chunks) if self.producer == "sm" else epoch
        return dict(a=a, b=b, out=out, rows=rows, row_off=row_off, tiles=tiles, epoch=epoch, target=target, n=n)

    def produce(self, plan) -> None:
        """Push this rank's shard to every peer and signal (SM kernel on the current stream, or copy engine)."""
        h = self.heap
        if h.world == 1:
            return
        a, off = plan["a"], plan["row_off"][h.rank] * self.k
        if self.producer == "ce":
            from sgl_kernel.tdist.stream_ops import ce_put_signal

            ce_put_signal(h, a, self.gather, off, self.seg_sig, self.ready, plan["epoch"], self._side_stream(a.device))
            return
        ag_producer_kernel[(h.world - 1, self.chunks)](h.meta, a, self.gather, self.seg_sig, self.ready, a.numel(),
                                                        off, self.state, CHUNKS=self.chunks, BLOCK=2048,
                                                        num_warps=4)

    def consume(self, plan) -> None:
        """The GEMM on the current stream; its tiles wait for their segments."""
        h, n, tiles = self.heap, plan["n"], plan["tiles"]
        n_m = sum(tiles)
        if n_m == 0 or n == 0:
            return
        dev = plan["a"].device
        row_off_t = cached_i32(self._dev_meta, plan["row_off"], dev)
        tiles_t = cached_i32(self._dev_meta, tiles, dev)
        b, out = plan["b"], plan["out"]
        grid = (n_m * triton.cdiv(n, self.tile["BN"]),)
        ag_gemm_consumer_kernel[grid](h.meta, plan["a"], self.gather, b, out, self.seg_sig, row_off_t, tiles_t,
                                      self.state, *self._target, n, self.k, b.stride(0), b.stride(1), out.stride(0),
                                      IEEE=self.dtype == torch.float32, **self.tile, **self.launch)

    def release(self, plan) -> None:
        """Tell every peer this rank's gather buffer may be overwritten by the next call."""
        if self.heap.world > 1:
            release_kernel[(1,)](self.heap.meta, self.ready, self.state, self._target[1] if self._target[0] else 0)

    def _side_stream(self, dev) -> "torch.cuda.Stream":
        if self._side is None:
            self._side = torch.cuda.Stream(dev, priority=-1)  # high priority: producer CTAs are dispatched first
        return self._side
