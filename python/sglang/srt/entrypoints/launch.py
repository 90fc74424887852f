"""Start the server's processes and tear them down (no orphans).

Process tree::

    main process: HTTP server (uvicorn) + TokenizerManager (asyncio)
      |- Scheduler subprocess per TP rank (model shard, KV cache, batching; rank 0 owns the sockets);
      |    with --enable-afd: each attention worker's TP ranks, plus the FFN worker subprocesses
      |- DetokenizerManager subprocess (incremental detokenization)

Multi-node TP (``--nnodes N --node-rank R --dist-init-addr HOST:PORT``): every node runs this launcher;
node R starts its ``tp/N`` ranks; only node 0 serves HTTP. A watchdog thread stops the server with a
clear error when any child dies.

What starts is the deployment plan (:func:`sglang.srt.deployment.plan_deployment`: one
:class:`~sglang.srt.deployment.plan.WorkerSpec` per worker, every technique resolved once); this module only
carries it out. Children are started through a
:class:`~sglang.srt.entrypoints.worker_launcher.WorkerLauncher` (``spawn``-ed processes; Ray actors with
``--use-ray``) with the plan's explicit devices (``--base-gpu-id``/``--gpu-id-step``); each exits when
its :class:`~sglang.srt.entrypoints.worker_launcher.ParentWatch` reports the launcher gone, and the parent
kills them on SIGINT/SIGTERM or when startup fails. ``--zmq-transport tcp`` puts the inter-process sockets
on TCP ports instead of IPC paths.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from sglang.srt.entrypoints.worker_launcher import (
    MultiprocessingLauncher,
    WorkerHandle,
    detokenizer_spec,
    process_spec,
)
from sglang.srt.server_args import EMBEDDED_MODELS, PortArgs, ServerArgs
from sglang.srt.utils.nvls_env import apply_nvls_off_env

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 1800
WATCHDOG_INTERVAL_S = 0.5


def describe_worker(spec) -> str:
    """How logs and errors name a worker: ``scheduler TP rank r`` (``attention worker a TP rank r`` with several
    attention workers, ``scheduler DP rank r`` under DP attention), or ``AFD FFN worker j``."""
    from sglang.srt.deployment.plan import WorkerRole

    if getattr(spec, "dp_attention", None) is not None:
        return f"scheduler DP rank {spec.dp_attention.dp_rank}"
    if spec.role is WorkerRole.FFN:
        return f"AFD FFN worker {spec.rank}"
    if spec.role is WorkerRole.ATTENTION and spec.group:
        return f"attention worker {spec.group} TP rank {spec.rank}"
    return f"scheduler TP rank {spec.rank}"


@dataclass
class Subprocesses:
    """Handles of the child processes plus what the first scheduler reported at startup.

    ``workers``: one handle per worker of the plan that runs here, in plan order (schedulers first: ``scheduler``
    is rank 0 of group 0); ``specs``: their :class:`~sglang.srt.deployment.plan.WorkerSpec` s, same order;
    ``detokenizer`` is None on nodes other than 0. ``failure`` is set by :meth:`watch` when a child died while
    serving. ``port_args``: the front end's endpoints when they differ from the caller's (several scheduler groups,
    or ``--use-ray``'s endpoints on the nodes Ray chose). ``tokenizer_inbox``: ``(zmq.asyncio.Context, PULL socket)``
    already bound on ``port_args.tokenizer_ipc`` when the launcher had to bind it before the workers started (Ray);
    the TokenizerManager takes it with :meth:`take_tokenizer_inbox`, else :meth:`shutdown` closes it.
    """

    workers: list
    specs: list
    detokenizer: Optional[WorkerHandle]
    scheduler_info: dict
    failure: Optional[str] = None
    port_args: Any = None
    launcher: Any = None  # keeps the children's liveness pipe open for the server's lifetime
    tokenizer_inbox: Any = None
    tokenizer: Any = None  # the HF tokenizer loaded here for the detokenizer's decode spec; the TokenizerManager reuses it
    _closing: threading.Event = field(default_factory=threading.Event)
    _shut_down: bool = False

    @property
    def schedulers(self) -> list:
        """The scheduler workers' handles, in plan order."""
        return [h for h, s in zip(self.workers, self.specs) if s.is_scheduler]

    @property
    def scheduler(self) -> WorkerHandle:
        """The first scheduler (rank 0 of group 0)."""
        return self.schedulers[0]

    @property
    def tp_ranks(self) -> list:
        """The scheduler workers' TP ranks, in plan order."""
        return [s.rank for s in self.specs if s.is_scheduler]

    def take_tokenizer_inbox(self) -> Optional[tuple]:
        """The pre-bound ``(context, socket)`` of the TokenizerManager (None when it binds its own); the caller owns
        it from now on."""
        inbox, self.tokenizer_inbox = self.tokenizer_inbox, None
        return inbox

    def children(self) -> list:
        """Every child process: the workers, then the detokenizer when present."""
        return list(self.workers) + ([self.detokenizer] if self.detokenizer else [])

    def shutdown(self, timeout: float = 5.0) -> None:
        """Terminate every child (SIGTERM, then SIGKILL after ``timeout`` seconds), then close the launcher;
        a second call does nothing."""
        if self._shut_down:
            return
        self._shut_down = True
        self._closing.set()
        procs = self.children()
        for p in procs:
            if p.is_alive():
                p.terminate()
        deadline = time.monotonic() + timeout
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(1.0)
        if self.launcher is not None:
            self.launcher.close()
        if (inbox := self.take_tokenizer_inbox()) is not None:
            inbox[1].close(linger=0)
            inbox[0].term()

    def dead_child(self) -> Optional[str]:
        """A message naming the first child that exited, or None while all live."""
        for p, spec in zip(self.workers, self.specs):
            if not p.is_alive():
                from sglang.srt.managers.watchdog import WATCHDOG_EXIT_CODE

                if spec.is_scheduler and p.exitcode == WATCHDOG_EXIT_CODE:
                    return (f"{describe_worker(spec)} (pid {p.pid}) was stopped by its watchdog: no scheduler step "
                            "finished within --watchdog-timeout (a TP rank or the device stalled)")
                return (f"{describe_worker(spec)} (pid {p.pid}) exited unexpectedly with code {p.exitcode}"
                        + (f" ({p.death_reason})" if getattr(p, "death_reason", None) else ""))
        if self.detokenizer is not None and not self.detokenizer.is_alive():
            if getattr(self.detokenizer, "death_reason", None):
                return f"detokenizer exited unexpectedly: {self.detokenizer.death_reason}"
            return f"detokenizer (pid {self.detokenizer.pid}) exited unexpectedly with code {self.detokenizer.exitcode}"
        return None

    def watch(self, on_failure) -> threading.Thread:
        """Start a daemon thread that, when any child dies (and we are not shutting down), records
        :attr:`failure`, logs it and calls ``on_failure()`` once."""

        def loop() -> None:
            """Poll the children every ``WATCHDOG_INTERVAL_S``; on the first death record it, log it and call
            ``on_failure``."""
            while not self._closing.wait(WATCHDOG_INTERVAL_S):
                why = self.dead_child()
                if why and not self._closing.is_set():
                    self.failure = why
                    logger.error("%s; stopping the server", why)
                    on_failure()
                    return

        t = threading.Thread(target=loop, name="sglang-child-watchdog", daemon=True)
        t.start()
        return t


def resolve_model(server_args: ServerArgs) -> ServerArgs:
    """Replace an embedded model's name (``sglang-tw/stories260K``, the default, or ``sglang-tw/tiny-random-llama``)
    by its local folder; the name stays the served model name.

    Raises:
        ValueError: the packaged default model's files are missing (see :func:`embedded_model_path`).
    """
    name = server_args.model_path
    if name not in EMBEDDED_MODELS:
        return server_args
    from sglang.srt.configs.default_model import embedded_model_path

    served = server_args.served_model_name or name
    return server_args.replace(model_path=embedded_model_path(name), served_model_name=served)


def _free_port() -> int:
    """A free local TCP port (a TP rendezvous)."""
    from sglang.srt.utils.common import free_tcp_ports

    return free_tcp_ports(1)[0]


def check_parallel_args(server_args: ServerArgs, plan=None) -> None:
    """Validate ``--tp-size/--ep-size/--nnodes`` against the model's config before any process starts (not for
    DP-attention plans: their attention is replicated, the technique's ``check_model`` checks the MoE split).

    Raises:
        ValueError: e.g. ``--tp-size=3`` with 8 attention heads (the message lists valid sizes).
    """
    if server_args.tp_size == 1 and server_args.nnodes == 1 and server_args.ep_size == 1:
        return
    if plan is not None and any(w.dp_attention is not None for w in plan.schedulers):
        return
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.distributed.parallel_state import validate_tp_config

    mc = ModelConfig.from_path(server_args.model_path, server_args.context_length, server_args.dtype,
                               server_args.resolved_device)
    validate_tp_config(mc, server_args.tp_size, server_args.ep_size, server_args.nnodes)


def _who(spec) -> str:
    """A worker's name in startup errors: ``FFN worker j`` or ``the scheduler process of TP rank r``."""
    from sglang.srt.deployment.plan import WorkerRole

    if spec.role is WorkerRole.FFN:
        return f"FFN worker {spec.rank}"
    if getattr(spec, "dp_attention", None) is not None:
        return f"the scheduler process of DP rank {spec.dp_attention.dp_rank}"
    group = f"attention worker {spec.group} " if spec.role is WorkerRole.ATTENTION and spec.group else ""
    return f"the scheduler process of {group}TP rank {spec.rank}"


def _wait_ready(procs: Subprocesses, readers: list, deadline: float) -> dict:
    """Wait for every worker's ready message (``readers[i]``: the ready pipe of ``procs.workers[i]``), FFN workers
    first; the first error message, a dead worker or the deadline aborts (the error dict is returned). Returns the
    first scheduler's ready message."""
    order = sorted(range(len(readers)), key=lambda i: procs.specs[i].is_scheduler)
    infos: dict[int, dict] = {}
    while len(infos) < len(order):
        if time.monotonic() > deadline:
            return {"status": "error", "message": f"the scheduler did not start within {STARTUP_TIMEOUT_S} s"}
        i = next(i for i in order if i not in infos)  # one at a time, in order: FFN workers, then schedulers
        p, reader = procs.workers[i], readers[i]
        try:
            if reader.poll(0.1):
                info = reader.recv()
                if info.get("status") != "ready":
                    return info
                infos[i] = info
                continue
            if p.is_alive():
                continue
        except EOFError:
            pass
        return {"status": "error", "message": f"{_who(procs.specs[i])} died during startup (exit code {p.exitcode})"}
    return infos[next(i for i in range(len(readers)) if procs.specs[i].is_scheduler)]


def _start_local(plan, server_args: ServerArgs, port_args: PortArgs) -> tuple[Subprocesses, list]:
    """Start this node's workers of ``plan`` (wired by :func:`~sglang.srt.deployment.wiring.wire_local`) and, on
    node 0, the detokenizer; returns at once with the ready pipes (one per worker).

    On node 0 the front end's tokenizer is loaded first (:func:`front_tokenizer`): its
    :class:`~sglang.srt.managers.backend_tokenizer.BackendTokenizerSpec` rides in every scheduler's wiring and the
    detokenizer's arguments, so those processes skip loading it (and the detokenizer skips torch).

    Raises:
        ValueError: the tokenizer cannot be loaded (before anything is spawned).
    """
    import dataclasses
    import multiprocessing as mp

    from sglang.srt.deployment.wiring import wire_local

    tokenizer, tokenizer_spec = front_tokenizer(server_args) if plan.detokenizer else (None, None)
    launcher = MultiprocessingLauncher()
    workers, front = wire_local(plan, server_args, port_args, _free_port)
    if tokenizer_spec is not None:
        workers = [w.bind(dataclasses.replace(w.wiring, tokenizer=tokenizer_spec)) if w.is_scheduler else w
                   for w in workers]
    handles, readers = [], []
    for w in workers:
        reader, writer = mp.get_context("spawn").Pipe(duplex=False)
        handle = launcher.launch(process_spec(w, writer))
        handles.append(handle)
        readers.append(reader)
        if w.tp_size > 1 or not w.is_scheduler:
            logger.info("%s started (pid %d) on %s", describe_worker(w), handle.pid, w.device)
    # A child that crashes while serving does not SIGTERM us: the watchdog (:meth:`Subprocesses.watch`, which
    # both launch_server and the Engine start) notices the dead child, records why and stops the server.
    detok = launcher.launch(detokenizer_spec(server_args, front, tokenizer_spec)) if plan.detokenizer else None
    procs = Subprocesses(handles, workers, detok, {}, launcher=launcher, port_args=front if front is not port_args
                         else None, tokenizer=tokenizer)
    return procs, readers


def front_tokenizer(server_args: ServerArgs) -> tuple:
    """The front end's HF tokenizer (None with ``--skip-tokenizer-init``) and the spec the workers rebuild it from
    without transformers (None when the tokenizer does not fit one: each worker then loads it itself; see
    :mod:`sglang.srt.managers.backend_tokenizer`). The TokenizerManager reuses the tokenizer.

    Raises:
        ValueError: the tokenizer cannot be loaded (the message names ``--tokenizer-path``).
    """
    if server_args.skip_tokenizer_init:
        return None, None
    from sglang.srt.managers.backend_tokenizer import BackendTokenizerSpec
    from sglang.srt.utils.common import get_tokenizer

    path = server_args.resolved_tokenizer_path
    tokenizer = get_tokenizer(path, server_args.trust_remote_code)
    return tokenizer, BackendTokenizerSpec.from_hf(tokenizer, path, server_args.trust_remote_code)


def launch_subprocesses(server_args: ServerArgs, port_args: PortArgs, in_process_engine: bool = False,
                        plan=None) -> Subprocesses:
    """Carry out the deployment plan on this node: start its workers (and, on node 0, the detokenizer) and wait
    until every worker is ready.

    ``plan``: the :class:`~sglang.srt.deployment.plan.DeploymentPlan` (default ``plan_deployment(server_args)``,
    which validates every technique first). TP: ranks ``node_rank * tp/nnodes ... + tp/nnodes - 1`` run here, one
    process each; they rendezvous at ``--dist-init-addr`` (multi-node) or a free local port. Every child gets the
    no-NVLink-multicast environment (``NCCL_NVLS_ENABLE=0`` ...). ``--use-ray``: the Ray launcher carries the plan
    out instead (:func:`sglang.srt.ray.launch.launch_ray_workers`).
    ``in_process_engine``: the parent is a user's program (``sgl.Engine``). No child ever SIGTERMs its parent
    on a crash: the caller's watchdog (:meth:`Subprocesses.watch`) reports the failure.
    Raises:
        ValueError: a bad flag combination, ``--tp-size`` does not fit the model, or a technique refuses the model
            (checked before anything is spawned).
        RuntimeError: a flag's optional package is missing (before anything is spawned), or a worker failed to
            start (its message says why: unknown architecture, missing or corrupt weights, failed rendezvous, ...)
            or died during startup.
    """
    from sglang.srt.deployment.compose import check_model, plan_deployment
    from sglang.srt.layers.quantization import check_quantization

    plan = plan or plan_deployment(server_args)
    check_parallel_args(server_args, plan)
    check_model(server_args)  # e.g. AFD refuses a dense model before anything is spawned
    check_quantization(server_args)  # --quantization / the checkpoint's quantization_config, before any spawn
    if plan.uses_ray:  # workers as Ray actors; the only path that imports ray
        from sglang.srt.ray.launch import launch_ray_workers

        return launch_ray_workers(plan, server_args, in_process_engine)
    apply_nvls_off_env()  # inherited by the spawned children
    procs, readers = _start_local(plan, server_args, port_args)
    atexit.register(procs.shutdown)
    try:
        info = _wait_ready(procs, readers, time.monotonic() + STARTUP_TIMEOUT_S)
    except BaseException:
        procs.shutdown()
        raise
    if info.get("status") != "ready":
        procs.shutdown()
        msg = info.get("message")
        if in_process_engine and "died during startup" in str(msg):
            msg += ("; if this runs from a script, create the Engine under `if __name__ == \"__main__\":` "
                    "(the subprocesses are spawned and re-import the main module)")
        raise RuntimeError(f"server startup failed: {msg}")
    for key in ("status", "tp_rank", "pid"):
        info.pop(key, None)
    procs.scheduler_info = info
    return procs


def _serve_worker_node(server_args: ServerArgs, procs: Subprocesses) -> None:
    """Nodes other than 0: no HTTP; keep the ranks alive until one exits or we are signalled."""
    stop = threading.Event()
    procs.watch(stop.set)
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    logger.info("node %d is a worker node: TP ranks %s serving (no HTTP here; node 0 serves it)",
                server_args.node_rank, procs.tp_ranks)
    try:
        stop.wait()
    finally:
        for sig, h in previous.items():
            signal.signal(sig, h)


def launch_server(server_args: ServerArgs) -> None:
    """Run the whole server in the foreground until SIGINT/SIGTERM.

    Raises:
        RuntimeError: startup failed, or a child (e.g. a TP rank) died while serving.
    """
    from sglang.srt.entrypoints.preflight import preflight

    from sglang.srt.deployment.compose import plan_deployment

    server_args = resolve_model(server_args)  # an embedded model's name -> its folder, which the worker specs carry
    plan = plan_deployment(server_args)  # every technique validated, before anything loads or starts
    preflight(server_args, serve_http=server_args.node_rank == 0)  # port, model path, device: before anything loads
    from sglang.srt.entrypoints.http_server import create_app, launch_http_server
    from sglang.srt.managers.tokenizer_manager import TokenizerManager

    port_args = PortArgs.init_new(plan.zmq_transport)
    procs = launch_subprocesses(server_args, port_args, plan=plan)
    port_args = procs.port_args or port_args  # several scheduler groups, or --use-ray's endpoints
    try:
        if server_args.node_rank != 0:
            _serve_worker_node(server_args, procs)
        else:
            tm = TokenizerManager(server_args, procs.port_args or port_args, procs.scheduler_info,
                                  inbox=procs.take_tokenizer_inbox(), tokenizer=procs.tokenizer)
            app = create_app(tm, server_args)

            def on_child_death() -> None:
                if plan.stay_up_on_worker_death:  # AFD: fail in-flight requests, stay up answering 503 (/health too)
                    tm.fail_all_threadsafe(f"the server is unhealthy: {procs.failure}")
                    return
                tm.fail_all_threadsafe(f"the server is stopping: {procs.failure}")
                time.sleep(1.0)  # let the failed requests' error responses (and /health 503s) go out first
                os.kill(os.getpid(), signal.SIGTERM)

            procs.watch(on_child_death)
            logger.info("serving %s at %s (tp_size=%d)", server_args.model_name, server_args.url(),
                        server_args.tp_size)
            launch_http_server(app, server_args)
    finally:
        failure = procs.failure
        procs.shutdown()
        import shutil

        shutil.rmtree(port_args.ipc_dir, ignore_errors=True)
    if failure:
        if plan.nnodes > 1 and not plan.uses_ray:
            failure += (f" (node {server_args.node_rank} of {server_args.nnodes}: a TP rank on another node may have "
                        f"stopped or crashed, which ends this node's ranks too; check every node's log)")
        raise RuntimeError(f"server stopped: {failure}")
