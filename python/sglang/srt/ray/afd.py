"""``--use-ray --enable-afd``: MegaScale-Infer attention and FFN workers as Ray actors.

Role groups (:mod:`sglang.srt.ray.placement`): one per attention worker ``attention<a>`` (its ``--tp`` ranks in
one bundle: STRICT_PACK inside the TP group; the detokenizer's CPU joins attention 0's bundle) and one ``ffn``
pool (every FFN worker in one bundle, one node). ``--ray-spread-roles`` puts all of them in one STRICT_SPREAD
placement group, so attention and FFN workers land on distinct nodes ("attention on A, FFN on B").

Wiring: each actor reports its node IP and free ports; the M2N control inbox of attention worker ``a`` (its TP
rank 0) and of FFN worker ``j`` are ``tcp://<its node IP>:<port>``, each attention worker's scheduler input and TP
rendezvous are on its rank 0's node, the detokenizer beside attention 0. The M2N transport ``auto`` is ``inline``
(ZMQ) on CPU; on GPU it is ``cuda_ipc`` when every worker shares one node and ``nccl`` otherwise.
"""

from __future__ import annotations

import dataclasses

import ray

from sglang.srt.entrypoints.launch import Subprocesses
from sglang.srt.entrypoints.worker_launcher import WorkerSpec, detokenizer_spec
from sglang.srt.ray.launcher import READY_CHANNEL, ActorRequest, RayLauncher
from sglang.srt.ray.placement import RoleGroup, plan_placement
from sglang.srt.server_args import PortArgs, ServerArgs


def launch_afd_actors(server_args: ServerArgs, launcher: RayLauncher, res: dict) -> tuple[Subprocesses, list]:
    """Place and start every attention rank, FFN worker and the detokenizer; returns the :class:`Subprocesses`
    (not yet ready: the caller waits on the rank and FFN handles; ``scheduler_info`` holds ``afd_ray_nodes``) and
    the node info of every scheduler rank in order (attention 0's ranks first).

    Raises:
        RuntimeError: not placeable, or an actor did not start.
    """
    from sglang.srt.afd.ffn_worker import run_ffn_worker
    from sglang.srt.afd.protocol import AfdTopology
    from sglang.srt.managers.scheduler_process import run_scheduler_process
    from sglang.srt.utils.common import free_tcp_ports

    tp, n_a, n_e = server_args.tp_size, server_args.afd_attention_workers, server_args.afd_ffn_workers
    groups = [RoleGroup(f"attention{a}", tp, 1, res, extra={"CPU": 1.0} if a == 0 else {}) for a in range(n_a)]
    groups.append(RoleGroup("ffn", n_e, 1, res))
    launcher.reserve(plan_placement(groups, spread_roles=server_args.ray_spread_roles),
                     server_args.ray_placement_timeout)
    launcher.add_slot(("detokenizer", 0), ("attention0", 0))
    reqs = [ActorRequest(f"attention{a}", r, f"sglang::attention{a}" + (f"_TP{r}" if tp > 1 else ""), res,
                         n_ports=3 if r == 0 else 0) for a in range(n_a) for r in range(tp)]
    reqs += [ActorRequest("ffn", j, f"sglang::ffn{j}", res, n_ports=1) for j in range(n_e)]
    reqs.append(ActorRequest("detokenizer", 0, "sglang::detokenizer", {"CPU": 1.0}, n_ports=1))
    infos = launcher.create_actors(reqs)
    att = [infos[a * tp:(a + 1) * tp] for a in range(n_a)]
    ffn, detok = infos[n_a * tp:n_a * tp + n_e], infos[-1]

    transport = server_args.afd_transport
    if transport == "auto":
        one_node = len({i["node_id"] for i in infos}) == 1
        transport = "inline" if server_args.resolved_device != "cuda" else ("cuda_ipc" if one_node else "nccl")
    addrs = tuple(f"tcp://{a[0]['ip']}:{a[0]['ports'][2]}" for a in att) + tuple(
        f"tcp://{f['ip']}:{f['ports'][0]}" for f in ffn)
    topo = AfdTopology(n_a, n_e, addrs, max_rows=max(server_args.afd_max_tokens, 1024), transport=transport,
                       timeout_s=server_args.afd_timeout_s)
    driver_ip = ray.util.get_node_ip_address()
    inputs = tuple(f"tcp://{a[0]['ip']}:{a[0]['ports'][0]}" for a in att)
    port_args = PortArgs(tokenizer_ipc=f"tcp://{driver_ip}:{free_tcp_ports(1, driver_ip)[0]}",
                         scheduler_input_ipc=inputs[0], detokenizer_ipc=f"tcp://{detok['ip']}:{detok['ports'][0]}",
                         dp_scheduler_inputs=inputs if n_a > 1 else ())
    device = "cuda:0" if res.get("GPU") else "cpu"  # each actor sees only the GPU Ray assigned to it
    ffn_handles = [launcher.launch(WorkerSpec(
        name=f"sglang::ffn{j}", target=run_ffn_worker,
        args=(server_args.replace(host=ffn[j]["ip"]), topo, j, device, READY_CHANNEL),
        role="ffn", rank=j, device=device, resources=res)) for j in range(n_e)]
    scheds, ranks = [], []
    for a in range(n_a):
        pa = dataclasses.replace(port_args, scheduler_input_ipc=inputs[a])
        init = f"tcp://{att[a][0]['ip']}:{att[a][0]['ports'][1]}" if tp > 1 else None
        for r in range(tp):
            args = server_args.replace(host=att[a][r]["ip"],
                                       dist_init_addr=init[len("tcp://"):] if init else None)
            scheds.append(launcher.launch(WorkerSpec(
                name=reqs[a * tp + r].name, target=run_scheduler_process,
                args=(args, pa, READY_CHANNEL, None, r, init, False, device, (topo, a)),
                role=f"attention{a}", rank=r, device=device, resources=res)))
            ranks.append(a * tp + r)
    detok_h = launcher.launch(detokenizer_spec(server_args, port_args))
    procs = Subprocesses(scheds[0], detok_h, {}, schedulers=scheds, tp_ranks=ranks, launcher=launcher,
                         ffn_workers=ffn_handles, port_args=port_args)
    node_infos = [i for a in att for i in a]
    procs.scheduler_info = {"afd_ray_nodes": {
        "attention": [{"ip": i["ip"], "node_id": i["node_id"], "gpu_ids": i["gpu_ids"]} for i in node_infos],
        "ffn": [{"ip": f["ip"], "node_id": f["node_id"], "gpu_ids": f["gpu_ids"]} for f in ffn],
        "transport": transport}}
    return procs, node_infos
