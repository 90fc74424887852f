"""SGLang's ``--watchdog-timeout`` for a scheduler rank: a stalled rank stops the server instead of hanging it.

Each scheduler process (every TP rank) runs a :class:`SchedulerWatchdog` thread. The event loop calls
:meth:`SchedulerWatchdog.beat` after every iteration (receive messages, run one forward step, send outputs);
an idle loop iterates at least every 0.5 s. When no iteration finished for ``timeout_s`` seconds, the rank
is stuck: typically inside a collective waiting for a TP peer that stopped (SIGSTOP, a hung GPU, a dead
NIC), which otherwise only the 30-minute gloo/NCCL timeout would end. The watchdog then logs every thread's
stack and exits the process with :data:`WATCHDOG_EXIT_CODE`; the launcher's child watch sees the dead
rank, fails every in-flight request with 503 (streams get an error event + ``[DONE]``), ``/health``
answers 503, and the server exits non-zero so an orchestrator restarts it.

The thread only reads a timestamp (it takes no lock the loop holds), and collectives release the GIL, so it
runs while the loop is blocked.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import sys
import threading
import time
from typing import Callable, Optional

logger = logging.getLogger(__name__)

WATCHDOG_EXIT_CODE = 75
"""Exit status of a scheduler rank stopped by its watchdog (the launcher names it in its error)."""


class SchedulerWatchdog:
    """Exit the process when the scheduler loop makes no progress for ``timeout_s`` seconds.

    Args:
        timeout_s: seconds one loop iteration may take (``--watchdog-timeout``; > 0).
        name: the rank's name for the log (e.g. ``"TP rank 1"``).
        on_expire: what to do on expiry (default: log, dump every thread's stack, ``os._exit(WATCHDOG_EXIT_CODE)``);
            tests pass a callback.
        clock: monotonic clock in seconds (tests).
    Raises:
        ValueError: ``timeout_s`` <= 0.
    """

    def __init__(self, timeout_s: float, name: str = "scheduler", on_expire: Optional[Callable[[], None]] = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not timeout_s > 0:
            raise ValueError(f"--watchdog-timeout must be positive seconds, got {timeout_s!r}")
        self.timeout_s = float(timeout_s)
        self.name = name
        self.on_expire = on_expire or self._exit
        self._clock = clock
        self._last = clock()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.expired = False

    def beat(self) -> None:
        """Record that one loop iteration finished (cheap: one float store)."""
        self._last = self._clock()

    def check(self) -> bool:
        """Fire ``on_expire`` once if the last beat is older than ``timeout_s``; returns whether it fired."""
        if self.expired or self._clock() - self._last <= self.timeout_s:
            return False
        self.expired = True
        self.on_expire()
        return True

    def start(self) -> "SchedulerWatchdog":
        """Start the daemon thread (checks every ``min(1, timeout_s / 4)`` seconds); returns self."""
        self.beat()
        period = min(1.0, self.timeout_s / 4)

        def loop() -> None:
            while not self._stop.wait(period):
                if self.check():
                    return

        self._thread = threading.Thread(target=loop, name="sglang-scheduler-watchdog", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the thread (idempotent)."""
        self._stop.set()

    def _exit(self) -> None:
        logger.error("%s: no scheduler step finished in %.0f s (--watchdog-timeout); a TP peer or the device is "
                     "stalled. Stacks of every thread follow; exiting so the server stops.", self.name, self.timeout_s)
        try:
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
            sys.stderr.flush()
        except Exception:  # noqa: BLE001 (best effort)
            pass
        os._exit(WATCHDOG_EXIT_CODE)
