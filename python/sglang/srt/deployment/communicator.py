"""Building a worker's TP communicator from its :class:`~sglang.srt.deployment.plan.CommunicatorSpec`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from sglang.srt.deployment.plan import CommunicatorSpec

if TYPE_CHECKING:
    from sglang.srt.server_args import ServerArgs


def make_communicator(spec: CommunicatorSpec, parallel_state: Any, hidden_size: Optional[int] = None):
    """This rank's :class:`~sglang.srt.distributed.communicator.Communicator` (the choice is logged): with
    ``spec.tokenweave`` and backend ``auto``, the plain communicator for unsplit calls composed with tw-comm's for the
    split halves (:class:`~sglang.srt.distributed.tw_communicator.TokenWeaveCommunicator`), tw-comm alone with
    ``tw``, the plain one when tw-comm cannot be built (:func:`~sglang.srt.tokenweave.create_tokenweave_communicator`);
    else :func:`~sglang.srt.distributed.communicator.create_communicator` of ``spec.backend``.

    Args:
        spec: the worker's communicator spec.
        parallel_state: the rank's ParallelState (None: a single rank).
        hidden_size: the model's hidden size; with ``spec.max_tokens`` it sizes tw-comm's workspace for the
            largest prefill (TokenWeave), so overlapped calls never fall back to NCCL.
    Raises:
        ValueError: an unknown backend name.
    """
    if spec.tokenweave:
        from sglang.srt.tokenweave import create_tokenweave_communicator

        return create_tokenweave_communicator(parallel_state, spec.backend, spec.comm_sms,
                                              spec.disable_custom_all_reduce, spec.max_tokens, hidden_size)
    from sglang.srt.distributed.communicator import create_communicator

    return create_communicator(parallel_state, spec.backend, spec.disable_custom_all_reduce)


def build_communicator(parallel_state: Any, server_args: "ServerArgs", backend: Optional[str] = None,
                       hidden_size: Optional[int] = None):
    """The communicator a worker built from ``server_args`` uses (benchmarks, ``bench_one_batch``, tests): the plan's
    :class:`CommunicatorSpec`; ``backend`` overrides ``--comm-backend`` and TokenWeave's choice; ``hidden_size``: see
    :func:`make_communicator`."""
    import dataclasses

    from sglang.srt.deployment.compose import worker_template

    spec = worker_template(server_args).communicator
    if backend is not None:
        spec = dataclasses.replace(spec, backend=backend, tokenweave=False)
    return make_communicator(spec, parallel_state, hidden_size)
