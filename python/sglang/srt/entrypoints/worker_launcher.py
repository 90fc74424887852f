"""How worker processes are started, watched and stopped: the :class:`WorkerLauncher` protocol.

The deployment plan (:mod:`sglang.srt.deployment`) lists every model worker as a
:class:`~sglang.srt.deployment.plan.ProcessSpec`; :func:`process_spec` turns one (bound to its wiring) into the
:class:`ProcessSpec` a launcher starts (entry point + the spec + its ready channel, explicit device, resources):
:class:`MultiprocessingLauncher` (``spawn`` on this host), or the Ray launcher (actors in placement groups,
``sglang.srt.ray``) for ``--use-ray``. Nothing else in the server knows how a worker was started.

Liveness does not depend on ``os.getppid()`` (which breaks when a worker lives on another host or under
another supervisor): each worker gets a :class:`ParentWatch` and polls ``parent_alive()``. The
multiprocessing implementation is a pipe whose only write end the parent holds: when the parent
exits for any reason (even SIGKILL) the kernel closes it and the child reads EOF.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Protocol, Sequence

from sglang.srt.utils.nvls_env import NVLS_OFF_ENV

logger = logging.getLogger(__name__)


class ParentWatch(Protocol):
    """A worker's view of its launcher: ``parent_alive()`` is False once the launcher is gone."""

    def parent_alive(self) -> bool:
        """True while the launcher that started this worker lives."""


class PipeParentWatch:
    """Parent liveness over a pipe (see the module docstring). Picklable for ``spawn``; cheap to poll."""

    def __init__(self, reader: Any):
        self._reader = reader
        self._gone = False

    def parent_alive(self) -> bool:
        """False once the parent's write end closed (EOF); never blocks."""
        if self._gone:
            return False
        try:
            if self._reader.poll(0):
                self._reader.recv()  # the parent never writes: readable means EOF
        except (EOFError, OSError):
            self._gone = True
        return not self._gone


class AlwaysAlive:
    """A :class:`ParentWatch` for workers with no parent to watch (tests, externally supervised workers)."""

    def parent_alive(self) -> bool:
        """Always True."""
        return True


@dataclass(frozen=True)
class ProcessSpec:
    """One process to start.

    Attributes:
        name: process name for logs and ``ps`` (e.g. ``sglang::scheduler_TP1``).
        target: the entry point, called as ``target(*args, parent_watch=watch)`` in the new process.
        args: positional arguments (picklable): for a model worker ``(ProcessSpec, ready channel)``.
        slot: the placement slot a placement-aware launcher created for it (e.g. ``("attention1", 0)``).
        device: explicit device, e.g. ``"cuda:3"`` or ``"cpu"``: the index comes from the plan's
            assignment, never from ``rank % ranks_per_node``.
        env: extra environment for the worker (the NVLS-off variables are always added).
        resources: what a placement-aware launcher must reserve, e.g. ``{"CPU": 1, "GPU": 1}``.
    """

    name: str
    target: Callable[..., Any]
    args: tuple = ()
    slot: tuple = ("worker", 0)
    device: str = "cpu"
    env: Mapping[str, str] = field(default_factory=dict)
    resources: Mapping[str, float] = field(default_factory=dict)


class WorkerHandle(Protocol):
    """A started worker: liveness, exit code, and stopping it."""

    name: str
    pid: Optional[int]

    def is_alive(self) -> bool:
        """True while the worker runs."""

    @property
    def exitcode(self) -> Optional[int]:
        """Exit code once it ended (negative: killed by that signal), else None."""

    def terminate(self) -> None:
        """Ask the worker to stop (SIGTERM or the launcher's equivalent)."""

    def kill(self) -> None:
        """Stop the worker now."""

    def join(self, timeout: Optional[float] = None) -> None:
        """Wait up to ``timeout`` seconds for it to end."""


class WorkerLauncher(ABC):
    """Starts :class:`ProcessSpec` s and owns the parent side of their liveness.

    Implementations: :class:`MultiprocessingLauncher`; a Ray launcher (actors placed by placement
    groups) for ``--use-ray``.
    """

    @abstractmethod
    def launch(self, spec: ProcessSpec) -> WorkerHandle:
        """Start one worker; returns at once (readiness is the caller's protocol, e.g. a ready pipe)."""

    def launch_all(self, specs: Sequence[ProcessSpec]) -> list[WorkerHandle]:
        """Start every spec in order."""
        return [self.launch(s) for s in specs]

    def close(self) -> None:
        """Release launcher-wide resources (the default has none)."""


class _ProcessHandle:
    """:class:`WorkerHandle` over a ``multiprocessing.Process``."""

    def __init__(self, name: str, proc: mp.Process):
        self.name, self._proc = name, proc

    @property
    def pid(self) -> Optional[int]:
        return self._proc.pid

    @property
    def exitcode(self) -> Optional[int]:
        return self._proc.exitcode

    def is_alive(self) -> bool:
        return self._proc.is_alive()

    def terminate(self) -> None:
        self._proc.terminate()

    def kill(self) -> None:
        self._proc.kill()

    def join(self, timeout: Optional[float] = None) -> None:
        self._proc.join(timeout)


def _run_with_env(env: Mapping[str, str], target: Callable[..., Any], args: tuple, watch: ParentWatch) -> None:
    """Child-side trampoline: apply the spec's environment, then run the entry point."""
    import os

    os.environ.update(env)
    target(*args, parent_watch=watch)


class MultiprocessingLauncher(WorkerLauncher):
    """``spawn``-ed daemon processes on this host, each given a :class:`PipeParentWatch`.

    The parent keeps the pipe's write end for its whole life and never writes to it; children get
    only the read end.
    """

    def __init__(self) -> None:
        self._ctx = mp.get_context("spawn")
        self._reader, self._writer = self._ctx.Pipe(duplex=False)

    def parent_watch(self) -> PipeParentWatch:
        """The watch handed to every child of this launcher."""
        return PipeParentWatch(self._reader)

    def launch(self, spec: ProcessSpec) -> WorkerHandle:
        """Spawn ``spec`` as a daemon process with the NVLS-off environment plus ``spec.env``."""
        env = {**NVLS_OFF_ENV, **spec.env}
        if spec.device.startswith("cuda:"):
            env.setdefault("SGLANG_WORKER_DEVICE", spec.device)
        proc = self._ctx.Process(target=_run_with_env, name=spec.name, daemon=True,
                                 args=(env, spec.target, spec.args, self.parent_watch()))
        proc.start()
        logger.debug("started %s (pid %d, slot %s, device %s)", spec.name, proc.pid, spec.slot, spec.device)
        return _ProcessHandle(spec.name, proc)


def process_spec(worker, ready: Any, slot: Optional[tuple] = None) -> ProcessSpec:
    """The process that carries out ``worker`` (a bound :class:`~sglang.srt.deployment.plan.WorkerSpec`): the FFN
    worker's or the scheduler's entry point, called as ``target(worker, ready, parent_watch=...)``; ``ready``: the
    channel its ready message goes to; ``slot``: its placement slot (default ``(role, index)``)."""
    from sglang.srt.deployment.plan import WorkerRole

    if worker.role is WorkerRole.FFN:
        from sglang.srt.afd.ffn_worker import run_ffn_worker as target
    else:
        from sglang.srt.managers.scheduler_process import run_scheduler_process as target
    return ProcessSpec(name=worker.name, target=target, args=(worker, ready),
                       slot=slot or (worker.role.value, worker.index), device=worker.device,
                       env=worker_env(worker), resources=dict(worker.resources))


def worker_env(worker, environ: Optional[Mapping[str, str]] = None) -> dict:
    """Extra environment of ``worker``'s process (set before it creates its CUDA context): a ``tdist_sp`` worker
    (``--enable-tdist-overlap``: its decomposition ops wait on peers with ``cuStreamWaitValue64``) gets
    ``CUDA_DEVICE_MAX_CONNECTIONS=32`` unless ``environ`` (default ``os.environ``) sets it
    (``sgl_kernel.tdist.layout.stream_queue_env``); every other worker nothing."""
    import os

    if worker.executor.name != "tdist_sp":
        return {}
    from sgl_kernel.tdist.layout import stream_queue_env

    return stream_queue_env(os.environ if environ is None else environ)


def detokenizer_spec(server_args, port_args, tokenizer_spec=None) -> ProcessSpec:
    """The :class:`ProcessSpec` of the detokenizer process (one CPU; node 0 / the driver's side only).
    ``tokenizer_spec``: a :class:`~sglang.srt.managers.backend_tokenizer.BackendTokenizerSpec` of the front end's
    tokenizer (the detokenizer then imports neither transformers nor torch); None: it loads the HF tokenizer."""
    from sglang.srt.managers.detokenizer_manager import run_detokenizer_process

    return ProcessSpec(name="sglang::detokenizer", target=run_detokenizer_process,
                       args=(server_args, port_args, None, False, tokenizer_spec), slot=("detokenizer", 0),
                       resources={"CPU": 1.0})
