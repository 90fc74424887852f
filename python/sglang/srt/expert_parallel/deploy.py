"""Expert parallelism by all-to-all: the deployment surface (see :mod:`sglang.srt.deployment.techniques`).

``--moe-a2a-backend nccl|tdist`` (SGLang's flag; ``none`` keeps the all-reduce EP of ``--ep-size``) gives every
scheduler worker a :class:`~sglang.srt.deployment.plan.MoeA2aSpec`: the worker builds one token dispatcher over its
EP group after the model loads and installs it on every MoE block (:func:`sglang.srt.expert_parallel.install.
install_moe_a2a`). With TP attention (the only attention layout without ``dp-attention``) each TP rank dispatches its
1/tp slice of the batch (token scope ``tp_slice``); a DP-attention technique turns the scope to ``local`` through its
own ``moe_a2a(args, spec)`` hook.

Flag-level checks (a value other than none/nccl/tdist, ``deepep``, ``--ep-size`` not equal to ``--tp-size``) are
``ServerArgs``'; the combinations with other techniques and the optional packages are checked here, before any
worker starts.
"""

from __future__ import annotations

import os
from typing import Any, Optional

from sglang.srt.deployment.plan import MoeA2aSpec
from sglang.srt.deployment.techniques import SGL_KERNEL_INSTALL, require_package

NAME = "moe_a2a"


def enabled(args: Any) -> bool:
    """``--moe-a2a-backend`` other than ``none``."""
    return args.moe_a2a_backend != "none"


def validate(args: Any) -> None:
    """Refuse the techniques whose executors own the MoE layers' data movement or the residual layout, and check the
    tdist backend's packages and, on CPU, the Triton interpreter.

    Raises:
        ValueError: ``--enable-afd``, ``--enable-tokenweave`` or ``--enable-tdist-overlap`` too (both flags named);
            ``--moe-a2a-backend tdist`` across nodes, or on CPU without ``TRITON_INTERPRET=1``.
        MissingPackageError: tdist without ``triton`` or ``sgl_kernel``.
    """
    flag = f"--moe-a2a-backend {args.moe_a2a_backend}"
    for other, why in (("enable_afd", "AFD sends the routed experts to FFN workers over M2N"),
                       ("enable_tokenweave", "TokenWeave keeps the residual sharded between its norms"),
                       ("enable_tdist_overlap", "the sequence-parallel executor runs dense decoders only")):
        if getattr(args, other):
            raise ValueError(f"{flag} and --{other.replace('_', '-')} cannot be combined ({why}); drop one")
    if args.moe_a2a_backend == "tdist" and args.nnodes > 1:
        raise ValueError(f"{flag} and --nnodes={args.nnodes} cannot be combined (the tdist symmetric heap maps peers "
                         "over CUDA IPC, within one node); use --moe-a2a-backend nccl across nodes")
    if args.moe_a2a_backend == "tdist":
        require_package(flag, "triton", "pip install triton")
        require_package(flag, "sgl_kernel", SGL_KERNEL_INSTALL, "sgl-kernel (sgl_kernel.tdist)")
        if args.resolved_device != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(f"{flag} on CPU runs the Triton-distributed kernels under the Triton interpreter: set "
                             "TRITON_INTERPRET=1 in the server's environment (correctness runs only), or use "
                             "--moe-a2a-backend nccl")


def moe_a2a(args: Any, spec: Optional[MoeA2aSpec]) -> MoeA2aSpec:
    """The worker's :class:`MoeA2aSpec`: the backend, token scope ``tp_slice`` (TP attention), two buffer sets."""
    return MoeA2aSpec(backend=args.moe_a2a_backend, token_scope="tp_slice", max_inflight=2)


def notes(args: Any) -> list:
    """One plan note: the backend, the EP size and the token scope (``tp_slice`` under TP attention, ``local`` under
    ``--enable-dp-attention``, whose ``moe_a2a`` hook sets it)."""
    scope = ("DP attention: each DP rank dispatches its own requests' tokens (token scope local)"
             if args.enable_dp_attention else
             f"TP attention: each rank dispatches 1/{args.tp_size} of the tokens (token scope tp_slice)")
    return [f"moe a2a: {args.moe_a2a_backend} all-to-all over EP {args.ep_size} (each expert on one rank); "
            f"normal mode for prefill/mixed batches, low-latency for decode; {scope}"]


def check_model(args: Any) -> None:
    """Refuse a model without routed experts, or whose expert count is not a multiple of ``--ep-size`` (reads the
    model's config; ValueError naming the model and the fix)."""
    from sglang.srt.configs.model_config import ModelConfig

    mc = ModelConfig.from_path(args.model_path, args.context_length, args.dtype, args.resolved_device)
    n = mc.get("num_local_experts") or mc.get("num_experts")
    if not n:
        raise ValueError(f"--moe-a2a-backend {args.moe_a2a_backend}: {args.model_path} has no routed experts "
                         f"({mc.architecture}); use --moe-a2a-backend none for dense models")
    if int(n) % args.ep_size:
        raise ValueError(f"--moe-a2a-backend {args.moe_a2a_backend}: {n} experts of {args.model_path} do not split "
                         f"over --ep-size={args.ep_size}; use an EP size that divides {n}")
