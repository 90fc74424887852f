"""Transfer-layer contract for prefill/decode disaggregation (KVDirect, Chen et al. 2024, sec. 4).

One :class:`TransferBackend` ("agent") per worker process registers the process's KV memory, publishes
its metadata (through the bootstrap server, at CONNECT), and moves bytes between registered memory of
two agents with **one-sided** operations: the initiator names remote and local addresses and the
remote worker's scheduler does no work per block (KVDirect sec. 4.1). Small control messages
(COMPLETE / ACK, sec. 4.2) go through the backend's notification channel.

Backends: ``"nixl"`` (NVIDIA NIXL over UCX; host memory on CPU, GPU memory on GPUs) and ``"fake"``
(a pure-Python TCP agent with the same semantics, for machines without nixl). Pick with
:func:`make_transfer_backend`. Address arithmetic lives in :mod:`.kv_plan`, the pull/push protocol in
:mod:`.queue`.
"""

from __future__ import annotations

import enum
import itertools
import logging
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

import numpy as np

logger = logging.getLogger(__name__)

BACKEND_NAMES = ("nixl", "fake")


@dataclass(frozen=True)
class MemRegion:
    """A registered memory region.

    Attributes:
        addr: start address (host pointer for "cpu", device pointer for "cuda:N"), bytes.
        nbytes: length in bytes (> 0).
        device: "cpu" or "cuda:N".
    """

    addr: int
    nbytes: int
    device: str

    def __post_init__(self) -> None:
        if self.addr <= 0 or self.nbytes <= 0:
            raise ValueError(f"MemRegion: addr={self.addr} and nbytes={self.nbytes} must be positive")
        if self.device != "cpu" and not (self.device.startswith("cuda:") and self.device[5:].isdigit()):
            raise ValueError(f"MemRegion: device={self.device!r} must be 'cpu' or 'cuda:N'")

    def contains(self, addr: int, nbytes: int) -> bool:
        """True when ``[addr, addr + nbytes)`` lies inside this region."""
        return self.addr <= addr and addr + nbytes <= self.addr + self.nbytes

    @property
    def device_id(self) -> int:
        """0 for "cpu", N for "cuda:N"."""
        return 0 if self.device == "cpu" else int(self.device[5:])


@dataclass(frozen=True)
class ReadOp:
    """One contiguous byte range to move.

    For a read, ``remote_addr`` is the source (in the peer's registered memory) and ``local_addr`` the
    destination; for a write (push mode), ``remote_addr`` is the destination and ``local_addr`` the
    source. Both ranges are ``nbytes`` long (> 0).
    """

    remote_addr: int
    local_addr: int
    nbytes: int


OpsLike = Union[Sequence[ReadOp], np.ndarray]
"""``list[ReadOp]`` or an ``int64 [N, 3]`` array of ``(remote_addr, local_addr, nbytes)`` rows (the fast
form for thousands of blocks; see :mod:`.kv_plan`)."""


def as_op_array(ops: OpsLike) -> np.ndarray:
    """``ops`` as a C-contiguous ``int64 [N, 3]`` array (ValueError for another shape)."""
    if isinstance(ops, np.ndarray):
        arr = np.ascontiguousarray(ops, dtype=np.int64)
        if arr.ndim != 2 or arr.shape[1] != 3:
            raise ValueError(f"an ops array must be [N, 3] (remote_addr, local_addr, nbytes), got {arr.shape}")
        return arr
    return np.array([(o.remote_addr, o.local_addr, o.nbytes) for o in ops], dtype=np.int64).reshape(-1, 3)


def _inside(addr: np.ndarray, nbytes: np.ndarray, regions: Sequence["MemRegion"]) -> np.ndarray:
    """Bool mask: range ``[addr, addr + nbytes)`` lies inside one of ``regions``."""
    ok = np.zeros(addr.shape, dtype=bool)
    for r in regions:
        ok |= (addr >= r.addr) & (addr + nbytes <= r.addr + r.nbytes)
    return ok


class TransferState(enum.Enum):
    """State of one posted transfer."""

    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"


@dataclass(frozen=True)
class TransferConfig:
    """Frozen options of a transfer agent.

    Attributes:
        transfer_timeout_s: a transfer not DONE this long after it was posted is FAILED by :meth:`poll`
            (the decode side then frees the request's KV; never a hang).
        connect_timeout_s: time allowed to reach a peer in :meth:`TransferBackend.connect`.
        host: address the fake backend listens on and publishes (the node's IP across nodes).
        port: port of the fake backend's listener (0: pick a free one).
        nixl_backends: NIXL plugins to instantiate (default UCX).
        nixl_num_threads: NIXL backend worker threads (0: the plugin's default). With UCX, > 0 gives the plugin that
            many dedicated threads, each with its own UCX worker (between GPUs of one host: its own CUDA streams).
        nixl_split_batch_size: UCX with ``nixl_num_threads > 0``: a transfer of at least this many descriptors is
            split over the dedicated threads (0: the plugin's default, 1024).
        nixl_ucx_defaults: before the first NIXL agent of the process creates its UCX context, set the UCX
            environment defaults of :data:`~.nixl_backend.UCX_ENV_DEFAULTS` where the user did not set them
            (False: leave UCX's and NIXL's own defaults).
    """

    transfer_timeout_s: float = 30.0
    connect_timeout_s: float = 10.0
    host: str = "127.0.0.1"
    port: int = 0
    nixl_backends: tuple[str, ...] = ("UCX",)
    nixl_num_threads: int = 0
    nixl_split_batch_size: int = 0
    nixl_ucx_defaults: bool = True

    def __post_init__(self) -> None:
        if self.transfer_timeout_s <= 0 or self.connect_timeout_s <= 0:
            raise ValueError(f"TransferConfig: transfer_timeout_s={self.transfer_timeout_s} and "
                             f"connect_timeout_s={self.connect_timeout_s} must be > 0")
        if self.nixl_num_threads < 0 or self.nixl_split_batch_size < 0:
            raise ValueError(f"TransferConfig: nixl_num_threads={self.nixl_num_threads} and nixl_split_batch_size="
                             f"{self.nixl_split_batch_size} must be >= 0 (0: the NIXL plugin's default)")
        if not 0 <= self.port < 65536:
            raise ValueError(f"TransferConfig: port={self.port} outside [0, 65535]")


_handle_ids = itertools.count(1)


@dataclass(eq=False)
class TransferHandle:
    """An asynchronous transfer; pass to :meth:`TransferBackend.poll`.

    Attributes:
        peer: remote agent name; op: "READ" or "WRITE"; nbytes: total bytes; num_ops: ranges posted.
        posted_at: ``time.monotonic()`` when posted; done_at: when it became DONE/FAILED (None before).
        error: reason for FAILED ("" otherwise). ``impl`` is backend-private.
    """

    peer: str
    op: str
    nbytes: int
    num_ops: int
    deadline: float
    posted_at: float = field(default_factory=time.monotonic)
    done_at: Optional[float] = None
    error: str = ""
    state: TransferState = TransferState.PENDING
    id: int = field(default_factory=lambda: next(_handle_ids))
    impl: object = None
    lock: threading.RLock = field(default_factory=threading.RLock, repr=False)

    def finish(self, state: TransferState, error: str = "") -> bool:
        """Move PENDING -> ``state`` (first caller wins); returns whether this call did it."""
        with self.lock:
            if self.state is not TransferState.PENDING:
                return False
            self.state, self.error, self.done_at = state, error, time.monotonic()
            return True

    @property
    def elapsed_s(self) -> float:
        """Seconds from posting to completion (or to now while PENDING)."""
        return (self.done_at if self.done_at is not None else time.monotonic()) - self.posted_at


class TransferError(RuntimeError):
    """A transfer-layer failure (unknown peer, unregistered memory, backend error)."""


class TransferBackend(ABC):
    """One transfer agent per worker process.

    Lifecycle: ``register`` the KV regions, publish ``local_metadata()``; peers ``connect`` with it
    (lazy, idempotent); then ``read``/``write`` return a :class:`TransferHandle` at once and ``poll``
    reports PENDING/DONE/FAILED. A handle PENDING past ``config.transfer_timeout_s`` is FAILED by
    ``poll``. ``notif`` bytes given to ``read``/``write`` reach the *peer* (``get_notifs`` there) after
    the data moved. Thread-safety: one thread drives an agent (the scheduler); backends may use
    internal threads.

    Args:
        agent_name: unique name of this agent (peers address it by this name).
        config: frozen :class:`TransferConfig`.
    """

    name = "base"

    def __init__(self, agent_name: str, config: TransferConfig):
        if not agent_name:
            raise ValueError("agent_name must be a non-empty string")
        self.agent_name = agent_name
        self.config = config
        self._regions: list[MemRegion] = []

    # ---- memory ----------------------------------------------------------------------------------
    @abstractmethod
    def register(self, regions: list[MemRegion]) -> None:
        """Register memory that peers may read/write and that local ranges of ops must lie in."""

    @property
    def regions(self) -> tuple[MemRegion, ...]:
        """Regions registered so far."""
        return tuple(self._regions)

    def _check_local(self, ops: "OpsLike") -> np.ndarray:
        """Ops as ``int64 [N, 3]`` (remote, local, nbytes); ValueError when empty, an op is empty or its
        local range is outside every registered region."""
        arr = as_op_array(ops)
        if len(arr) == 0:
            raise ValueError("ops is empty")
        if (arr[:, 2] <= 0).any():
            raise ValueError(f"every op needs nbytes > 0; got {int(arr[:, 2].min())}")
        bad = ~_inside(arr[:, 1], arr[:, 2], self._regions)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise ValueError(f"local range [{int(arr[i, 1]):#x}, +{int(arr[i, 2])}) is not inside a registered "
                             "region; register() it first")
        return arr

    # ---- peers -----------------------------------------------------------------------------------
    @abstractmethod
    def local_metadata(self) -> bytes:
        """Opaque bytes a peer needs to connect (published at CONNECT via the bootstrap server)."""

    @abstractmethod
    def connect(self, peer: str, peer_metadata: bytes) -> None:
        """Make ``peer`` addressable (idempotent; new metadata for a known peer replaces the old one).
        Raises TransferError when the metadata is malformed or names another agent."""

    @abstractmethod
    def disconnect(self, peer: str) -> None:
        """Forget ``peer``; its PENDING transfers become FAILED. Unknown peers are ignored."""

    # ---- data ------------------------------------------------------------------------------------
    @abstractmethod
    def read(self, peer: str, ops: OpsLike, notif: Optional[bytes] = None) -> TransferHandle:
        """Post a one-sided READ: for each op copy ``nbytes`` from ``peer``'s ``remote_addr`` to local
        ``local_addr`` (``ops``: ``list[ReadOp]`` or an ``int64 [N, 3]`` array). Returns at once; a dead peer
        gives a handle that polls FAILED. Raises ValueError for empty ops / unregistered local ranges and
        TransferError for an unknown peer."""

    @abstractmethod
    def write(self, peer: str, ops: OpsLike, notif: Optional[bytes] = None) -> TransferHandle:
        """Post a one-sided WRITE (push mode): copy local ``local_addr`` to ``peer``'s ``remote_addr``."""

    @abstractmethod
    def poll(self, handle: TransferHandle) -> TransferState:
        """Current state; FAILED once ``transfer_timeout_s`` has passed without completion."""

    def wait(self, handle: TransferHandle, timeout_s: Optional[float] = None, sleep_s: float = 1e-4
             ) -> TransferState:
        """Poll until DONE/FAILED (or ``timeout_s``, then FAILED). Convenience for tests/benchmarks."""
        end = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            state = self.poll(handle)
            if state is not TransferState.PENDING:
                return state
            if end is not None and time.monotonic() > end:
                self._fail(handle, f"wait timed out after {timeout_s}s")
                return TransferState.FAILED
            if sleep_s:
                time.sleep(sleep_s)

    def cancel(self, handle: TransferHandle, reason: str = "cancelled") -> None:
        """Give up a PENDING transfer: it becomes FAILED and no byte of it lands locally afterwards where the
        backend can guarantee it (fake: yes; NIXL: the handle is released, which aborts where the plugin can).
        A finished handle is left as it is."""
        self._fail(handle, reason)

    def in_flight(self, handle: TransferHandle) -> bool:
        """Whether the transport may still move bytes of ``handle`` (read its local source or write its remote
        destination), even after :meth:`cancel`: memory it names may be reused only once this is False. Default:
        while it is PENDING (backends whose cancelled transfers may still run override it)."""
        return handle.state is TransferState.PENDING

    def _fail(self, handle: TransferHandle, reason: str) -> None:
        """Mark FAILED (backends override to also cancel)."""
        if handle.finish(TransferState.FAILED, reason):
            logger.warning("transfer %d to %s failed: %s", handle.id, handle.peer, reason)

    def _timed_out(self, handle: TransferHandle) -> bool:
        if handle.state is TransferState.PENDING and time.monotonic() > handle.deadline:
            self._fail(handle, f"no completion within transfer_timeout_s={self.config.transfer_timeout_s}")
            return True
        return False

    def _new_handle(self, peer: str, op: str, arr: np.ndarray) -> TransferHandle:
        return TransferHandle(peer=peer, op=op, nbytes=int(arr[:, 2].sum()), num_ops=len(arr),
                              deadline=time.monotonic() + self.config.transfer_timeout_s)

    # ---- control messages ------------------------------------------------------------------------
    @abstractmethod
    def send_notif(self, peer: str, msg: bytes) -> None:
        """Send a small control message (COMPLETE / ACK) to ``peer``; TransferError if unreachable."""

    @abstractmethod
    def get_notifs(self) -> dict[str, list[bytes]]:
        """Drain notifications received so far: ``{sender agent name: [msg, ...]}`` in arrival order."""

    @abstractmethod
    def close(self) -> None:
        """Release everything; PENDING transfers become FAILED. Idempotent."""

    def __enter__(self) -> "TransferBackend":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def nixl_available() -> tuple[bool, str]:
    """(True, "") when a NIXL Python package imports, else (False, reason)."""
    from sglang.srt.disaggregation.transfer.nixl_backend import import_nixl

    try:
        import_nixl()
        return True, ""
    except ImportError as e:
        return False, str(e)


def make_transfer_backend(name: str, agent_name: str, config: Optional[TransferConfig] = None) -> TransferBackend:
    """Create a transfer agent: ``name`` is "nixl" or "fake" (``--disaggregation-transfer-backend``).

    Raises:
        ValueError: unknown ``name``.
        ImportError: "nixl" requested but the package is missing (install the ``pd`` extra).
    """
    config = config or TransferConfig()
    if name == "fake":
        from sglang.srt.disaggregation.transfer.fake_backend import FakeTransferBackend

        return FakeTransferBackend(agent_name, config)
    if name == "nixl":
        from sglang.srt.disaggregation.transfer.nixl_backend import NixlTransferBackend

        return NixlTransferBackend(agent_name, config)
    raise ValueError(f"unknown transfer backend {name!r}; choose one of {BACKEND_NAMES}")
