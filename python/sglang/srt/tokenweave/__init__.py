"""TokenWeave (Gond et al., "TokenWeave: Efficient Compute-Communication Overlap for Distributed LLM
Inference", 2025): wave-aware token splitting (:mod:`.planner`), the overlapped two-stream executor
(:mod:`.executor`) and the tw-comm communicator it drives
(:mod:`sglang.srt.distributed.tw_communicator`). Turned on with ``--enable-tokenweave``."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Optional

import torch

if TYPE_CHECKING:
    from sglang.srt.configs.model_config import ModelConfig

logger = logging.getLogger(__name__)


def gemm_widths_of(model_config: "ModelConfig", tp_size: int) -> tuple[int, ...]:
    """The planner's per-layer GEMM output widths (QKV, O, gate+up, down; columns on one TP rank) for a model
    config (MoE: experts per token x the expert intermediate size, a dense equivalent), from the config's own
    sizes: TokenWeave's smart splitting (Gond et al. 2025, sec. 3.1.1) without a hand-written table per model.

    Raises:
        ValueError: a non-positive size (see :func:`~sglang.srt.tokenweave.planner.layer_gemm_widths`).
    """
    from sglang.srt.tokenweave.planner import layer_gemm_widths

    mc = model_config
    inter = mc.get("moe_intermediate_size") or mc.get("intermediate_size")
    if mc.get("num_local_experts") or mc.get("num_experts"):
        inter = int(inter) * int(mc.get("num_experts_per_tok", 2))
    return layer_gemm_widths(mc.hidden_size, mc.num_attention_heads, mc.num_key_value_heads, mc.head_dim,
                             int(inter), tp_size)


def create_tokenweave_executor(model_config: "ModelConfig", min_tokens: int, comm_sms: Optional[int],
                               device: torch.device, tp_size: int):
    """The :class:`~sglang.srt.tokenweave.executor.TokenWeaveExecutor` for this worker (SM count of the GPU in
    the wave model; the H100/H200 default on CPU). ``min_tokens`` / ``comm_sms``: ``--tokenweave-min-tokens`` /
    ``--tokenweave-comm-sms`` (validated by ``ServerArgs``)."""
    from sglang.srt.tokenweave.executor import TokenWeaveConfig, TokenWeaveExecutor
    from sglang.srt.tokenweave.planner import GemmShape

    shape = GemmShape()
    if device.type == "cuda":
        shape = GemmShape(num_sms=torch.cuda.get_device_properties(device).multi_processor_count)
    cfg = TokenWeaveConfig(min_tokens=min_tokens, comm_sms=comm_sms, gemm_widths=gemm_widths_of(model_config, tp_size),
                           gemm_shape=shape)
    logger.info("TokenWeave on: min tokens %d, comm SMs %s, GEMM widths %s, %d SMs", cfg.min_tokens,
                cfg.comm_sms or "default", cfg.gemm_widths, shape.num_sms)
    return TokenWeaveExecutor(cfg, device)


def create_tokenweave_communicator(ps: Any, backend: str, comm_sms: Optional[int], disable_custom_all_reduce: bool):
    """The tw-comm communicator when ``backend`` (``--comm-backend``) is auto or tw and it can be built; else the
    requested backend (NCCL/gloo torch by default), logged either way. ``comm_sms``: ``--tokenweave-comm-sms``."""
    from sglang.srt.distributed.communicator import create_communicator

    if backend not in ("auto", "tw") or ps is None or ps.tp_size == 1:
        return create_communicator(ps, "torch" if backend == "auto" else backend, disable_custom_all_reduce)
    from sglang.srt.distributed.tw_communicator import TwCommunicator

    try:
        comm = TwCommunicator(ps, comm_sms=comm_sms)
    except (ImportError, OSError, RuntimeError) as e:
        logger.warning("TokenWeave: tw-comm is unavailable (%s); falling back to NCCL collectives", e)
        return create_communicator(ps, "torch", disable_custom_all_reduce)
    logger.info("TP communicator (rank %d/%d): %s [TokenWeave]", ps.tp_rank, ps.tp_size, comm.describe())
    return comm
