"""The scheduler's side of the DP step agreement: report this rank's batch, turn "no batch" into an idle batch when
another rank runs a forward, and attach the agreed step to the batch (the model runner reads it)."""

from __future__ import annotations

from typing import Callable, Optional

import torch

from sglang.srt.dp_attention.step_sync import NO_GRAPH, DpRankReport, DpStepSync
from sglang.srt.forward_batch_info import ForwardMode
from sglang.srt.managers.schedule_batch import ScheduleBatch


def local_report(batch: Optional[ScheduleBatch], has_work: bool, graph_max_bs: Optional[int],
                 split_check: Optional[Callable[[ScheduleBatch], bool]] = None) -> DpRankReport:
    """This rank's :class:`DpRankReport`: its batch's new tokens, whether it holds requests, its decode batch size
    when the batch could replay a CUDA graph (decode, ``bs <= graph_max_bs``, no input logprobs: the rule of
    ``CudaGraphRunner.can_run``), whether its executor would split it (``split_check``; None: never) and whether it
    is a decode batch."""
    if batch is None:
        return DpRankReport(0, has_work, 0)
    tokens = sum(r.extend_len for r in batch.reqs)
    graph_bs = NO_GRAPH
    if (graph_max_bs and batch.forward_mode == ForwardMode.DECODE and len(batch.reqs) <= graph_max_bs
            and not any(r.input_logprob_targets()[0] for r in batch.reqs)):
        graph_bs = len(batch.reqs)
    return DpRankReport(tokens, True, graph_bs, bool(split_check(batch)) if split_check is not None else False,
                        batch.forward_mode == ForwardMode.DECODE)


def idle_batch(device: torch.device) -> ScheduleBatch:
    """An empty batch (``ForwardMode.IDLE``): no requests, no KV slots, nothing sampled."""
    return ScheduleBatch(reqs=[], out_cache_loc=torch.empty(0, dtype=torch.int64, device=device),
                         forward_mode=ForwardMode.IDLE)


def agree_batch(sync: DpStepSync, batch: Optional[ScheduleBatch], has_work: bool, graph_max_bs: Optional[int],
                device: torch.device, split_check: Optional[Callable[[ScheduleBatch], bool]] = None
                ) -> Optional[ScheduleBatch]:
    """Agree on this step with the other DP ranks (one collective; every rank calls it once per scheduler step) and
    return the batch to launch: ``batch`` (or an idle batch when this rank has none but another rank has tokens) with
    the agreed :class:`~sglang.srt.dp_attention.step_sync.DpGlobalStep` as ``dp_step``; None when no rank runs a
    forward. Raises RuntimeError when a peer left (from the collective)."""
    step = sync.agree(local_report(batch, has_work, graph_max_bs, split_check))
    if not step.runs_forward:
        return None
    if batch is None:
        batch = idle_batch(device)
        sync.idle_forwards += 1
    batch.dp_step = step
    return batch
