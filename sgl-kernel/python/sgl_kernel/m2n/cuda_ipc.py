"""Same-node GPU transport over CUDA IPC (copy engine, pull).

At attach, every endpoint publishes to every peer the CUDA IPC handle of its registered send ring
(``[world, slots, capacity]`` uint8) and one inter-process event per (peer, slot), both created on the
endpoint's own device. Sending packs rows into the slot on the caller's stream and records that slot's event --
nothing waits on the host. The receiver, on its header, makes its current stream wait for the sender's event
and copies the bytes from the mapped ring into its registered receive buffer (``cudaMemcpyAsync``, i.e. the
copy engine), so consumers on that stream see the data in order.

Ranks may sit on different GPUs of the node. The default strategy (``mem=own, event=own``) follows CUDA's
simpleIPC sample: the peer's ring (``cudaIpcOpenMemHandle`` with lazy peer access) and events
(``cudaIpcOpenEventHandle``) are opened in the RECEIVER's device context, the wait and the copy run on the
receiver's stream, and the copy reads the peer's memory through the peer mapping (NVLink/PCIe). Alternatives,
picked without code change by ``SGL_M2N_IPC_MEM`` / ``SGL_M2N_IPC_EVENT`` (``scripts/gpu/m2n_ipc_probe.py``
tests each on real GPUs):

* ``SGL_M2N_IPC_MEM=peer``: open the ring on the peer's device index (torch's own CUDA tensor sharing; needs
  the same ``CUDA_VISIBLE_DEVICES`` everywhere); the copy is then torch's cross-device copy.
* ``SGL_M2N_IPC_EVENT=peer``: open the events on the peer's device index; ``sync``: no IPC event, the sender
  synchronizes its stream before the header leaves (one host sync per message, always correct).

Slot reuse relies on ``slots`` >= the messages a peer may leave unconsumed (dispatch/combine answers every
message first). Handles are msgpack'd bytes/ints, never pickles. GPU only: importing this module on a CPU
machine is fine, attaching raises RuntimeError.
"""

from __future__ import annotations

import os
from typing import Optional

import msgspec
import numpy as np
import torch

from sgl_kernel.m2n.base import HEADER_LEN, PayloadTransport

KIND_IPC_HELLO = 3
MEM_MODES = ("own", "peer")
EVENT_MODES = ("own", "peer", "sync")


def _mode(value: Optional[str], env: str, choices: tuple[str, ...]) -> str:
    v = value if value is not None else os.environ.get(env, choices[0])
    if v not in choices:
        raise ValueError(f"CUDA IPC: {env}={v!r}; choose one of {', '.join(choices)}")
    return v


class CudaIpcTransport(PayloadTransport):
    """See the module docstring.

    Args:
        mem: where a peer's ring is opened, ``own`` | ``peer`` (default: ``$SGL_M2N_IPC_MEM`` or ``own``).
        event: ``own`` | ``peer`` | ``sync`` (default: ``$SGL_M2N_IPC_EVENT`` or ``own``).

    Raises:
        ValueError: an unknown mode.
    """

    name = "cuda_ipc"

    def __init__(self, mem: Optional[str] = None, event: Optional[str] = None) -> None:
        self.mem = _mode(mem, "SGL_M2N_IPC_MEM", MEM_MODES)
        self.event = _mode(event, "SGL_M2N_IPC_EVENT", EVENT_MODES)
        self.ep = None
        self._events: list[list[torch.cuda.Event]] = []
        self._peer_bufs: dict[int, torch.Tensor] = {}
        self._peer_events: dict[int, list[torch.cuda.Event]] = {}

    def attach(self, endpoint) -> None:
        """Create the per-(peer, slot) events on the endpoint's device and send every peer this rank's handles.

        Raises:
            RuntimeError: the endpoint's buffers are not on a CUDA device.
        """
        if endpoint.device.type != "cuda":
            raise RuntimeError("CudaIpcTransport needs CUDA buffers (M2NConfig.device='cuda:N')")
        self.ep = endpoint
        world, slots = endpoint.world, endpoint.config.slots
        dev = endpoint.device.index if endpoint.device.index is not None else torch.cuda.current_device()
        with torch.cuda.device(dev):  # an event is created on the current device at its first ipc_handle()
            if self.event != "sync":
                self._events = [[torch.cuda.Event(interprocess=True) for _ in range(slots)] for _ in range(world)]
            share = endpoint.send_bufs.untyped_storage()._share_cuda_()
            for peer in range(world):
                if peer == endpoint.rank:
                    continue
                events = [e.ipc_handle() for e in self._events[peer]] if self._events else []
                body = msgspec.msgpack.encode({"share": list(share), "shape": list(endpoint.send_bufs.shape),
                                               "events": events, "device": dev})
                header = np.zeros(HEADER_LEN, dtype=np.int64)
                header[:2] = (KIND_IPC_HELLO, endpoint.rank)
                endpoint.send_control(peer, [header.tobytes(), body])

    def on_control(self, frames) -> None:
        """Open a peer's published ring and events (the hello message) per ``mem`` / ``event``.

        Raises:
            RuntimeError: the peer's device index does not exist in this process (``peer`` modes with
                different ``CUDA_VISIBLE_DEVICES`` across ranks).
        """
        header = np.frombuffer(frames[0].buffer, dtype=np.int64)
        if int(header[0]) != KIND_IPC_HELLO:
            return
        src = int(header[1])
        d = msgspec.msgpack.decode(bytes(frames[1].buffer))
        own = self.ep.device.index if self.ep.device.index is not None else torch.cuda.current_device()
        peer_dev = int(d["device"])
        if "peer" in (self.mem, self.event) and peer_dev >= torch.cuda.device_count():
            raise RuntimeError(f"CUDA IPC: rank {src} is on cuda:{peer_dev} but this process sees "
                               f"{torch.cuda.device_count()} device(s); give every rank the same CUDA_VISIBLE_DEVICES")
        share = list(d["share"])
        mem_dev = own if self.mem == "own" else peer_dev
        share[0] = mem_dev  # torch opens the handle under this device (cudaIpcMemLazyEnablePeerAccess)
        share[7] = False  # no wait on torch's producer event: the ring's bytes are ordered by the slot events
        with torch.cuda.device(mem_dev):
            storage = torch.UntypedStorage._new_shared_cuda(*share)
            buf = torch.empty(0, dtype=torch.uint8, device=storage.device)
            buf.set_(storage, 0, d["shape"])
        ev_dev = own if self.event == "own" else peer_dev
        with torch.cuda.device(ev_dev):
            events = [torch.cuda.Event.from_ipc_handle(torch.device("cuda", ev_dev), h) for h in d["events"]]
        self._peer_bufs[src] = buf
        self._peer_events[src] = events

    def post_send(self, peer: int, slot: int, view: torch.Tensor) -> Optional[bytes]:
        """Record the slot's event on the current stream (after the pack); ``sync``: wait for the stream."""
        with torch.cuda.device(self.ep.device):
            stream = torch.cuda.current_stream(self.ep.device)
            if self.event == "sync":
                stream.synchronize()
            else:
                self._events[peer][slot].record(stream)
        return None

    def complete_recv(self, src: int, slot: int, nbytes: int, inline: Optional[bytes], out: torch.Tensor) -> None:
        """Wait (on the receiver's stream) for the sender's event, then copy-engine copy from its mapped ring.

        Raises:
            RuntimeError: no hello from ``src`` arrived before its data.
        """
        if src not in self._peer_bufs:
            raise RuntimeError(f"CUDA IPC: data from rank {src} before its handles")
        with torch.cuda.device(self.ep.device):
            if self.event != "sync":
                torch.cuda.current_stream(self.ep.device).wait_event(self._peer_events[src][slot])
            if nbytes:  # mem=own: one same-device cudaMemcpyAsync through the peer mapping
                out.copy_(self._peer_bufs[src][self.ep.rank, slot, :nbytes], non_blocking=True)
