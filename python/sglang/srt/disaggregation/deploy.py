"""PD disaggregation's deployment surface (KVDirect, Chen et al. 2024; see :mod:`sglang.srt.deployment.techniques`):
``--disaggregation-mode prefill|decode`` makes every scheduler worker a ``prefill`` or ``decode`` worker with the KV
connector of its side."""

from __future__ import annotations

from typing import Any

from sglang.srt.deployment.plan import ConnectorSpec, WorkerRole
from sglang.srt.deployment.techniques import NIXL_INSTALL, NIXL_MODULES, require_package

NAME = "pd"


def enabled(args: Any) -> bool:
    """``--disaggregation-mode`` is prefill or decode."""
    return args.disaggregation_mode != "null"


def validate(args: Any) -> None:
    """The nixl transfer backend needs NIXL (``fake`` needs nothing).

    Raises:
        MissingPackageError: ``--disaggregation-transfer-backend nixl`` without ``nixl``.
    """
    if args.disaggregation_transfer_backend == "nixl":
        require_package("--disaggregation-transfer-backend nixl", NIXL_MODULES, NIXL_INSTALL, "NIXL")


def role(args: Any) -> WorkerRole:
    """``prefill`` or ``decode``."""
    return WorkerRole(args.disaggregation_mode)


def connector(args: Any) -> ConnectorSpec:
    """The connector of this side: transport and transfer mode."""
    return ConnectorSpec(side=role(args), transfer_backend=args.disaggregation_transfer_backend,
                         transfer_mode=args.disaggregation_transfer_mode)


def make_connector(spec: ConnectorSpec, scheduler: Any):
    """The scheduler side of the connector of ``spec.side`` (prefill: publishes KV; decode: pulls or receives it)."""
    from sglang.srt.disaggregation.connector import create_connector

    return create_connector(scheduler)
