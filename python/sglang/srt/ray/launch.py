"""``--use-ray`` startup: carry out the deployment plan with Ray actors.

Called by :func:`sglang.srt.entrypoints.launch.launch_subprocesses` instead of the ``spawn`` path, with the plan
(:func:`sglang.srt.deployment.plan_deployment`; :mod:`sglang.srt.ray.deploy` listed every worker of every node
slice). The driver (this process: HTTP + TokenizerManager, or the user's ``sgl.Engine``) connects to the Ray
cluster at ``--ray-address`` (default ``auto``: the running cluster, e.g. inside ``ray job submit``), reserves one
placement group per role group (:mod:`sglang.srt.ray.placement`: ``scheduler``, or ``attention<a>`` per AFD
attention worker plus one ``ffn`` pool), starts one actor per worker plus the detokenizer (in the first worker's
bundle), then wires them with TCP sockets on the IPs Ray reports: the TokenizerManager binds on the driver's node,
each scheduler group's input and TP rendezvous on its rank 0's node, AFD M2N inboxes on each worker's node (the
transport ``auto`` resolved by :func:`sglang.srt.afd.deploy.transport` once the nodes are known). ``--nnodes N``
splits the TP group into N node slices on N distinct nodes (no ``--node-rank`` / ``--dist-init-addr``: Ray places
every slice).
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import time
from typing import Any

import ray
import zmq
import zmq.asyncio
from ray.exceptions import RayActorError, RayError

from sglang.srt.deployment.plan import DeploymentPlan, WorkerRole, WorkerSpec, Wiring
from sglang.srt.entrypoints.launch import STARTUP_TIMEOUT_S, Subprocesses
from sglang.srt.entrypoints.worker_launcher import detokenizer_spec, process_spec
from sglang.srt.ray.launcher import READY_CHANNEL, ActorRequest, RayLauncher
from sglang.srt.ray.placement import RoleGroup, plan_placement
from sglang.srt.server_args import PortArgs, ServerArgs
from sglang.srt.utils.common import bind_zmq_tcp

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


def launch_ray_workers(plan: DeploymentPlan, server_args: ServerArgs, in_process_engine: bool = False) -> Subprocesses:
    """Carry out ``plan`` (``--use-ray``): every worker and the detokenizer as Ray actors; wait until all are ready.

    Returns:
        the :class:`Subprocesses` whose ``port_args`` the TokenizerManager must use (TCP endpoints on the
        nodes Ray chose) and whose ``launcher`` owns the actors and placement groups.
    Raises:
        RuntimeError: no cluster, resources not placeable, or a worker failed/died during startup.
    """
    launcher = RayLauncher(server_args.log_level, owns_connection=connect(server_args.ray_address))
    try:
        procs = _launch(plan, server_args, launcher)
    except BaseException:
        launcher.close()
        raise
    atexit.register(procs.shutdown)
    return procs


def slot_of(w: WorkerSpec) -> tuple:
    """The placement slot (role group name, rank) of a worker: ``("scheduler", r)``, ``("attention<a>", r)`` or
    ``("ffn", j)``."""
    if w.role is WorkerRole.FFN:
        return ("ffn", w.rank)
    if w.role is WorkerRole.ATTENTION:
        return (f"attention{w.group}", w.rank)
    return ("scheduler", w.rank)


def role_groups(plan: DeploymentPlan) -> list:
    """One :class:`RoleGroup` per slot group of ``plan`` (in plan order), its node slices from the specs' ``node``;
    the first group's bundle 0 also holds the detokenizer's CPU."""
    names: dict = {}
    for w in plan.workers:
        names.setdefault(slot_of(w)[0], []).append(w)
    return [RoleGroup(name, len(ws), 1 + max(w.node for w in ws), dict(ws[0].resources),
                      extra={"CPU": 1.0} if i == 0 else {}) for i, (name, ws) in enumerate(names.items())]


def _n_ports(w: WorkerSpec) -> int:
    """Free ports a worker's actor reports: a group's rank 0 gets its scheduler input, TP rendezvous and M2N inbox;
    an FFN worker its M2N inbox."""
    return 1 if not w.is_scheduler else (3 if w.rank == 0 else 0)


def _bind(plan: DeploymentPlan, args: ServerArgs, infos: list, detok: dict, inbox: str,
          tokenizer_spec: Any = None) -> tuple[list, PortArgs]:
    """Wire every worker with the addresses its actors reported (``infos``, plan order), the detokenizer's and the
    TokenizerManager's ``inbox`` (already bound here); schedulers also get ``tokenizer_spec`` (the front end's
    :class:`~sglang.srt.managers.backend_tokenizer.BackendTokenizerSpec`, or None)."""
    lead = {w.group: i for w, i in zip(plan.workers, infos) if w.is_scheduler and w.rank == 0}
    inputs = {g: f"tcp://{i['ip']}:{i['ports'][0]}" for g, i in lead.items()}
    port_args = PortArgs(tokenizer_ipc=inbox,
                         scheduler_input_ipc=inputs[0], detokenizer_ipc=f"tcp://{detok['ip']}:{detok['ports'][0]}",
                         dp_scheduler_inputs=tuple(inputs.values()) if len(inputs) > 1 else ())
    topo = None
    if "afd" in plan.techniques:
        from sglang.srt.afd import deploy as afd

        addrs = tuple(f"tcp://{i['ip']}:{i['ports'][2]}" for i in lead.values()) + tuple(
            f"tcp://{i['ip']}:{i['ports'][0]}" for w, i in zip(plan.workers, infos) if not w.is_scheduler)
        topo = afd.topology(args, addrs, one_node=len({i["node_id"] for i in infos + [detok]}) == 1)
    bound = []
    for w, info in zip(plan.workers, infos):
        if not w.is_scheduler:
            bound.append(w.bind(Wiring(afd_topology=topo), host=info["ip"]))
            continue
        r0 = lead[w.group]
        init = f"tcp://{r0['ip']}:{r0['ports'][1]}" if w.tp_size > 1 else None
        pa = dataclasses.replace(port_args, scheduler_input_ipc=inputs[w.group], dp_scheduler_inputs=())
        # host: worker-side sockets (PD bootstrap server and KV transfer agents) bind the IP Ray knows the node by
        bound.append(w.bind(Wiring(port_args=pa, dist_init=init, afd_topology=topo, tokenizer=tokenizer_spec),
                            host=info["ip"],
                            node_rank=w.node, dist_init_addr=init[len("tcp://"):] if init else None))
    return bound, port_args


def _launch(plan: DeploymentPlan, server_args: ServerArgs, launcher: RayLauncher) -> Subprocesses:
    """Reserve the placement, create the actors, wire their TCP endpoints, start the entry points and wait until
    every worker is ready (see :func:`launch_ray_workers`)."""
    launcher.reserve(plan_placement(role_groups(plan), spread_roles=server_args.ray_spread_roles),
                     server_args.ray_placement_timeout)
    launcher.add_slot(("detokenizer", 0), slot_of(plan.workers[0]))
    *infos, detok_info = launcher.create_actors(
        [ActorRequest(*slot_of(w), w.name, dict(w.resources), n_ports=_n_ports(w)) for w in plan.workers]
        + [ActorRequest("detokenizer", 0, "sglang::detokenizer", {"CPU": 1.0}, n_ports=1)])
    # the TokenizerManager's inbox is bound before any worker starts: a port only probed here could be taken by the
    # time the front end binds it, after every worker is up
    from sglang.srt.entrypoints.launch import front_tokenizer

    tokenizer, tokenizer_spec = front_tokenizer(server_args)  # the actors rebuild it from the spec
    ctx = zmq.asyncio.Context()
    sock, inbox = bind_zmq_tcp(ctx, zmq.PULL, ray.util.get_node_ip_address())
    try:
        bound, port_args = _bind(plan, server_args, infos, detok_info, inbox, tokenizer_spec)
        handles = [launcher.launch(process_spec(w, READY_CHANNEL, slot=slot_of(w))) for w in bound]
        detok = launcher.launch(detokenizer_spec(server_args, port_args, tokenizer_spec))
    except BaseException:
        sock.close(linger=0)
        ctx.term()
        raise
    procs = Subprocesses(handles, bound, detok, {}, launcher=launcher, port_args=port_args, tokenizer_inbox=(ctx, sock),
                         tokenizer=tokenizer)
    info = _wait_ready(launcher, handles, STARTUP_TIMEOUT_S)
    if info.get("status") == "ready" and bound[0].role is WorkerRole.PREFILL:
        info["disaggregation_bootstrap_host"] = infos[0]["ip"]  # the bootstrap server runs in rank 0's actor
    return _finish(plan, procs, info, infos)


def _finish(plan: DeploymentPlan, procs: Subprocesses, info: dict, infos: list) -> Subprocesses:
    """Record the first scheduler's ready message (plus where every worker runs) as ``procs.scheduler_info``.

    Raises:
        RuntimeError: ``info`` is an error (the startup failed).
    """
    if info.get("status") != "ready":
        raise RuntimeError(f"server startup failed: {info.get('message')}")
    for key in ("status", "tp_rank", "pid"):
        info.pop(key, None)
    where = [(w, {"ip": n["ip"], "node_id": n["node_id"], "gpu_ids": n["gpu_ids"]})
             for w, n in zip(plan.workers, infos)]
    info["ray_nodes"] = [{"tp_rank": w.rank, **n} for w, n in where if w.is_scheduler]
    if "afd" in plan.techniques:  # where the attention and FFN workers run, and the M2N transport Ray's placement gave
        info["afd_ray_nodes"] = {"attention": [n for w, n in where if w.is_scheduler],
                                 "ffn": [n for w, n in where if not w.is_scheduler],
                                 "transport": procs.specs[0].wiring.afd_topology.transport}
    procs.scheduler_info = info
    logger.info("Ray: %d worker(s) ready on node(s) %s (scheduler input %s)", len(infos),
                sorted({n["ip"] for n in infos}), procs.port_args.scheduler_input_ipc)
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
