"""Copy-engine producer for AllGather-GEMM (Zheng et al., "Triton-distributed", 2025, sec. 3.2: intra-node AG
moves data with the copy engines so all SMs stay with the GEMM).

Per peer, on a side stream: ``cuStreamWaitValue64(ready[peer] >= epoch - 1)`` (the peer released its gather buffer),
``cuMemcpyAsync`` of the shard into the peer's gather buffer (IPC-mapped address), ``cuStreamWriteValue64`` of
``epoch`` into the peer's ``seg_sig[me]`` (preceded by a system-scope fence, so it is a release). The consumer waits
``seg_sig[s] >= epoch`` with ld.acquire.sys. The current stream joins the side stream afterwards (in the caller).
"""

from __future__ import annotations

import torch

from sgl_kernel.tdist import cuda_ipc


def _peer_addr(heap, t: torch.Tensor, peer: int) -> int:
    """Peer ``peer``'s address of the heap location of local tensor ``t`` (t must lie in this rank's heap)."""
    off = t.data_ptr() - heap.bases[heap.rank]
    if not 0 <= off < heap.config.total_bytes:
        raise ValueError("tensor is not inside this rank's symmetric heap")
    return heap.bases[peer] + off


def ce_put_signal(heap, a: torch.Tensor, gather: torch.Tensor, elem_off: int, seg_sig: torch.Tensor,
                  ready: torch.Tensor, epoch: int, side: "torch.cuda.Stream") -> None:
    """Push ``a`` (contiguous) to ``gather.view(-1)[elem_off:]`` of every peer with the copy engine, then SET the
    peer's ``seg_sig[me]`` to ``epoch``; all on stream ``side``, which first waits for the current stream. The caller
    makes the current stream wait for ``side`` once the consumer is launched."""
    dev = a.device
    main = torch.cuda.current_stream(dev)
    side.wait_stream(main)
    s = side.cuda_stream
    nbytes = a.numel() * a.element_size()
    me = heap.rank
    dst_local = gather.view(-1)[elem_off:]
    for j in range(1, heap.world):
        p = (me + j) % heap.world
        cuda_ipc.stream_wait_value64(ready[p].data_ptr(), epoch - 1, s)
        if nbytes:
            cuda_ipc.memcpy_async(_peer_addr(heap, dst_local, p), a.data_ptr(), nbytes, s)
        cuda_ipc.stream_write_value64(_peer_addr(heap, seg_sig[me], p), epoch, s)
    a.record_stream(side)
