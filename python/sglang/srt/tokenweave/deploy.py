"""TokenWeave's deployment surface (see :mod:`sglang.srt.deployment.techniques`): ``--enable-tokenweave`` gives every
scheduler worker the ``tokenweave`` executor (Gond et al. 2025, sec. 3.1.2) and TokenWeave's communicator choice;
``--comm-backend tw`` alone uses tw-comm's collectives without the executor."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from sglang.srt.deployment.plan import CommunicatorSpec, ExecutorSpec
from sglang.srt.deployment.techniques import SGL_KERNEL_INSTALL, require_package

NAME = "tokenweave"


def enabled(args: Any) -> bool:
    """``--enable-tokenweave`` or ``--comm-backend tw``."""
    return bool(args.enable_tokenweave) or args.comm_backend == "tw"


def validate(args: Any) -> None:
    """tw-comm's kernels live in ``sgl_kernel``. The combinations with ``--enable-tdist-overlap`` and
    ``--enable-afd`` are refused by ``ServerArgs`` (both flags named).

    Raises:
        MissingPackageError: ``sgl_kernel`` is not installed (naming ``--enable-tokenweave`` or ``--comm-backend tw``).
    """
    flag = "--enable-tokenweave" if args.enable_tokenweave else "--comm-backend tw"
    require_package(flag, "sgl_kernel", SGL_KERNEL_INSTALL, "sgl-kernel (tw-comm)")


def executor(args: Any) -> Optional[ExecutorSpec]:
    """The ``tokenweave`` executor with ``--tokenweave-min-tokens`` and the residual mode (``sharded_residual``:
    False with ``--tokenweave-full-residual``, else True, the default); None with ``--comm-backend tw`` alone."""
    if not args.enable_tokenweave:
        return None
    return ExecutorSpec.of("tokenweave", min_tokens=args.tokenweave_min_tokens, comm_sms=args.tokenweave_comm_sms,
                           sharded_residual=args.resolved_tokenweave_sharded_residual)


def communicator(args: Any, spec: CommunicatorSpec) -> CommunicatorSpec:
    """TokenWeave's choice of communicator (tw-comm when it can be built), its SM budget and the largest forward
    (sizes tw-comm's workspace)."""
    from sglang.srt.tokenweave import max_prefill_tokens_of

    return dataclasses.replace(spec, tokenweave=bool(args.enable_tokenweave), comm_sms=args.tokenweave_comm_sms,
                               max_tokens=max_prefill_tokens_of(args))


def make_executor(spec: ExecutorSpec, ctx: Any):
    """The :class:`~sglang.srt.tokenweave.executor.TokenWeaveExecutor` of ``spec`` for the worker of ``ctx`` (an
    :class:`~sglang.srt.model_executor.executors.registry.ExecutorContext`)."""
    from sglang.srt.tokenweave import create_tokenweave_executor

    opts = spec.opts()
    ex = create_tokenweave_executor(ctx.model_config, opts["min_tokens"], opts.get("comm_sms"), ctx.device,
                                    ctx.tp_size, sharded_residual=bool(opts.get("sharded_residual", True)))
    if ctx.model is not None:
        ex.check_model(ctx.model)  # fail at startup, not with wrong tokens (TokenWeaveExecutor.check_model)
    return ex
