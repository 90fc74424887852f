"""RDMA / cross-node payload transport over NVIDIA NIXL (one-sided READ, pull).

The same pull shape as :mod:`~sgl_kernel.m2n.cuda_ipc` (MegaScale-Infer, Zhu et al. 2025, sec. 5: the
receiver pulls from the sender's registered buffer; descriptors are exchanged once, never per message):

* at :meth:`NixlTransport.attach` every endpoint registers its send ring (``[world, slots, capacity]``
  uint8) and its receive buffer with one NIXL agent (host memory as ``DRAM``, GPU memory as ``VRAM``) and
  sends every peer a hello on the M2N control channel: the agent's name and metadata plus the ring's base
  address and shape (msgpack, never pickles);
* :meth:`post_send` leaves the packed payload in the registered send slot (no copy, no inline bytes);
* on the data header the receiver posts **one** NIXL READ of exactly ``nbytes`` from (peer ring,
  ``[my rank, slot]``) into its registered receive buffer and polls it to completion within
  ``M2NConfig.timeout_s``; a failed or late READ raises ConnectionError naming the peer (fails closed,
  never a hang). Messages of 0 rows (0 bytes) move nothing.
* :meth:`close` after a fault (a failed READ, a receive timeout or a failed liveness check of the endpoint: a peer
  may be dead) abandons the agent instead of tearing it down: NIXL/UCX teardown can wait without bound on a
  SIGKILLed peer (on 2 H100s the killed-peer phase never returned from ``close``), so a dead peer
  fails the group closed within the receive timeout and close returns at once.

Slot reuse follows :mod:`~sgl_kernel.m2n.cuda_ipc`: ``slots`` must be >= the messages a peer may leave
unconsumed (dispatch/combine answers every message before its slot comes round again), so the sender never
waits for the READ.

NIXL moves bytes over UCX: shared memory / TCP between processes of one host, RDMA (InfiniBand, RoCE) across
nodes, GPU memory directly where UCX has CUDA support. The agent (NIXL registration, metadata and READ/poll) is
injected: ``agent_factory`` builds a :class:`ReadAgent` -- in sglang-tw the PD KV transfer's agent,
``sglang.srt.disaggregation.transfer.nixl_backend.m2n_read_agent`` (sgl_kernel never imports sglang). ``nixl``
itself is imported by the factory at :meth:`NixlTransport.attach` (``pip install 'sglang[pd]'``); the plain server
never imports it.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from typing import Any, Callable, Optional, Protocol

import msgspec
import numpy as np
import torch

from sgl_kernel.m2n.base import HEADER_LEN, PayloadTransport

logger = logging.getLogger(__name__)

KIND_NIXL_HELLO = 4
INSTALL_HINT = "pip install 'sglang[pd]'"


class ReadAgent(Protocol):
    """What :class:`NixlTransport` needs of a one-sided READ agent (a NIXL agent with its memory registered).

    ``poll`` returns a state whose ``name`` is ``"PENDING"``, ``"DONE"`` or ``"FAILED"``; a FAILED handle names the
    reason in ``handle.error``; ``connect`` raises RuntimeError when the peer is unreachable.
    """

    def local_metadata(self) -> bytes: ...

    def connect(self, peer: str, peer_metadata: bytes) -> None: ...

    def read(self, peer: str, ops: np.ndarray) -> Any: ...

    def poll(self, handle: Any) -> Any: ...

    def cancel(self, handle: Any, reason: str) -> None: ...

    def close(self) -> None: ...


ReadAgentFactory = Callable[[str, float, tuple, list], ReadAgent]
"""``(agent name, transfer timeout s, NIXL plugins, regions [(addr, nbytes, "cpu" | "cuda:N")]) -> ReadAgent``: builds
the agent and registers the regions; raises ImportError when nixl is missing."""


def _device_str(t: torch.Tensor) -> str:
    return "cpu" if t.device.type == "cpu" else f"cuda:{t.device.index or 0}"


class NixlTransport(PayloadTransport):
    """See the module docstring.

    Args:
        agent_factory: builds the READ agent (:data:`ReadAgentFactory`).
        backends: NIXL plugins to instantiate (default UCX).
        poll_sleep_s: sleep between polls of a pending READ (0: spin).
    Raises (from :meth:`attach`):
        ImportError: nixl is not installed (message names ``pip install 'sglang[pd]'``).
    """

    name = "nixl"

    def __init__(self, agent_factory: ReadAgentFactory, backends: tuple[str, ...] = ("UCX",),
                 poll_sleep_s: float = 2e-5) -> None:
        if not callable(agent_factory):
            raise ValueError("NixlTransport needs agent_factory, a callable building the NIXL READ agent (in sglang-tw: "
                             "sglang.srt.disaggregation.transfer.nixl_backend.m2n_read_agent)")
        self.agent_factory = agent_factory
        self.backends = tuple(backends)
        self.poll_sleep_s = poll_sleep_s
        self.ep = None
        self.agent = None
        self._peers: dict[int, tuple[str, int, int]] = {}  # rank -> (agent name, ring base address, slot bytes)
        self._fault: Optional[str] = None  # set once a peer may be dead: close() then never waits on peers

    def attach(self, endpoint) -> None:
        """Create the agent, register the endpoint's send ring and receive buffer, send every peer the hello.

        Raises:
            ImportError: nixl missing. RuntimeError: NIXL could not register the memory (from NIXL).
        """
        name = f"m2n-r{endpoint.rank}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        sb, rb = endpoint.send_bufs, endpoint.recv_buf
        regions = [(sb.data_ptr(), sb.numel(), _device_str(sb)), (rb.data_ptr(), rb.numel(), _device_str(rb))]
        try:
            self.agent = self.agent_factory(name, endpoint.config.timeout_s, self.backends, regions)
        except ImportError as e:
            raise ImportError(f"--afd-transport nixl needs the nixl package ({INSTALL_HINT}): {e}") from e
        self.ep = endpoint
        body = msgspec.msgpack.encode({"name": name, "md": self.agent.local_metadata(), "ring": sb.data_ptr(),
                                       "shape": list(sb.shape)})
        header = np.zeros(HEADER_LEN, dtype=np.int64)
        header[:2] = (KIND_NIXL_HELLO, endpoint.rank)
        for peer in range(endpoint.world):
            if peer != endpoint.rank:
                endpoint.send_control(peer, [header.tobytes(), body])
        logger.debug("M2N rank %d: NIXL agent %s registered %d + %d bytes", endpoint.rank, name, sb.numel(),
                     rb.numel())

    def on_control(self, frames) -> None:
        """Load a peer's hello (agent metadata, ring base address and shape).

        Raises:
            ValueError: the peer's ring shape does not match this group (another world size or slot count).
            ConnectionError: NIXL cannot load the peer's metadata (peer unreachable or gone; rank named).
        """
        header = np.frombuffer(frames[0].buffer, dtype=np.int64)
        if int(header[0]) != KIND_NIXL_HELLO:
            return
        src = int(header[1])
        d = msgspec.msgpack.decode(bytes(frames[1].buffer))
        world, slots, cap = d["shape"]
        if world != self.ep.world or slots != self.ep.config.slots:
            raise ValueError(f"NIXL M2N: rank {src} has a [{world}, {slots}] send ring, this group is "
                             f"[{self.ep.world}, {self.ep.config.slots}]; launch every rank with the same config")
        try:
            self.agent.connect(d["name"], d["md"])
        except RuntimeError as e:  # TransferError: the peer is unreachable (e.g. died after its hello)
            raise ConnectionError(f"NIXL M2N rank {self.ep.rank}: cannot reach rank {src} (agent {d['name']}): "
                                  f"{e}") from e
        self._peers[src] = (d["name"], int(d["ring"]), int(cap))

    def post_send(self, peer: int, slot: int, view: torch.Tensor) -> Optional[bytes]:
        """Nothing to move (the receiver reads the slot). On GPU the pack must be complete before the header
        leaves, so the current stream is synchronized (NIXL READs are not stream-ordered)."""
        if view.is_cuda:
            torch.cuda.current_stream(view.device).synchronize()
        return None

    def complete_recv(self, src: int, slot: int, nbytes: int, inline: Optional[bytes], out: torch.Tensor) -> None:
        """READ ``nbytes`` from ``src``'s ring slot ``[my rank, slot]`` into ``out`` and wait for it.

        Raises:
            RuntimeError: data from ``src`` before its hello, or inline bytes on a NIXL group.
            ConnectionError: the READ failed, did not finish within ``M2NConfig.timeout_s`` or the endpoint's
                ``alive()`` turned False while it was pending (peer named).

        On GPU the current stream is synchronized first (the READ is not stream-ordered and must not overwrite the
        receive buffer under kernels still reading the previous message); the data is in place on return.
        """
        if src not in self._peers:
            raise RuntimeError(f"NIXL M2N: data from rank {src} before its hello (agent metadata)")
        if inline is not None:
            raise RuntimeError(f"NIXL M2N: rank {src} sent inline bytes; every rank must use --afd-transport nixl")
        if not nbytes:
            return
        if out.is_cuda:  # kernels queued on the stream may still read the previous message's views of this buffer
            torch.cuda.current_stream(out.device).synchronize()
        name, base, cap = self._peers[src]
        remote = base + (self.ep.rank * self.ep.config.slots + slot) * cap
        handle = self.agent.read(name, np.array([[remote, out.data_ptr(), nbytes]], dtype=np.int64))
        next_alive = time.monotonic() + 0.05
        while True:
            state = self.agent.poll(handle).name  # FAILED past transfer_timeout_s (= M2NConfig.timeout_s)
            if state == "PENDING" and self.ep.alive is not None and time.monotonic() > next_alive:
                next_alive = time.monotonic() + 0.05
                if not self.ep.alive():
                    self.agent.cancel(handle, "the peer group is gone (liveness check failed)")
                    state = "FAILED"
            if state == "DONE":
                return
            if state == "FAILED":
                self._fault = f"READ from rank {src} failed"
                raise ConnectionError(f"NIXL M2N rank {self.ep.rank}: READ of {nbytes} bytes from rank {src} "
                                      f"(agent {name}) failed: {handle.error}")
            if self.poll_sleep_s:
                time.sleep(self.poll_sleep_s)

    def on_fault(self, reason: str) -> None:
        """Remember that a peer may be dead (see :meth:`close`)."""
        self._fault = self._fault or reason

    def close(self) -> None:
        """Deregister the buffers and forget the peers (pending READs fail). After a fault (:meth:`on_fault`, a
        failed READ) the agent is abandoned instead (no call that could wait on a dead peer; its registrations are
        kept until the process exits). Never blocks on a peer after a fault. Idempotent."""
        if self.agent is not None:
            if self._fault is not None:
                self.agent.abandon(self._fault)
            else:
                self.agent.close()
            self.agent = None
        self._peers.clear()
