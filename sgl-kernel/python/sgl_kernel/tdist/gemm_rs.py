"""GEMM-ReduceScatter with the scatter fused into the GEMM epilogue (Zheng et al., "Triton-distributed", 2025,
sec. 3.3).

``out_r = (sum_s A_s @ B_s)[rows of r]``: every rank holds the same M rows of its K-slice ``A_s`` ([M, K_s],
row-parallel input) and ``B_s`` ([K_s, N]); rows are owned by ranks in token-sharded (sequence-parallel) segments
(uneven allowed). The GEMM gives each output tile a destination segment, computes it and stores it straight into
the owner's heap (``partial[me]`` of the owner; a remote store over NVLink/P2P), then adds 1 to the owner's
``arrive[me]`` counter (red.release.sys). Tiles go round the ring starting with segment ``me+1`` and end with the
own segment (sec. 3.7), so the peers' reductions can start while this rank still computes. The reduce kernel then
waits for every source's counter (ld.acquire.sys, cumulative targets: never reset) and sums the ``world`` partials
in fp32. The writer of call e+1 waits for the owner's release of call e (common.release_kernel).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import triton
import triton.language as tl

from sgl_kernel.tdist import primitives as P
from sgl_kernel.tdist.common import cached_i32, cdiv, check_tensor, release_kernel, ring_tile_segment


@triton.jit
def gemm_rs_kernel(meta, a, b, partial, arrive, ready, row_off, tiles, state, N, K, max_rows,
                   stride_am, stride_bk, stride_bn,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr = False):
    """GEMM + scatter. ``pid = m_tile * n_tiles + n_tile``; m tiles in ring order starting at segment me+1. Tile of
    segment s: compute fp32, wait ``ready[s] >= state[0]`` (owner released its partial buffer), store into
    owner's ``partial[me, rows - row_off[s], cols]`` ([world, max_rows, N] in the heap), add 1 to owner's
    ``arrive[me]``."""
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(N, BN)
    pid_m = pid // n_tiles
    pid_n = pid % n_tiles
    me = P.rank(meta)
    world = P.num_ranks(meta)
    seg, lt = ring_tile_segment(pid_m, tiles, me, world, 1)
    r0 = tl.load(row_off + seg)
    r1 = tl.load(row_off + seg + 1)
    rows_local = lt * BM + tl.arange(0, BM)
    m_mask = rows_local < (r1 - r0)
    cols = pid_n * BN + tl.arange(0, BN)
    n_mask = cols < N
    ks = tl.arange(0, BK)
    a_ptrs = a + (r0 + rows_local[:, None]).to(tl.int64) * stride_am + ks[None, :]
    b_ptrs = b + ks[:, None].to(tl.int64) * stride_bk + cols[None, :].to(tl.int64) * stride_bn
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        k_mask = (k0 + ks) < K
        x = tl.load(a_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        y = tl.load(b_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        if IEEE:  # fp32 inputs: full fp32 products (no TF32), like torch's default matmul
            acc = tl.dot(x, y, acc, input_precision="ieee")
        else:
            acc = tl.dot(x, y, acc)
        a_ptrs += BK
        b_ptrs += BK * stride_bk
    P.wait(ready + seg, tl.load(state), meta, 5)
    dst = partial + (me * max_rows + rows_local[:, None]).to(tl.int64) * N + cols[None, :]
    tl.store(P.symm_at(dst, seg, meta), acc.to(partial.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])
    P.notify(arrive + me, seg, meta, 1, P.SIGNAL_ADD)


@triton.jit(do_not_specialize=["inc"])
def rs_reduce_kernel(meta, partial, arrive, out, state, inc, M, N, max_rows, stride_om,
                     BM: tl.constexpr, BN: tl.constexpr):
    """Reduce. Program (m, n) of this rank's [M, N] rows: for every source s wait ``arrive[s] >= state[1] + inc``
    (cumulative: ``inc`` tiles arrive per source per call), then
    sum ``partial[s]`` tiles in fp32 and store to ``out``."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    world = P.num_ranks(meta)
    rows = pid_m * BM + tl.arange(0, BM)
    cols = pid_n * BN + tl.arange(0, BN)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    target = tl.load(state + 1) + inc
    for s in range(0, world):
        tok = P.wait(arrive + s, target, meta, 6)
        ptrs = P.consume_token(partial + (s * max_rows + rows[:, None]).to(tl.int64) * N + cols[None, :], tok)
        acc += tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out + rows[:, None].to(tl.int64) * stride_om + cols[None, :], acc.to(out.dtype.element_ty), mask=mask)


class GemmRs:
    """Host side of GEMM-ReduceScatter on a :class:`~sgl_kernel.tdist.heap.SymmetricHeap` (one object per op site).

    Args: heap; max_rows (largest segment any rank owns) and n (output columns) size the partial buffer
    (``world * max_rows * n`` elements of ``dtype`` per rank); tile sizes. Allocation is collective bookkeeping:
    all ranks build the same objects in the same order.
    """

    def __init__(self, heap, max_rows: int, n: int, dtype: torch.dtype = torch.bfloat16, *, name: str = "gemm_rs",
                 bm: int = 128, bn: int = 128, bk: int = 64, num_warps: int = 8, num_stages: int = 3):
        if max_rows < 1 or n < 1:
            raise ValueError(f"max_rows={max_rows} and n={n} must be >= 1")
        self.heap, self.max_rows, self.n, self.dtype, self.name = heap, max_rows, n, dtype, name
        self.tile = dict(BM=bm, BN=bn, BK=bk)
        self.launch = dict(num_warps=num_warps, num_stages=num_stages)
        self.partial = heap.tensor(f"{name}.partial", (heap.world, max_rows, n), dtype)
        self.arrive = heap.signals(f"{name}.arrive", heap.world)
        self.ready = heap.signals(f"{name}.ready", heap.world)
        self._dev_meta: dict = {}  # row offsets / tile counts per shape, on the device (cached_i32)
        self.state = heap.counters(name)  # device epochs (common.release_kernel), shared by ops of this name

    def __call__(self, a: torch.Tensor, b: torch.Tensor, rows: Sequence[int], out: Optional[torch.Tensor] = None):
        """Reduce-scattered ``a @ b`` over the group: returns this rank's [rows[rank], N] rows of the sum.

        a: [M, K_local] (unit column stride), M = sum(rows); b: [K_local, N] (any strides; ``weight.t()``);
        rows: row counts per rank, identical on all ranks; all ranks call together. Raises ValueError on bad input.
        """
        plan = self.prepare(a, b, rows, out)
        self.gemm(plan)
        self.reduce(plan)
        self.release(plan)
        return plan["out"]

    def prepare(self, a, b, rows, out=None):
        """Validate, allocate ``out``, take the epoch (split for simulation: all ranks' :meth:`gemm`, then all
        :meth:`reduce`, then :meth:`release`)."""
        h = self.heap
        check_tensor("a", a, 2, h.device, self.dtype)
        check_tensor("b", b, 2, h.device, self.dtype)
        rows = tuple(int(r) for r in rows)
        if len(rows) != h.world or any(r < 0 for r in rows):
            raise ValueError(f"gemm_rs: rows={rows} must be {h.world} non-negative counts")
        m = sum(rows)
        if a.shape[0] != m:
            raise ValueError(f"gemm_rs: a has {a.shape[0]} rows, sum(rows)={m}")
        if a.shape[1] != b.shape[0] or b.shape[1] != self.n:
            raise ValueError(f"gemm_rs: a {tuple(a.shape)} @ b {tuple(b.shape)} must give N={self.n} columns")
        if a.stride(1) != 1:
            raise ValueError("gemm_rs: a must have unit column stride (call .contiguous())")
        if max(rows) > self.max_rows:
            raise ValueError(f"gemm_rs: a segment of {max(rows)} rows > max_rows={self.max_rows}; build GemmRs larger")
        mine = rows[h.rank]
        if out is None:
            out = torch.empty(mine, self.n, dtype=a.dtype, device=a.device)
        elif tuple(out.shape) != (mine, self.n) or out.dtype != a.dtype or out.stride(1) != 1:
            raise ValueError(f"gemm_rs: out must be [{mine}, {self.n}] {a.dtype} with unit column stride")
        row_off = [0]
        for r in rows:
            row_off.append(row_off[-1] + r)
        bm, bn = self.tile["BM"], self.tile["BN"]
        tiles = [cdiv(r, bm) for r in rows]
        epoch = h.epochs.next(f"{self.name}.call")
        # every source delivers tiles(mine) * n_tiles adds to this rank's arrive[src] per call
        inc = cdiv(mine, bm) * cdiv(self.n, bn)
        target = h.epochs.advance(f"{self.name}.arrive", inc)
        return dict(a=a, b=b, out=out, rows=rows, row_off=row_off, tiles=tiles, epoch=epoch, target=target, inc=inc)

    def gemm(self, plan) -> None:
        """GEMM tiles with the remote-store epilogue (current stream)."""
        h, a, b = self.heap, plan["a"], plan["b"]
        n_m = sum(plan["tiles"])
        if n_m == 0:
            return
        dev = a.device
        grid = (n_m * cdiv(self.n, self.tile["BN"]),)
        gemm_rs_kernel[grid](h.meta, a, b, self.partial, self.arrive, self.ready,
                             cached_i32(self._dev_meta, plan["row_off"], dev),
                             cached_i32(self._dev_meta, plan["tiles"], dev), self.state,
                             self.n, a.shape[1], self.max_rows, a.stride(0), b.stride(0), b.stride(1),
                             IEEE=self.dtype == torch.float32, **self.tile, **self.launch)

    def reduce(self, plan) -> None:
        """Sum the partials of every source for this rank's rows (waits on the arrive counters)."""
        h, out = self.heap, plan["out"]
        mine = out.shape[0]
        if mine == 0:
            return
        grid = (cdiv(mine, 64), cdiv(self.n, 128))
        rs_reduce_kernel[grid](h.meta, self.partial, self.arrive, out, self.state, plan["inc"], mine, self.n,
                               self.max_rows,
                               out.stride(0), BM=64, BN=128, num_warps=4)

    def release(self, plan) -> None:
        """Tell every peer this rank's partial buffer may be overwritten by the next call."""
        release_kernel[(1,)](self.heap.meta, self.ready, self.state, plan["inc"])
