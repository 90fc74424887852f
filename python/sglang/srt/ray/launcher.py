"""``RayLauncher``: the :class:`~sglang.srt.entrypoints.worker_launcher.WorkerLauncher` of ``--use-ray``.

Every worker process is a Ray actor (:class:`_WorkerActor`, one Ray worker process each) created inside the
placement-group bundle of its ``(role, rank)`` (:mod:`sglang.srt.ray.placement`). The actor runs the same
entry point a ``spawn``-ed process would (``target(*args, parent_watch=...)``) on one of its threads, so the
scheduler and detokenizer code is unchanged:

- readiness: an argument equal to :data:`READY_CHANNEL` is replaced inside the actor by a local channel whose
  ``send(info)`` the driver reads through ``wait_ready``;
- device: Ray sets ``CUDA_VISIBLE_DEVICES`` to the GPU(s) it assigned to the actor, so the worker's device is
  ``cuda:0`` of its own view; the physical ids come from ``ray.get_gpu_ids()`` (no contiguity assumption);
- liveness: the handle's ``is_alive()`` is "the actor's ``run`` call has not finished"; a dead actor or node
  finishes it with ``RayActorError`` (the launcher's watchdog then stops the server). Workers watch the
  driver through Ray's ownership: actors are non-detached, so Ray kills them when the driver dies
  (``ray job stop``, SIGKILL); :meth:`RayLauncher.close` kills them and removes the placement groups;
- logs: the actors log to stderr, which Ray forwards to the driver (``log_to_driver``), prefixed with the
  actor's pid and node IP.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from sglang.srt.entrypoints.worker_launcher import ProcessSpec, WorkerHandle, WorkerLauncher
from sglang.srt.ray.placement import PlacementGroupPlan
from sglang.srt.utils.nvls_env import NVLS_OFF_ENV

logger = logging.getLogger(__name__)


class _ReadyChannelMarker:
    """Placeholder for the worker's ready pipe inside :class:`ProcessSpec` args (compared by type)."""

    def __reduce__(self):
        return (_ReadyChannelMarker, ())


READY_CHANNEL = _ReadyChannelMarker()


class _ReadyChannel:
    """Actor-local stand-in for a ``multiprocessing`` pipe end: ``send(info)`` stores the first message."""

    def __init__(self) -> None:
        self.info: Optional[dict] = None
        self.event = threading.Event()

    def send(self, info: dict) -> None:
        if self.info is None:
            self.info = info
        self.event.set()


class _StopWatch:
    """:class:`~sglang.srt.entrypoints.worker_launcher.ParentWatch` of an actor: False once ``stop`` was called."""

    def __init__(self, event: threading.Event):
        self._event = event

    def parent_alive(self) -> bool:
        return not self._event.is_set()


class _WorkerActor:
    """One worker process (see the module docstring). Threaded (``max_concurrency``) so ``wait_ready`` and
    ``stop`` are served while ``run`` blocks."""

    def __init__(self, name: str, env: Mapping[str, str], log_level: str = "info") -> None:
        os.environ.update(env)
        self._name = name
        self._ready = _ReadyChannel()
        self._stop = threading.Event()
        self._done = threading.Event()
        self._error: Optional[str] = None
        logging.basicConfig(level=log_level.upper(), format=f"[{name}] %(levelname)s %(name)s: %(message)s")

    def node_info(self, n_ports: int = 0) -> dict:
        """Where this actor runs: node IP and id, pid, the GPU ids Ray assigned, and ``n_ports`` TCP ports free
        on this node's IP a moment ago."""
        from sglang.srt.utils.common import free_tcp_ports

        ip = ray.util.get_node_ip_address()
        iface = _interface_of(ip)
        if iface and "GLOO_SOCKET_IFNAME" not in os.environ:
            # gloo otherwise binds the address the hostname resolves to (often 127.0.0.1): peers on other
            # nodes could not connect back. Use the interface that carries the IP Ray knows this node by.
            os.environ["GLOO_SOCKET_IFNAME"] = iface
        return {"iface": iface, "ip": ip, "node_id": ray.get_runtime_context().get_node_id(), "pid": os.getpid(),
                "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
                "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
                "ports": free_tcp_ports(n_ports, ip) if n_ports else []}

    def run(self, target, args: tuple) -> None:
        """Run ``target(*args, parent_watch=...)`` until it returns (the ready marker replaced by the channel).

        Raises:
            whatever the entry point raised (the driver sees a ``RayTaskError``).
        """
        args = tuple(self._ready if isinstance(a, _ReadyChannelMarker) else a for a in args)
        try:
            target(*args, parent_watch=_StopWatch(self._stop))
        except BaseException as e:
            self._error = f"{type(e).__name__}: {e}"
            raise
        finally:
            self._done.set()
            self._ready.event.set()

    def wait_ready(self, timeout: float) -> dict:
        """The worker's ready message; an error dict when it ended (or timed out) without one."""
        self._ready.event.wait(timeout)
        if self._ready.info is not None:
            return self._ready.info
        if self._done.is_set():
            return {"status": "error", "message": f"{self._name} ended during startup"
                                                  + (f": {self._error}" if self._error else "")}
        return {"status": "error", "message": f"{self._name} did not start within {timeout:.0f} s"}

    def stop(self) -> None:
        """Ask the entry point to return (its ``parent_watch`` turns False)."""
        self._stop.set()


def _interface_of(ip: str) -> Optional[str]:
    """The network interface that holds ``ip`` on this host, or None."""
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address == ip for a in addrs):
            return name
    return None


@dataclass(frozen=True)
class ActorRequest:
    """One actor to create: worker ``(role, rank)`` named ``name``, reserving ``resources`` from its bundle, with
    ``env`` added to its environment and ``n_ports`` free TCP ports probed on its node."""

    role: str
    rank: int
    name: str
    resources: Mapping[str, float]
    env: Mapping[str, str] = field(default_factory=dict)
    n_ports: int = 0


class RayWorkerHandle:
    """:class:`~sglang.srt.entrypoints.worker_launcher.WorkerHandle` over an actor and its ``run`` call."""

    def __init__(self, name: str, actor: Any, run_ref: Any, info: dict):
        self.name, self.actor, self._run_ref, self.info = name, actor, run_ref, info
        self.pid: Optional[int] = info.get("pid")
        self._exit: Optional[int] = None
        self.death_reason: Optional[str] = None

    def is_alive(self) -> bool:
        """True while the actor's ``run`` call is unfinished."""
        if self._exit is not None:
            return False
        if not ray.is_initialized():  # the launcher disconnected: its actors were killed
            self._exit, self.death_reason = -9, f"{self.name}: the driver left the Ray cluster"
            return False
        ready, _ = ray.wait([self._run_ref], timeout=0)
        if not ready:
            return True
        self._settle()
        return False

    def _settle(self) -> None:
        where = f"on node {self.info.get('ip')}"
        try:
            ray.get(self._run_ref, timeout=5)
            self._exit, self.death_reason = 0, f"{self.name} returned {where}"
        except RayActorError as e:
            self._exit = -9
            self.death_reason = f"{self.name} (Ray actor, pid {self.pid}) died {where}: {str(e).splitlines()[0]}"
        except RayError as e:
            self._exit = 1
            self.death_reason = f"{self.name} (pid {self.pid}) failed {where}: {str(e).splitlines()[0]}"

    @property
    def exitcode(self) -> Optional[int]:
        """0 when ``run`` returned, 1 when it raised, -9 when the actor (or its node) died; None while alive."""
        return None if self.is_alive() else self._exit

    def terminate(self) -> None:
        """Ask the worker to return (its loop sees the stop); :meth:`kill` follows if it does not."""
        if not ray.is_initialized():
            return
        try:
            self.actor.stop.remote()
        except RayError:
            pass

    def kill(self) -> None:
        """``ray.kill`` the actor (no restart)."""
        if not ray.is_initialized():
            return
        try:
            ray.kill(self.actor, no_restart=True)
        except (RayError, ValueError):
            pass

    def join(self, timeout: Optional[float] = None) -> None:
        """Wait up to ``timeout`` seconds for ``run`` to finish."""
        if ray.is_initialized():
            ray.wait([self._run_ref], timeout=timeout)


class RayLauncher(WorkerLauncher):
    """Creates placement groups from plans, then one :class:`_WorkerActor` per worker in its bundle.

    Use: :meth:`reserve` (placement groups ready) -> :meth:`create_actors` (returns each worker's node info:
    IP, GPU ids, free ports) -> :meth:`launch` per :class:`ProcessSpec` (starts the entry point in the actor
    created for ``spec.slot``) -> :meth:`close` (kills every actor, removes the groups).
    """

    def __init__(self, log_level: str = "info", owns_connection: bool = False) -> None:
        """``owns_connection``: this launcher's caller ran ``ray.init``; :meth:`close` then disconnects."""
        self._log_level = log_level
        self._owns_connection = owns_connection
        self._pgs: list = []
        self._slot: dict = {}  # (role, rank) -> (placement group, bundle index)
        self._actors: dict = {}  # (role, rank) -> (actor, node info)
        self._handles: list = []
        self._closed = False

    def reserve(self, plans: Sequence[PlacementGroupPlan], timeout_s: float) -> None:
        """Create the placement groups of ``plans`` and wait until all are placed.

        Raises:
            RuntimeError: not placeable within ``timeout_s`` (the message names the bundles, the strategy and
                the cluster's resources).
        """
        for plan in plans:
            pg = placement_group([dict(b) for b in plan.bundles], strategy=plan.strategy, name=plan.name)
            self._pgs.append(pg)
            for key, idx in plan.slots.items():
                self._slot[key] = (pg, idx)
            try:
                ray.get(pg.ready(), timeout=timeout_s)
            except GetTimeoutError:
                raise RuntimeError(
                    f"Ray could not place {plan.name} (bundles {list(plan.bundles)}, strategy {plan.strategy}) "
                    f"within {timeout_s:.0f} s; cluster resources: {ray.cluster_resources()}, alive nodes: "
                    f"{sum(n['Alive'] for n in ray.nodes())}. Add nodes/resources or lower --tp-size/--nnodes")
            logger.info("placement group %s ready: %d bundle(s) %s, %s", plan.name, len(plan.bundles),
                        list(plan.bundles), plan.strategy)

    def add_slot(self, key: tuple, same_as: tuple) -> None:
        """Place worker ``key`` in the same bundle as ``same_as`` (e.g. the detokenizer with TP rank 0)."""
        self._slot[key] = self._slot[same_as]

    def create_actors(self, requests: Sequence[ActorRequest], timeout_s: float = 300.0) -> list[dict]:
        """Start the actors of ``requests`` (all at once) in their bundles; returns each one's
        :meth:`_WorkerActor.node_info` (IP, node id, pid, Ray GPU ids, ``n_ports`` free ports), in order.

        Raises:
            KeyError: no bundle was planned for a request's ``(role, rank)``.
            RuntimeError: an actor died or did not start within ``timeout_s`` (the others are killed by
                :meth:`close`).
        """
        started = []
        for r in requests:
            pg, idx = self._slot[(r.role, r.rank)]
            res = r.resources
            opts = dict(num_cpus=res.get("CPU", 0), num_gpus=res.get("GPU", 0),
                        resources={k: v for k, v in res.items() if k not in ("CPU", "GPU")} or None,
                        max_concurrency=4, max_restarts=0,
                        scheduling_strategy=PlacementGroupSchedulingStrategy(
                            placement_group=pg, placement_group_bundle_index=idx,
                            placement_group_capture_child_tasks=True))
            actor = ray.remote(_WorkerActor).options(**opts).remote(r.name, {**NVLS_OFF_ENV, **r.env},
                                                                     self._log_level)
            self._actors[(r.role, r.rank)] = (actor, {})
            started.append((r, actor, actor.node_info.remote(r.n_ports)))
        infos = []
        for r, actor, ref in started:
            try:
                info = ray.get(ref, timeout=timeout_s)
            except (RayError, GetTimeoutError) as e:
                raise RuntimeError(f"Ray actor {r.name} did not start: {str(e).splitlines()[0]}") from e
            self._actors[(r.role, r.rank)] = (actor, info)
            infos.append(info)
        return infos

    def launch(self, spec: ProcessSpec) -> RayWorkerHandle:
        """Run ``spec.target(*spec.args, parent_watch=...)`` in the actor created for ``spec.slot``; returns at
        once."""
        actor, info = self._actors[tuple(spec.slot)]
        handle = RayWorkerHandle(spec.name, actor, actor.run.remote(spec.target, spec.args), info)
        self._handles.append(handle)
        logger.info("%s started as a Ray actor (pid %s) on node %s, device %s, Ray GPU ids %s", spec.name,
                    info.get("pid"), info.get("ip"), spec.device, info.get("gpu_ids") or "-")
        return handle

    def wait_ready(self, handle: RayWorkerHandle, timeout_s: float) -> Any:
        """An object ref resolving to the worker's ready message (or an error dict)."""
        return handle.actor.wait_ready.remote(timeout_s)

    def close(self) -> None:
        """Kill every actor and remove every placement group (idempotent)."""
        if self._closed or not ray.is_initialized():
            self._closed = True
            return
        self._closed = True
        for actor, _ in self._actors.values():
            try:
                ray.kill(actor, no_restart=True)
            except (RayError, ValueError):
                pass
        for pg in self._pgs:
            try:
                remove_placement_group(pg)
            except (RayError, ValueError):
                pass
        # wait (bounded) until the actors are gone so a caller's check for leftovers is meaningful
        refs = [a.node_info.remote() for a, _ in self._actors.values()]
        if refs:
            ray.wait(refs, num_returns=len(refs), timeout=10)
        if self._owns_connection:
            ray.shutdown()
