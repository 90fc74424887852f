"""``fake`` transfer backend: the :class:`~.base.TransferBackend` contract over plain TCP, no nixl.

Each agent runs a small listener thread that serves READ/WRITE requests against its registered host
memory (``ctypes`` copies), so a peer's reads stay one-sided from the owner's *scheduler*'s point of
view (no scheduler work per block), while the bytes do travel through a socket (a staging copy: this
backend is for tests and CPU machines without nixl, not for speed). Semantics match the NIXL backend:
the notification given to ``read``/``write`` reaches the peer after the data moved; ``send_notif``
needs ``connect(peer)`` on the sending side; a dead or silent peer turns PENDING transfers into FAILED
(connection error or ``transfer_timeout_s``).

Wire format: frames ``struct("!IQ")(header_len, payload_len) + msgpack(header) + payload``.
"""

from __future__ import annotations

import ctypes
import logging
import queue
import socket
import struct
import threading
import time
from typing import Optional

import msgspec
import numpy as np

from sglang.srt.disaggregation.transfer.base import (MemRegion, OpsLike, TransferBackend, TransferConfig,
                                                     TransferError, TransferHandle, TransferState)

logger = logging.getLogger(__name__)

_FRAME = struct.Struct("!IQ")
_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder()


def _recv_exact(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError("peer closed the connection")
        got += k
    return buf


def _send_frame(sock: socket.socket, header: dict, payload: bytes = b"") -> None:
    h = _enc.encode(header)
    sock.sendall(_FRAME.pack(len(h), len(payload)) + h)
    if payload:
        sock.sendall(payload)


def _recv_frame(sock: socket.socket) -> tuple[dict, bytearray]:
    hlen, plen = _FRAME.unpack(bytes(_recv_exact(sock, _FRAME.size)))
    header = _dec.decode(bytes(_recv_exact(sock, hlen)))
    payload = _recv_exact(sock, plen) if plen else bytearray()
    return header, payload


def _gather(ops) -> bytes:
    return b"".join(ctypes.string_at(a, n) for a, n in ops)


def _scatter(pairs, payload: bytearray) -> None:
    """Copy consecutive chunks of ``payload`` to ``(addr, nbytes)`` pairs."""
    src = (ctypes.c_char * len(payload)).from_buffer(payload) if payload else None
    base = ctypes.addressof(src) if src is not None else 0
    off = 0
    for addr, n in pairs:
        ctypes.memmove(addr, base + off, n)
        off += n


class _Peer:
    """Client side of one connection: a worker thread runs this peer's transfers in posting order."""

    def __init__(self, owner: "FakeTransferBackend", name: str, host: str, port: int):
        self.owner, self.name, self.host, self.port = owner, name, host, port
        self.jobs: "queue.Queue[Optional[tuple]]" = queue.Queue()
        self.sock: Optional[socket.socket] = None
        self.ctrl: Optional[socket.socket] = None  # notifications: own connection, sent in call order
        self.ctrl_lock = threading.Lock()
        self.pending: set[TransferHandle] = set()
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._run, name=f"fake-xfer-{owner.agent_name}->{name}", daemon=True)
        self.thread.start()

    def _connect(self) -> socket.socket:
        if self.sock is None:
            s = socket.create_connection((self.host, self.port), timeout=self.owner.config.connect_timeout_s)
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.sock = s
        return self.sock

    def _drop(self) -> None:
        if self.sock is not None:
            try:
                self.sock.close()
            except OSError:
                pass
            self.sock = None

    def _run(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                self._drop()
                return
            handle, op, ops = job
            try:
                self._do(handle, op, ops)
            except Exception as e:  # noqa: BLE001 -- any failure ends this transfer, never the worker thread
                self._drop()  # the stream may be out of sync; reconnect on the next job
                self.owner._fail(handle, f"{type(e).__name__}: {e}")
            finally:
                with self.lock:
                    self.pending.discard(handle)

    def _do(self, handle: TransferHandle, op: str, ops: np.ndarray) -> None:
        if handle.state is not TransferState.PENDING:  # timed out / cancelled before it started
            return
        remaining = handle.deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("deadline passed before the transfer started")
        sock = self._connect()
        sock.settimeout(remaining)
        hdr = {"t": op, "from": self.owner.agent_name, "ops": ops[:, [0, 2]].tolist(), "notif": handle.impl}
        payload = _gather(ops[:, [1, 2]].tolist()) if op == "write" else b""
        _send_frame(sock, hdr, payload)
        reply, data = _recv_frame(sock)
        if reply.get("t") != "ok":
            raise ValueError(f"peer {self.name} refused the {op}: {reply.get('msg')}")
        with handle.lock:  # no late copy into memory the caller already gave up (FAILED by timeout)
            if handle.state is not TransferState.PENDING:
                return
            if op == "read":
                if len(data) != handle.nbytes:
                    raise ValueError(f"peer {self.name} sent {len(data)} bytes, expected {handle.nbytes}")
                _scatter(ops[:, [1, 2]].tolist(), data)
            handle.finish(TransferState.DONE)

    def send_notif(self, msg: bytes) -> None:
        hdr = {"t": "notif", "from": self.owner.agent_name, "msg": bytes(msg)}
        with self.ctrl_lock:
            for attempt in (0, 1):  # one reconnect: the cached connection may predate a peer restart
                try:
                    if self.ctrl is None:
                        self.ctrl = socket.create_connection((self.host, self.port),
                                                             timeout=self.owner.config.connect_timeout_s)
                    _send_frame(self.ctrl, hdr)
                    return
                except OSError as e:
                    if self.ctrl is not None:
                        self.ctrl.close()
                        self.ctrl = None
                    if attempt:
                        raise TransferError(f"cannot send a notification to {self.name!r}: {e}") from e

    def submit(self, handle: TransferHandle, op: str, ops: np.ndarray) -> None:
        with self.lock:
            self.pending.add(handle)
        self.jobs.put((handle, op, ops))

    def stop(self) -> None:
        with self.lock:
            pending = list(self.pending)
        for h in pending:
            self.owner._fail(h, f"peer {self.name} disconnected")
        self.jobs.put(None)
        with self.ctrl_lock:
            if self.ctrl is not None:
                self.ctrl.close()
                self.ctrl = None
        sock = self.sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)  # unblocks a worker waiting in recv
            except OSError:
                pass


class FakeTransferBackend(TransferBackend):
    """TCP implementation of :class:`TransferBackend` for host memory ("cpu" regions only).

    Raises:
        OSError: the listener cannot bind ``config.host:config.port``.
    """

    name = "fake"

    def __init__(self, agent_name: str, config: TransferConfig):
        super().__init__(agent_name, config)
        self._peers: dict[str, _Peer] = {}
        self._peer_md: dict[str, bytes] = {}
        self._notifs: dict[str, list[bytes]] = {}
        self._notif_lock = threading.Lock()
        self._reg_lock = threading.Lock()
        self._closed = False
        self._conns: set[socket.socket] = set()
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((config.host, config.port))
        self._listener.listen(64)
        self._listener.settimeout(0.2)
        self.port = self._listener.getsockname()[1]
        self._accept_thread = threading.Thread(target=self._accept_loop, name=f"fake-xfer-listen-{agent_name}",
                                               daemon=True)
        self._accept_thread.start()

    # ---- memory ----------------------------------------------------------------------------------
    def register(self, regions: list[MemRegion]) -> None:
        for r in regions:
            if r.device != "cpu":
                raise ValueError(f"the fake backend moves host memory only; got a {r.device} region (use nixl)")
        with self._reg_lock:
            self._regions.extend(regions)

    def _remote_ok(self, ops) -> Optional[str]:
        with self._reg_lock:
            regions = list(self._regions)
        for addr, n in ops:
            if n <= 0 or not any(r.contains(addr, n) for r in regions):
                return f"range [{addr:#x}, +{n}) is not inside a region registered by {self.agent_name}"
        return None

    # ---- listener (target side) ------------------------------------------------------------------
    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.settimeout(None)
            self._conns.add(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True,
                             name=f"fake-xfer-serve-{self.agent_name}").start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            while not self._closed:
                hdr, payload = _recv_frame(conn)
                t, sender = hdr.get("t"), hdr.get("from", "?")
                if t == "notif":
                    self._push_notif(sender, hdr["msg"])
                    continue
                ops = hdr.get("ops", [])
                err = self._remote_ok(ops)
                if self._closed:  # closed while checking: the registered memory may be gone, touch nothing
                    break
                if err is None and t == "write" and len(payload) != sum(n for _, n in ops):
                    err = f"write payload of {len(payload)} bytes does not match its ops"
                if err is not None or t not in ("read", "write"):
                    _send_frame(conn, {"t": "err", "msg": err or f"unknown request {t!r}"})
                    continue
                if t == "read":
                    _send_frame(conn, {"t": "ok"}, _gather(ops))
                else:
                    _scatter(ops, payload)
                    _send_frame(conn, {"t": "ok"})
                if hdr.get("notif") is not None:
                    self._push_notif(sender, hdr["notif"])
        except (OSError, ConnectionError, msgspec.DecodeError, struct.error):
            pass
        finally:
            self._conns.discard(conn)
            try:
                conn.close()
            except OSError:
                pass

    def _push_notif(self, sender: str, msg: bytes) -> None:
        with self._notif_lock:
            self._notifs.setdefault(sender, []).append(bytes(msg))

    # ---- peers -----------------------------------------------------------------------------------
    def local_metadata(self) -> bytes:
        host = self.config.host if self.config.host not in ("0.0.0.0", "") else socket.gethostbyname(
            socket.gethostname())
        return _enc.encode({"backend": "fake", "name": self.agent_name, "host": host, "port": self.port})

    def connect(self, peer: str, peer_metadata: bytes) -> None:
        if self._closed:
            raise TransferError("agent is closed")
        if self._peer_md.get(peer) == peer_metadata:
            return
        try:
            md = _dec.decode(peer_metadata)
            name, host, port = md["name"], md["host"], int(md["port"])
        except (msgspec.DecodeError, KeyError, TypeError, ValueError) as e:
            raise TransferError(f"malformed fake-backend metadata for peer {peer!r}: {e}") from e
        if md.get("backend") != "fake" or name != peer:
            raise TransferError(f"metadata names agent {name!r} of backend {md.get('backend')!r}, expected "
                                f"fake agent {peer!r}")
        self.disconnect(peer)
        self._peers[peer] = _Peer(self, peer, host, port)
        self._peer_md[peer] = peer_metadata

    def disconnect(self, peer: str) -> None:
        p = self._peers.pop(peer, None)
        self._peer_md.pop(peer, None)
        if p is not None:
            p.stop()

    def _peer(self, peer: str) -> _Peer:
        if self._closed:
            raise TransferError("agent is closed")
        try:
            return self._peers[peer]
        except KeyError:
            raise TransferError(f"unknown peer {peer!r}; connect() it first") from None

    # ---- data ------------------------------------------------------------------------------------
    def _post(self, op: str, peer: str, ops: OpsLike, notif: Optional[bytes]) -> TransferHandle:
        arr = self._check_local(ops)
        p = self._peer(peer)
        handle = self._new_handle(peer, op.upper(), arr)
        handle.impl = None if notif is None else bytes(notif)
        p.submit(handle, op, arr)
        return handle

    def read(self, peer: str, ops: OpsLike, notif: Optional[bytes] = None) -> TransferHandle:
        return self._post("read", peer, ops, notif)

    def write(self, peer: str, ops: OpsLike, notif: Optional[bytes] = None) -> TransferHandle:
        return self._post("write", peer, ops, notif)

    def poll(self, handle: TransferHandle) -> TransferState:
        self._timed_out(handle)
        return handle.state

    def in_flight(self, handle: TransferHandle) -> bool:
        """True until the peer's worker thread is done with ``handle`` (a cancelled WRITE whose frame was being sent
        may still land on the peer until then)."""
        p = self._peers.get(handle.peer)
        if p is None:
            return False
        with p.lock:
            return handle in p.pending

    # ---- control ---------------------------------------------------------------------------------
    def send_notif(self, peer: str, msg: bytes) -> None:
        self._peer(peer).send_notif(msg)

    def get_notifs(self) -> dict[str, list[bytes]]:
        with self._notif_lock:
            out, self._notifs = self._notifs, {}
        return out

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for peer in list(self._peers):
            self.disconnect(peer)
        try:
            self._listener.close()
        except OSError:
            pass
        for c in list(self._conns):
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
