"""Two-batch overlap's deployment surface (see :mod:`sglang.srt.deployment.techniques`): ``--enable-two-batch-overlap``
gives every scheduler worker the ``two_batch_overlap`` executor (:mod:`.executor`), with
``--tbo-token-distribution-threshold`` (SGLang's name and default) and ``--tbo-min-tokens`` (the auto-off threshold;
default: the table of :mod:`.auto_off`)."""

from __future__ import annotations

import logging
from typing import Any

from sglang.srt.deployment.plan import ExecutorSpec

logger = logging.getLogger(__name__)

NAME = "two_batch_overlap"

# flags whose executors cannot run together with two-batch overlap's (each worker has one executor)
_EXCLUSIVE = (("enable_tokenweave", "--enable-tokenweave", "TokenWeave's token splits"),
              ("enable_tdist_overlap", "--enable-tdist-overlap", "the sequence-parallel executor of dense decoders"),
              ("enable_afd", "--enable-afd", "AFD's ping-pong micro-batches to remote FFN workers"))


def enabled(args: Any) -> bool:
    """``--enable-two-batch-overlap``."""
    return bool(args.enable_two_batch_overlap)


def validate(args: Any) -> None:
    """Refuse combinations with another executor technique (both flags named), before any worker starts.

    Raises:
        ValueError: ``--enable-tokenweave``, ``--enable-tdist-overlap`` or ``--enable-afd`` is set too.
    """
    for field, flag, what in _EXCLUSIVE:
        if getattr(args, field, False):
            raise ValueError(f"--enable-two-batch-overlap and {flag} cannot be combined (a worker runs one executor: "
                             f"two-batch overlap's micro-batches or {what}); drop one")


def graph_max_bs_of(args: Any) -> int:
    """The largest decode batch a CUDA graph may capture (0 with ``--disable-cuda-graph`` or on CPU)."""
    if args.disable_cuda_graph or args.resolved_device != "cuda":
        return 0
    from sglang.srt.model_executor.cuda_graph_runner import DEFAULT_MAX_BS

    return int(args.cuda_graph_max_bs or DEFAULT_MAX_BS)


def executor(args: Any) -> ExecutorSpec:
    """The ``two_batch_overlap`` executor with the token-distribution threshold, ``--tbo-min-tokens`` (None: the
    auto-off table, resolved on the worker, which knows its GPU) and the EP size."""
    return ExecutorSpec.of(NAME, token_distribution_threshold=float(args.tbo_token_distribution_threshold),
                           min_tokens=args.tbo_min_tokens, ep_size=int(args.ep_size),
                           graph_max_bs=graph_max_bs_of(args))


def make_executor(spec: ExecutorSpec, ctx: Any):
    """The :class:`~sglang.srt.two_batch_overlap.executor.TwoBatchOverlapExecutor` of ``spec`` for the worker of
    ``ctx`` (an :class:`~sglang.srt.model_executor.executors.registry.ExecutorContext`); logs the resolved threshold
    and where it came from. Raises ValueError on a bad option (see :class:`TboConfig`)."""
    import torch

    from sglang.srt.two_batch_overlap.auto_off import resolve_threshold
    from sglang.srt.two_batch_overlap.executor import TboConfig, TwoBatchOverlapExecutor

    opts = spec.opts()
    device = torch.device(ctx.device if ctx.device is not None else "cpu")
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
    threshold = resolve_threshold(opts.get("min_tokens"), int(opts.get("ep_size", 1)), gpu, device.type)
    config = TboConfig(token_distribution_threshold=float(opts.get("token_distribution_threshold", 0.48)),
                       threshold=threshold, graph_max_bs=int(opts.get("graph_max_bs", 0)))
    rank = int(getattr(ctx.worker, "rank", 0) or 0)
    ex = TwoBatchOverlapExecutor(config, device, rank)
    logger.log(logging.INFO if rank == 0 else logging.DEBUG,
               "two-batch overlap: EP %d on %s; batches split from %s; token distribution threshold %.2f; decode CUDA "
               "graphs %s", int(opts.get("ep_size", 1)), gpu or device.type, threshold.describe(),
               config.token_distribution_threshold,
               "off" if config.graph_max_bs == 0 else "capture the two-micro-batch schedule"
               if ex.graph_captures_executor else "capture the unsplit forward (graphed batches are below the threshold)")
    if ctx.model is not None and not ex.has_communication(ctx.model):
        logger.warning("two-batch overlap: no stage of this model communicates (one rank, or DP attention with "
                       "--moe-a2a-backend none, whose all-gather EP runs inside the experts stage): the micro-batches "
                       "have nothing to overlap and only add the split's cost")
    return ex
