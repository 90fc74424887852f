"""Role-aware worker building: what a worker process loads and allocates, decided by its role.

Roles (the deployments this project runs):

* ``aggregated`` -- today's server: the whole model and a KV cache (prefill and decode together);
* ``prefill`` / ``decode`` -- PD disaggregation (KVDirect, Chen et al. 2024): both hold the whole model
  and a KV cache; prefill publishes its KV region, decode pulls from it;
* ``attention`` -- attention/FFN disaggregation (MegaScale-Infer, Zhu et al. 2025, sec. 3): embeddings,
  attention, norms, dense MLPs, routers and the LM head, plus the KV cache -- no routed experts;
* ``ffn`` -- the routed experts only, no KV cache.

:class:`~sglang.srt.deployment.plan.WorkerRole` is the one role vocabulary (defined with the deployment plan);
:func:`role_spec` gives a role's frozen :class:`RoleSpec`; :func:`kv_budget_tokens` and
:func:`max_running_requests` turn flags and free memory into the KV budget.
:class:`~sglang.srt.model_executor.model_runner.ModelRunner` uses them, so a role is a constructor argument, never
a fork of the runner or of a model file.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional

import torch

from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.deployment.plan import WorkerRole

if TYPE_CHECKING:
    from sglang.srt.server_args import ServerArgs

logger = logging.getLogger(__name__)

CPU_DEFAULT_MAX_TOTAL_TOKENS = 65536
CPU_DEFAULT_MAX_RUNNING = 256
# --mem-fraction-static when unset: SGLang's value at TP 1 before its heuristic (SGLang 0.4: 0.88; SGLang 0.5 derives
# 0.835 on an 80 GB H100 from a 13.4 GB guess of the activation memory). The memory left beside weights + KV is
# max((1 - f) x total, the measured activation reserve) (mem_cache/memory_budget.py), so the pool never takes memory
# the profiled forwards need; 0.85 before.
GPU_DEFAULT_MEM_FRACTION = 0.88
GPU_DEFAULT_MAX_RUNNING = 1024
GPU_MAX_DEFAULT_TOKENS = 1 << 22  # tiny models on big GPUs: a memory-derived pool is capped here
REQ_TO_TOKEN_MAX_BYTES = 1 << 30

# HF names of routed-expert tensors (Mixtral ``block_sparse_moe.experts.N.*``, Qwen-MoE ``mlp.experts.N.*``)
_ROUTED_EXPERT_RE = re.compile(r"\.experts\.\d+\.")
# our names of routed-expert parameters (FusedMoE's stacked ``w13_weight`` / ``w2_weight``)
_ROUTED_EXPERT_PARAM_RE = re.compile(r"\.experts\.(w13|w2)_weight$")


def is_routed_expert_weight(hf_name: str) -> bool:
    """True for the HF tensors of routed experts (the part an FFN worker holds)."""
    return _ROUTED_EXPERT_RE.search(hf_name) is not None


def is_routed_expert_param(name: str) -> bool:
    """True for our routed-expert parameters (``...mlp.experts.w13_weight`` / ``w2_weight``)."""
    return _ROUTED_EXPERT_PARAM_RE.search(name) is not None


def _not_routed_expert_param(name: str) -> bool:
    return not is_routed_expert_param(name)


@dataclass(frozen=True)
class RoleSpec:
    """What a role loads and allocates.

    Attributes:
        role: the :class:`WorkerRole`.
        holds_kv: allocates a KV cache (and request rows).
        weight_filter: HF tensor name -> loaded by this role; None loads everything.
        holds_param: our parameter name -> constructed by this role (others stay on ``meta``, no memory);
            None constructs everything.
        publishes_kv: exposes its KV region to peers (``KVCache.describe()`` sent at connect).
    """

    role: WorkerRole
    holds_kv: bool
    weight_filter: Optional[Callable[[str], bool]]
    publishes_kv: bool = False
    holds_param: Optional[Callable[[str], bool]] = None


def role_spec(role: "WorkerRole | str") -> RoleSpec:
    """The :class:`RoleSpec` of ``role`` (a :class:`WorkerRole` or its value).

    Raises:
        ValueError: unknown role name (the message lists the roles).
    """
    try:
        r = WorkerRole(role)
    except ValueError:
        raise ValueError(f"unknown worker role {role!r}; choose one of {[x.value for x in WorkerRole]}") from None
    if r is WorkerRole.ATTENTION:
        return RoleSpec(r, holds_kv=True, weight_filter=lambda n: not is_routed_expert_weight(n),
                        holds_param=_not_routed_expert_param)
    if r is WorkerRole.FFN:
        return RoleSpec(r, holds_kv=False, weight_filter=is_routed_expert_weight, holds_param=is_routed_expert_param)
    return RoleSpec(r, holds_kv=True, weight_filter=None, publishes_kv=r is WorkerRole.PREFILL)


def set_cpu_threads(model_config: ModelConfig) -> None:
    """Pick torch's intra-op thread count for CPU serving.

    Small models run best on one thread: their ops take microseconds, and OpenMP workers spin-waiting
    on a busy machine turn them into milliseconds. ``SGLANG_CPU_THREADS`` overrides the choice.
    """
    env = os.environ.get("SGLANG_CPU_THREADS")
    n = int(env) if env else (1 if model_config.hidden_size < 1024 else max(1, (os.cpu_count() or 1)))
    torch.set_num_threads(n)
    logger.info("CPU intra-op threads: %d", n)


def kv_budget_tokens(args: "ServerArgs", device: torch.device, bytes_per_token: int, page_size: int,
                     reserve_bytes: int = 0, fixed_bytes: int = 0) -> int:
    """KV slots this device can hold: ``--max-total-tokens`` if given; else on CUDA
    :func:`~sglang.srt.mem_cache.memory_budget.kv_pool_bytes` (free memory minus ``fixed_bytes`` minus the larger
    of ``(1 - --mem-fraction-static)`` of the total and the measured activation ``reserve_bytes``) divided by
    ``bytes_per_token`` (capped at ``GPU_MAX_DEFAULT_TOKENS``); else ``CPU_DEFAULT_MAX_TOTAL_TOKENS``. Rounded down
    to whole pages."""
    from sglang.srt.mem_cache.memory_budget import kv_pool_bytes

    if args.max_total_tokens is not None:
        tokens = args.max_total_tokens
    elif device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        frac = args.mem_fraction_static or GPU_DEFAULT_MEM_FRACTION
        budget = kv_pool_bytes(free, total, frac, reserve_bytes, fixed_bytes)
        tokens = min(budget // bytes_per_token, GPU_MAX_DEFAULT_TOKENS)
    else:
        tokens = CPU_DEFAULT_MAX_TOTAL_TOKENS
    return tokens - tokens % page_size


def max_running_requests(args: "ServerArgs", device: torch.device, context_len: int, max_total_tokens: int) -> int:
    """``--max-running-requests`` (or the device default), capped so ``req_to_token`` stays under
    ``REQ_TO_TOKEN_MAX_BYTES`` and by the KV budget; at least 1."""
    n = args.max_running_requests or (GPU_DEFAULT_MAX_RUNNING if device.type == "cuda" else CPU_DEFAULT_MAX_RUNNING)
    row_bytes = 4 * (context_len + 8)
    return max(1, min(n, REQ_TO_TOKEN_MAX_BYTES // row_bytes, max_total_tokens))
