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
    from sglang.srt.server_args import ServerArgs

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


# Auto-off: the smallest batch TokenWeave splits when --tokenweave-min-tokens is not given, per (GPU model, TP size),
# from bench_tokenweave.py (4 layers of Llama-3.3-70B, dummy bf16, same-run NCCL / NCCL-symmetric baselines with the
# same fused norm). H100 TP2 (2026-11-26, benchmark/results/archive/tokenweave/2026-11-26_allreduce_rmsnorm_and_layer_1712utc_2xh100.md):
# TokenWeave / NCCL = 1.56 at 1024 tokens, 1.10 at 2048, 1.05 at 4096, 1.015 at 8192: it loses at every T measured,
# so it stays off (TOKENWEAVE_OFF is above any prefill chunk). H100 TP4: NOT measured (no 4 x H100 run in
# benchmark/results); 8192 copies the H200 TP4 row (the earlier 1-layer table, unfused-norm baselines, had 0.90 at
# 8192). H200 TP2 (2026-11-26_allreduce_rmsnorm_and_layer_2027utc_2xh200.md): 1.33 / 1.15 / 1.07 / 1.05 at 1K / 2K / 4K / 8K: off. H200
# TP4 (2026-11-27_layer_tp4_and_allreduce_4xh200.md, eager): 1.61 / 1.14 / 1.24 / 0.965 (CUDA-graphed 1.11 / 1.005 / 1.16 / 0.99),
# full residual, before the sharded-residual default. Unknown GPUs use the H100 row of their TP size; other TP sizes
# keep the paper's 1024 (set on 8 H200s).
TOKENWEAVE_OFF = 1 << 30
AUTO_MIN_TOKENS = {("H100", 2): TOKENWEAVE_OFF, ("H100", 4): 8192, ("H200", 2): TOKENWEAVE_OFF, ("H200", 4): 8192}
DEFAULT_MIN_TOKENS = 1024


def resolve_min_tokens(requested: Optional[int], tp_size: int, gpu_name: str = "") -> int:
    """``--tokenweave-min-tokens`` when given, else the auto-off threshold of (``gpu_name``, ``tp_size``) in
    :data:`AUTO_MIN_TOKENS` (the GPU model matched as a substring of ``gpu_name``, e.g. ``"NVIDIA H100 80GB
    HBM3"``; an unknown GPU uses the H100 row of its TP size; :data:`DEFAULT_MIN_TOKENS` for other TP sizes).
    :data:`TOKENWEAVE_OFF` means TokenWeave never splits (every batch runs the sequential executor)."""
    if requested is not None:
        return requested
    for (gpu, tp), t in AUTO_MIN_TOKENS.items():
        if tp == tp_size and gpu in gpu_name:
            return t
    return AUTO_MIN_TOKENS.get(("H100", tp_size), DEFAULT_MIN_TOKENS)


def create_tokenweave_executor(model_config: "ModelConfig", min_tokens: Optional[int], comm_sms: Optional[int],
                               device: torch.device, tp_size: int, sharded_residual: bool = True):
    """The :class:`~sglang.srt.tokenweave.executor.TokenWeaveExecutor` for this worker (SM count of the GPU in
    the wave model; the H100/H200 default on CPU). ``min_tokens`` / ``comm_sms``: ``--tokenweave-min-tokens`` /
    ``--tokenweave-comm-sms`` (validated by ``ServerArgs``; ``min_tokens`` None: :func:`resolve_min_tokens`'s
    auto-off threshold of this GPU and TP size); ``sharded_residual``: True (the default) unless
    ``--tokenweave-full-residual``."""
    from sglang.srt.tokenweave.executor import TokenWeaveConfig, TokenWeaveExecutor
    from sglang.srt.tokenweave.planner import GemmShape

    shape, gpu = GemmShape(), ""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        shape, gpu = GemmShape(num_sms=props.multi_processor_count), props.name
    cfg = TokenWeaveConfig(min_tokens=resolve_min_tokens(min_tokens, tp_size, gpu), comm_sms=comm_sms,
                           gemm_widths=gemm_widths_of(model_config, tp_size), gemm_shape=shape,
                           sharded_residual=sharded_residual)
    if cfg.min_tokens >= TOKENWEAVE_OFF:
        logger.info("TokenWeave auto-off on %s at TP%d: it lost to NCCL at every measured size (pass "
                    "--tokenweave-min-tokens to force it on)", gpu or device.type, tp_size)
    logger.info("TokenWeave on: min tokens %d, comm SMs %s, GEMM widths %s, %d SMs, residual %s", cfg.min_tokens,
                cfg.comm_sms or "default", cfg.gemm_widths, shape.num_sms,
                "sharded" if cfg.sharded_residual else "full")
    return TokenWeaveExecutor(cfg, device)


def max_prefill_tokens_of(server_args: "ServerArgs") -> int:
    """The most new tokens one forward can carry: the chunked-prefill size when set (> 0), else
    ``--max-prefill-tokens``."""
    chunk = server_args.chunked_prefill_size
    return chunk if chunk is not None and chunk > 0 else server_args.max_prefill_tokens


def create_tokenweave_communicator(ps: Any, backend: str, comm_sms: Optional[int], disable_custom_all_reduce: bool,
                                   max_tokens: Optional[int] = None, hidden_size: Optional[int] = None):
    """A TokenWeave worker's communicator, logged: with ``backend`` (``--comm-backend``) ``auto`` on TP > 1, a
    :class:`~sglang.srt.distributed.tw_communicator.TokenWeaveCommunicator` that runs every unsplit call (forwards
    below ``--tokenweave-min-tokens``, decode steps and their CUDA graphs) on exactly the communicator the same server
    builds without ``--enable-tokenweave`` (:func:`~sglang.srt.distributed.communicator.create_communicator` of
    ``backend``: custom all-reduce / NCCL on GPU, gloo on CPU) and only the split halves on tw-comm; with ``tw``,
    tw-comm for every call (what ``--comm-backend tw`` gives without TokenWeave too); another backend, TP 1, or
    tw-comm unavailable: ``create_communicator(backend)`` alone. ``comm_sms``: ``--tokenweave-comm-sms``. With
    ``max_tokens`` (:func:`max_prefill_tokens_of`) and ``hidden_size`` the tw-comm workspace is sized for the
    largest prefill (``max_tokens`` x ``hidden_size`` x 2 bytes) so split calls never fall back to NCCL; without
    them, tw-comm's 64 MiB default."""
    from sglang.srt.distributed.communicator import create_communicator

    if backend not in ("auto", "tw") or ps is None or ps.tp_size == 1:
        return create_communicator(ps, backend, disable_custom_all_reduce)
    from sglang.srt.distributed.tw_communicator import TokenWeaveCommunicator, TwCommunicator, workspace_bytes

    max_bytes = workspace_bytes(max_tokens, hidden_size) if hidden_size and max_tokens else None
    try:
        comm = TwCommunicator(ps, comm_sms=comm_sms, max_bytes=max_bytes)
    except (ImportError, OSError, RuntimeError) as e:
        logger.warning("TokenWeave: tw-comm is unavailable (%s); falling back to the plain communicator", e)
        return create_communicator(ps, backend, disable_custom_all_reduce)
    if backend == "auto":
        comm = TokenWeaveCommunicator(create_communicator(ps, backend, disable_custom_all_reduce), comm)
    logger.info("TP communicator (rank %d/%d): %s [TokenWeave]", ps.tp_rank, ps.tp_size, comm.describe())
    return comm
