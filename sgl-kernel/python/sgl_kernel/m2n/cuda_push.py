"""Device-driven same-node GPU transport (``cuda_push``): MegaScale-Infer's M2N fast path (Zhu et al. 2025, sec. 5:
no host involvement per message on the data path; GPU-to-GPU writes followed by flags).

Every endpoint owns one CUDA IPC allocation (a one-rank :class:`~sgl_kernel.tdist.heap.SymmetricHeap`: its error
record, then ``flags[world, slots]``, ``acks[world]``, then the receive ring ``[world(src), slots, capacity]``) and
publishes its handle once (a ``KIND_PUSH_HELLO`` control message, before any data). A peer's heap is mapped on first
use, in this rank's device context (legacy CUDA IPC: no multicast object, NVLS untouched).

Per message from ``me`` to ``peer``, all stream-ordered on the caller's stream, one Triton launch on each side
(:mod:`sgl_kernel.m2n.push_kernels`; the sequence numbers are device counters the kernels advance themselves):

* sender: :func:`~sgl_kernel.m2n.push_kernels.m2n_send_kernel` waits (bounded) until the peer acked the slot's
  previous message, copies the packed payload with 16-byte stores into the peer's ring slot over NVLink/PCIe and
  release-stores the flag ``(seq + 1) << 32 | rows`` into the peer's ``flags[me, slot]`` (after all its programs
  arrived and a system fence);
* receiver: :func:`~sgl_kernel.m2n.push_kernels.m2n_recv_kernel` spins with ``ld.acquire.sys`` on the flag (bounded:
  the tdist error record; the host raises from :meth:`CudaPushTransport.check`), copies the payload into the
  endpoint's receive buffer with the row count read from the flag word, and acks the slot (release store into the
  sender's heap).

``protocol="ll"`` (``create_transport("cuda_push_ll")``): the low-latency protocol of
:mod:`sgl_kernel.m2n.ll_kernels` instead: every payload word travels with the message tag in one 8-byte word (2x the
ring and the wire), no flag, fence or cross-CTA counter on the critical path; per-program headers, acks and counters.
Both sides of a group must use the same protocol (the hello carries it; a mismatch raises ValueError).

Two ways to receive: ``M2NEndpoint.recv()`` (the header still rides ZMQ, for callers that need ``meta``/``src`` on
the host, e.g. AFD) and ``M2NEndpoint.recv_device(src)`` with ``send(..., host_header=False)``: nothing goes through
the host per message, the row count stays on the device (``send(..., rows=<device int64 [1]>)`` even sends a row
count computed on the device). A message's views stay valid until the next receive. The device path is CUDA-graph
capturable: capture K sends / receives once, replay without host work (the counters continue across replays and
eager calls). Sends to one peer, and receives from one source, must stay on one stream (the counters are
stream-ordered).
"""

from __future__ import annotations

import logging
from typing import Optional

import msgspec
import numpy as np
import torch

from sgl_kernel.m2n.base import HEADER_LEN, PayloadTransport

logger = logging.getLogger(__name__)
KIND_PUSH_HELLO = 4
MAX_GRID = 32
BLOCK = 1024  # int32 words per program and step (4 KB)


def _as_tensor(ptr: int, nbytes: int, dev: int) -> torch.Tensor:
    from sgl_kernel.tdist.heap import _DevicePointer

    return torch.as_tensor(_DevicePointer(ptr, nbytes), device=torch.device("cuda", dev))


class _CudaPlatform:
    """Where the transport touches CUDA: the driver (``sgl_kernel.tdist.cuda_ipc``), device contexts, the current
    stream and raw-pointer tensors. Tests substitute a one-process CPU stand-in to run the host logic with the Triton
    interpreter."""

    def __init__(self) -> None:
        from sgl_kernel.tdist import cuda_ipc

        self.driver = cuda_ipc

    def check(self, device: torch.device) -> int:
        """The CUDA device index of ``device``. Raises RuntimeError for a non-CUDA device."""
        if device.type != "cuda":
            raise RuntimeError("CudaPushTransport needs CUDA buffers (M2NConfig.device='cuda:N')")
        return device.index if device.index is not None else torch.cuda.current_device()

    def context(self, dev: int):
        """Context manager making ``dev`` current."""
        return torch.cuda.device(dev)

    def stream(self, dev: int) -> int:
        """The current stream's handle on ``dev``."""
        return torch.cuda.current_stream(dev).cuda_stream

    def tensor(self, ptr: int, nbytes: int, dev: int) -> torch.Tensor:
        """A uint8 tensor over ``nbytes`` of device memory at ``ptr`` (no copy)."""
        return _as_tensor(ptr, nbytes, dev)


class CudaPushTransport(PayloadTransport):
    """See the module docstring.

    Args:
        wait_timeout_s: budget of every device wait (default: the endpoint's ``timeout_s``); a wait that runs out
            records the error and the host raises TimeoutError from :meth:`check` / the next receive.
        protocol: ``"flag"`` (payload, then a release flag: :mod:`~sgl_kernel.m2n.push_kernels`) or ``"ll"`` (tagged
            8-byte words: :mod:`~sgl_kernel.m2n.ll_kernels`).
    Raises:
        ValueError: a non-positive budget or an unknown protocol.
    """

    name = "cuda_push"
    device_driven = True

    def __init__(self, wait_timeout_s: Optional[float] = None, platform: Optional[_CudaPlatform] = None,
                 protocol: str = "flag") -> None:
        if wait_timeout_s is not None and not wait_timeout_s > 0:
            raise ValueError(f"cuda_push: wait_timeout_s={wait_timeout_s} must be > 0")
        if protocol not in ("flag", "ll"):
            raise ValueError(f"cuda_push: protocol={protocol!r}; use 'flag' or 'll'")
        self.protocol = protocol
        self.wait_timeout_s = wait_timeout_s
        self.platform = platform or _CudaPlatform()
        self.ep = None
        self.heap = None
        self._peers: dict[int, dict] = {}
        self._opened: list[int] = []

    # ---- set-up --------------------------------------------------------------------------------------------
    def attach(self, endpoint) -> None:
        """Allocate this rank's heap (flags, acks, ring), and send every peer its IPC handle.

        Raises:
            RuntimeError: the endpoint is not on a CUDA device; CudaDriverError when the driver refuses.
        """
        from sgl_kernel.tdist.heap import SymmetricHeap
        from sgl_kernel.tdist.layout import HeapConfig

        self.dev = self.platform.check(endpoint.device)
        cuda_ipc = self.platform.driver
        self.ep = endpoint
        world, slots = endpoint.world, endpoint.config.slots
        self.cap = int(endpoint.recv_buf.numel())
        budget = self.wait_timeout_s or endpoint.config.timeout_s
        ll = self.protocol == "ll"
        self.max_grid = 0
        if ll:
            from sgl_kernel.m2n.ll_kernels import ll_grid, ll_max_grid

            self.max_grid = ll_max_grid()
        self.grid = ll_grid(self.cap, self.max_grid) if ll else 0  # LL: this receiver's grid (its senders use it)
        ring_cap = self.cap * (2 if ll else 1)  # LL: one int64 word per int32 payload word
        ll_sig = world * slots * self.grid + world * self.max_grid if ll else 0
        cfg = HeapConfig(data_bytes=max(16, world * slots * ring_cap), signal_slots=8 + world * slots + world + ll_sig,
                         wait_timeout_s=budget)
        with self.platform.context(self.dev):
            torch.zeros(1, device=endpoint.device)  # the primary context is current on this thread
            ptr = cuda_ipc.mem_alloc(cfg.total_bytes)
            cuda_ipc.memset_d8(ptr, 0, cfg.total_bytes)
            local = self.platform.tensor(ptr, cfg.total_bytes, self.dev)

            def closer() -> None:
                for b in self._opened:
                    cuda_ipc.ipc_close(b)
                cuda_ipc.mem_free(ptr)

            # one rank's heap: a timed-out wait aborts no peer (a dead peer's memory is never written on timeout)
            self.heap = SymmetricHeap(0, 1, local, [ptr], cfg, barrier=lambda: None, closer=closer,
                                      backend="cuda_ipc")
            self.flags = self.heap.signals("m2n.flags", world * slots)
            self.acks = self.heap.signals("m2n.acks", world)
            self.ring = self.heap.tensor("m2n.ring", (world, slots, ring_cap), torch.uint8)
            if ll:  # per-program headers [src, slot, grid], acks [peer, max_grid], counters [send|recv, peer, *]
                self.ll_hdr = self.heap.signals("m2n.ll_hdr", world * slots * self.grid)
                self.ll_acks = self.heap.signals("m2n.ll_acks", world * self.max_grid)
                self.ll_ctr = torch.zeros(2, world, self.max_grid, dtype=torch.int64, device=endpoint.device)
            self.rows_out = torch.zeros(1, dtype=torch.int64, device=endpoint.device)
            self.col_bytes = torch.tensor([torch.empty(0, dtype=d).element_size() * w
                                           for d, w in endpoint.recv_layout.columns], dtype=torch.int64,
                                          device=endpoint.device)
            self._send_col_bytes = torch.tensor([torch.empty(0, dtype=d).element_size() * w
                                                 for d, w in endpoint.layout.columns], dtype=torch.int64,
                                                device=endpoint.device)
            # device sequence counters (see push_kernels): sent / received per peer, arrival words per kernel
            self.ctr = torch.zeros(4 * world, dtype=torch.int64, device=endpoint.device)
        self._recv32 = endpoint.recv_buf.view(torch.int32)
        self._ring32 = self.ring.view(torch.int32)
        self._ring64 = self.ring.view(torch.int64)
        self._ack_me = self.acks[endpoint.rank:endpoint.rank + 1]  # launch arguments made once
        body = msgspec.msgpack.encode({"handle": cuda_ipc.ipc_get_handle(ptr), "cap": self.cap,
                                       "flags": self.flags.data_ptr() - ptr, "acks": self.acks.data_ptr() - ptr,
                                       "ring": self.ring.data_ptr() - ptr, "bytes": cfg.total_bytes,
                                       "protocol": self.protocol, "grid": self.grid, "max_grid": self.max_grid,
                                       **({"ll_hdr": self.ll_hdr.data_ptr() - ptr,
                                           "ll_acks": self.ll_acks.data_ptr() - ptr} if ll else {})})
        header = np.zeros(HEADER_LEN, dtype=np.int64)
        header[:2] = (KIND_PUSH_HELLO, endpoint.rank)
        for peer in range(world):
            if peer != endpoint.rank:
                endpoint.send_control(peer, [header.tobytes(), body])

    def on_control(self, frames) -> None:
        """Map a peer's heap from its hello (in this rank's device context)."""
        header = np.frombuffer(frames[0].buffer, dtype=np.int64)
        if int(header[0]) != KIND_PUSH_HELLO:
            return
        src = int(header[1])
        d = msgspec.msgpack.decode(bytes(frames[1].buffer))
        with self.platform.context(self.dev):
            base = self.platform.driver.ipc_open(bytes(d["handle"]))
        self._opened.append(base)
        me, slots = self.ep.rank, self.ep.config.slots
        cap = int(d["cap"])
        if d.get("protocol", "flag") != self.protocol:
            self._peers[src] = {"error": f"cuda_push: rank {src} uses protocol {d.get('protocol', 'flag')!r}, this "
                                         f"rank {self.protocol!r}; give every rank the same transport"}
            return
        if self.protocol == "ll":
            if int(d.get("max_grid", 0)) != self.max_grid:
                self._peers[src] = {"error": f"cuda_push_ll: rank {src} uses SGLANG_M2N_LL_MAX_GRID="
                                             f"{d.get('max_grid')}, this rank {self.max_grid}; set the same value "
                                             "on every rank"}
                return
            G = self.max_grid
            g = int(d["grid"])
            ring = base + int(d["ring"]) + me * slots * 2 * cap
            self._peers[src] = {"cap": cap, "grid": g, "ring_delta": (ring - self.ring.data_ptr()) // 8,
                                "hdr_delta": (base + int(d["ll_hdr"]) + 8 * me * slots * g
                                              - self.ll_hdr.data_ptr()) // 8,
                                "ack_delta": (base + int(d["ll_acks"]) - self.ll_acks.data_ptr()) // 8,
                                "ack_me": self.ll_acks[me * G:(me + 1) * G],
                                "acks": self.ll_acks[src * G:(src + 1) * G]}
            return
        ring = base + int(d["ring"]) + me * slots * cap
        self._peers[src] = {"cap": cap, "ring_delta": (ring - self.ring.data_ptr()) // 4,
                            "flag_delta": (base + int(d["flags"]) + 8 * me * slots - self.flags.data_ptr()) // 8,
                            "ack_delta": (base + int(d["acks"]) - self.acks.data_ptr()) // 8}

    def connect(self, peer: int) -> None:
        """Block until ``peer``'s heap is mapped (its hello arrived). Raises TimeoutError after the endpoint's
        ``timeout_s``."""
        self._peer(peer)

    def _peer(self, peer: int) -> dict:
        if peer not in self._peers:
            self.ep.pump_control(lambda: peer in self._peers, f"cuda_push handles of rank {peer}")
        if "error" in self._peers[peer]:
            raise ValueError(self._peers[peer]["error"])
        return self._peers[peer]

    # ---- send ----------------------------------------------------------------------------------------------
    def post_send(self, peer: int, slot: int, view: torch.Tensor, rows: int = 0,
                  rows_dev: Optional[torch.Tensor] = None, src_rows: int = -1) -> Optional[bytes]:
        """One :func:`~sgl_kernel.m2n.push_kernels.m2n_send_kernel` launch: bounded wait for the slot, copy of
        ``view`` (the packed send slot) into ``peer``'s ring, release flag. ``slot`` is ignored (the device counter
        picks it). ``rows_dev`` (int64 [1] on the device, clamped to ``src_rows``): send that many of the ``src_rows``
        rows packed in ``view`` (column blocks at ``src_rows``-row offsets); otherwise ``rows`` rows packed for
        ``rows``.

        Raises:
            ValueError: the payload exceeds the peer's ring slot (its max_rows / layout is smaller).
        """
        from sgl_kernel.m2n.push_kernels import grid_for, launch_send

        p = self._peer(peer)
        nbytes = int(view.numel())
        if nbytes > p["cap"]:
            raise ValueError(f"cuda_push: {nbytes} payload bytes exceed rank {peer}'s ring slot ({p['cap']} bytes); "
                             "raise its max_rows")
        if self.protocol == "ll":
            self._post_send_ll(peer, p, view, rows, rows_dev, src_rows)
            return None
        with self.platform.context(self.dev):
            launch_send(self.heap.meta, self.ctr, peer, self.acks, self.flags, p["flag_delta"], self._ring32,
                        p["ring_delta"], view.view(torch.int32), rows, rows_dev, src_rows,
                        src_rows if rows_dev is not None else rows, self._send_col_bytes, self.ep.world,
                        self.ep.config.slots, p["cap"] // 4, grid_for(nbytes, MAX_GRID, BLOCK), BLOCK)
        return None

    def _post_send_ll(self, peer: int, p: dict, view: torch.Tensor, rows: int, rows_dev, src_rows: int) -> None:
        """:func:`~sgl_kernel.m2n.ll_kernels.m2n_ll_send_kernel` with the peer's grid (see :meth:`post_send`)."""
        from sgl_kernel.m2n.ll_kernels import launch_ll_send

        with self.platform.context(self.dev):
            launch_ll_send(self.heap.meta, self.ll_ctr[0, peer], peer, p["acks"], self.ll_hdr, p["hdr_delta"],
                           self._ring64, p["ring_delta"], view.view(torch.int32), rows, rows_dev, src_rows,
                           src_rows if rows_dev is not None else rows, self._send_col_bytes, self.ep.world,
                           self.ep.config.slots, p["cap"] // 4, p["grid"])

    # ---- receive -------------------------------------------------------------------------------------------
    def _recv_into(self, src: int, cap_rows: int, grid_bytes: int) -> None:
        from sgl_kernel.m2n.push_kernels import grid_for, launch_recv

        p = self._peer(src)
        if self.protocol == "ll":
            from sgl_kernel.m2n.ll_kernels import launch_ll_recv

            with self.platform.context(self.dev):
                launch_ll_recv(self.heap.meta, self.ll_ctr[1, src], src, self.ll_hdr, p["ack_me"], p["ack_delta"],
                               self._ring64, self._recv32, self.rows_out, self.col_bytes, cap_rows,
                               self.ep.config.max_rows, self.ep.world, self.ep.config.slots, self.cap // 4, self.grid)
            return
        with self.platform.context(self.dev):
            launch_recv(self.heap.meta, self.ctr, src, self.flags, self._ack_me, p["ack_delta"], self._ring32,
                        self._recv32, self.rows_out, self.col_bytes, cap_rows, self.ep.config.max_rows, self.ep.world,
                        self.ep.config.slots, self.cap // 4, True, grid_for(grid_bytes, MAX_GRID, BLOCK), BLOCK)

    def complete_recv(self, src: int, slot: int, nbytes: int, inline: Optional[bytes], out: torch.Tensor) -> None:
        """The header arrived over ZMQ: wait (device, bounded) for the flag, copy the payload into ``out``'s buffer
        (packed for its rows). ``slot`` is informational (the device counter picks the slot)."""
        self._recv_into(src, -1, nbytes)

    def recv_device(self, src: int) -> torch.Tensor:
        """Enqueue the receive of the next message from ``src`` into the endpoint's receive buffer, column blocks at
        the offsets of ``max_rows`` rows; returns the int64 [1] device tensor of its row count (valid until the next
        receive). No host wait; graph-capturable."""
        self._recv_into(src, self.ep.config.max_rows, self.cap)
        return self.rows_out

    def check(self) -> None:
        """Raise TimeoutError if a device wait of this endpoint gave up (synchronizing; the endpoint is then unusable:
        a peer died or stalled past the budget)."""
        msg = self.heap.wait_error() if self.heap is not None else None
        if msg is not None:
            raise TimeoutError(f"M2N rank {self.ep.rank} (cuda_push): {msg.replace('rank 0 of 1', 'this rank')}")

    def close(self) -> None:
        """Unmap the peers and free the heap (after this device's work finished)."""
        if self.heap is not None:
            heap, self.heap = self.heap, None
            try:
                heap.close()
            except Exception as e:  # a faulted context: nothing more to free safely
                logger.warning("cuda_push rank %d: close failed: %s", self.ep.rank, e)
