"""DP attention's deployment surface (see :mod:`sglang.srt.deployment.techniques`): ``--enable-dp-attention
--dp-size N --tp-size N`` plans N scheduler workers, DP rank r = scheduler group r (its own sockets, requests, radix
cache and KV cache) and rank r of one torch.distributed world of N (the MoE layers' expert parallelism).

Devices (multiprocessing, GPU): DP rank r -> device slot r (``--base-gpu-id + r * --gpu-id-step``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from sglang.srt.deployment.plan import DpAttentionSpec, MoeA2aSpec, WorkerSpec

NAME = "dp_attention"

# flags that cannot be combined with --enable-dp-attention here, and why (each names the fix)
_REFUSED = (
    ("enable_afd", "--enable-afd", "AFD already runs its attention workers data parallel (--afd-attention-workers)"),
    ("enable_tokenweave", "--enable-tokenweave", "TokenWeave overlaps the all-reduce of attention TP, which DP "
     "attention does not have"),
    ("enable_tdist_overlap", "--enable-tdist-overlap", "the sequence-parallel layout shards attention TP, which DP "
     "attention does not have"),
    ("use_ray", "--use-ray", "the Ray launcher does not wire DP-attention ranks yet; launch with multiprocessing"),
)


def enabled(args: Any) -> bool:
    """``--enable-dp-attention``."""
    return bool(args.enable_dp_attention)


def moe_a2a_backend(args: Any) -> str:
    """``--moe-a2a-backend``: ``none`` (all-gather EP over the DP ranks), ``nccl`` or ``tdist``."""
    return args.moe_a2a_backend or "none"


def validate(args: Any) -> None:
    """The combinations DP attention refuses, before any process starts (``--dp-size`` = ``--tp-size`` is checked
    by ``ServerArgs``).

    Raises:
        ValueError: naming both flags and the fix: with ``--enable-afd``, ``--enable-tokenweave``,
            ``--enable-tdist-overlap``, ``--use-ray``, ``--disaggregation-mode`` or ``--nnodes > 1``.
    """
    for attr, flag, why in _REFUSED:
        if getattr(args, attr, False):
            raise ValueError(f"--enable-dp-attention and {flag} cannot be combined ({why}); drop one")
    if args.disaggregation_mode != "null":
        raise ValueError(f"--enable-dp-attention and --disaggregation-mode={args.disaggregation_mode} cannot be "
                         "combined yet (a DP-attention prefill/decode server is not built); drop one")
    if args.nnodes > 1:
        raise ValueError(f"--enable-dp-attention runs on one node here (--nnodes={args.nnodes}); use --nnodes 1")


def moe_a2a(args: Any, spec: Optional[MoeA2aSpec]) -> Optional[MoeA2aSpec]:
    """The DP worker's MoE all-to-all: the expert-parallel technique's spec (its hook runs first; this module is last
    in ``TECHNIQUE_MODULES``) with the ``local`` token scope, as each DP rank dispatches its own requests' tokens (the
    DP rank installs it over its DP world: :meth:`~sglang.srt.dp_attention.rank.DpAttentionRank.install_moe_a2a`).
    None (``--moe-a2a-backend none``): the all-gather EP of :mod:`sglang.srt.dp_attention.moe`."""
    if spec is None:
        return None
    from sglang.srt.dp_attention.moe_a2a import LOCAL_SCOPE

    return dataclasses.replace(spec, token_scope=LOCAL_SCOPE)


def workers(args: Any, base: WorkerSpec) -> list:
    """One scheduler worker per DP rank: group = rank = r, ``tp_size`` = the DP world, placed on device slot r."""
    from sglang.srt.deployment.compose import place

    n = args.dp_size
    backend = moe_a2a_backend(args)
    return [dataclasses.replace(base, name=f"sglang::scheduler_DP{r}", group=r, rank=r, tp_size=n, index=r, node=0,
                                local_index=r, device=place(args, r),
                                dp_attention=DpAttentionSpec(r, n, args.ep_size, backend)) for r in range(n)]


def notes(args: Any) -> list:
    """The layout, for the plan table."""
    return [f"dp attention: {args.dp_size} DP ranks (attention and dense layers replicated, KV cache per rank, "
            f"requests by --load-balance-method {args.load_balance_method}); MoE layers expert parallel over all "
            f"ranks, --ep-size {args.ep_size}, --moe-a2a-backend {moe_a2a_backend(args)}"]


def check_model(args: Any) -> None:
    """The model's MoE sizes must split over the DP world (the attention is replicated, so its head counts do not
    matter). Reads the model's config before anything is spawned.

    Raises:
        ValueError: ``num_experts % --ep-size`` or the MoE intermediate size by ``--dp-size / --ep-size`` (naming the
            value and the fix).
    """
    from sglang.srt.configs.model_config import ModelConfig

    mc = ModelConfig.from_path(args.model_path, args.context_length, args.dtype, args.resolved_device)
    n_exp = int(mc.get("num_local_experts") or mc.get("num_experts") or 0)
    if not n_exp:
        if args.ep_size > 1:
            raise ValueError(f"--ep-size={args.ep_size} needs a MoE model; {mc.path} is dense (its DP-attention ranks "
                             "share no layer): use --ep-size 1")
        return
    moe_tp = args.dp_size // args.ep_size
    inter = int(mc.get("moe_intermediate_size") or mc.get("intermediate_size") or 0)
    if n_exp % args.ep_size:
        raise ValueError(f"num_experts={n_exp} of {mc.path} is not divisible by --ep-size={args.ep_size}; pick an "
                         "--ep-size that divides it")
    if inter % moe_tp:
        raise ValueError(f"moe intermediate_size={inter} of {mc.path} is not divisible by --dp-size/--ep-size="
                         f"{moe_tp}; use --ep-size {args.dp_size} (every expert whole on one rank)")
