"""A uvicorn server whose shutdown ends in-flight requests cleanly.

On SIGINT/SIGTERM uvicorn stops accepting connections and waits ``timeout_graceful_shutdown`` seconds for
open responses; then it cancels their tasks, which cut streams mid-way (no error event, no
``data: [DONE]``) and logged ASGI ``CancelledError`` tracebacks. :class:`GracefulServer` gives in-flight
requests most of the grace period to finish normally, then calls ``on_deadline`` (the TokenizerManager fails
every in-flight request with 503 "the server is shutting down"), so each stream sends an error event and
``data: [DONE]`` and every response completes before uvicorn's deadline: nothing is cancelled.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable, Optional

import uvicorn

logger = logging.getLogger(__name__)


def fail_deadline_s(grace_s: float) -> float:
    """Seconds after shutdown starts at which unfinished requests are failed: 1 s before the grace period ends
    (half of it for grace periods under 2 s)."""
    return max(grace_s - 1.0, grace_s / 2)


class GracefulServer(uvicorn.Server):
    """``uvicorn.Server`` that calls ``on_deadline()`` :func:`fail_deadline_s` seconds into a graceful shutdown.

    Args:
        config: the ``uvicorn.Config`` (its ``timeout_graceful_shutdown`` is the grace period; None: 5 s).
        on_deadline: called once on the event loop when requests are still open at the deadline.
    """

    def __init__(self, config: uvicorn.Config, on_deadline: Optional[Callable[[], None]] = None) -> None:
        super().__init__(config)
        self.on_deadline = on_deadline

    async def shutdown(self, sockets=None) -> None:
        """uvicorn's shutdown, with in-flight requests failed cleanly before its deadline."""
        handle = None
        if self.on_deadline is not None:
            grace = self.config.timeout_graceful_shutdown
            grace = 5.0 if grace is None else float(grace)
            handle = asyncio.get_running_loop().call_later(fail_deadline_s(grace), self._deadline)
        try:
            await super().shutdown(sockets)
        finally:
            if handle is not None:
                handle.cancel()

    def _deadline(self) -> None:
        if self.server_state.tasks or self.server_state.connections:
            logger.info("shutdown: ending %d open request(s) with an error event", len(self.server_state.tasks))
            self.on_deadline()
