"""Host-to-device transfers for per-step batch metadata (CPU-safe; imports no CUDA-only module).

A step of the scheduler ships a few small integer tensors (KV slots, input ids, positions, indices)
to the GPU. From pageable memory each ``cudaMemcpyAsync`` is staged by the driver and may block the
host until the GPU has drained the stream; from pinned memory it is a true asynchronous DMA that
the host does not wait for. PyTorch's caching host allocator records the copy's stream on the
pinned block, so the temporary may be dropped right after the call without a race.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch


def host_to_device(t: torch.Tensor, device: Union[str, torch.device], dtype: torch.dtype = None) -> torch.Tensor:
    """Copy CPU tensor ``t`` to ``device`` (optionally cast to ``dtype`` first, on the host).

    On CUDA the copy goes through pinned memory and is asynchronous on the current stream; on any
    other device it is a plain ``.to``. A tensor already on ``device`` is only cast.

    Args:
        t: any-shape tensor, normally on the CPU.
        device: the target device.
        dtype: the result's dtype (None keeps ``t.dtype``).
    Returns:
        A tensor on ``device`` with ``t``'s shape and values.
    """
    device = torch.device(device)
    if dtype is not None and t.dtype != dtype:
        t = t.to(dtype)
    if t.device == device or (t.device.type == device.type and device.index is None):
        return t
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def ints_to_device(values: Sequence[int], device: Union[str, torch.device], dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """A Python int sequence as a 1-D ``dtype`` tensor on ``device`` (see :func:`host_to_device`)."""
    return host_to_device(torch.tensor(values, dtype=dtype), device)


def columns_to_device(columns: Sequence[tuple[Sequence, torch.dtype]], device: Union[str, torch.device],
                      pack: Optional[bool] = None) -> list[torch.Tensor]:
    """Several per-request host columns as 1-D tensors on ``device``, in ONE host-to-device copy.

    Packed (default on CUDA): the columns go into one byte buffer (pinned on CUDA), each at an offset aligned to
    its element size, widest first; the buffer is copied asynchronously once and the columns are returned as
    typed views of the device buffer (no device kernels). Unpacked (default elsewhere): one plain tensor per
    column. Used for the per-step sampling columns, which otherwise cost one pinned allocation and one
    ``cudaMemcpyAsync`` each.

    Args:
        columns: ``(values, dtype)`` pairs; values a Python sequence (any length, may differ per column).
        device: the target device.
        pack: force packing on or off (None: on for CUDA devices).
    Returns:
        One tensor per column, in the given order, ``dtype`` and ``[len(values)]``.
    """
    device = torch.device(device)
    host = [torch.tensor(list(v), dtype=dt) for v, dt in columns]
    if pack is None:
        pack = device.type == "cuda"
    if not pack:
        return [t.to(device) for t in host]
    offsets, total = {}, 0
    for i in sorted(range(len(host)), key=lambda j: -host[j].element_size()):
        size = host[i].element_size()
        total = (total + size - 1) // size * size
        offsets[i] = total
        total += host[i].numel() * size
    buf = torch.empty(max(total, 8), dtype=torch.uint8, pin_memory=device.type == "cuda")
    for i, t in enumerate(host):
        buf[offsets[i]: offsets[i] + t.numel() * t.element_size()].view(t.dtype).copy_(t)
    dev = buf.to(device, non_blocking=True)
    return [dev[offsets[i]: offsets[i] + t.numel() * t.element_size()].view(t.dtype) for i, t in enumerate(host)]
