"""Wiring a plan on one node (the multiprocessing launcher): socket endpoints per scheduler group, one TP
rendezvous per group, the AFD M2N inboxes. The Ray launcher wires with the addresses Ray reports instead
(:mod:`sglang.srt.ray.launch`)."""

from __future__ import annotations

import dataclasses
from typing import Callable

from sglang.srt.deployment.plan import DeploymentPlan, Wiring


def wire_local(plan: DeploymentPlan, args, port_args, free_port: Callable[[], int]) -> tuple[list, object]:
    """Bind every worker of ``plan`` to this node's endpoints.

    Group g of several data-parallel scheduler groups binds ``<scheduler input>-dp<g>``; each group's TP ranks
    rendezvous at ``--dist-init-addr`` (multi-node TP, one group) or a free local port; DP-attention ranks (one group
    each) share one rendezvous (their MoE layers form one world) and the front end wakes every rank when it sends a
    request to one (their loops step together); AFD workers share the topology of
    :func:`sglang.srt.afd.deploy.topology` (one node).

    Returns:
        ``(bound worker specs in plan order, the front end's PortArgs)`` (with ``dp_scheduler_inputs`` when there
        are several groups).
    """
    from sglang.srt.distributed.parallel_state import dist_init_method

    groups = plan.scheduler_groups
    dp_world = any(w.dp_attention is not None for w in plan.schedulers)
    group_ports = {0: port_args}
    if groups > 1:
        group_ports = {g: dataclasses.replace(port_args, scheduler_input_ipc=f"{port_args.scheduler_input_ipc}-dp{g}")
                       for g in range(groups)}
        port_args = dataclasses.replace(port_args, dp_scheduler_inputs=tuple(
            group_ports[g].scheduler_input_ipc for g in range(groups)), dp_wake_peers=dp_world)
    tp = max((w.tp_size for w in plan.schedulers), default=1)
    inits = {g: None for g in range(groups)}
    if dp_world:  # one world over every DP rank
        shared = dist_init_method(None, free_port())
        inits = {g: shared for g in range(groups)}
    elif tp > 1:
        addr = args.dist_init_addr if groups == 1 else None
        inits = {g: dist_init_method(addr, None if addr else free_port()) for g in range(groups)}
    topo = None
    if "afd" in plan.techniques:
        from sglang.srt.afd import deploy as afd

        topo = afd.topology(args, afd.local_inboxes(args, port_args), one_node=True)
    bound = [w.bind(Wiring(port_args=group_ports[w.group] if w.is_scheduler else None,
                           dist_init=inits[w.group] if w.is_scheduler else None, afd_topology=topo))
             for w in plan.workers]
    return bound, port_args
