"""AG-GEMM and GEMM-RS as a decomposition: cuBLAS per chunk, copy-engine pushes on per-peer streams, stream waits on
signals (the scheme of PyTorch's symmetric-memory ``fused_all_gather_matmul`` / ``fused_matmul_reduce_scatter``, and
of Wang et al., "Overlap Communication with Dependent Computation via Decomposition in Large Deep Learning Models",
ASPLOS 2023, sec. 3; data moved by the copy engines as in Zheng et al., "Triton-distributed", 2025, sec. 3.2).

No SM does any communication and the host only enqueues: every dependency is a stream operation.

* Data signal ``sig[src]`` (in the receiver's heap): the sender's per-peer stream copies (``cuMemcpyAsync`` into the
  receiver's IPC-mapped heap) then writes 1 with ``cuStreamWriteValue64`` (preceded by a system-scope fence, so a
  release). The receiver waits ``sig[src] >= 1`` (``cuStreamWaitValue64``) and resets it to 0 on the stream of the
  same ring step, after that step's own push, and records an event; the consumer stream waits on the event, then
  runs the dependent cuBLAS GEMM (AG-GEMM) or addition (GEMM-RS).
* Credit ``ready[dst]`` (in the sender's heap, 1 at construction): the receiver writes 1 into the sender's
  ``ready[me]`` once it finished reading the buffer the sender writes; the sender's stream waits for it and resets it
  before the next push.

Signal values are constants (1 / 0), not epochs, so a call is host-sync free and can be captured in a CUDA graph and
replayed (every replay runs the same handshake). A wait never times out on the device (stream waits have no budget):
callers bound the whole run on the host (spawn.run_ranks timeouts).

AG-GEMM, rank ``me``: push ``a`` to every peer (one stream per peer), compute ``a @ b`` into its rows of ``out``
meanwhile, then each peer segment's GEMM as soon as its signal arrives (ring order ``me-1, me-2, ...``: the order in
which the pushes of the peers arrive). GEMM-RS: compute the partial of each peer's rows first (ring order ``me+1,
...``) and push it from a per-peer stream as soon as it is done, then the own rows into ``out``; then add every
received partial to ``out`` as it arrives (``out`` accumulates in the output dtype, as NCCL's reduce-scatter does).
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch

from sgl_kernel.tdist import cuda_ipc
from sgl_kernel.tdist.checks import check_rows, check_tensor


def _peer_addr(heap, t: torch.Tensor, peer: int) -> int:
    """Peer ``peer``'s address of the heap location of local heap tensor ``t``."""
    off = t.data_ptr() - heap.bases[heap.rank]
    if not 0 <= off < heap.config.total_bytes:
        raise ValueError("tensor is not inside this rank's symmetric heap")
    return heap.bases[peer] + off


class _Handshake:
    """Per-op signals and per-peer streams of the decomposition (see the module docstring)."""

    def __init__(self, heap, name: str):
        self.heap = heap
        self.sig = heap.signals(f"{name}.sig", heap.world)
        self.ready = heap.signals(f"{name}.ready", heap.world)
        self.streams: dict = {}
        self.events: dict = {}
        if heap.device.type == "cuda":
            self.ready.fill_(1)  # every receiver starts with its buffers free
            heap.barrier()  # nobody writes a peer's ready before that peer's fill

    def stream(self, j: int) -> "torch.cuda.Stream":
        """The copy stream of ring step ``j`` (high priority: a copy is never queued behind GEMMs)."""
        s = self.streams.get(j)
        if s is None:
            s = torch.cuda.Stream(self.heap.device, priority=-1)
            self.streams[j] = s
            self.events[j] = torch.cuda.Event()
        return s

    def exchange(self, j: int, dst_local: torch.Tensor, src: torch.Tensor, after: torch.cuda.Event,
                 sender: int) -> torch.cuda.Event:
        """Ring step ``j`` on its own stream: wait for ``after`` and the credit of ``peer = me + j``, copy ``src``
        into the peer's copy of ``dst_local`` (same byte size), signal the peer's ``sig[me]``; then wait for this
        rank's ``sig[sender]`` and reset it. Returns an event the consumer's stream waits on, so every dependency of
        the consumer is CUDA-visible (stream waits only sit behind this step's own push: no serialization of graph
        branches or of aliased hardware queues can order a wait before the push the peer waits for)."""
        h = self.heap
        peer = (h.rank + j) % h.world
        s = self.stream(j)
        s.wait_event(after)
        cs = s.cuda_stream
        cuda_ipc.stream_wait_value64(self.ready[peer].data_ptr(), 1, cs)
        cuda_ipc.stream_write_value64(self.ready[peer].data_ptr(), 0, cs)
        nbytes = src.numel() * src.element_size()
        if nbytes:
            cuda_ipc.memcpy_async(_peer_addr(h, dst_local, peer), src.data_ptr(), nbytes, cs)
        cuda_ipc.stream_write_value64(_peer_addr(h, self.sig[h.rank], peer), 1, cs)
        cuda_ipc.stream_wait_value64(self.sig[sender].data_ptr(), 1, cs)
        cuda_ipc.stream_write_value64(self.sig[sender].data_ptr(), 0, cs)
        ev = self.events[j]
        ev.record(s)
        return ev

    def credit(self, src: int, stream: "torch.cuda.Stream") -> None:
        """After ``stream``'s earlier work: tell ``src`` its buffer here may be overwritten (its ``ready[me]`` = 1)."""
        h = self.heap
        cuda_ipc.stream_write_value64(_peer_addr(h, self.ready[h.rank], src), 1, stream.cuda_stream)

    def join(self, main: "torch.cuda.Stream") -> None:
        """``main`` waits for every step stream (their copies have left this rank's buffers). This is also why no
        ``record_stream`` is needed: memory freed after the call is reused behind this join on ``main``."""
        for s in self.streams.values():
            main.wait_stream(s)


def _offsets(rows: Sequence[int]) -> List[int]:
    off = [0]
    for r in rows:
        off.append(off[-1] + r)
    return off


class DecompAgGemm:
    """``all_gather(a) @ b`` by decomposition (module docstring) on a :class:`~sgl_kernel.tdist.heap.SymmetricHeap`.

    Args: heap (CUDA IPC heap, one GPU per rank or shared); max_rows (largest total M) and k size the gather buffer
    (``max_rows * k`` elements of ``dtype`` per rank); name (unique per op site). Construction is collective (it
    allocates heap signals, sets the credits and runs a host barrier). Raises ValueError on bad sizes.
    """

    def __init__(self, heap, max_rows: int, k: int, dtype: torch.dtype = torch.bfloat16, *, name: str = "dag"):
        if max_rows < 1 or k < 1:
            raise ValueError(f"max_rows={max_rows} and k={k} must be >= 1")
        self.heap, self.max_rows, self.k, self.dtype = heap, max_rows, k, dtype
        self.gather = heap.tensor(f"{name}.gather", (max_rows, k), dtype)
        self.hs = _Handshake(heap, name)
        self._done = torch.cuda.Event() if heap.device.type == "cuda" else None

    def __call__(self, a: torch.Tensor, b: torch.Tensor, rows: Sequence[int], out: Optional[torch.Tensor] = None):
        """a: [rows[rank], K] contiguous (this rank's shard, self.dtype, on the heap's CUDA device); b: [K, N] (any
        strides, e.g. ``weight.t()``); rows: every rank's row count (same on all ranks, sum <= max_rows); out:
        optional [sum(rows), N] contiguous. Returns ``out`` = all_gather(a) @ b. Enqueues only (no host sync).
        All ranks call together. Raises ValueError on bad shapes, dtypes or devices."""
        h = self.heap
        check_tensor("a", a, 2, h.device, self.dtype)
        check_tensor("b", b, 2, h.device, self.dtype)
        rows = check_rows(rows, h.world, h.rank, a.shape[0], "decomp ag_gemm")
        if a.shape[1] != self.k or b.shape[0] != self.k or not a.is_contiguous():
            raise ValueError(f"decomp ag_gemm: a {tuple(a.shape)} must be contiguous, a and b {tuple(b.shape)} "
                             f"must have K={self.k}")
        off = _offsets(rows)
        if off[-1] > self.max_rows:
            raise ValueError(f"decomp ag_gemm: total rows {off[-1]} > max_rows={self.max_rows}")
        n = b.shape[1]
        if out is None:
            out = torch.empty(off[-1], n, dtype=a.dtype, device=a.device)
        elif tuple(out.shape) != (off[-1], n) or out.dtype != a.dtype or not out.is_contiguous():
            raise ValueError(f"decomp ag_gemm: out must be contiguous [{off[-1]}, {n}] {a.dtype}")
        main = torch.cuda.current_stream(h.device)
        me, w = h.rank, h.world
        self._done.record(main)  # a is ready
        arrived = []
        for j in range(1, w):  # step j pushes to me + j and receives from me - j (which pushes at its step j)
            s = (me - j) % w
            arrived.append(self.hs.exchange(j, self.gather[off[me]: off[me + 1]], a, self._done, s))
        torch.mm(a, b, out=out[off[me]: off[me + 1]])
        for j in range(1, w):
            s = (me - j) % w
            main.wait_event(arrived[j - 1])
            if rows[s]:
                torch.mm(self.gather[off[s]: off[s + 1]], b, out=out[off[s]: off[s + 1]])
            self.hs.credit(s, main)
        self.hs.join(main)
        return out


class DecompGemmRs:
    """Reduce-scattered ``a @ b`` by decomposition (module docstring): returns this rank's ``rows[rank]`` rows of
    ``sum over ranks of a_r @ b_r``.

    Args: heap; max_rows (largest segment any rank owns) and n (output columns) size the receive buffer
    (``world * max_rows * n`` elements of ``dtype`` per rank) and the local staging buffers; name (unique per op
    site). Construction is collective. Raises ValueError on bad sizes.
    """

    def __init__(self, heap, max_rows: int, n: int, dtype: torch.dtype = torch.bfloat16, *, name: str = "drs"):
        if max_rows < 1 or n < 1:
            raise ValueError(f"max_rows={max_rows} and n={n} must be >= 1")
        self.heap, self.max_rows, self.n, self.dtype = heap, max_rows, n, dtype
        self.recv = heap.tensor(f"{name}.recv", (heap.world, max_rows, n), dtype)
        self.stage = torch.empty(max(heap.world - 1, 1), max_rows, n, dtype=dtype, device=heap.device)
        self.hs = _Handshake(heap, name)
        cuda = heap.device.type == "cuda"
        self._events = [torch.cuda.Event() for _ in range(heap.world)] if cuda else []

    def __call__(self, a: torch.Tensor, b: torch.Tensor, rows: Sequence[int], out: Optional[torch.Tensor] = None):
        """a: [sum(rows), K_local] contiguous (self.dtype); b: [K_local, N] (any strides); rows: rows owned per rank
        (same on all ranks, each <= max_rows); out: optional [rows[rank], N] contiguous. Returns ``out``.
        Enqueues only (no host sync). All ranks call together. Raises ValueError on bad input."""
        h = self.heap
        check_tensor("a", a, 2, h.device, self.dtype)
        check_tensor("b", b, 2, h.device, self.dtype)
        rows = tuple(int(r) for r in rows)
        if len(rows) != h.world or any(r < 0 for r in rows) or max(rows) > self.max_rows:
            raise ValueError(f"decomp gemm_rs: rows={rows} must be {h.world} counts in [0, {self.max_rows}]")
        off = _offsets(rows)
        if a.shape[0] != off[-1] or a.shape[1] != b.shape[0] or b.shape[1] != self.n or not a.is_contiguous():
            raise ValueError(f"decomp gemm_rs: a {tuple(a.shape)} (contiguous, {off[-1]} rows) @ b {tuple(b.shape)} "
                             f"must give N={self.n}")
        me, w = h.rank, h.world
        if out is None:
            out = torch.empty(rows[me], self.n, dtype=a.dtype, device=a.device)
        elif tuple(out.shape) != (rows[me], self.n) or out.dtype != a.dtype or not out.is_contiguous():
            raise ValueError(f"decomp gemm_rs: out must be contiguous [{rows[me]}, {self.n}] {a.dtype}")
        main = torch.cuda.current_stream(h.device)
        arrived = []
        for j in range(1, w):  # peers' partials first, each pushed as soon as its GEMM is done; step j receives
            d = (me + j) % w  # from me - j, which pushes to me at its step j
            part = self.stage[j - 1, : rows[d]]
            torch.mm(a[off[d]: off[d + 1]], b, out=part)
            self._events[j].record(main)
            arrived.append(self.hs.exchange(j, self.recv[me, : rows[d]], part, self._events[j], (me - j) % w))
        torch.mm(a[off[me]: off[me + 1]], b, out=out)
        for j in range(1, w):  # reduce each source's partial as soon as it is here
            s = (me - j) % w
            main.wait_event(arrived[j - 1])
            out.add_(self.recv[s, : rows[me]])
            self.hs.credit(s, main)
        self.hs.join(main)
        return out
