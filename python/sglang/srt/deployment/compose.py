"""``plan_deployment(server_args)``: compose the technique packages into one :class:`DeploymentPlan`.

Order: every enabled technique validates the flags (combinations name both flags; missing optional packages name
the flag and the install command), then the worker template is resolved (role, executor, communicator, connector:
each asked of the technique that owns it), then the technique that shapes the deployment (AFD: attention and FFN
workers; Ray: every node slice) lists the workers; otherwise one worker per TP rank of this node.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Optional

from sglang.srt.deployment.plan import (
    CommunicatorSpec,
    DeploymentPlan,
    ExecutorSpec,
    WorkerRole,
    WorkerSpec,
)
from sglang.srt.deployment.techniques import enabled_techniques

if TYPE_CHECKING:
    from sglang.srt.server_args import ServerArgs


def validate(args: "ServerArgs") -> list:
    """Run every enabled technique's ``validate(args)``; returns the enabled technique modules.

    Raises:
        ValueError: a bad combination (naming both flags).
        MissingPackageError: a flag's optional package is not installed (naming the flag and the install command).
    """
    mods = enabled_techniques(args)
    for m in mods:
        m.validate(args)
    return mods


def worker_resources(device_type: str) -> dict:
    """What a placement-aware launcher reserves for one model worker: one CPU, and one GPU on ``cuda``."""
    return {"CPU": 1.0, **({"GPU": 1.0} if device_type == "cuda" else {})}


def worker_device(device_type: str, local_index: int, base_gpu_id: int = 0, gpu_id_step: int = 1) -> str:
    """The explicit device of the ``local_index``-th worker on this node: ``cuda:<base + index*step>`` on GPU
    (SGLang's ``--base-gpu-id`` / ``--gpu-id-step``), ``cpu`` otherwise.

    Raises:
        ValueError: a negative index, base or non-positive step.
    """
    if local_index < 0 or base_gpu_id < 0 or gpu_id_step < 1:
        raise ValueError(f"worker_device: local_index={local_index}, base_gpu_id={base_gpu_id} must be >= 0 and "
                         f"gpu_id_step={gpu_id_step} >= 1")
    if device_type != "cuda":
        return "cpu"
    return f"cuda:{base_gpu_id + local_index * gpu_id_step}"


def place(args: "ServerArgs", local_index: int) -> str:
    """The device of device slot ``local_index`` on this node (``--tp-ranks-share-gpu``: every worker on
    ``--base-gpu-id``)."""
    return worker_device(args.resolved_device, 0 if args.tp_ranks_share_gpu else local_index, args.base_gpu_id,
                         args.gpu_id_step)


def worker_template(args: "ServerArgs", mods: Optional[list] = None) -> WorkerSpec:
    """The spec every scheduler worker shares before placement: role, executor, communicator, connector and MoE
    all-to-all, each from the technique that owns it (the defaults: aggregated, sequential, ``--comm-backend``, no
    connector, all-reduce EP). ``moe_a2a(args, current)`` hooks run in technique order, each seeing the previous
    one's spec (e.g. DP attention turns the token scope to ``local``)."""
    mods = enabled_techniques(args) if mods is None else mods
    role, executor, connector, moe_a2a = WorkerRole.AGGREGATED, ExecutorSpec(), None, None
    comm = CommunicatorSpec(backend=args.comm_backend, disable_custom_all_reduce=args.disable_custom_all_reduce)
    for m in mods:  # a hook that returns None has no opinion
        role = (m.role(args) if hasattr(m, "role") else None) or role
        executor = (m.executor(args) if hasattr(m, "executor") else None) or executor
        comm = m.communicator(args, comm) if hasattr(m, "communicator") else comm
        connector = (m.connector(args) if hasattr(m, "connector") else None) or connector
        moe_a2a = m.moe_a2a(args, moe_a2a) if hasattr(m, "moe_a2a") else moe_a2a
    return WorkerSpec(role=role, name="sglang::scheduler", tp_size=args.tp_size, executor=executor,
                      communicator=comm, connector=connector, moe_a2a=moe_a2a,
                      resources=worker_resources(args.resolved_device), args=args)


def single_worker_spec(args: "ServerArgs", role: Optional[WorkerRole] = None) -> WorkerSpec:
    """The spec of a worker built directly from ``args`` (tests, benchmarks, ``bench_one_batch``): the plan's
    template, with ``role`` when given. No validation of optional packages."""
    spec = worker_template(args)
    return dataclasses.replace(spec, role=role) if role is not None else spec


def tp_workers(args: "ServerArgs", base: WorkerSpec) -> list:
    """One worker per TP rank of this node (multiprocessing; ``--nnodes N``: ranks ``node_rank * tp/N ...``)."""
    tp, per_node = args.tp_size, args.tp_size // args.nnodes
    out = []
    for local, rank in enumerate(range(args.node_rank * per_node, (args.node_rank + 1) * per_node)):
        name = f"sglang::scheduler_TP{rank}" if tp > 1 else "sglang::scheduler"
        out.append(dataclasses.replace(base, name=name, rank=rank, index=local, node=args.node_rank,
                                       local_index=local, device=place(args, local)))
    return out


def plan_deployment(args: "ServerArgs") -> DeploymentPlan:
    """Every process this launch starts (see the module docstring). Reads no model files and starts nothing.

    Raises:
        ValueError / MissingPackageError: see :func:`validate`.
    """
    mods = validate(args)
    base = worker_template(args, mods)
    shaper = next((m for m in reversed(mods) if hasattr(m, "workers")), None)  # dp attention, else ray, else afd
    workers = shaper.workers(args, base) if shaper is not None else tp_workers(args, base)
    uses_ray = any(m.NAME == "ray" for m in mods)
    notes = tuple(n for m in mods if hasattr(m, "notes") for n in m.notes(args))
    return DeploymentPlan(
        workers=tuple(workers), launcher="ray" if uses_ray else "multiprocessing",
        techniques=tuple(m.NAME for m in mods), detokenizer=uses_ray or args.node_rank == 0,
        zmq_transport="tcp" if uses_ray else args.zmq_transport, node_rank=0 if uses_ray else args.node_rank,
        nnodes=args.nnodes, notes=notes, stay_up_on_worker_death=any(getattr(m, "STAY_UP_ON_WORKER_DEATH", False)
                                                                    for m in mods))


# techniques that cannot run quantized weights yet: flag -> why
NO_QUANTIZED_WEIGHTS = {
    "enable_afd": "its FFN workers load the experts in the model dtype",
    "enable_tdist_overlap": "its fused AG-GEMM / GEMM-RS kernels take model-dtype weights",
}


def check_model(args: "ServerArgs") -> None:
    """Every enabled technique's model check (e.g. AFD refuses a dense model), before anything is spawned; reads the
    model's config. A technique of :data:`NO_QUANTIZED_WEIGHTS` with quantized weights (``--quantization`` or the
    checkpoint's ``quantization_config``) is refused. Raises ValueError naming the model / flag and the fix."""
    for m in enabled_techniques(args):
        if hasattr(m, "check_model"):
            m.check_model(args)
    flags = [f for f in NO_QUANTIZED_WEIGHTS if getattr(args, f, False)]
    if flags:
        from sglang.srt.layers.quantization import quant_config_of

        quant = quant_config_of(args)
        if quant is not None:
            flag = flags[0]
            raise ValueError(f"--{flag.replace('_', '-')} does not support quantized weights ({quant.describe()}) "
                             f"yet: {NO_QUANTIZED_WEIGHTS[flag]}; drop --quantization or serve a model-dtype "
                             "checkpoint")
