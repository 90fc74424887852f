"""Start the server's processes and tear them down (no orphans).

Process tree::

    main process: HTTP server (uvicorn) + TokenizerManager (asyncio)
      |- Scheduler subprocess per TP rank (model shard, KV cache, batching; rank 0 owns the sockets)
      |- DetokenizerManager subprocess (incremental detokenization)

Multi-node TP (``--nnodes N --node-rank R --dist-init-addr HOST:PORT``): every node runs this launcher;
node R starts its ``tp/N`` ranks; only node 0 serves HTTP. A watchdog thread stops the server with a
clear error when any child dies.

Children are started through a :class:`~sglang.srt.entrypoints.worker_launcher.WorkerLauncher`
(``spawn``-ed processes today) with explicit devices (``--base-gpu-id``/``--gpu-id-step``); each exits when
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
    launch_scheduler_rank,
    worker_device,
)
from sglang.srt.server_args import EMBEDDED_MODELS, PortArgs, ServerArgs
from sglang.srt.utils.nvls_env import apply_nvls_off_env

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 1800
WATCHDOG_INTERVAL_S = 0.5


@dataclass
class Subprocesses:
    """Handles of the child processes plus what the scheduler (rank 0) reported at startup.

    ``schedulers``: one process per local TP rank (``scheduler`` is the first, rank 0 on node 0);
    ``detokenizer`` is None on nodes other than 0. ``failure`` is set by :meth:`watch` when a child
    died while serving.
    """

    scheduler: WorkerHandle
    detokenizer: Optional[WorkerHandle]
    scheduler_info: dict
    schedulers: list = field(default_factory=list)
    tp_ranks: list = field(default_factory=list)
    failure: Optional[str] = None
    ffn_workers: list = field(default_factory=list)  # AFD FFN workers (--enable-afd)
    # the front end's PortArgs when it differs: AFD data-parallel scheduler inputs, or --use-ray's endpoints
    port_args: Any = None
    launcher: Any = None  # keeps the children's liveness pipe open for the server's lifetime
    _closing: threading.Event = field(default_factory=threading.Event)
    _shut_down: bool = False

    def children(self) -> list:
        """Every child process: the scheduler(s), then the detokenizer when present."""
        return list(self.schedulers or [self.scheduler]) + list(self.ffn_workers) + \
            ([self.detokenizer] if self.detokenizer else [])

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

    def dead_child(self) -> Optional[str]:
        """A message naming the first child that exited, or None while all live."""
        for p, rank in zip(self.schedulers, self.tp_ranks):
            if not p.is_alive():
                from sglang.srt.managers.watchdog import WATCHDOG_EXIT_CODE

                if p.exitcode == WATCHDOG_EXIT_CODE:
                    return (f"scheduler TP rank {rank} (pid {p.pid}) was stopped by its watchdog: no scheduler step "
                            "finished within --watchdog-timeout (a TP rank or the device stalled)")
                return (f"scheduler TP rank {rank} (pid {p.pid}) exited unexpectedly with code {p.exitcode}"
                        + (f" ({p.death_reason})" if getattr(p, "death_reason", None) else ""))
        for j, p in enumerate(self.ffn_workers):
            if not p.is_alive():
                return (f"AFD FFN worker {j} (pid {p.pid}) exited unexpectedly with code {p.exitcode}"
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


def check_parallel_args(server_args: ServerArgs) -> None:
    """Validate ``--tp-size/--ep-size/--nnodes`` against the model's config before any process starts.

    Raises:
        ValueError: e.g. ``--tp-size=3`` with 8 attention heads (the message lists valid sizes).
    """
    if server_args.tp_size == 1 and server_args.nnodes == 1 and server_args.ep_size == 1:
        return
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.distributed.parallel_state import validate_tp_config

    mc = ModelConfig.from_path(server_args.model_path, server_args.context_length, server_args.dtype,
                               server_args.resolved_device)
    validate_tp_config(mc, server_args.tp_size, server_args.ep_size, server_args.nnodes)


def _await_ready(pipes: list, handles: list, deadline: float, who, infos: dict) -> Optional[dict]:
    """Collect the ready message of every ``(key, reader)`` in ``pipes`` (``handles``: their processes, same order)
    into ``infos``; the first error message, a death (``who(key)`` names the worker) or the deadline is returned
    as an error dict, None when all are ready."""
    while len(infos) < len(pipes):
        if time.monotonic() > deadline:
            return {"status": "error", "message": f"{who(None)} did not start within {STARTUP_TIMEOUT_S} s"}
        for (key, reader), p in zip(pipes, handles):
            if key in infos:
                continue
            try:
                if reader.poll(0.1):
                    info = reader.recv()
                    if info.get("status") != "ready":
                        return info
                    infos[key] = info
                    continue
                if p.is_alive():
                    continue
            except EOFError:
                pass
            return {"status": "error", "message": f"{who(key)} died during startup (exit code {p.exitcode})"}
    return None


def _wait_ready(procs: Subprocesses, pipes: list, deadline: float, ffn_pipes: tuple = ()) -> dict:
    """Wait for every local rank's (and AFD FFN worker's) ready message; the first error or dead process aborts
    (message returned)."""
    error = _await_ready(list(ffn_pipes), procs.ffn_workers, deadline,
                         lambda j: "the FFN workers" if j is None else f"FFN worker {j}", {})
    if error is not None:
        return error
    infos: dict[int, dict] = {}
    error = _await_ready(pipes, procs.schedulers, deadline,
                         lambda r: "the scheduler" if r is None else f"the scheduler process of TP rank {r}", infos)
    return error if error is not None else infos[min(infos)]


def launch_subprocesses(server_args: ServerArgs, port_args: PortArgs, in_process_engine: bool = False) -> Subprocesses:
    """Start this node's scheduler ranks (and, on node 0, the detokenizer); wait until every rank is ready.

    TP: ranks ``node_rank * tp/nnodes ... + tp/nnodes - 1`` run here, one process each; they rendezvous at
    ``--dist-init-addr`` (multi-node) or a free local port. Every child gets the no-NVLink-multicast
    environment (``NCCL_NVLS_ENABLE=0`` ...).
    ``in_process_engine``: the parent is a user's program (``sgl.Engine``). No child ever SIGTERMs its parent
    on a crash: the caller's watchdog (:meth:`Subprocesses.watch`) reports the failure.
    Raises:
        ValueError: ``--tp-size`` does not fit the model (checked before anything is spawned).
        RuntimeError: a rank failed to start (its message says why: unknown architecture, missing or
            corrupt weights, failed rendezvous, ...) or died during startup.
    """
    from sglang.srt.distributed.parallel_state import dist_init_method
    check_parallel_args(server_args)
    if server_args.enable_afd:
        from sglang.srt.afd.launch import check_afd_model

        check_afd_model(server_args)  # a dense model is refused before anything is spawned
    if server_args.use_ray:  # workers as Ray actors; the only path that imports ray
        try:
            from sglang.srt.ray.launch import launch_ray_workers
        except ImportError as e:
            raise RuntimeError(f"--use-ray needs Ray ({e}); install the extra: pip install 'sglang[ray]' "
                               f"(from a checkout: pip install './python[ray]')") from e

        return launch_ray_workers(server_args, in_process_engine)
    apply_nvls_off_env()  # inherited by the spawned children
    launcher = MultiprocessingLauncher()
    tp, nnodes = server_args.tp_size, server_args.nnodes
    per_node = tp // nnodes
    ranks = list(range(server_args.node_rank * per_node, (server_args.node_rank + 1) * per_node))
    init = None
    if tp > 1:
        init = dist_init_method(server_args.dist_init_addr, None if server_args.dist_init_addr else _free_port())
    # A child that crashes while serving does not SIGTERM us: the watchdog (:meth:`Subprocesses.watch`, which
    # both launch_server and the Engine start) notices the dead child, records why and stops the server. A
    # crash-time SIGTERM would race the watchdog and the server could exit 0 without saying why.
    signal_parent_on_crash = False
    device_type = server_args.resolved_device
    pipes, scheds, afd = [], [], None
    if server_args.enable_afd:
        from sglang.srt.afd.launch import launch_afd_workers

        afd = launch_afd_workers(server_args, port_args, launcher, _free_port, False)
        pipes, scheds, ranks = afd.pipes, afd.schedulers, afd.ranks
    for local, rank in enumerate([] if afd else ranks):
        # --tp-ranks-share-gpu (correctness test mode): every rank on --base-gpu-id
        device = worker_device(device_type, 0 if server_args.tp_ranks_share_gpu else local, server_args.base_gpu_id,
                               server_args.gpu_id_step)
        handle, reader = launch_scheduler_rank(
            launcher, server_args, port_args, name=f"sglang::scheduler_TP{rank}" if tp > 1 else "sglang::scheduler",
            tp_rank=rank, device=device, init=init, signal_parent_on_crash=signal_parent_on_crash)
        scheds.append(handle)
        pipes.append((rank, reader))
        if tp > 1:
            logger.info("scheduler TP rank %d started (pid %d) on %s", rank, handle.pid, device)
    detok = None
    if server_args.node_rank == 0:
        detok = launcher.launch(detokenizer_spec(server_args, port_args, signal_parent_on_crash))
    procs = Subprocesses(scheds[0], detok, {}, schedulers=scheds, tp_ranks=ranks, launcher=launcher,
                         ffn_workers=afd.ffn if afd else [], port_args=afd.port_args if afd else None)
    atexit.register(procs.shutdown)
    try:
        info = _wait_ready(procs, pipes, time.monotonic() + STARTUP_TIMEOUT_S, afd.ffn_pipes if afd else ())
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

    preflight(server_args, serve_http=server_args.node_rank == 0)  # port, model path, device: before anything loads
    from sglang.srt.entrypoints.http_server import create_app, launch_http_server
    from sglang.srt.managers.tokenizer_manager import TokenizerManager

    server_args = resolve_model(server_args)
    port_args = PortArgs.init_new("tcp" if server_args.use_ray else server_args.zmq_transport)
    procs = launch_subprocesses(server_args, port_args)
    port_args = procs.port_args or port_args  # --use-ray: endpoints on the nodes Ray chose
    try:
        if server_args.node_rank != 0:
            _serve_worker_node(server_args, procs)
        else:
            tm = TokenizerManager(server_args, procs.port_args or port_args, procs.scheduler_info)
            app = create_app(tm, server_args)

            def on_child_death() -> None:
                if server_args.enable_afd:  # AFD: fail in-flight requests, stay up answering 503 (/health too)
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
        if server_args.nnodes > 1 and not server_args.use_ray:
            failure += (f" (node {server_args.node_rank} of {server_args.nnodes}: a TP rank on another node may have "
                        f"stopped or crashed, which ends this node's ranks too; check every node's log)")
        raise RuntimeError(f"server stopped: {failure}")
