"""The CPU payload transport: the packed payload rides the control message (ZMQ, IPC or TCP).

Used by the CPU tests and CPU serving; any host reachable over TCP works. On GPU it would copy through the
host, so GPU deployments use :mod:`~sgl_kernel.m2n.cuda_ipc` (same node) or an RDMA transport.
"""

from __future__ import annotations

from typing import Optional

import torch

from sgl_kernel.m2n.base import PayloadTransport


class InlineTransport(PayloadTransport):
    """Payload bytes inline in the ZMQ message (one copy out of the registered send slot, one copy into the
    registered receive buffer)."""

    name = "inline"

    def post_send(self, peer: int, slot: int, view: torch.Tensor) -> Optional[bytes]:
        """The payload's bytes (copied from the send slot, so the slot is free at once)."""
        return view.cpu().numpy().tobytes()

    def complete_recv(self, src: int, slot: int, nbytes: int, inline: Optional[bytes], out: torch.Tensor) -> None:
        """Copy the inline bytes into ``out`` (ValueError when the message carried none or a wrong size)."""
        if inline is None or len(inline) != nbytes:
            raise ValueError(f"inline M2N payload from {src}: expected {nbytes} bytes, got "
                             f"{None if inline is None else len(inline)}")
        if nbytes:
            out.copy_(torch.frombuffer(bytearray(inline), dtype=torch.uint8))
