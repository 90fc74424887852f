"""Static decode inputs of the CUDA graphs, filled with ONE host-to-device copy per step.

A decode step's per-row integers (input id, position, request row, sequence length, KV slot) go into a persistent
pinned host buffer ``[5, max_bs]`` int64 through numpy views (no per-step tensor construction, no per-step pinned
allocation) and reach the graphs' static device buffer in one asynchronous copy. Two host buffers alternate; before
one is refilled, the event recorded after its previous copy is waited on (that copy was issued a step earlier, so
the wait is normally already satisfied and the host never waits on the replay itself).

Formerly every replay cloned a pad tensor, built a ``[4, bs]`` tensor from Python lists, pinned it
(a fresh pinned block per step) and issued a second copy for the KV slots: :func:`stage_decode_inputs_legacy`
keeps that sequence for the host micro-benchmark (``benchmark/decode/host_step.py``) only.
"""

from __future__ import annotations

from typing import Union

import numpy as np
import torch

ROWS = ("input_ids", "positions", "req_pool_indices", "seq_lens", "out_cache_loc")


class DecodeInputStager:
    """The graphs' static decode inputs and the host buffers that fill them.

    Args:
        max_bs: largest padded batch (columns of the buffers).
        pad_req_idx: the reserved ``req_to_token`` row padding rows read (its slot 0 is the dummy KV slot 0).
        device: the graphs' device; on CUDA the host buffers are pinned and copies asynchronous, elsewhere (tests,
            the micro-benchmark on CPU) the copy is a plain synchronous ``copy_``.
        num_buffers: host buffers used in turn (>= 1).
    Attributes:
        static: ``[5, max_bs]`` int64 on ``device``; rows in :data:`ROWS` order, padding columns hold token 0 at
            position 0 of ``pad_req_idx`` with sequence length 1 writing KV slot 0.
    Raises:
        ValueError: ``max_bs`` or ``num_buffers`` < 1.
    """

    def __init__(self, max_bs: int, pad_req_idx: int, device: Union[str, torch.device], num_buffers: int = 2):
        if max_bs < 1 or num_buffers < 1:
            raise ValueError(f"DecodeInputStager: max_bs={max_bs} and num_buffers={num_buffers} must be >= 1")
        self.device = torch.device(device)
        self.max_bs = max_bs
        pad = torch.tensor([[0], [0], [pad_req_idx], [1], [0]], dtype=torch.int64).expand(len(ROWS), max_bs)
        self._pad = pad.contiguous().numpy()
        self.static = torch.from_numpy(self._pad.copy()).to(self.device)
        pinned = self.device.type == "cuda"
        self._host = [torch.from_numpy(self._pad.copy()) for _ in range(num_buffers)]
        if pinned:
            self._host = [h.pin_memory() for h in self._host]
        self._np = [h.numpy() for h in self._host]
        self._events = [torch.cuda.Event() if pinned else None for _ in range(num_buffers)]
        self._used = [False] * num_buffers
        self._turn = 0

    def views(self) -> tuple[torch.Tensor, ...]:
        """``(input_ids, positions, req_pool_indices, seq_lens, out_cache_loc)``, each ``[max_bs]`` int64 on the
        device: views of :attr:`static` (the tensors the graphs are captured on)."""
        return tuple(self.static.unbind(0))

    def stage(self, batch, padded: int) -> None:
        """Write ``batch`` (a decode ``ModelWorkerBatch`` of ``bs <= padded`` rows: list or CPU-tensor columns,
        ``out_cache_loc`` an int tensor on the host or on the device) into columns ``[:bs]`` and padding into
        ``[bs:padded]`` of :attr:`static`, issued on the current stream without waiting for the device. ``bs`` may be 0
        (a DP-attention idle rank replays padding only)."""
        bs = batch.batch_size
        if not (0 <= bs <= padded <= self.max_bs and padded >= 1):
            raise ValueError(f"DecodeInputStager.stage: need 0 <= bs ({bs}) <= padded ({padded}) <= {self.max_bs}")
        i = self._turn
        self._turn = (i + 1) % len(self._host)
        if self._events[i] is not None and self._used[i]:
            self._events[i].synchronize()  # the copy that last read this buffer (a step ago) has finished
        h = self._np[i]
        h[0, :bs] = batch.input_ids
        h[1, :bs] = batch.positions
        h[2, :bs] = batch.req_pool_indices
        h[3, :bs] = batch.seq_lens
        loc = batch.out_cache_loc
        loc_on_host = not isinstance(loc, torch.Tensor) or loc.device.type == "cpu"
        if loc_on_host:
            h[4, :bs] = np.asarray(loc)
        if padded > bs:
            h[:, bs:padded] = self._pad[:, bs:padded]
        self.static.copy_(self._host[i], non_blocking=self._events[i] is not None)
        if not loc_on_host:  # slots already on the device: one device copy after the packed one (same stream)
            self.static[4, :bs].copy_(loc)
        if self._events[i] is not None:
            self._events[i].record()
            self._used[i] = True


def stage_decode_inputs_legacy(static: torch.Tensor, pad: torch.Tensor, batch, padded: int) -> None:
    """The former (legacy) staging, kept only to measure it (``benchmark/decode/host_step.py``): clone a pad tensor
    ``pad`` ``[4, max_bs]`` int64 (CPU), fill ``[:, :bs]`` from a new tensor of the batch's lists, pin it when
    ``static`` (``[5, max_bs]`` int64, rows as :data:`ROWS`) is on CUDA, copy it, then copy the KV slots
    separately and zero the padding slots."""
    bs = batch.batch_size
    host = pad.clone()
    host[:, :bs] = torch.tensor([batch.input_ids, batch.positions, batch.req_pool_indices, batch.seq_lens],
                                dtype=torch.int64)
    if static.device.type == "cuda":
        host = host.pin_memory()
    static[:4].copy_(host, non_blocking=True)
    static[4, :bs].copy_(batch.out_cache_loc.to(static.device, torch.int64))
    if padded > bs:
        static[4, bs:padded].zero_()
