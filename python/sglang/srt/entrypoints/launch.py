"""Start the server's processes and tear them down (no orphans).

Process tree::

    main process: HTTP server (uvicorn) + TokenizerManager (asyncio)
      |- Scheduler subprocess (model, KV cache, batching)
      |- DetokenizerManager subprocess (incremental detokenization)

Children are ``spawn``-ed; each exits when it notices its parent is gone, and
the parent kills them on SIGINT/SIGTERM or when startup fails.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing as mp
import os
from dataclasses import dataclass

from sglang.srt.server_args import DEFAULT_MODEL, PortArgs, ServerArgs

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 1800


@dataclass
class Subprocesses:
    """Handles of the child processes plus what the scheduler reported at startup."""

    scheduler: mp.Process
    detokenizer: mp.Process
    scheduler_info: dict

    def shutdown(self, timeout: float = 5.0) -> None:
        """Terminate both children (SIGTERM, then SIGKILL after ``timeout`` seconds)."""
        for p in (self.scheduler, self.detokenizer):
            if p.is_alive():
                p.terminate()
        for p in (self.scheduler, self.detokenizer):
            p.join(timeout)
            if p.is_alive():
                p.kill()
                p.join(1.0)


def resolve_model(server_args: ServerArgs) -> ServerArgs:
    """Replace the embedded default model's name by the folder it is built into."""
    if server_args.model_path != DEFAULT_MODEL:
        return server_args
    from sglang.srt.configs.default_model import ensure_default_model

    path = ensure_default_model()
    return server_args.replace(model_path=path, served_model_name=server_args.served_model_name or DEFAULT_MODEL)


def launch_subprocesses(server_args: ServerArgs, port_args: PortArgs) -> Subprocesses:
    """Start the scheduler and detokenizer; wait until the model is loaded.

    Raises:
        RuntimeError: the scheduler failed to start (its message says why:
            unknown architecture, missing or corrupt weights, ...).
    """
    ctx = mp.get_context("spawn")
    from sglang.srt.managers.detokenizer_manager import run_detokenizer_process
    from sglang.srt.managers.scheduler_process import run_scheduler_process

    reader, writer = ctx.Pipe(duplex=False)
    parent = os.getpid()
    sched = ctx.Process(target=run_scheduler_process, args=(server_args, port_args, writer, parent),
                        name="sglang::scheduler", daemon=True)
    detok = ctx.Process(target=run_detokenizer_process, args=(server_args, port_args, parent),
                        name="sglang::detokenizer", daemon=True)
    sched.start()
    detok.start()
    procs = Subprocesses(sched, detok, {})
    atexit.register(procs.shutdown)
    try:
        if not reader.poll(STARTUP_TIMEOUT_S):
            raise RuntimeError(f"the scheduler did not start within {STARTUP_TIMEOUT_S} s")
        info = reader.recv()
    except EOFError:
        info = {"status": "error", "message": f"the scheduler process died during startup (exit code {sched.exitcode})"}
    except BaseException:
        procs.shutdown()
        raise
    if info.get("status") != "ready":
        procs.shutdown()
        raise RuntimeError(f"server startup failed: {info.get('message')}")
    info.pop("status")
    procs.scheduler_info = info
    return procs


def launch_server(server_args: ServerArgs) -> None:
    """Run the whole server in the foreground until SIGINT/SIGTERM."""
    from sglang.srt.entrypoints.http_server import create_app, launch_http_server
    from sglang.srt.managers.tokenizer_manager import TokenizerManager

    server_args = resolve_model(server_args)
    port_args = PortArgs.init_new()
    procs = launch_subprocesses(server_args, port_args)
    try:
        tm = TokenizerManager(server_args, port_args, procs.scheduler_info)
        app = create_app(tm, server_args)
        logger.info("serving %s at %s", server_args.model_name, server_args.url())
        launch_http_server(app, server_args)
    finally:
        procs.shutdown()
        import shutil

        shutil.rmtree(port_args.ipc_dir, ignore_errors=True)


