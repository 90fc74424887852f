"""``--use-ray`` startup: place, create and start the server's workers as Ray actors.

Called by :func:`sglang.srt.entrypoints.launch.launch_subprocesses` instead of the ``spawn`` path. The driver
(this process: HTTP + TokenizerManager, or the user's ``sgl.Engine``) connects to the Ray cluster at
``--ray-address`` (default ``auto``: the running cluster, e.g. inside ``ray job submit``), reserves one placement
group per role group (:mod:`sglang.srt.ray.placement`), starts one actor per TP rank plus the detokenizer (in
rank 0's bundle), then wires them with TCP sockets on the IPs Ray reports: the TokenizerManager binds on the
driver's node, the scheduler input and detokenizer on rank 0's node, and the TP rendezvous is rank 0's node.
``--nnodes N`` splits the TP group into N node slices on N distinct nodes (no ``--node-rank`` /
``--dist-init-addr``: Ray places every slice).
"""

from __future__ import annotations

import atexit
import logging
import time

import ray
from ray.exceptions import RayActorError, RayError

from sglang.srt.entrypoints.launch import STARTUP_TIMEOUT_S, Subprocesses
from sglang.srt.entrypoints.worker_launcher import WorkerSpec, detokenizer_spec
from sglang.srt.ray.launcher import READY_CHANNEL, ActorRequest, RayLauncher
from sglang.srt.ray.placement import RoleGroup, plan_placement
from sglang.srt.server_args import PortArgs, ServerArgs

logger = logging.getLogger(__name__)


def connect(address: str) -> bool:
    """``ray.init`` at ``address`` unless already connected; True when this call connected.

    Raises:
        RuntimeError: no cluster there (the message says how to start one).
    """
    if ray.is_initialized():
        return False
    try:
        ray.init(address=address, log_to_driver=True, logging_level=logging.WARNING)
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise RuntimeError(f"--use-ray: no Ray cluster at --ray-address={address!r} ({e}); start one with "
                           f"`ray start --head` (and `ray start --address HEAD:6379` on other nodes) or run "
                           f"under `ray job submit`") from e
    return True


def worker_resources(server_args: ServerArgs) -> dict:
    """What one TP rank reserves: ``--ray-cpus-per-worker`` CPUs, on CUDA ``--ray-gpus-per-worker`` GPUs, plus the
    custom resources of ``--ray-worker-resources`` (which pin an instance to the nodes that offer them)."""
    res = {"CPU": float(server_args.ray_cpus_per_worker), **server_args.ray_extra_resources()}
    if server_args.resolved_device == "cuda":
        res["GPU"] = float(server_args.ray_gpus_per_worker)
    return res


def launch_ray_workers(server_args: ServerArgs, in_process_engine: bool = False) -> Subprocesses:
    """Start every TP rank and the detokenizer as Ray actors and wait until all ranks are ready.

    Returns:
        the :class:`Subprocesses` whose ``port_args`` the TokenizerManager must use (TCP endpoints on the
        nodes Ray chose) and whose ``launcher`` owns the actors and placement groups.
    Raises:
        RuntimeError: no cluster, resources not placeable, or a rank failed/died during startup.
    """
    if server_args.node_rank != 0:
        raise ValueError(f"--node-rank={server_args.node_rank} is invalid with --use-ray: one launcher places every "
                         f"node; drop --node-rank (and --dist-init-addr)")
    launcher = RayLauncher(server_args.log_level, owns_connection=connect(server_args.ray_address))
    try:
        procs = _launch(server_args, launcher)
    except BaseException:
        launcher.close()
        raise
    atexit.register(procs.shutdown)
    return procs


def _launch(server_args: ServerArgs, launcher: RayLauncher) -> Subprocesses:
    """Plan and reserve the placement, create the actors, wire their TCP endpoints, start the entry points and
    wait until every rank is ready (see :func:`launch_ray_workers`)."""
    from sglang.srt.managers.scheduler_process import run_scheduler_process
    from sglang.srt.utils.common import free_tcp_ports

    tp, nnodes = server_args.tp_size, server_args.nnodes
    res = worker_resources(server_args)
    if server_args.enable_afd:
        from sglang.srt.ray.afd import launch_afd_actors

        procs, node_infos = launch_afd_actors(server_args, launcher, res)
        info = _wait_ready(launcher, procs.schedulers + procs.ffn_workers, STARTUP_TIMEOUT_S)
        return _finish(server_args, procs, info, node_infos)
    group = RoleGroup("scheduler", tp, nnodes, res, extra={"CPU": 1.0})
    launcher.reserve(plan_placement([group], spread_roles=server_args.ray_spread_roles),
                     server_args.ray_placement_timeout)
    launcher.add_slot(("detokenizer", 0), ("scheduler", 0))
    names = [f"sglang::scheduler_TP{rank}" if tp > 1 else "sglang::scheduler" for rank in range(tp)]
    *sched_infos, detok_info = launcher.create_actors(
        [ActorRequest("scheduler", r, names[r], res, n_ports=2 if r == 0 else 0) for r in range(tp)]
        + [ActorRequest("detokenizer", 0, "sglang::detokenizer", {"CPU": 1.0}, n_ports=1)])
    infos = dict(enumerate(sched_infos))
    driver_ip = ray.util.get_node_ip_address()
    ip0 = infos[0]["ip"]
    sched_port, dist_port = infos[0]["ports"]
    port_args = PortArgs(tokenizer_ipc=f"tcp://{driver_ip}:{free_tcp_ports(1, driver_ip)[0]}",
                         scheduler_input_ipc=f"tcp://{ip0}:{sched_port}",
                         detokenizer_ipc=f"tcp://{detok_info['ip']}:{detok_info['ports'][0]}")
    init = f"tcp://{ip0}:{dist_port}" if tp > 1 else None
    handles = []
    for rank in range(tp):
        node_slice = group.slice_of(rank)
        # host: worker-side sockets (PD bootstrap server and KV transfer agents) bind the IP Ray knows the node by
        args = server_args.replace(node_rank=node_slice, dist_init_addr=f"{ip0}:{dist_port}" if tp > 1 else None,
                                   host=infos[rank]["ip"])
        device = "cuda:0" if res.get("GPU") else "cpu"  # the actor's CUDA_VISIBLE_DEVICES is Ray's assignment
        spec = WorkerSpec(name=names[rank],
                          target=run_scheduler_process,
                          args=(args, port_args, READY_CHANNEL, None, rank, init, False, device),
                          role="scheduler", rank=rank, device=device, resources=res)
        handles.append(launcher.launch(spec))
    detok = launcher.launch(detokenizer_spec(server_args, port_args))
    procs = Subprocesses(handles[0], detok, {}, schedulers=handles, tp_ranks=list(range(tp)), launcher=launcher,
                         port_args=port_args)
    info = _wait_ready(launcher, handles, STARTUP_TIMEOUT_S)
    if info.get("status") == "ready" and server_args.disaggregation_mode == "prefill":
        info["disaggregation_bootstrap_host"] = ip0  # the bootstrap server runs in rank 0's actor
    return _finish(server_args, procs, info, [infos[r] for r in range(tp)])


def _finish(server_args: ServerArgs, procs: Subprocesses, info: dict, node_infos: list) -> Subprocesses:
    """Record rank 0's ready message (plus where every scheduler rank runs) as ``procs.scheduler_info``.

    Raises:
        RuntimeError: ``info`` is an error (the startup failed).
    """
    if info.get("status") != "ready":
        raise RuntimeError(f"server startup failed: {info.get('message')}")
    for key in ("status", "tp_rank", "pid"):
        info.pop(key, None)
    info["ray_nodes"] = [{"tp_rank": r % server_args.tp_size, "ip": n["ip"], "node_id": n["node_id"],
                          "gpu_ids": n["gpu_ids"]} for r, n in enumerate(node_infos)]
    info.update(procs.scheduler_info)  # AFD: where the attention and FFN workers run
    procs.scheduler_info = info
    logger.info("Ray: %d scheduler rank(s) ready on node(s) %s (scheduler input %s)", len(node_infos),
                [n["ip"] for n in node_infos], procs.port_args.scheduler_input_ipc)
    return procs


def _wait_ready(launcher: RayLauncher, handles: list, timeout_s: float) -> dict:
    """The first handle's (rank 0's) ready message once every worker is ready; the first error (or dead actor)
    otherwise."""
    refs = {launcher.wait_ready(h, timeout_s): (rank, h) for rank, h in enumerate(handles)}
    infos = {}
    deadline = time.monotonic() + timeout_s
    while refs:
        done, _ = ray.wait(list(refs), num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        if not done:
            return {"status": "error", "message": f"the scheduler did not start within {timeout_s:.0f} s"}
        rank, h = refs.pop(done[0])
        try:
            info = ray.get(done[0])
        except (RayActorError, RayError) as e:
            return {"status": "error", "message": f"the Ray actor {h.name} died during startup on "
                                                  f"node {h.info.get('ip')}: {str(e).splitlines()[0]}"}
        if info.get("status") != "ready":
            return info
        infos[rank] = info
    return infos[0]
