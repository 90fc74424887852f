"""Control requests of the TokenizerManager: ``/flush_cache`` and the internal state, sent to every scheduler
(one per data-parallel AFD attention worker, addressed by ``dp_rank``) and answered once all replied.

CPU-only. :class:`TokenizerControlMixin` is mixed into
:class:`~sglang.srt.managers.tokenizer_manager.TokenizerManager`; the host provides ``start()``, ``_send(msg)``,
``_dp_socks`` (the data-parallel scheduler sockets, empty without data parallelism), ``control_timeout_s``, the
dicts ``_control_futs``, ``_control_locks``, ``_control_replies`` and the round counter ``_control_seq``; its
receive loop hands every :class:`FlushCacheReqOutput` / :class:`GetInternalStateReqOutput` to
:meth:`_on_control_reply`.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable, Union

from sglang.srt.managers.io_struct import (
    FlushCacheReqInput,
    FlushCacheReqOutput,
    GetInternalStateReq,
    GetInternalStateReqOutput,
)

logger = logging.getLogger(__name__)


class TokenizerControlMixin:
    """Flush the cache / read the internal state of every scheduler (see the module docstring)."""

    async def flush_cache(self) -> FlushCacheReqOutput:
        """Ask every scheduler (each data-parallel AFD attention worker) to drop its prefix cache; a
        scheduler refuses while it has requests.

        Returns:
            ``success`` only when every scheduler flushed; otherwise ``message`` names each one that
            refused and why (the others did flush).
        Raises:
            RequestError(503): some scheduler gave no answer within ``control_timeout_s``.
        """
        n = max(len(self._dp_socks), 1)
        replies = await self._control("flush", lambda seq: [FlushCacheReqInput(dp_rank=a, seq=seq) for a in range(n)])
        if n == 1:
            return replies[0]
        refused = sorted((r for r in replies if not r.success), key=lambda r: r.dp_rank)
        if not refused:
            return FlushCacheReqOutput(success=True)
        why = "; ".join(f"data-parallel scheduler {r.dp_rank}: {r.message or 'refused'}" for r in refused)
        return FlushCacheReqOutput(success=False, message=f"Cache not flushed on {len(refused)} of {n} "
                                                          f"data-parallel schedulers ({why}); the others flushed.")

    async def get_internal_state(self) -> dict[str, Any]:
        """The first scheduler's state dict (KV usage, queue lengths, limits); see :meth:`get_internal_states`."""
        return (await self.get_internal_states())[0]

    async def get_internal_states(self) -> list[dict[str, Any]]:
        """Every scheduler's state dict (one per data-parallel AFD attention worker, in worker order; one
        without data parallelism), as SGLang's ``/get_server_info`` ``internal_states``.

        Raises:
            RequestError(503): some scheduler gave no answer within ``control_timeout_s``.
        """
        n = max(len(self._dp_socks), 1)
        out = await self._control("state", lambda seq: [GetInternalStateReq(dp_rank=a, seq=seq) for a in range(n)])
        return [dict(r.state) for r in sorted(out, key=lambda r: r.dp_rank)]

    async def _control(self, key: str, make_msgs: Callable[[int], list]) -> list:
        """Send the control messages ``make_msgs(seq)`` of a new round ``seq`` and wait for one reply to each
        (replies in arrival order; replies of earlier rounds, e.g. one that timed out, are dropped)."""
        self.start()
        lock = self._control_locks.setdefault(key, asyncio.Lock())
        async with lock:
            self._control_seq += 1
            msgs = make_msgs(self._control_seq)
            fut = asyncio.get_running_loop().create_future()
            self._control_futs[key] = fut
            self._control_replies[key] = (self._control_seq, len(msgs), [])
            for msg in msgs:
                self._send(msg)
            try:
                return await asyncio.wait_for(fut, timeout=self.control_timeout_s)
            except asyncio.TimeoutError:
                from sglang.srt.managers.tokenizer_manager import RequestError  # the host module (no cycle)

                got = len(self._control_replies[key][2])
                raise RequestError(503, f"the scheduler did not answer {type(msgs[0]).__name__} within "
                                        f"{self.control_timeout_s} s ({got} of {len(msgs)} answered)") from None
            finally:
                self._control_futs.pop(key, None)
                self._control_replies.pop(key, None)

    def _on_control_reply(self, msg: Union[FlushCacheReqOutput, GetInternalStateReqOutput]) -> None:
        """A scheduler's reply: resolve the waiting call once every scheduler asked has answered."""
        key = "flush" if isinstance(msg, FlushCacheReqOutput) else "state"
        fut = self._control_futs.get(key)
        if fut is None or fut.done():
            return
        seq, want, got = self._control_replies[key]
        if msg.seq != seq:
            logger.warning("dropping a %s of an earlier round (%d, now %d): it came after its round timed out",
                           type(msg).__name__, msg.seq, seq)
            return
        got.append(msg)
        if len(got) >= want:
            fut.set_result(got)
