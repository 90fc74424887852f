"""Ray's deployment surface (see :mod:`sglang.srt.deployment.techniques`): ``--use-ray`` places every worker of the
plan (all node slices, one launcher) as a Ray actor. Importing this module never imports ``ray``."""

from __future__ import annotations

import dataclasses
from typing import Any

from sglang.srt.deployment.plan import WorkerSpec
from sglang.srt.deployment.techniques import require_package

NAME = "ray"
RAY_INSTALL = "pip install 'sglang[ray]' (from a checkout: pip install './python[ray]')"


def enabled(args: Any) -> bool:
    """``--use-ray``."""
    return bool(args.use_ray)


def validate(args: Any) -> None:
    """Ray must be installed; one launcher places every node, so ``--node-rank`` must stay 0.

    Raises:
        ValueError: ``--node-rank`` set (both flags named).
        MissingPackageError: ``ray`` is not installed.
    """
    if args.node_rank != 0:
        raise ValueError(f"--node-rank={args.node_rank} is invalid with --use-ray: one launcher places every node; "
                         "drop --node-rank (and --dist-init-addr)")
    require_package("--use-ray", "ray", RAY_INSTALL, "Ray")


def resources(args: Any) -> dict:
    """What one worker reserves: ``--ray-cpus-per-worker`` CPUs, on CUDA ``--ray-gpus-per-worker`` GPUs, plus the
    custom resources of ``--ray-worker-resources`` (which pin an instance to the nodes that offer them)."""
    res = {"CPU": float(args.ray_cpus_per_worker), **args.ray_extra_resources()}
    if args.resolved_device == "cuda":
        res["GPU"] = float(args.ray_gpus_per_worker)
    return res


def workers(args: Any, base: WorkerSpec) -> list:
    """Every worker of every node slice; each actor sees only the GPU Ray assigned to it (``cuda:0``). AFD: the
    attention and FFN workers of :func:`sglang.srt.afd.deploy.workers`; else ``--tp`` ranks in ``--nnodes`` slices."""
    device = "cuda:0" if args.resolved_device == "cuda" else "cpu"
    base = dataclasses.replace(base, resources=resources(args), device=device)
    if args.enable_afd:
        from sglang.srt.afd import deploy as afd

        return afd.workers(args, base, device=lambda slot: device)
    tp, per_node = args.tp_size, args.tp_size // args.nnodes
    return [dataclasses.replace(base, name=f"sglang::scheduler_TP{r}" if tp > 1 else "sglang::scheduler", rank=r,
                                index=r, node=r // per_node, local_index=r % per_node) for r in range(tp)]
