"""Install expert parallelism by all-to-all on a built model: one token dispatcher per rank, one
:class:`~sglang.srt.layers.moe.ep_a2a.EpA2aMoe` per MoE block (no model file changes).

Buffer sizes (per rank, fixed at start; DeepEP sizes its one ``Buffer`` the same way, from the largest batch of each
mode):

* NORMAL: ``max_tokens_normal`` = the largest forward the scheduler can form (``--chunked-prefill-size``, or
  ``--max-prefill-tokens`` without chunking, plus the running decodes; :func:`~sglang.srt.mem_cache.memory_budget.
  forward_limits`), divided by the TP size under the ``tp_slice`` scope (each rank dispatches its share);
* LOW_LATENCY: ``max_tokens_low_latency`` = the largest decode CUDA-graph batch (``--cuda-graph-max-bs``, default
  160, at most the running-request limit; the same rule on CPU, where nothing is captured), divided by the TP size
  under ``tp_slice``. Larger decode batches run in normal mode.

The dispatcher is built before the KV pool is sized, so its fixed buffers are already allocated when the budget reads
the free device memory, and the profiling forwards (which run the normal mode at the largest size) measure the
transient receive buffers (:mod:`sglang.srt.mem_cache.memory_budget`).
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch

from sglang.srt.layers.moe.ep_a2a import EpA2aMoe, make_token_scope
from sglang.srt.layers.moe.sparse_moe_block import SparseMoeBlock
from sglang.srt.layers.moe.token_dispatcher import DispatcherConfig, TokenDispatcher, create_token_dispatcher

logger = logging.getLogger(__name__)


def moe_blocks(model: Any) -> list:
    """Every :class:`SparseMoeBlock` of ``model``, in module order."""
    return [m for m in model.modules() if isinstance(m, SparseMoeBlock)]


def dispatcher_sizes(args: Any, max_running: int, tp_size: int, token_scope: str) -> tuple[int, int]:
    """``(max_tokens_normal, max_tokens_low_latency)`` per rank (module docstring)."""
    from sglang.srt.mem_cache.memory_budget import forward_limits
    from sglang.srt.model_executor.cuda_graph_runner import DEFAULT_MAX_BS, capture_batch_sizes

    total = forward_limits(args, max_running, graphs_on=False).max_tokens
    graph_bs = capture_batch_sizes(min(args.cuda_graph_max_bs or DEFAULT_MAX_BS, max_running))[-1]
    div = tp_size if token_scope == "tp_slice" else 1
    return -(-total // div), -(-graph_bs // div)


def install_moe_a2a(model: Any, spec: Any, parallel_state: Any, args: Any, device: torch.device,
                    max_running: int) -> Optional[TokenDispatcher]:
    """Build this rank's dispatcher for ``spec`` (a :class:`~sglang.srt.deployment.plan.MoeA2aSpec`; None: nothing
    to do) and set ``block.a2a`` on every MoE block of ``model``. Collective over the EP group (every rank calls it).

    Args:
        model: the loaded model; parallel_state: the rank's ParallelState (its ``ep_group`` is the EP group);
        args: the ServerArgs (sizes); device: the rank's device; max_running: the running-request limit.
    Returns:
        the dispatcher (close it at shutdown), or None when ``spec`` is None.
    Raises:
        ValueError: no MoE block, MoE blocks of different shapes, experts whose intermediate dim is split
            (``--ep-size`` below ``--tp-size``), or no EP group.
    """
    if spec is None:
        return None
    blocks = moe_blocks(model)
    if not blocks:
        raise ValueError(f"--moe-a2a-backend {spec.backend}: the model has no MoE layers; use "
                         "--moe-a2a-backend none")
    shapes = {(b.experts.num_experts, b.experts.top_k, b.experts.hidden_size, b.experts.ep_size, b.experts.ep_rank,
               b.experts.moe_tp_size, b.experts.w13_weight.dtype) for b in blocks}
    if len(shapes) != 1:
        raise ValueError(f"--moe-a2a-backend {spec.backend}: MoE layers differ in shape {sorted(map(str, shapes))}")
    e, k, h, ep, ep_rank, moe_tp, dtype = shapes.pop()
    if moe_tp != 1 or ep < 2:
        raise ValueError(f"--moe-a2a-backend {spec.backend} needs every expert whole on one rank: --ep-size={ep} must "
                         f"equal --tp-size={ep * moe_tp} (and be > 1)")
    group = getattr(parallel_state, "ep_group", None)
    if group is None:
        raise ValueError(f"--moe-a2a-backend {spec.backend}: this rank has no EP process group (--ep-size={ep})")
    tp_rank, tp_size = parallel_state.tp_rank, parallel_state.tp_size
    normal, low_latency = dispatcher_sizes(args, max_running, tp_size, spec.token_scope)
    cfg = DispatcherConfig(num_experts=e, top_k=k, hidden_size=h, ep_size=ep, ep_rank=ep_rank,
                           max_tokens_normal=normal, max_tokens_low_latency=low_latency, dtype=dtype,
                           device=str(device), max_inflight=spec.max_inflight)
    dispatcher = create_token_dispatcher(spec.backend, cfg, group)
    scope = make_token_scope(spec.token_scope, tp_rank, tp_size)
    runner = EpA2aMoe(dispatcher, scope)
    for b in blocks:
        b.a2a = runner
    logger.info("MoE all-to-all (%s) on %d MoE layers: EP rank %d/%d holds experts %d..%d, token scope %s, per-rank "
                "capacity normal %d / low-latency %d tokens, fixed buffers %.1f MiB", spec.backend, len(blocks),
                ep_rank, ep, cfg.expert_start, cfg.expert_start + cfg.num_local_experts - 1, scope.name, normal,
                low_latency, dispatcher.buffer_bytes(cfg) / 2**20)
    return dispatcher
