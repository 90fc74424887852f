"""Starting an AFD deployment with one launch: N_A attention workers (each ``--tp`` scheduler ranks, its own
requests: data parallel) and N_E FFN workers, all through a
:class:`~sglang.srt.entrypoints.worker_launcher.WorkerLauncher` (multiprocessing today, Ray for ``--use-ray``):
every entry point takes picklable arguments plus ``parent_watch``, so any launcher can place them.

Devices (GPU): attention worker a, TP rank r -> local index ``a * tp + r``; FFN worker j -> ``N_A * tp + j``
(``--base-gpu-id``/``--gpu-id-step``); ``--tp-ranks-share-gpu`` puts every worker on ``--base-gpu-id`` (the
one-GPU correctness mode of ``scripts/gpu/afd_one_gpu.sh``).
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing as mp
import os
from dataclasses import dataclass, field

from sglang.srt.afd.protocol import AfdTopology
from sglang.srt.entrypoints.worker_launcher import (
    WorkerLauncher,
    WorkerSpec,
    launch_scheduler_rank,
    worker_device,
    worker_resources,
)

logger = logging.getLogger(__name__)


@dataclass
class AfdWorkers:
    """What :func:`launch_afd_workers` started: scheduler handles/ranks/ready pipes (attention workers, in
    order), FFN handles and ready pipes, the topology and the front-end PortArgs (with the DP inputs)."""

    schedulers: list = field(default_factory=list)
    ranks: list = field(default_factory=list)
    pipes: list = field(default_factory=list)
    ffn: list = field(default_factory=list)
    ffn_pipes: list = field(default_factory=list)
    topo: AfdTopology = None
    port_args: object = None


def check_afd_model(server_args) -> None:
    """Refuse a dense model (ValueError naming it) and unsupported TP sizes before anything is spawned."""
    from sglang.srt.afd.executor import refuse_dense
    from sglang.srt.configs.model_config import ModelConfig

    mc = ModelConfig.from_path(server_args.model_path, server_args.context_length, server_args.dtype,
                               server_args.resolved_device)
    specs = refuse_dense(mc)
    if specs[0].num_experts % server_args.afd_ffn_workers:
        raise ValueError(f"--afd-ffn-workers={server_args.afd_ffn_workers} must divide the {specs[0].num_experts} "
                         "routed experts (static expert parallelism)")


def afd_topology(server_args, port_args) -> AfdTopology:
    """Control inboxes of every worker (IPC paths in the server's private directory, or TCP ports)."""
    n = server_args.afd_attention_workers + server_args.afd_ffn_workers
    if server_args.zmq_transport == "tcp" or not port_args.ipc_dir:
        from sglang.srt.utils.common import free_tcp_ports

        addrs = tuple(f"tcp://127.0.0.1:{p}" for p in free_tcp_ports(n, "127.0.0.1"))
    else:
        addrs = tuple(f"ipc://{os.path.join(port_args.ipc_dir, f'afd{i}')}" for i in range(n))
    transport = server_args.afd_transport
    if transport == "auto":
        transport = "cuda_ipc" if server_args.resolved_device == "cuda" else "inline"
    return AfdTopology(server_args.afd_attention_workers, server_args.afd_ffn_workers, addrs,
                       max_rows=max(server_args.afd_max_tokens, 1024), transport=transport,
                       timeout_s=server_args.afd_timeout_s)


def launch_afd_workers(server_args, port_args, launcher: WorkerLauncher, free_port, signal_parent_on_crash: bool
                       ) -> AfdWorkers:
    """Start every FFN worker and every attention worker's scheduler ranks; returns at once (the caller waits for
    the ready pipes). ``free_port()``: a free local TCP port (each attention worker's TP rendezvous)."""
    from sglang.srt.afd.ffn_worker import run_ffn_worker
    from sglang.srt.distributed.parallel_state import dist_init_method

    out = AfdWorkers()
    topo = out.topo = afd_topology(server_args, port_args)
    tp = server_args.tp_size
    dev_type = server_args.resolved_device
    share = server_args.tp_ranks_share_gpu

    def device(local: int) -> str:
        return worker_device(dev_type, 0 if share else local, server_args.base_gpu_id, server_args.gpu_id_step)

    ctx = mp.get_context("spawn")
    for j in range(topo.num_ffn):
        reader, writer = ctx.Pipe(duplex=False)
        dev = device(topo.num_attention * tp + j)
        out.ffn.append(launcher.launch(WorkerSpec(
            name=f"sglang::ffn{j}", target=run_ffn_worker, args=(server_args, topo, j, dev, writer), role="ffn",
            rank=j, device=dev, resources=worker_resources(dev_type))))
        out.ffn_pipes.append((j, reader))
    inputs = []
    for a in range(topo.num_attention):
        pa = port_args
        if topo.num_attention > 1:
            pa = dataclasses.replace(port_args, scheduler_input_ipc=f"{port_args.scheduler_input_ipc}-dp{a}")
            inputs.append(pa.scheduler_input_ipc)
        init = dist_init_method(None, free_port()) if tp > 1 else None
        for r in range(tp):
            handle, reader = launch_scheduler_rank(
                launcher, server_args, pa, name=f"sglang::attention{a}" + (f"_TP{r}" if tp > 1 else ""), tp_rank=r,
                device=device(a * tp + r), init=init, role="attention", spec_rank=a * tp + r, afd=(topo, a),
                signal_parent_on_crash=signal_parent_on_crash)
            out.schedulers.append(handle)
            out.ranks.append(a * tp + r)
            out.pipes.append((a * tp + r, reader))
    out.port_args = dataclasses.replace(port_args, dp_scheduler_inputs=tuple(inputs)) if inputs else port_args
    logger.info("AFD: %d attention worker(s) x TP %d, %d FFN worker(s), m=%d, M2N transport %s",
                topo.num_attention, tp, topo.num_ffn, server_args.afd_micro_batches, topo.transport)
    return out
