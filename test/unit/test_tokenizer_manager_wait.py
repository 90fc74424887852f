"""Regression: a request with no HTTP connection (the in-process Engine) whose outputs arrive more than
``disconnect_poll_s`` apart must still wake up (the poll window restarts; before the fix the wait timeout stuck
at 0 and ``wait_for(event.wait(), 0)`` never saw the event: a busy loop and a hung ``Engine.generate``)."""

from __future__ import annotations

import asyncio
import types

from sglang.srt.managers.tokenizer_manager import TokenizerManager


def test_wait_wakes_after_a_quiet_period_without_a_request():
    tm = types.SimpleNamespace(disconnect_poll_s=0.05)

    async def main() -> float:
        loop = asyncio.get_running_loop()
        event = asyncio.Event()
        poll = [loop.time()]
        loop.call_later(0.3, event.set)  # the output comes after several poll windows
        t0 = loop.time()
        await asyncio.wait_for(TokenizerManager._wait(tm, event, [], None, poll), timeout=5)
        return loop.time() - t0

    assert 0.25 < asyncio.run(main()) < 5
