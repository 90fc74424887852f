"""M2N: persistent point-to-point row exchange between M senders and N receivers (MegaScale-Infer, Zhu et al.
2025, sec. 5).

An :class:`M2NEndpoint` is one rank of a fixed group (attention workers and FFN workers alike). It owns
persistent, registered staging buffers (one send ring per peer, one receive buffer), sends a variable number
of rows to any peer, and receives from any peer (or a given one) -- no group set-up per call, no collective:
exactly the M-to-N / N-to-M pattern of dispatch and combine.

A message is ``n`` rows of a fixed :class:`RowLayout` (e.g. hidden state [H] + top-k ids [k] + weights [k])
plus a small integer ``meta`` tuple (e.g. layer, micro-batch, version). It travels as

* a **header** (``int64 [HEADER_LEN]``: kind, source rank, n, slot, sequence, meta...) on the control
  channel (ZMQ PUSH/PULL over IPC or TCP: any source, polling with timeouts, never a hang), and
* a **payload** of ``n * layout.row_bytes`` bytes, moved by a :class:`PayloadTransport`:
  ``inline`` (the payload rides the ZMQ message, CPU), ``nccl`` (NCCL ``isend/irecv`` on a group made once:
  the point-to-point baseline), ``cuda_ipc`` (same-node GPUs: the receiver copies from the sender's
  IPC-mapped registered buffer with the copy engine after waiting on the sender's inter-process event --
  stream-ordered, no host synchronization on the data), ``cuda_push`` (same-node GPUs, device-driven: the
  sender's stream writes the payload and a flag word carrying (sequence, rows) into the receiver's IPC-mapped
  ring, the receiver's stream spins on the flag with a bounded acquire; :meth:`M2NEndpoint.recv_device` with
  ``send(..., host_header=False)`` involves no host message at all, see :mod:`sgl_kernel.m2n.cuda_push`). An
  RDMA transport (NIXL READ from the peer's registered buffer, descriptors exchanged once) is the same pull shape
  as ``cuda_ipc`` and plugs in as another :class:`PayloadTransport`; callers do not change.

Row counts are known on the host when a message is sent (the header carries them); on GPU the payload's
bytes are never synchronized to the host.
"""

from __future__ import annotations

import collections
import logging
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import numpy as np
import torch

logger = logging.getLogger(__name__)

HEADER_LEN = 12
META_LEN = 6
KIND_DATA, KIND_CLOSE = 1, 2


@dataclass(frozen=True)
class RowLayout:
    """The columns of one row: ``((dtype, width), ...)``; a message of n rows carries, per column, a
    ``[n, width]`` tensor of that dtype. Columns are packed one after another (column-major blocks), each
    block padded to 16 bytes.

    Raises:
        ValueError: an empty layout or a non-positive width.
    """

    columns: tuple[tuple[torch.dtype, int], ...]

    def __post_init__(self):
        if not self.columns or any(w <= 0 for _, w in self.columns):
            raise ValueError(f"RowLayout columns {self.columns} must be non-empty with positive widths")

    @property
    def row_bytes(self) -> int:
        """Bytes per row over all columns (before padding)."""
        return sum(torch.empty(0, dtype=d).element_size() * w for d, w in self.columns)

    def nbytes(self, n: int) -> int:
        """Payload bytes of ``n`` rows (each column block rounded up to 16 bytes)."""
        return sum(_pad16(n * torch.empty(0, dtype=d).element_size() * w) for d, w in self.columns)

    def pack(self, buf: torch.Tensor, tensors: Sequence[torch.Tensor]) -> int:
        """Copy ``tensors`` (column i: ``[n, width_i]`` of dtype_i, any layout) into the uint8 buffer ``buf``
        (same device); returns the payload's bytes. Raises ValueError on a shape/dtype mismatch or overflow."""
        if len(tensors) != len(self.columns):
            raise ValueError(f"expected {len(self.columns)} tensors, got {len(tensors)}")
        n = tensors[0].shape[0]
        if self.nbytes(n) > buf.numel():
            raise ValueError(f"{n} rows ({self.nbytes(n)} bytes) exceed the registered buffer ({buf.numel()} bytes); "
                             "raise max_rows")
        off = 0
        for t, (d, w) in zip(tensors, self.columns):
            if t.dtype != d or tuple(t.shape) != (n, w):
                raise ValueError(f"column of shape {tuple(t.shape)} {t.dtype} does not match ({n}, {w}) {d}")
            size = n * w * t.element_size()
            if size:
                buf[off:off + size].view(d).view(n, w).copy_(t, non_blocking=True)
            off += _pad16(size)
        return off

    def unpack(self, buf: torch.Tensor, n: int) -> list[torch.Tensor]:
        """Views ``[n, width_i]`` of dtype_i into the uint8 buffer ``buf`` (valid until it is reused)."""
        out, off = [], 0
        for d, w in self.columns:
            size = n * w * torch.empty(0, dtype=d).element_size()
            out.append(buf[off:off + size].view(d).view(n, w) if size else torch.empty(0, w, dtype=d,
                                                                                        device=buf.device))
            off += _pad16(size)
        return out


def _pad16(x: int) -> int:
    return (x + 15) // 16 * 16


@dataclass(frozen=True)
class M2NConfig:
    """One endpoint's view of the group.

    Attributes:
        rank: this endpoint's index in ``addresses``.
        addresses: the control inbox of every rank (``ipc:///path`` or ``tcp://host:port``), fixed at launch.
        max_rows: the most rows one message carries (sizes the registered buffers).
        slots: send-ring depth per peer: at most this many messages to one peer may be unconsumed at once
            (in dispatch/combine every message is answered before its slot comes round again).
        device: where rows live (``cpu`` or ``cuda:N``).
        timeout_s: a receive waiting longer raises TimeoutError (a dead peer never hangs the caller).
    """

    rank: int
    addresses: tuple[str, ...]
    max_rows: int
    slots: int = 4
    device: str = "cpu"
    timeout_s: float = 60.0

    def __post_init__(self):
        if not 0 <= self.rank < len(self.addresses):
            raise ValueError(f"M2N rank={self.rank} outside [0, {len(self.addresses)})")
        if self.max_rows < 1 or self.slots < 1 or self.timeout_s <= 0:
            raise ValueError(f"M2N max_rows={self.max_rows}, slots={self.slots} must be >= 1 and timeout_s > 0")


@dataclass
class Message:
    """A received message: ``src`` rank, ``meta`` (ints), ``tensors`` (views into the receive buffer, valid until
    the next receive from the same endpoint unless copied)."""

    src: int
    meta: tuple[int, ...]
    tensors: list[torch.Tensor]


@dataclass
class DeviceMessage:
    """A message received with :meth:`M2NEndpoint.recv_device` (device-driven transports): ``src`` rank, ``tensors``
    (``[max_rows, width_i]`` views of the receive buffer, rows past ``rows`` are stale) and ``rows`` (int64 [1] on the
    device: the row count carried by the flag word). Valid until the next receive; stream-ordered."""

    src: int
    tensors: list[torch.Tensor]
    rows: torch.Tensor


class PayloadTransport(ABC):
    """Moves a packed payload from the sender's registered send slot to the receiver's registered receive
    buffer. ``inline`` transports return the bytes to ship with the header; pull/push transports return None
    and move them themselves (stream-ordered on GPU)."""

    name = "abstract"
    device_driven = False  # True: post_send takes ``rows``; recv_device / check are implemented

    def attach(self, endpoint: "M2NEndpoint") -> None:
        """Called once when the endpoint has allocated its buffers (register them, exchange handles)."""

    @abstractmethod
    def post_send(self, peer: int, slot: int, view: torch.Tensor) -> Optional[bytes]:
        """Start moving ``view`` (uint8, a prefix of send slot ``slot`` to ``peer``); returns inline bytes or None."""

    @abstractmethod
    def complete_recv(self, src: int, slot: int, nbytes: int, inline: Optional[bytes], out: torch.Tensor) -> None:
        """Land the payload of a message whose header arrived into ``out`` (uint8, ``nbytes`` long), stream-ordered
        (on GPU the caller's current stream sees the data)."""

    def wait_send_slot(self, peer: int, slot: int) -> None:
        """Block until send slot ``slot`` to ``peer`` may be overwritten (default: at once)."""

    def on_control(self, frames) -> None:
        """A transport message (kind other than data/close) arrived, e.g. a peer's registered-buffer handles
        (default: ignored)."""

    def on_fault(self, reason: str) -> None:
        """The endpoint gave up waiting (receive timeout or failed liveness check): a peer may be dead, so
        :meth:`close` must not wait on peers (default: nothing to do)."""

    def close(self) -> None:
        """Release transport resources."""


class M2NEndpoint:
    """One rank of an M2N group (see the module docstring).

    Args:
        config: :class:`M2NConfig`.
        layout: the :class:`RowLayout` of data messages this endpoint sends.
        recv_layout: the :class:`RowLayout` of the data messages it receives (default: ``layout``).
        transport: the :class:`PayloadTransport` (default :class:`~sgl_kernel.m2n.zmq_transport.InlineTransport`).
        alive: optional ``() -> bool`` polled while waiting (False: raise ConnectionError at once).
    Raises:
        ValueError: bad config.
    """

    def __init__(self, config: M2NConfig, layout: RowLayout, recv_layout: Optional[RowLayout] = None,
                 transport: Optional[PayloadTransport] = None, alive: Optional[Callable[[], bool]] = None):
        import zmq

        from sgl_kernel.m2n.zmq_transport import InlineTransport

        self.config, self.layout = config, layout
        self.recv_layout = recv_layout or layout
        self.rank, self.world = config.rank, len(config.addresses)
        self.device = torch.device(config.device)
        self.alive = alive
        cap_send = layout.nbytes(config.max_rows)
        cap_recv = self.recv_layout.nbytes(config.max_rows)
        # persistent registered buffers: a send ring per peer, one receive buffer
        self.send_bufs = torch.empty(self.world, config.slots, cap_send, dtype=torch.uint8, device=self.device)
        self.recv_buf = torch.empty(cap_recv, dtype=torch.uint8, device=self.device)
        self._seq = np.zeros(self.world, dtype=np.int64)
        self._ctx = zmq.Context(1)
        self._inbox = self._ctx.socket(zmq.PULL)
        self._inbox.setsockopt(zmq.LINGER, 0)
        self._inbox.bind(config.addresses[config.rank])
        self._out: dict[int, object] = {}
        self._poller = zmq.Poller()
        self._poller.register(self._inbox, zmq.POLLIN)
        self._stash: collections.deque = collections.deque()  # data frames read while waiting for control frames
        self.transport = transport or InlineTransport()
        try:
            self.transport.attach(self)
        except BaseException:  # fail closed: no socket or context left for the garbage collector to terminate
            self._inbox.close(linger=0)
            self._ctx.term()
            raise
        self.closed = False

    # ---- sockets ---------------------------------------------------------------------------------------
    def _sock(self, peer: int):
        import zmq

        s = self._out.get(peer)
        if s is None:
            s = self._ctx.socket(zmq.PUSH)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.SNDHWM, 0)
            s.connect(self.config.addresses[peer])
            self._out[peer] = s
        return s

    def send_control(self, peer: int, frames: Sequence[bytes]) -> None:
        """Send raw frames to ``peer``'s inbox (transports use it for handle exchange)."""
        self._sock(peer).send_multipart(list(frames), copy=False)

    # ---- data ------------------------------------------------------------------------------------------
    def pump_control(self, done: Callable[[], bool], what: str) -> None:
        """Read the inbox until ``done()`` (transport control messages go to ``transport.on_control``; data and close
        messages are kept, in order, for :meth:`recv`).

        Raises:
            TimeoutError: ``what`` did not arrive within ``config.timeout_s``.
        """
        deadline = time.monotonic() + self.config.timeout_s
        while not done():
            if time.monotonic() > deadline:
                raise TimeoutError(f"M2N rank {self.rank}: no {what} within {self.config.timeout_s:.1f} s")
            if self._poller.poll(50):
                frames = self._inbox.recv_multipart(copy=False)
                kind = int(np.frombuffer(frames[0].buffer, dtype=np.int64)[0])
                if kind in (KIND_DATA, KIND_CLOSE):
                    self._stash.append(frames)
                else:
                    self.transport.on_control(frames)

    def send(self, peer: int, tensors: Sequence[torch.Tensor], meta: Sequence[int] = (),
             host_header: bool = True, rows: Optional[torch.Tensor] = None) -> None:
        """Send ``n`` rows (``tensors`` per :attr:`layout`, on :attr:`device`) and ``meta`` (<= META_LEN ints) to
        ``peer``. Returns once the payload is packed into the persistent send slot and posted (asynchronous on GPU).
        ``host_header=False`` (device-driven transports only): no host message at all; ``meta`` is not delivered and
        the peer must take it with :meth:`recv_device`. ``rows`` (with ``host_header=False``): an int64 [1] device
        tensor; only that many of the ``n`` rows are sent (clamped to [0, n]), a count computed on the device (no
        host sync; CUDA-graph capturable).

        Raises:
            ValueError: bad peer, shapes, too many rows or meta values; ``host_header=False`` on a host transport;
                ``rows`` with a host header or not an int64 [1] tensor on :attr:`device`.
        """
        if not host_header and not self.transport.device_driven:
            raise ValueError(f"send(host_header=False) needs a device-driven transport (cuda_push), not "
                             f"{self.transport.name!r}")
        if rows is not None and (host_header or rows.dtype != torch.int64 or rows.numel() != 1
                                 or rows.device.type != self.device.type):
            raise ValueError(f"send(rows=...) needs host_header=False and an int64 [1] tensor on {self.device}, got "
                             f"{rows.dtype} {tuple(rows.shape)} on {rows.device}")
        if not 0 <= peer < self.world:
            raise ValueError(f"peer={peer} outside [0, {self.world})")
        if len(meta) > META_LEN:
            raise ValueError(f"meta has {len(meta)} values; at most {META_LEN}")
        n = int(tensors[0].shape[0])
        if n > self.config.max_rows:
            raise ValueError(f"{n} rows exceed max_rows={self.config.max_rows}")
        seq = int(self._seq[peer])
        self._seq[peer] += 1
        slot = seq % self.config.slots
        self.transport.wait_send_slot(peer, slot)
        view = self._direct_view(tensors) if self.transport.device_driven else None
        if view is None:
            nbytes = self.layout.pack(self.send_bufs[peer, slot], tensors)
            view = self.send_bufs[peer, slot, :nbytes]
        nbytes = int(view.numel())
        if rows is not None:
            inline = self.transport.post_send(peer, slot, view, rows=n, rows_dev=rows, src_rows=n)
        elif self.transport.device_driven:
            inline = self.transport.post_send(peer, slot, view, rows=n)
        else:
            inline = self.transport.post_send(peer, slot, view)
        if not host_header:
            return
        header = np.zeros(HEADER_LEN, dtype=np.int64)
        header[:6] = (KIND_DATA, self.rank, n, slot, seq, nbytes)
        header[6:6 + len(meta)] = list(meta)
        frames = [header.tobytes()] + ([inline] if inline is not None else [])
        self._sock(peer).send_multipart(frames, copy=False)

    def _direct_view(self, tensors: Sequence[torch.Tensor]) -> Optional[torch.Tensor]:
        """A one-column message already laid out as its packed payload (contiguous, 16-byte aligned, a multiple of 16
        bytes, at least one row, matching the layout): its flat uint8 view, which a device-driven transport copies
        to the peer directly (stream-ordered, so no staging copy); otherwise None (pack into the send slot)."""
        if len(tensors) != 1 or len(self.layout.columns) != 1:
            return None
        t, (d, w) = tensors[0], self.layout.columns[0]
        if (t.dtype != d or t.dim() != 2 or t.shape[1] != w or t.shape[0] == 0 or not t.is_contiguous()
                or t.device.type != self.device.type or t.data_ptr() % 16 or (t.numel() * t.element_size()) % 16):
            return None
        return t.view(-1).view(torch.uint8)

    def poll(self, timeout_ms: int) -> bool:
        """True when a message is waiting (waits up to ``timeout_ms``), including one kept by :meth:`pump_control`."""
        return bool(self._stash) or bool(self._poller.poll(timeout_ms))

    def recv(self, timeout_s: Optional[float] = None) -> Message:
        """The next message from any peer, its payload landed in the receive buffer (views: copy them before the
        next ``recv``).

        Raises:
            TimeoutError: nothing within ``timeout_s`` (default ``config.timeout_s``).
            ConnectionError: ``alive()`` turned False while waiting, or a peer closed the group.
        """
        deadline = time.monotonic() + (self.config.timeout_s if timeout_s is None else timeout_s)
        while True:
            if self.poll(50):
                msg = self._land(self._stash.popleft() if self._stash else self._inbox.recv_multipart(copy=False))
                if msg is not None:
                    return msg
                continue
            if self.alive is not None and not self.alive():
                self.transport.on_fault("liveness check failed")
                raise ConnectionError("M2N: the peer group is gone (liveness check failed)")
            if time.monotonic() > deadline:
                self.transport.on_fault("receive timed out")
                raise TimeoutError(f"M2N rank {self.rank}: no message within "
                                   f"{self.config.timeout_s if timeout_s is None else timeout_s:.1f} s")

    def recv_nowait(self) -> Optional[Message]:
        """The next data message if one is already waiting, else None at once: transport control messages waiting
        ahead of it are handled (``recv`` would instead wait up to its timeout for data behind them). Never waits
        for a message and never reports a fault; views as for :meth:`recv`.

        Raises:
            ConnectionError: a peer closed the group.
        """
        while self.poll(0):
            msg = self._land(self._stash.popleft() if self._stash else self._inbox.recv_multipart(copy=False))
            if msg is not None:
                return msg
        return None

    def _land(self, frames) -> Optional[Message]:
        """One inbox message: a data message landed in the receive buffer, or None for a transport control message
        (given to ``transport.on_control``). Raises ConnectionError for a close notice."""
        header = np.frombuffer(frames[0].buffer, dtype=np.int64)
        kind = int(header[0])
        if kind == KIND_CLOSE:
            raise ConnectionError(f"M2N peer {int(header[1])} closed the group")
        if kind != KIND_DATA:  # a transport's own message (e.g. CUDA IPC handles)
            self.transport.on_control(frames)
            return None
        src, n, slot, _seq, nbytes = (int(v) for v in header[1:6])
        out = self.recv_buf[:nbytes]
        self.transport.complete_recv(src, slot, nbytes, frames[1].buffer if len(frames) > 1 else None, out)
        meta = tuple(int(v) for v in header[6:6 + META_LEN])
        return Message(src, meta, self.recv_layout.unpack(self.recv_buf, n))

    def recv_device(self, src: int) -> DeviceMessage:
        """Device-driven receive of the next message from ``src`` (sent with ``host_header=False``): enqueues a bounded
        device wait + copy on the current stream and returns at once; the row count stays on the device. A dead
        peer makes the wait give up after the transport's budget: :meth:`check` then raises.

        Raises:
            ValueError: bad ``src`` or a transport that is not device-driven.
        """
        if not self.transport.device_driven:
            raise ValueError(f"recv_device needs a device-driven transport (cuda_push), not {self.transport.name!r}")
        if not 0 <= src < self.world or src == self.rank:
            raise ValueError(f"src={src} must be another rank in [0, {self.world})")
        rows = self.transport.recv_device(src)
        return DeviceMessage(src, self.recv_layout.unpack(self.recv_buf, self.config.max_rows), rows)

    def check(self) -> None:
        """Raise TimeoutError if a device-side wait of a device-driven transport gave up (synchronizing); no-op
        for host transports."""
        if self.transport.device_driven:
            self.transport.check()

    def close(self, notify: Sequence[int] = ()) -> None:
        """Tell ``notify`` peers the group is closing (their ``recv`` raises ConnectionError) and free the sockets."""
        if self.closed:
            return
        self.closed = True
        header = np.zeros(HEADER_LEN, dtype=np.int64)
        header[:2] = (KIND_CLOSE, self.rank)
        for p in notify:
            try:
                self._sock(p).send(header.tobytes())
            except Exception:  # a peer already gone
                pass
        self.transport.close()
        for s in self._out.values():
            s.close(linger=200 if notify else 0)  # let the close notices go out
        self._inbox.close(0)
        self._ctx.term()
