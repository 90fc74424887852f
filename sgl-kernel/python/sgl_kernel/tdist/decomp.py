"""AG-GEMM and GEMM-RS as a decomposition: cuBLAS per chunk, copy-engine pushes on per-peer streams, stream waits on
signals (the scheme of PyTorch's symmetric-memory ``fused_all_gather_matmul`` / ``fused_matmul_reduce_scatter``, and
of Wang et al., "Overlap Communication with Dependent Computation via Decomposition in Large Deep Learning Models",
ASPLOS 2023, sec. 3; data moved by the copy engines as in Zheng et al., "Triton-distributed", 2025, sec. 3.2).

No SM does any communication and the host only enqueues: every dependency is a stream operation.

* Data signal ``sig[src]`` (in the receiver's heap): the sender's per-peer stream copies (``cuMemcpyAsync`` into the
  receiver's IPC-mapped heap) then writes 1 with ``cuStreamWriteValue64`` (preceded by a system-scope fence, so a
  release). The receiver waits ``sig[src] >= 1`` (``cuStreamWaitValue64``) and resets it to 0 on the receive stream
  of the same ring step (apart from the push stream, so no rank's pushes wait for its peers' pushes), and records an
  event; the consumer stream waits on the event, then
  runs the dependent cuBLAS GEMM (AG-GEMM) or addition (GEMM-RS).
* Credit ``ready[dst]`` (in the sender's heap, 1 at construction): the receiver writes 1 into the sender's
  ``ready[me]`` once it finished reading the buffer the sender writes; the sender's stream waits for it and resets it
  before the next push.

Signal values are constants (1 / 0), not epochs, so a call is host-sync free and can be captured in a CUDA graph and
replayed (every replay runs the same handshake). ``cuStreamWaitValue64`` has no time limit, so with
``bounded_waits=True`` every wait is instead a one-warp Triton kernel on the same stream
(:func:`~sgl_kernel.tdist.common.wait_reset_kernel`: spin with ld.acquire.sys under the heap's wait budget, then
reset the signal): a dead peer makes the wait give up after ``HeapConfig.wait_timeout_s``, record the failure and
abort the group, and :meth:`SymmetricHeap.check` raises TdistWaitError (fail closed, no hang; the results of that
call are garbage). Without it (default: no extra launches) callers bound the whole run on the host (spawn.run_ranks
timeouts).

AG-GEMM, rank ``me``: push ``a`` to every peer (one stream per peer) in :func:`plan_chunks` pieces, compute ``a @ b``
into its rows of ``out`` meanwhile, then each peer piece's GEMM as soon as its signal arrives (ring order ``me-1,
me-2, ...``: the order in which the pushes of the peers arrive).

Schedule of the per-peer streams (``schedule``): ``"ring"`` (default from world 3) staggers them: step ``j``'s first
push waits until step ``j-1``'s pushes are done, so at any time every rank sends to ONE peer ``me+j`` and receives
from ONE peer ``me-j`` (a permutation: each NVLink direction carries one transfer at full bandwidth, no incast), and
the segments land in the order the consumer takes them (the whole first segment arrives after ``1/(world-1)`` of
the transfer time instead of all segments at the end); this is the step order of PyTorch's symmetric-memory ops
(one peer per step). ``"all"`` (world 2, where both are the same) runs every step at once; its consumer then takes
the pieces piece-major (piece 0 of every source first), the order in which they arrive.

GEMM-RS: compute the partial of each peer's rows
first (ring order ``me+1, ...``), piece by piece, each piece pushed from a per-peer stream as soon as it is done; the
first source's pieces are copied into ``out`` by the copy engine as they land, and the own rows' GEMM accumulates
into them (``out += a @ b``, cuBLAS beta = 1: the reduction rides in the GEMM epilogue; ``out`` accumulates in the
output dtype, as NCCL's reduce-scatter does).
"""

from __future__ import annotations

import functools
from typing import List, Optional, Sequence, Tuple

import torch

from sgl_kernel.tdist import cuda_ipc
from sgl_kernel.tdist.checks import check_rows, check_tensor


def _peer_addr(heap, t: torch.Tensor, peer: int) -> int:
    """Peer ``peer``'s address of the heap location of local heap tensor ``t``."""
    off = t.data_ptr() - heap.bases[heap.rank]
    if not 0 <= off < heap.config.total_bytes:
        raise ValueError("tensor is not inside this rank's symmetric heap")
    return heap.bases[peer] + off


MAX_CHUNKS = 4  # pieces per ring step (signal slots per source)
SCHEDULES = ("ring", "all")  # per-peer stream schedule (module docstring)
_MIN_PIECE_ELEMS = 4 << 20  # output elements per piece GEMM (rows * N) below which cuBLAS leaves SMs idle
_BYTES_PER_FLOP = 1.0 / 3000.0  # copy-engine push bandwidth / dense bf16 GEMM rate on H100 (~200 GB/s / ~600 TFLOP/s)


def plan_chunks(kind: str, rows: Sequence[int], k: int, n: int, min_rows: int = 512) -> int:
    """Pieces per ring step: how finely each segment is pushed and consumed. The GEMM time per row over the push
    time per row is ``n * B / F`` for AG-GEMM (a row of ``a`` is ``2k`` bytes and ``2kn`` flops) and ``k * B / F``
    for GEMM-RS; when the GEMM hides the transfer (ratio >= 3) one piece keeps the GEMMs large, else 2 or 4 pieces
    let the consumer start on the first piece while the rest is in flight. GEMM-RS uses >= 2 pieces: the own rows'
    GEMM adds each received piece in its epilogue, so it must not wait for the whole transfer. Capped so a piece
    has >= ``min_rows`` rows (of the largest segment) and, for world > 2, so a piece GEMM has >= 4M output elements
    (``rows * N``; a narrower GEMM leaves SMs idle: qkv's N = 2560 at 512 rows fills a third of an H100) and
    ``(world - 1) * pieces <= 4`` (each piece costs ~6 host-side stream operations per step; at world 4 with 4
    pieces the host enqueue time exceeded the GPU time, 2026-11-26 on 4 x H200). Same on every rank (a function of
    the shared ``rows``)."""
    ratio = (n if kind == "ag" else k) * _BYTES_PER_FLOP
    c = 1 if ratio >= 3 else 2 if ratio >= 1.5 else 4
    big = max(rows) if rows else 0
    cap = big // min_rows
    if len(rows) > 2:
        cap = min(cap, big * n // _MIN_PIECE_ELEMS, 4 // (len(rows) - 1))
    c = min(c, cap)
    if kind == "rs":  # the GEMM-RS floor of 2 pieces outranks the world > 2 caps (not the min_rows one)
        c = max(c, min(2, big // min_rows))
    return max(1, c)


def default_schedule(world: int) -> str:
    """The per-peer stream schedule used when the op is given none: ``"ring"`` from world 3 (module docstring)."""
    return "ring" if world > 2 else "all"


@functools.lru_cache(maxsize=256)
def _pieces(total: int, c: int) -> Tuple[Tuple[int, int], ...]:
    """``c`` row ranges [lo, hi) covering ``total`` rows, multiples of 16 rows except the last (cached: called
    per step on every call)."""
    step = -(-total // c)
    step = -(-step // 16) * 16 if total >= 16 * c else step
    out, lo = [], 0
    for _ in range(c):
        hi = min(total, lo + step)
        out.append((lo, hi))
        lo = hi
    return tuple(out)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class _Handshake:
    """Per-op signals and per-peer streams of the decomposition (see the module docstring). Signal slot
    ``sig[src * MAX_CHUNKS + c]`` carries piece ``c`` from ``src``."""

    def __init__(self, heap, name: str, bounded: bool = False, schedule: Optional[str] = None):
        schedule = schedule or default_schedule(heap.world)
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule={schedule!r} must be one of {SCHEDULES} (or None: per world)")
        self.heap, self.bounded, self.schedule = heap, bounded, schedule
        self.split, self.split_min_bytes = 1, 4 << 20  # see _push (1: one copy per piece)
        self.split_recv = True  # receive waits on their own streams (see exchange)
        self._used: list = []  # stream keys used by the current call (joined by join)
        self.sig = heap.signals(f"{name}.sig", heap.world * MAX_CHUNKS)
        self.ready = heap.signals(f"{name}.ready", heap.world)
        # heap offsets of the signal arrays: a peer's slot address is plain integer arithmetic (no tensor per op)
        self._sig_off = self.sig.data_ptr() - heap.bases[heap.rank]
        self._ready_off = self.ready.data_ptr() - heap.bases[heap.rank]
        self.streams: dict = {}
        self.events: dict = {}
        if heap.device.type == "cuda":
            self.ready.fill_(1)  # every receiver starts with its buffers free
            heap.barrier()  # nobody writes a peer's ready before that peer's fill

    def stream(self, j) -> "torch.cuda.Stream":
        """The copy stream of ring step ``j`` (or of a key such as ``("copy", j, i)``: a helper of :meth:`_push`;
        high priority: a copy is never queued behind GEMMs). With ``HeapConfig.shared_streams`` (default) the heap's
        stream of that key, shared by every op of the heap (bounded count; ops of a heap run one after another on
        the caller's stream and each joins its streams, so sharing adds no wait), else one per op."""
        s = self.streams.get(j)
        if s is None:
            s = (self.heap.side_stream(("decomp", j)) if self.heap.config.shared_streams
                 else torch.cuda.Stream(self.heap.device, priority=-1))
            self.streams[j] = s
        return s

    def event(self, key) -> "torch.cuda.Event":
        """A cached event (one per ``key``; reused by every call: CUDA-graph friendly)."""
        ev = self.events.get(key)
        if ev is None:
            ev = self.events[key] = torch.cuda.Event()
        return ev

    def begin(self, main: "torch.cuda.Stream") -> None:
        """Start of a call: record the ``start`` event on ``main`` (the receive streams fork from it: their landing
        copies write ``out`` after ``main``'s earlier use of it, and under CUDA-graph capture every stream of the
        call joins the capture through it) and forget the streams of the previous call (:meth:`join` waits only
        for the streams this call used)."""
        self._used = []
        self.event("start").record(main)

    def _use(self, key) -> "torch.cuda.Stream":
        s = self.stream(key)
        if key not in self._used:
            self._used.append(key)
        return s

    def exchange(self, j: int, sends, afters, sender: int, land=None) -> List["torch.cuda.Event"]:
        """Ring step ``j``, piece by piece. Push side, on the step's stream: with the ``"ring"`` schedule first
        wait until step ``j - 1``'s pushes of this call are done (recorded by the previous ``exchange`` call: call
        the steps in order); wait for the credit of ``peer = me + j``; then for each piece ``c``: wait
        ``afters[c]``, copy ``sends[c] = (dst_local, src)`` into the peer's copy of ``dst_local``, signal the
        peer's ``sig[me, c]``. Receive side, on the step's receive stream (forked from the call's ``start`` event,
        :meth:`begin`; with ``split_recv=False`` on the push stream after piece ``c``'s push, the layout before
        2026-11-27): wait for this rank's ``sig[sender, c]`` and reset it, optionally copy the received piece
        locally (``land[c] = (dst, src)``, a copy-engine copy off the SMs), record event ``c``. Returns the
        per-piece events the consumer's stream waits on. No cycle: a push waits only for GEMMs of this call, the
        ring's previous step's pushes (lower steps only) and credits the peers' consumers gave at the end of the
        previous call; the receive waits only for peers' pushes. On the push stream a receive wait holds back
        this rank's next pushes (piece ``c + 1``, and under ``"ring"`` the next step) behind its sender's push of
        piece ``c``, chaining the ranks' pieces around the ring (benchmark/tdist/bench_kernels.py measures both layouts: notes
        "waits on push streams")."""
        h = self.heap
        peer = (h.rank + j) % h.world
        s = self._use(j)
        cs = s.cuda_stream
        # not in _used: the consumer waits on every piece event of the receive stream, its last work (joined)
        r = self.stream(("recv", j)) if self.split_recv else s
        if r is not s:
            r.wait_event(self.event("start"))
        s.wait_event(afters[0])
        if self.schedule == "ring" and j > 1:
            s.wait_event(self.event(("pushed", j - 1)))
        self._wait_reset(self.ready, peer, s)
        sig_peer = h.bases[peer] + self._sig_off + 8 * h.rank * MAX_CHUNKS
        evs = []
        for c, (dst_local, src) in enumerate(sends):
            if c and afters[c] is not afters[c - 1]:
                s.wait_event(afters[c])
            if _nbytes(src):
                self._push(j, c, _peer_addr(h, dst_local, peer), src.data_ptr(), _nbytes(src), s)
            cuda_ipc.stream_write_value64(sig_peer + 8 * c, 1, cs)
            if c == len(sends) - 1 and self.schedule == "ring":
                self.event(("pushed", j)).record(s)  # the next step's pushes may start (this one's are done)
            if r is s:
                evs.append(self._receive(j, c, sender, land, r))
        if r is not s:
            evs = [self._receive(j, c, sender, land, r) for c in range(len(sends))]
        return evs

    def _receive(self, j: int, c: int, sender: int, land, r: "torch.cuda.Stream") -> "torch.cuda.Event":
        """On stream ``r``: wait for and reset ``sig[sender, c]``, land piece ``c`` (``land[c]``, optional), record
        and return the event of (step ``j``, piece ``c``)."""
        self._wait_reset(self.sig, sender * MAX_CHUNKS + c, r)
        if land is not None and _nbytes(land[c][1]):
            cuda_ipc.memcpy_async(land[c][0].data_ptr(), land[c][1].data_ptr(), _nbytes(land[c][1]), r.cuda_stream)
        ev = self.event((j, c))
        ev.record(r)
        return ev

    def _push(self, j: int, c: int, dst: int, src: int, n: int, s: "torch.cuda.Stream") -> None:
        """``cuMemcpyAsync`` of ``n`` bytes ``src -> dst`` in stream order on ``s``. With ``self.split = k > 1``
        (and ``n >= self.split_min_bytes``) the copy is cut in ``k`` parts: parts 1.. run on helper streams forked
        from ``s`` (so on other copy engines, in parallel) and ``s`` waits for them before its next operation (the
        piece's signal), so the protocol is unchanged. Opt-in: measured by benchmark/tdist/bench_kernels.py (pieces notes)."""
        k = self.split if n >= self.split_min_bytes else 1
        part = -(-n // max(k, 1) // 256) * 256
        if k <= 1 or part >= n:
            cuda_ipc.memcpy_async(dst, src, n, s.cuda_stream)
            return
        fork = self.event(("fork", j, c))
        fork.record(s)
        joins = []
        for i in range(1, k):
            lo = i * part
            if lo >= n:
                break
            helper = self.stream(("copy", j, i))  # joined into s below (so not in _used)
            helper.wait_event(fork)
            cuda_ipc.memcpy_async(dst + lo, src + lo, min(part, n - lo), helper.cuda_stream)
            ev = self.event(("join", j, c, i))
            ev.record(helper)
            joins.append(ev)
        cuda_ipc.memcpy_async(dst, src, part, s.cuda_stream)
        for ev in joins:
            s.wait_event(ev)

    def _wait_reset(self, sigs: torch.Tensor, i: int, s: "torch.cuda.Stream") -> None:
        """On stream ``s``: wait until the int64 signal ``sigs[i]`` (this rank's heap) is 1, then set it to 0;
        bounded by the heap's wait budget when ``self.bounded`` (module docstring)."""
        if self.bounded:
            from sgl_kernel.tdist.common import wait_reset_kernel  # Triton only on this path

            with torch.cuda.stream(s):
                wait_reset_kernel[(1,)](self.heap.meta, sigs[i: i + 1], num_warps=1)
        else:
            addr = sigs.data_ptr() + 8 * i
            cuda_ipc.stream_wait_value64(addr, 1, s.cuda_stream)
            cuda_ipc.stream_write_value64(addr, 0, s.cuda_stream)

    def credit(self, src: int, stream: "torch.cuda.Stream") -> None:
        """After ``stream``'s earlier work: tell ``src`` its buffer here may be overwritten (its ``ready[me]`` = 1)."""
        h = self.heap
        cuda_ipc.stream_write_value64(h.bases[src] + self._ready_off + 8 * h.rank, 1, stream.cuda_stream)

    def join(self, main: "torch.cuda.Stream") -> None:
        """``main`` waits for every push stream this call used (their copies have left this rank's buffers; the
        receive streams are joined already: the consumer waited on their last events). This is
        also why no ``record_stream`` is needed: memory freed after the call is reused behind this join on
        ``main``. Only this call's streams: a stream created by an earlier call in another mode (e.g. the helper
        streams of split pushes) is not part of a CUDA-graph capture, and waiting on it from the capturing stream
        invalidates the capture (cudaErrorStreamCaptureInvalidated, 2026-11-27 on 4 x H200)."""
        for key in self._used:
            main.wait_stream(self.streams[key])
        self._used = []


def _offsets(rows: Sequence[int]) -> List[int]:
    off = [0]
    for r in rows:
        off.append(off[-1] + r)
    return off


def _check_chunks(chunks: Optional[int]) -> None:
    if chunks is not None and not 1 <= chunks <= MAX_CHUNKS:
        raise ValueError(f"chunks={chunks} must be None (planned per shape) or in [1, {MAX_CHUNKS}]")


class DecompAgGemm:
    """``all_gather(a) @ b`` by decomposition (module docstring) on a :class:`~sgl_kernel.tdist.heap.SymmetricHeap`.

    Args: heap (CUDA IPC heap, one GPU per rank or shared); max_rows (largest total M) and k size the gather buffer
    (``max_rows * k`` elements of ``dtype`` per rank); name (unique per op site); chunks (pieces per segment, None:
    :func:`plan_chunks` per call); bounded_waits (every signal wait is a bounded Triton wait kernel instead of
    ``cuStreamWaitValue64``: a dead peer raises TdistWaitError from ``heap.check()`` instead of hanging; module
    docstring); schedule (``"ring"`` / ``"all"``, None: :func:`default_schedule`; same on every rank; module
    docstring; ``op.hs.schedule`` may be changed between calls on every rank). Construction is collective (it
    allocates heap signals, sets the credits and runs a host barrier).
    Raises ValueError on bad sizes.
    """

    def __init__(self, heap, max_rows: int, k: int, dtype: torch.dtype = torch.bfloat16, *, name: str = "dag",
                 chunks: Optional[int] = None, bounded_waits: bool = False, schedule: Optional[str] = None):
        if max_rows < 1 or k < 1:
            raise ValueError(f"max_rows={max_rows} and k={k} must be >= 1")
        _check_chunks(chunks)
        self.heap, self.max_rows, self.k, self.dtype, self.chunks = heap, max_rows, k, dtype, chunks
        self.gather = heap.tensor(f"{name}.gather", (max_rows, k), dtype)
        self.hs = _Handshake(heap, name, bounded_waits, schedule)

    def __call__(self, a: torch.Tensor, b: torch.Tensor, rows: Sequence[int], out: Optional[torch.Tensor] = None,
                 chunks: Optional[int] = None, bulk: bool = False):
        """a: [rows[rank], K] contiguous (this rank's shard, self.dtype, on the heap's CUDA device); b: [K, N] (any
        strides, e.g. ``weight.t()``); rows: every rank's row count (same on all ranks, sum <= max_rows); out:
        optional [sum(rows), N] contiguous; chunks: pieces for this call (same on all ranks; default: the
        constructor's, else planned); bulk: world 2 with one piece only (else ignored), see :meth:`_bulk`.
        Returns ``out`` = all_gather(a) @ b. Enqueues only (no host sync). All ranks call together (same ``chunks``
        and ``bulk``). Raises ValueError on bad shapes, dtypes or devices."""
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
        _check_chunks(chunks)
        c = chunks or self.chunks or plan_chunks("ag", rows, self.k, n)
        self.hs.begin(main)
        done = self.hs.event("start")  # a is ready
        mine = self.gather[off[me]: off[me + 1]]
        if bulk and w == 2 and c == 1:
            head = min(rows[me], -(-rows[1 - me] * 3900 // (n * 128)) * 128)
            if 0 < head < rows[me] and rows[1 - me]:
                return self._bulk(a, b, off, out, head, done, mine)
        sends = [(mine[lo:hi], a[lo:hi]) for lo, hi in _pieces(rows[me], c)]
        arrived = []
        for j in range(1, w):  # step j pushes to me + j and receives from me - j (which pushes at its step j)
            arrived.append(self.hs.exchange(j, sends, [done] * c, (me - j) % w))
        torch.mm(a, b, out=out[off[me]: off[me + 1]])  # the own rows while the first pieces are in flight
        # consumer order = arrival order: segment by segment on the ring, piece-major when every step runs at once
        order = ([(j, p) for j in range(1, w) for p in range(c)] if self.hs.schedule == "ring" or c == 1 else
                 [(j, p) for p in range(c) for j in range(1, w)])
        for j, p in order:
            s = (me - j) % w
            lo, hi = _pieces(rows[s], c)[p]
            main.wait_event(arrived[j - 1][p])
            if hi > lo:
                torch.mm(self.gather[off[s] + lo: off[s] + hi], b, out=out[off[s] + lo: off[s] + hi])
            if p == c - 1 and (self.hs.schedule == "ring" or c == 1):
                self.hs.credit(s, main)
        if not (self.hs.schedule == "ring" or c == 1):
            for j in range(1, w):
                self.hs.credit((me - j) % w, main)
        self.hs.join(main)
        return out


    def _bulk(self, a, b, off, out, head, done, mine):
        """World 2, one piece: the GEMM of ``head`` own rows (sized so it outlasts the push: ~1.3x the transfer at
        the B/F ratio of :func:`plan_chunks`) while the shard goes out and the copy engine also copies ``a`` into
        this rank's own rows of the gather buffer; then ONE GEMM over every other row, which is contiguous in the
        gather buffer (rank 0: head = its first rows; rank 1: its last rows): one large GEMM instead of two halves
        when the GEMM hides the transfer anyway. The exchange is the ordinary one-piece exchange, so a rank whose
        head would cover all its rows may take the ordinary path while its peer takes this one."""
        main = torch.cuda.current_stream(self.heap.device)
        me, total = self.heap.rank, off[-1]
        ev = self.hs.exchange(1, [(mine, a)], [done], 1 - me, [(mine, a)])[0]
        lo, hi = (0, head) if me == 0 else (a.shape[0] - head, a.shape[0])
        torch.mm(a[lo:hi], b, out=out[off[me] + lo: off[me] + hi])
        rest = (head, total) if me == 0 else (0, total - head)
        main.wait_event(ev)
        torch.mm(self.gather[rest[0]: rest[1]], b, out=out[rest[0]: rest[1]])
        self.hs.credit(1 - me, main)
        self.hs.join(main)
        return out


class DecompGemmRs:
    """Reduce-scattered ``a @ b`` by decomposition (module docstring): returns this rank's ``rows[rank]`` rows of
    ``sum over ranks of a_r @ b_r``.

    Args: heap; max_rows (largest segment any rank owns) and n (output columns) size the receive buffer
    (``world * max_rows * n`` elements of ``dtype`` per rank) and the local staging buffers; name (unique per op
    site); chunks (pieces per segment, None: :func:`plan_chunks` per call); bounded_waits, schedule: as
    DecompAgGemm.
    Construction is collective. Raises ValueError on bad sizes.
    """

    def __init__(self, heap, max_rows: int, n: int, dtype: torch.dtype = torch.bfloat16, *, name: str = "drs",
                 chunks: Optional[int] = None, bounded_waits: bool = False, schedule: Optional[str] = None):
        if max_rows < 1 or n < 1:
            raise ValueError(f"max_rows={max_rows} and n={n} must be >= 1")
        _check_chunks(chunks)
        self.heap, self.max_rows, self.n, self.dtype, self.chunks = heap, max_rows, n, dtype, chunks
        self.recv = heap.tensor(f"{name}.recv", (heap.world, max_rows, n), dtype)
        self.stage = torch.empty(max(heap.world - 1, 1), max_rows, n, dtype=dtype, device=heap.device)
        self.hs = _Handshake(heap, name, bounded_waits, schedule)

    def __call__(self, a: torch.Tensor, b: torch.Tensor, rows: Sequence[int], out: Optional[torch.Tensor] = None,
                 chunks: Optional[int] = None):
        """a: [sum(rows), K_local] contiguous (self.dtype); b: [K_local, N] (any strides); rows: rows owned per rank
        (same on all ranks, each <= max_rows); out: optional [rows[rank], N] contiguous; chunks: as in
        DecompAgGemm. Returns ``out``.
        Enqueues only (no host sync). All ranks call together. Raises ValueError on bad input.

        Schedule: the peers' partials first, piece by piece, each piece pushed as soon as its GEMM is done; the
        first source's pieces are copied into ``out`` by the copy engine as they land; the own rows' GEMM then runs
        piece by piece as ``out += a @ b`` (cuBLAS beta = 1: the reduction is fused into the GEMM epilogue, no
        separate add kernel); further sources (world > 2) are added per piece."""
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
        if w == 1:
            return torch.mm(a, b, out=out)
        main = torch.cuda.current_stream(h.device)
        _check_chunks(chunks)
        c = chunks or self.chunks or plan_chunks("rs", rows, a.shape[1], self.n)
        self.hs.begin(main)
        mine = _pieces(rows[me], c)
        arrived = []
        for j in range(1, w):  # step j pushes to d = me + j and receives from me - j (which pushes at its step j)
            d = (me + j) % w
            sends, afters = [], []
            for p, (lo, hi) in enumerate(_pieces(rows[d], c)):
                part = self.stage[j - 1, lo:hi]
                torch.mm(a[off[d] + lo: off[d] + hi], b, out=part)
                ev = self.hs.event(("p", j, p))
                ev.record(main)
                sends.append((self.recv[me, lo:hi], part))
                afters.append(ev)
            src = self.recv[(me - j) % w]
            land = [(out[lo:hi], src[lo:hi]) for lo, hi in mine] if j == 1 else None
            arrived.append(self.hs.exchange(j, sends, afters, (me - j) % w, land))
        for p, (lo, hi) in enumerate(mine):  # own rows: out += a @ b per piece, once the piece has landed
            for j in range(1, w):
                main.wait_event(arrived[j - 1][p])
            if hi > lo:
                out[lo:hi].addmm_(a[off[me] + lo: off[me] + hi], b)  # in place: no copy of out into C
                for j in range(2, w):
                    out[lo:hi].add_(self.recv[(me - j) % w, lo:hi])
        for j in range(1, w):
            self.hs.credit((me - j) % w, main)
        self.hs.join(main)
        return out
