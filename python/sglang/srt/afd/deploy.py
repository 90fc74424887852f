"""MegaScale-Infer's deployment surface (Zhu et al. 2025, sec. 3; see :mod:`sglang.srt.deployment.techniques`):
``--enable-afd`` plans N_A attention workers (each ``--tp`` scheduler ranks with the ``afd`` ping-pong executor,
data parallel) and N_E FFN workers (routed experts), and owns the one rule that resolves ``--afd-transport auto``.

Devices (multiprocessing, GPU): attention worker a, TP rank r -> device slot ``a * tp + r``; FFN worker j ->
``N_A * tp + j`` (``--base-gpu-id``/``--gpu-id-step``); ``--tp-ranks-share-gpu`` puts every worker on
``--base-gpu-id``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any, Callable, Optional

from sglang.srt.deployment.plan import ExecutorSpec, WorkerRole, WorkerSpec
from sglang.srt.deployment.techniques import NIXL_INSTALL, NIXL_MODULES, SGL_KERNEL_INSTALL, require_package

logger = logging.getLogger(__name__)

NAME = "afd"
STAY_UP_ON_WORKER_DEATH = True  # an FFN worker's death fails in-flight requests (503), the server stays up


def enabled(args: Any) -> bool:
    """``--enable-afd``."""
    return bool(args.enable_afd)


def validate(args: Any) -> None:
    """The M2N library lives in ``sgl_kernel``; ``--afd-transport nixl`` needs NIXL; PD disaggregation cannot be
    combined (the flag-level checks are ``ServerArgs``').

    Raises:
        ValueError: ``--disaggregation-mode`` too (both flags named).
        MissingPackageError: ``sgl_kernel`` (or, for the nixl transport, ``nixl``) is not installed.
    """
    if args.disaggregation_mode != "null":
        raise ValueError(f"--enable-afd and --disaggregation-mode={args.disaggregation_mode} cannot be combined "
                         "(attention/FFN and prefill/decode disaggregation are separate deployments); drop one")
    require_package("--enable-afd", "sgl_kernel", SGL_KERNEL_INSTALL, "sgl-kernel (the M2N library)")
    if args.afd_transport == "nixl":
        require_package("--afd-transport nixl", NIXL_MODULES, NIXL_INSTALL, "NIXL")


def role(args: Any) -> WorkerRole:
    """Scheduler workers are attention workers."""
    return WorkerRole.ATTENTION


def executor(args: Any) -> ExecutorSpec:
    """The ``afd`` executor: ``--afd-micro-batches`` m, expert redundancy and rebalancing."""
    return ExecutorSpec.of("afd", micro_batches=args.afd_micro_batches, redundant_experts=args.afd_redundant_experts,
                           rebalance_interval=args.afd_rebalance_interval)


def transport(args: Any, one_node: bool) -> str:
    """``--afd-transport``, with ``auto`` resolved by the one rule: ``inline`` (ZMQ) on CPU; on GPU ``cuda_ipc`` when
    every worker shares one node, ``nccl`` across nodes.

    ``cuda_push`` / ``cuda_push_ll`` (device-driven; flag / low-latency protocol) are explicit-only: AFD's host
    path sends its messages with the ZMQ header, and on that path ``cuda_push`` measured slower than ``cuda_ipc``
    (2 x H200, 2026-11-26, one-way 390-531 vs 252-395 us at 32-512 KB,
    ``benchmark/results/archive/afd/2026-11-26_m2n_device_push_2xh200.md``); their host-free path is AFD's device-driven
    steps (``sglang.srt.afd.device_m2n``), not yet measured end to end against ``cuda_ipc`` in a server."""
    if args.afd_transport != "auto":
        return args.afd_transport
    if args.resolved_device != "cuda":
        return "inline"
    return "cuda_ipc" if one_node else "nccl"


def notes(args: Any) -> list:
    """The resolved transport for the plan table (Ray: known once placed unless ``--ray-spread-roles``)."""
    if args.use_ray and not args.ray_spread_roles and args.afd_transport == "auto" and args.resolved_device == "cuda":
        return ["afd transport: auto -> cuda_ipc if Ray places every worker on one node, else nccl"]
    one_node = not (args.use_ray and args.ray_spread_roles)
    return [f"afd transport: {args.afd_transport} -> {transport(args, one_node)}; m={args.afd_micro_batches}"]


def workers(args: Any, base: WorkerSpec, device: Optional[Callable[[int], str]] = None) -> list:
    """Attention workers (N_A groups x ``--tp`` ranks), then FFN workers; ``device(slot)`` places each (default: this
    node's device slots)."""
    from sglang.srt.deployment.compose import place

    device = device or (lambda slot: place(args, slot))
    tp, n_a = args.tp_size, args.afd_attention_workers
    out = []
    for a in range(n_a):
        for r in range(tp):
            out.append(dataclasses.replace(base, name=f"sglang::attention{a}" + (f"_TP{r}" if tp > 1 else ""),
                                           group=a, rank=r, index=a * tp + r, local_index=a * tp + r,
                                           device=device(a * tp + r)))
    for j in range(args.afd_ffn_workers):
        slot = n_a * tp + j
        out.append(dataclasses.replace(base, role=WorkerRole.FFN, name=f"sglang::ffn{j}", group=0, rank=j, tp_size=1,
                                       index=slot, local_index=slot, device=device(slot),
                                       executor=ExecutorSpec("ffn_server"), connector=None))
    return out


def topology(args: Any, addresses: tuple, one_node: bool):
    """The :class:`~sglang.srt.afd.protocol.AfdTopology` (logged): ``addresses`` = the N_A + N_E M2N control
    inboxes; ``one_node``: every worker shares a node (decides ``--afd-transport auto``)."""
    from sglang.srt.afd.protocol import AfdTopology

    topo = AfdTopology(args.afd_attention_workers, args.afd_ffn_workers, tuple(addresses),
                       max_rows=max(args.afd_max_tokens, 1024), transport=transport(args, one_node),
                       timeout_s=args.afd_timeout_s)
    logger.info("AFD: %d attention worker(s) x TP %d, %d FFN worker(s), m=%d, M2N transport %s", topo.num_attention,
                args.tp_size, topo.num_ffn, args.afd_micro_batches, topo.transport)
    return topo


def local_inboxes(args: Any, port_args: Any) -> tuple:
    """M2N control inboxes on this node: IPC paths in the server's private directory, or TCP ports."""
    n = args.afd_attention_workers + args.afd_ffn_workers
    if args.zmq_transport == "tcp" or not port_args.ipc_dir:
        from sglang.srt.utils.common import free_tcp_ports

        return tuple(f"tcp://127.0.0.1:{p}" for p in free_tcp_ports(n, "127.0.0.1"))
    return tuple(f"ipc://{os.path.join(port_args.ipc_dir, f'afd{i}')}" for i in range(n))


def check_model(args: Any) -> None:
    """Refuse a dense model (ValueError naming it) and more FFN workers than routed experts (uneven blocks are fine),
    before anything is spawned (reads the model's config)."""
    from sglang.srt.afd.executor import refuse_dense
    from sglang.srt.configs.model_config import ModelConfig

    mc = ModelConfig.from_path(args.model_path, args.context_length, args.dtype, args.resolved_device)
    specs = refuse_dense(mc)
    if args.afd_ffn_workers > specs[0].num_experts:
        raise ValueError(f"--afd-ffn-workers={args.afd_ffn_workers} exceeds the {specs[0].num_experts} routed "
                         "experts (static expert parallelism: every FFN worker holds at least one)")


def make_executor(spec: ExecutorSpec, ctx: Any):
    """The :class:`~sglang.srt.afd.executor.AfdExecutor` of attention worker ``ctx.worker.group``, TP rank
    ``ctx.worker.rank``, over the topology the launcher wired (``ctx.worker.wiring.afd_topology``)."""
    from sglang.srt.afd.executor import AfdExecutor

    w, opts = ctx.worker, spec.opts()
    return AfdExecutor(ctx.model_config, w.wiring.afd_topology, w.group, opts["micro_batches"], ctx.device, w.rank,
                       alive=ctx.alive, redundant_experts=opts["redundant_experts"],
                       rebalance_interval=opts["rebalance_interval"])
