"""The NCCL point-to-point baseline transport: the payload moves with ``torch.distributed.isend/irecv`` on a
process group created once by the caller (ranks = M2N ranks); the header still goes over ZMQ so receives can
come from any source. This is the baseline of the paper's Fig. 11-12 (NCCL send/recv)."""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

from sgl_kernel.m2n.base import PayloadTransport


class NcclP2PTransport(PayloadTransport):
    """Payload over ``dist.isend``/``dist.irecv`` in ``group`` (NCCL on GPU; gloo works too for CPU checks).

    Args:
        group: a process group whose rank ``r`` is M2N rank ``r`` (None: the default group).
    """

    name = "nccl"

    def __init__(self, group: Any = None):
        self.group = group
        self._pending: dict[tuple[int, int], Any] = {}

    def post_send(self, peer: int, slot: int, view: torch.Tensor) -> Optional[bytes]:
        """Post an ``isend`` of ``view`` (kept alive until the slot is reused)."""
        if view.numel():
            self._pending[(peer, slot)] = dist.isend(view, dst=self._global(peer), group=self.group)
        return None

    def wait_send_slot(self, peer: int, slot: int) -> None:
        """Wait for the previous ``isend`` from this slot (on NCCL: stream-ordered, no host block)."""
        work = self._pending.pop((peer, slot), None)
        if work is not None:
            work.wait()

    def complete_recv(self, src: int, slot: int, nbytes: int, inline: Optional[bytes], out: torch.Tensor) -> None:
        """``irecv`` exactly ``nbytes`` from ``src`` into ``out`` and wait (stream-ordered on NCCL)."""
        if nbytes:
            dist.irecv(out, src=self._global(src), group=self.group).wait()

    def _global(self, r: int) -> int:
        return r if self.group is None else dist.get_global_rank(self.group, r)

    def close(self) -> None:
        """Wait for every outstanding send."""
        for w in self._pending.values():
            w.wait()
        self._pending.clear()
