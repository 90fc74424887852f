"""The deployment plan: which processes start where, with which executor, communicator and connector.

``plan_deployment(server_args)`` (:mod:`.compose`) returns a frozen :class:`DeploymentPlan` of
:class:`WorkerSpec` s (:mod:`.plan`); the launchers (``entrypoints/launch.py``, ``ray/launch.py``) only carry it
out, and each worker process builds what its spec names. ``render_plan`` prints it (``--dry-run``).
"""

from sglang.srt.deployment.compose import plan_deployment, single_worker_spec, validate, worker_device
from sglang.srt.deployment.plan import (
    CommunicatorSpec,
    ConnectorSpec,
    DeploymentPlan,
    ExecutorSpec,
    WorkerRole,
    WorkerSpec,
    Wiring,
)
from sglang.srt.deployment.render import render_plan
from sglang.srt.deployment.techniques import MissingPackageError

__all__ = ["CommunicatorSpec", "ConnectorSpec", "DeploymentPlan", "ExecutorSpec", "MissingPackageError",
           "WorkerRole", "WorkerSpec", "Wiring", "plan_deployment", "render_plan", "single_worker_spec", "validate",
           "worker_device"]
