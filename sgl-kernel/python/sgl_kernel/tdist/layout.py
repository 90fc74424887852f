"""Host-side bookkeeping of the Triton-distributed symmetric heap (pure Python, no CUDA).

Every rank of a process group owns one heap of the same size; a region (a buffer or a block of signals) sits at the
same byte offset in every rank's heap, so a kernel translates "my address of region R" into "peer p's address of R"
by adding ``base[p] - base[me]`` (Zheng et al., "Triton-distributed", 2025, sec. 2.2: symmetric memory). The offsets
are decided here, identically on every rank, by a deterministic bump allocator: ranks must request regions in the
same order with the same sizes (the collective ops that use the heap do, since all ranks know every shape).

Signals are int64 slots in a separate region at the start of the heap. They are never reset: a writer *sets* a slot
to the call's epoch (1, 2, 3, ... per op name) or *adds* to a cumulative counter whose expected total the host keeps
(:meth:`SignalEpochs.advance`), and a reader waits until ``slot >= target``. So a signal is reused across calls
without a reset kernel and without a race between a late reset and an early next-call write.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Mapping, Sequence, Tuple

# ---- device error record (the first ERROR_SLOTS int64 signal slots of every rank's heap) ---------------------------
# A bounded wait that gives up writes, in its own rank's heap: [ERR_ABORT] = 1 + rank of the first rank that timed
# out (also written into every peer's heap, so their waits give up at once instead of each burning the full budget);
# the first failing wait of the rank (CAS of [ERR_SITE] from 0) fills [ERR_SITE] = kernel site code (WAIT_SITES),
# [ERR_SIG] = byte offset of the awaited signal from the heap base (outside [0, signal bytes) = not a heap signal),
# [ERR_EXPECT] = awaited value, [ERR_SEEN] = last value read, [ERR_REASON] (WAIT_REASONS), [ERR_CMP] (comparison
# code), [ERR_NS] = nanoseconds waited. The host decodes it with SymmetricHeap.check().
ERROR_SLOTS = 8
ERR_ABORT, ERR_SITE, ERR_SIG, ERR_EXPECT, ERR_SEEN, ERR_REASON, ERR_CMP, ERR_NS = range(8)
WAIT_REASONS = {1: "timed out", 2: "gave up: a peer rank timed out first (group aborted)",
                3: "can never be satisfied in this one-process simulation (a rank would wait forever)"}
WAIT_CMPS = {0: "==", 1: "!=", 2: ">", 3: ">=", 4: "<", 5: "<="}
# site codes passed (constexpr) by every kernel's waits, so the host error names the kernel
WAIT_SITES = {1: "test/user kernel", 2: "barrier_all", 3: "ag_producer_kernel", 4: "ag_gemm_consumer_kernel",
              5: "gemm_rs_kernel", 6: "rs_reduce_kernel", 7: "a2a_kernel (counts / credit)",
              8: "a2a_kernel (arrival)", 9: "mp_consumer_kernel", 10: "pingpong_kernel", 11: "pingpong_cta_kernel",
              12: "wait_reset_kernel (decomposition stream wait)",
              13: "m2n_recv_kernel / m2n_send_kernel (sgl_kernel.m2n.push_kernels)",
              14: "m2n_ll_recv_kernel / m2n_ll_send_kernel (sgl_kernel.m2n.ll_kernels)"}

ALIGN = 256  # bytes: every region starts on a 256-byte boundary (vectorized 16-byte accesses, TMA-friendly)
SIGNAL_BYTES = 8  # one signal slot: int64


MAX_CONNECTIONS_VAR = "CUDA_DEVICE_MAX_CONNECTIONS"
STREAM_QUEUES = 32  # the CUDA maximum (default 8)


def stream_queue_env(environ: Mapping[str, str]) -> Dict[str, str]:
    """Environment for a process whose streams wait on peers (``cuStreamWaitValue64`` in the decomposition ops):
    ``{"CUDA_DEVICE_MAX_CONNECTIONS": "32"}``, or ``{}`` when ``environ`` sets the variable already (an explicit
    value wins, e.g. ``8`` for an A/B run). The driver maps all streams of a context onto that many hardware queues
    (default 8; NVIDIA MPS docs, "CUDA_DEVICE_MAX_CONNECTIONS"); streams sharing a queue run in submission order, so
    a blocked wait holds back the other streams of its queue (false dependencies: lost overlap, and a hazard
    wherever the GPU's order differs from the submission order). Read when the CUDA context is created: apply it
    before the process touches CUDA (spawn.run_ranks does for its ranks; the server for ``--enable-tdist-overlap``
    workers)."""
    return {} if MAX_CONNECTIONS_VAR in environ else {MAX_CONNECTIONS_VAR: str(STREAM_QUEUES)}


def align_up(n: int, a: int = ALIGN) -> int:
    """Smallest multiple of ``a`` that is >= ``n`` (``n`` >= 0)."""
    return -(-n // a) * a


@dataclass(frozen=True)
class HeapConfig:
    """Sizes of one rank's heap.

    data_bytes: bytes for data regions (gather buffers, partial sums, all-to-all slots). signal_slots: number of
    int64 signal slots (the signal region is ``signal_slots * 8`` bytes, placed first). wait_timeout_s: budget of
    every bounded device wait (seconds). shared_streams: the decomposition ops of the heap share its side streams
    (``SymmetricHeap.side_stream``: ``2 * (world - 1)`` plus split-push helpers, however many ops exist) instead of
    each op creating its own (False: the layout before 2026-11-27, for A/B runs). Raises ValueError on
    non-positive sizes.
    """

    data_bytes: int = 256 << 20
    signal_slots: int = 8192
    wait_timeout_s: float = 60.0
    shared_streams: bool = True

    def __post_init__(self) -> None:
        if self.data_bytes <= 0:
            raise ValueError(f"data_bytes={self.data_bytes} must be > 0; give the heap some data space")
        if self.signal_slots <= 0:
            raise ValueError(f"signal_slots={self.signal_slots} must be > 0")
        if not self.wait_timeout_s > 0:
            raise ValueError(f"wait_timeout_s={self.wait_timeout_s} must be > 0 seconds (device waits are bounded)")

    @property
    def wait_timeout_ns(self) -> int:
        """:attr:`wait_timeout_s` in nanoseconds (``%globaltimer`` units), the last entry of ``heap.meta``."""
        return int(self.wait_timeout_s * 1e9)

    @property
    def signal_bytes(self) -> int:
        """Bytes of the signal region, rounded up to :data:`ALIGN`."""
        return align_up(self.signal_slots * SIGNAL_BYTES)

    @property
    def total_bytes(self) -> int:
        """Bytes of one rank's heap allocation: signal region + data region."""
        return self.signal_bytes + align_up(self.data_bytes)


@dataclass
class HeapLayout:
    """Deterministic bump allocator of named regions inside one rank's heap.

    ``region(name, nbytes)`` returns the byte offset of a data region at least ``nbytes`` large; asking again for
    the same name returns the same offset while it fits, otherwise a new, larger region (the old one is abandoned:
    regions are few and long-lived). ``signals(name, n)`` returns the index of the first of ``n`` int64 slots.
    Every rank must make the same sequence of calls (that is what makes the heap symmetric); :meth:`fingerprint`
    lets the caller check it. Raises ValueError when the heap is too small (the message names the fix).
    """

    config: HeapConfig
    _regions: Dict[str, Tuple[int, int]] = field(default_factory=dict)
    _signals: Dict[str, Tuple[int, int]] = field(default_factory=dict)
    _data_used: int = 0
    _slots_used: int = 0

    def region(self, name: str, nbytes: int) -> int:
        """Byte offset (from the heap base) of data region ``name`` with room for ``nbytes`` bytes."""
        if nbytes < 0:
            raise ValueError(f"region {name!r}: nbytes={nbytes} must be >= 0")
        have = self._regions.get(name)
        if have is not None and have[1] >= nbytes:
            return have[0]
        size = align_up(max(nbytes, 1))
        if self._data_used + size > align_up(self.config.data_bytes):
            raise ValueError(
                f"symmetric heap too small for region {name!r} ({nbytes} bytes; {self._data_used} of "
                f"{self.config.data_bytes} data bytes in use): raise HeapConfig.data_bytes")
        off = self.config.signal_bytes + self._data_used
        self._data_used += size
        self._regions[name] = (off, size)
        return off

    def signals(self, name: str, n: int) -> int:
        """Index of the first of ``n`` signal slots named ``name`` (allocated once; n must not grow)."""
        if n <= 0:
            raise ValueError(f"signals {name!r}: n={n} must be > 0")
        have = self._signals.get(name)
        if have is not None:
            if have[1] < n:
                raise ValueError(f"signals {name!r} were allocated with {have[1]} slots, {n} requested: "
                                 "use a new name")
            return have[0]
        if self._slots_used + n > self.config.signal_slots:
            raise ValueError(f"signal region full: {name!r} needs {n} slots, {self.config.signal_slots - self._slots_used}"
                             f" left; raise HeapConfig.signal_slots")
        idx = self._slots_used
        self._slots_used += n
        self._signals[name] = (idx, n)
        return idx

    def fingerprint(self) -> Tuple:
        """A value equal on all ranks iff they made the same allocations (compare it across ranks)."""
        return (tuple(sorted(self._regions.items())), tuple(sorted(self._signals.items())))

    @property
    def data_used(self) -> int:
        """Data bytes handed out so far (aligned)."""
        return self._data_used


@dataclass
class SignalEpochs:
    """Host-side epochs and cumulative signal targets (identical on every rank of a group).

    ``next(name)`` returns 1, 2, 3, ... : the value a *set* signal carries in that call. ``advance(name, n)`` adds the
    number of *add* signals (e.g. tiles) one call delivers to a slot and returns the new cumulative total, the value a
    reader waits for. Counters are Python ints; the slots are int64, good for 2**63 signals.
    """

    _epochs: Dict[str, int] = field(default_factory=dict)
    _totals: Dict[str, int] = field(default_factory=dict)

    def next(self, name: str) -> int:
        """The next epoch of ``name`` (first call: 1)."""
        e = self._epochs.get(name, 0) + 1
        self._epochs[name] = e
        return e

    def current(self, name: str) -> int:
        """The last epoch handed out for ``name`` (0 before the first call)."""
        return self._epochs.get(name, 0)

    def advance(self, name: str, n: int) -> int:
        """Cumulative target of ``name`` after one more call delivering ``n`` increments (n >= 0)."""
        if n < 0:
            raise ValueError(f"advance({name!r}, n={n}): n must be >= 0")
        t = self._totals.get(name, 0) + n
        self._totals[name] = t
        return t


def split_rows(total: int, world: int) -> Tuple[int, ...]:
    """Token-sharded (sequence-parallel) row counts: ``total`` rows over ``world`` ranks, the first
    ``total % world`` ranks one row more. Raises ValueError on negative total or world < 1."""
    if world < 1:
        raise ValueError(f"world={world} must be >= 1")
    if total < 0:
        raise ValueError(f"total={total} must be >= 0")
    q, r = divmod(total, world)
    return tuple(q + (1 if i < r else 0) for i in range(world))


def offsets(counts: Sequence[int]) -> Tuple[int, ...]:
    """Exclusive prefix sums of ``counts`` with the total appended: ``(0, c0, c0+c1, ..., sum)``."""
    out = [0]
    for c in counts:
        if c < 0:
            raise ValueError(f"counts={list(counts)} must be >= 0")
        out.append(out[-1] + c)
    return tuple(out)
