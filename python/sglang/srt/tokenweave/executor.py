"""TokenWeave's executor (Gond et al. 2025, sec. 3.1.2, Fig. 8): two wave-aware token splits whose
AllReduce + RMSNorm run on a communication stream while the other split computes.

Per layer, stage by stage, split by split (the :class:`SubBatchExecutor` schedule); on CUDA every norm+comm
stage is issued on the communication stream and every compute stage (attention, MLP / MoE) on the
compute stream, each waiting only on the previous stage *of its own split* through CUDA events (no host
synchronization). The resulting overlap::

    compute: attn(A)  attn(B)         mlp(A)         mlp(B)          attn(A, next layer) ...
    comm   :          norm(A)         norm(B)        norm(A, next)   norm(B, next) ...

The suffix split's attention is issued after the prefix split's on the same compute stream, so a
request straddling the cut reads the prefix split's KV of that layer. Batches below
``--tokenweave-min-tokens`` and decode batches run the sequential executor (and its CUDA graphs).
On CPU there are no streams: the same schedule runs in order, which is what the CPU tests compare.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Optional

import torch

from sglang.srt.forward_batch_info import ForwardBatch
from sglang.srt.layers.stages import NORM_STAGES, LayerState
from sglang.srt.model_executor.executors.split import SubBatchExecutor
from sglang.srt.tokenweave.planner import GemmShape, plan_split

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TokenWeaveConfig:
    """``--tokenweave-min-tokens`` (batches with fewer new tokens run unsplit; >= 2), ``--tokenweave-comm-sms``
    (SM budget of the overlapped communication kernel; None: tw-comm's default), the layer's GEMM output
    widths for the planner, and the device's GEMM wave model. The two flags are validated once, by ``ServerArgs``;
    raises ValueError when the GEMM widths are missing."""

    min_tokens: int = 1024
    comm_sms: Optional[int] = None
    gemm_widths: tuple[int, ...] = ()
    gemm_shape: GemmShape = GemmShape()

    def __post_init__(self) -> None:
        if not self.gemm_widths:
            raise ValueError("TokenWeaveConfig needs the layer's GEMM widths (layer_gemm_widths)")


class TokenWeaveExecutor(SubBatchExecutor):
    """Two token splits overlapped over a compute and a communication stream (see the module docstring).

    Args:
        config: :class:`TokenWeaveConfig`.
        device: the model's device (streams are created on CUDA devices only).
    """

    name = "tokenweave"

    def __init__(self, config: TokenWeaveConfig, device: torch.device):
        super().__init__()
        self.config = config
        self.device = torch.device(device)
        self.comm_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._logged: set[tuple[int, bool]] = set()
        self._events: dict[int, Any] = {}

    # ---- which sub-batches ------------------------------------------------------------------------------
    def plan(self, forward_batch: ForwardBatch) -> list[ForwardBatch]:
        """Two planner-chosen splits, or the whole batch (decode, or fewer than ``min_tokens`` tokens)."""
        n = forward_batch.num_tokens
        if forward_batch.forward_mode.is_decode() or n < self.config.min_tokens:
            self._log_once(n, None)
            return [forward_batch]
        plan = plan_split(n, self.config.gemm_widths, self.config.gemm_shape)
        self._log_once(n, plan)
        return list(forward_batch.split_tokens(plan.prefix))

    def _log_once(self, n: int, plan) -> None:
        """Log the decision for an ``n``-token batch the first time it is made (a size can be both a decode
        batch, unsplit, and a prefill batch, split: each decision is logged once)."""
        key = (n, plan is None)
        if key in self._logged or len(self._logged) > 4096:
            return
        self._logged.add(key)
        if plan is None:
            logger.info("TokenWeave: %d tokens run unsplit (below --tokenweave-min-tokens=%d or decode)", n,
                        self.config.min_tokens)
        else:
            logger.info("TokenWeave: %d tokens split %d + %d (%d extra GEMM waves over %d unsplit)", n, plan.prefix,
                        plan.suffix, plan.extra_waves, plan.unsplit_waves)

    # ---- where each stage runs --------------------------------------------------------------------------
    def run(self, model: Any, forward_batch: ForwardBatch) -> Any:
        """Forward the batch as planned; on CUDA, wait for every split's last event before the final norm."""
        if self.comm_stream is None:
            return super().run(model, forward_batch)
        self._events: dict[int, torch.cuda.Event] = {}
        return super().run(model, forward_batch)

    def finish(self, states: list[LayerState]) -> None:
        """Make the compute stream wait for every split's last stage before the concatenation."""
        if self.comm_stream is None:
            return
        cur = torch.cuda.current_stream(self.device)
        for st in states:
            ev = self._events.pop(id(st), None)
            if ev is not None:
                cur.wait_event(ev)

    def run_stage(self, layer: Any, stage: str, state: LayerState) -> None:
        """Norm+comm stages on the communication stream (fused AllReduce + add + RMSNorm with the overlap SM
        budget), compute stages on the current stream; each waits on its split's previous stage."""
        comm_stage = stage in NORM_STAGES and state.residual is not None
        if self.comm_stream is None:
            if comm_stage:
                self._norm_comm(layer, stage, state, overlap=False)
            else:
                layer.run_stage(stage, state)
            return
        compute = torch.cuda.current_stream(self.device)
        stream = self.comm_stream if comm_stage else compute
        prev = self._events.get(id(state))
        if prev is not None:
            stream.wait_event(prev)
        elif stream is not compute:
            stream.wait_stream(compute)  # the split's inputs were produced on the compute stream
        with torch.cuda.stream(stream):
            if comm_stage:
                self._norm_comm(layer, stage, state, overlap=True)
            else:
                layer.run_stage(stage, state)
            ev = torch.cuda.Event()
            ev.record(stream)
        other = compute if stream is not compute else self.comm_stream
        for t in (state.hidden, state.residual):
            if t is not None and t.is_cuda:
                t.record_stream(other)  # the other stream reads it next: keep the allocator from reusing it
        self._events[id(state)] = ev

    def _norm_comm(self, layer: Any, stage: str, state: LayerState, overlap: bool) -> None:
        norm = layer.norm_module(stage)
        comm = norm.comm
        if comm is not None and comm.supports_overlap:
            state.hidden, state.residual = comm.all_reduce_add_rmsnorm(state.hidden, state.residual, norm.weight,
                                                                       norm.eps, overlap=overlap)
        else:
            layer.run_stage(stage, state)
