"""Same-node GPU transport over CUDA IPC (copy engine, pull).

At attach, every endpoint publishes to every peer the CUDA IPC handle of its registered send ring
(``[world, slots, capacity]`` uint8) and one inter-process event per (peer, slot). Sending packs rows into
the slot on the caller's stream and records that slot's event -- nothing waits on the host. The receiver,
on its header, makes its current stream wait for the sender's event and copies the bytes from the mapped
ring into its registered receive buffer (``cudaMemcpyAsync``, i.e. the copy engine), so consumers on that
stream see the data in order. Ranks may sit on different GPUs of the node: a peer's ring and events are opened
on the peer's device (the index it published; every rank must see the same CUDA devices, i.e. the same
``CUDA_VISIBLE_DEVICES``), and the cross-device copy is ordered by events on both devices' current streams
(torch's peer copy: a two-way event barrier, no host synchronization). Slot reuse relies on ``slots`` >= the
messages a peer may leave unconsumed (dispatch/combine answers every message first).

Handles are msgpack'd bytes/ints, never pickles. GPU only: importing this module on a CPU machine is fine,
attaching raises RuntimeError.
"""

from __future__ import annotations

from typing import Optional

import msgspec
import numpy as np
import torch

from sgl_kernel.m2n.base import HEADER_LEN, PayloadTransport

KIND_IPC_HELLO = 3


class CudaIpcTransport(PayloadTransport):
    """See the module docstring."""

    name = "cuda_ipc"

    def __init__(self) -> None:
        self.ep = None
        self._events: list[list[torch.cuda.Event]] = []
        self._peer_bufs: dict[int, torch.Tensor] = {}
        self._peer_events: dict[int, list[torch.cuda.Event]] = {}

    def attach(self, endpoint) -> None:
        """Create the per-(peer, slot) events and send every peer this rank's handles.

        Raises:
            RuntimeError: the endpoint's buffers are not on a CUDA device.
        """
        if endpoint.device.type != "cuda":
            raise RuntimeError("CudaIpcTransport needs CUDA buffers (M2NConfig.device='cuda:N')")
        self.ep = endpoint
        world, slots = endpoint.world, endpoint.config.slots
        self._events = [[torch.cuda.Event(interprocess=True) for _ in range(slots)] for _ in range(world)]
        st = endpoint.send_bufs.untyped_storage()
        share = st._share_cuda_()
        shape = list(endpoint.send_bufs.shape)
        for peer in range(world):
            if peer == endpoint.rank:
                continue
            body = msgspec.msgpack.encode({
                "share": [x if not isinstance(x, bytes) else x for x in share], "shape": shape,
                "events": [e.ipc_handle() for e in self._events[peer]],
                "device": endpoint.device.index or 0})
            header = np.zeros(HEADER_LEN, dtype=np.int64)
            header[:2] = (KIND_IPC_HELLO, endpoint.rank)
            endpoint.send_control(peer, [header.tobytes(), body])

    def on_control(self, frames) -> None:
        """Open a peer's published ring and events (the hello message) on the peer's device.

        Raises:
            RuntimeError: the peer's device index does not exist in this process (different
                ``CUDA_VISIBLE_DEVICES`` across ranks).
        """
        header = np.frombuffer(frames[0].buffer, dtype=np.int64)
        if int(header[0]) != KIND_IPC_HELLO:
            return
        src = int(header[1])
        d = msgspec.msgpack.decode(bytes(frames[1].buffer))
        peer_dev = int(d["device"])
        if peer_dev >= torch.cuda.device_count():
            raise RuntimeError(f"CUDA IPC: rank {src} is on cuda:{peer_dev} but this process sees "
                               f"{torch.cuda.device_count()} device(s); give every rank the same CUDA_VISIBLE_DEVICES")
        with torch.cuda.device(peer_dev):
            storage = torch.UntypedStorage._new_shared_cuda(*d["share"])
            buf = torch.empty(0, dtype=torch.uint8, device=storage.device)
            buf.set_(storage, 0, d["shape"])
            events = [torch.cuda.Event.from_ipc_handle(torch.device("cuda", peer_dev), h) for h in d["events"]]
        self._peer_bufs[src] = buf
        self._peer_events[src] = events

    def post_send(self, peer: int, slot: int, view: torch.Tensor) -> Optional[bytes]:
        """Record the slot's event on the current stream (after the pack); the receiver pulls."""
        self._events[peer][slot].record(torch.cuda.current_stream(self.ep.device))
        return None

    def complete_recv(self, src: int, slot: int, nbytes: int, inline: Optional[bytes], out: torch.Tensor) -> None:
        """Wait (on the stream) for the sender's event, then copy-engine copy from its mapped ring.

        Raises:
            RuntimeError: no hello from ``src`` arrived before its data.
        """
        if src not in self._peer_bufs:
            raise RuntimeError(f"CUDA IPC: data from rank {src} before its handles")
        torch.cuda.current_stream(self.ep.device).wait_event(self._peer_events[src][slot])
        if nbytes:  # same GPU: one cudaMemcpyAsync; another GPU: a peer copy ordered on both devices' streams
            with torch.cuda.device(self.ep.device):
                out.copy_(self._peer_bufs[src][self.ep.rank, slot, :nbytes], non_blocking=True)
