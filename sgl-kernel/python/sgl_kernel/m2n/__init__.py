"""M2N: MegaScale-Infer's many-to-many row exchange (Zhu et al. 2025, sec. 5) -- tw-comm's Python API.

``M2NEndpoint(M2NConfig(rank, addresses, max_rows), RowLayout(...), transport=...)``; ``send(peer, tensors,
meta)``, ``recv() -> Message``. Transports: :class:`InlineTransport` (CPU), :class:`NcclP2PTransport`
(baseline), :class:`CudaIpcTransport` (same-node GPUs, host-driven pull), :class:`CudaPushTransport`
(same-node GPUs, device-driven push: flags + bounded device waits, ``recv_device``), :class:`NixlTransport`
(RDMA/UCX READ, any node; the caller injects the NIXL agent, see :mod:`sgl_kernel.m2n.nixl_transport`; ``pip install 'sglang[pd]'``). See
:mod:`sgl_kernel.m2n.base` and ``docs/afd.md``.
"""

from sgl_kernel.m2n.base import DeviceMessage, M2NConfig, M2NEndpoint, Message, PayloadTransport, RowLayout
from sgl_kernel.m2n.zmq_transport import InlineTransport


def create_transport(name: str, group=None, nixl_agent_factory=None) -> PayloadTransport:
    """The payload transport called ``name``: ``inline`` | ``nccl`` (``group``: the p2p process group) |
    ``cuda_ipc`` | ``cuda_push`` | ``cuda_push_ll`` | ``nixl`` (``nixl_agent_factory``: builds the READ agent, see
    :data:`sgl_kernel.m2n.nixl_transport.ReadAgentFactory`; nixl itself is imported at attach). Raises ValueError
    for another name, or for ``nixl`` without ``nixl_agent_factory``."""
    if name == "inline":
        return InlineTransport()
    if name == "nccl":
        from sgl_kernel.m2n.nccl_p2p import NcclP2PTransport

        return NcclP2PTransport(group)
    if name == "cuda_ipc":
        from sgl_kernel.m2n.cuda_ipc import CudaIpcTransport

        return CudaIpcTransport()
    if name == "cuda_push":
        from sgl_kernel.m2n.cuda_push import CudaPushTransport

        return CudaPushTransport()
    if name == "cuda_push_ll":  # the low-latency protocol (sgl_kernel.m2n.ll_kernels)
        from sgl_kernel.m2n.cuda_push import CudaPushTransport

        return CudaPushTransport(protocol="ll")
    if name == "nixl":
        from sgl_kernel.m2n.nixl_transport import NixlTransport

        return NixlTransport(nixl_agent_factory)
    raise ValueError(f"unknown M2N transport {name!r}; use inline, nccl, cuda_ipc, cuda_push, cuda_push_ll or nixl")


__all__ = ["DeviceMessage", "M2NConfig", "M2NEndpoint", "Message", "PayloadTransport", "RowLayout", "InlineTransport",
           "create_transport"]
