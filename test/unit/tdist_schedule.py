"""Interleaving explorer for the tdist kernels under TRITON_INTERPRET=1 with simulated ranks (one process, CPU).

Each rank has a FIFO of launches (its stream: e.g. gemm(e), reduce(e), release(e) for e = 1..E). A random schedule
repeatedly picks a rank and tries to run its next launch to completion. The bounded-wait primitives record an
unsatisfiable wait in the interpreter at once (primitives.signal_wait_until, reason 3), so a launch whose waits are
not yet satisfied is detected, the heaps are restored from a snapshot taken before it (undoing its partial effects),
and the rank counts as blocked at that launch. If every unfinished rank is blocked, the schedule deadlocked: the
error names each rank's blocked kernel and signal (what the GPU run would have hung on).

This models every cross-rank interleaving of *whole* launches (a rank running several calls ahead of a slow peer, a
peer lagging at any step), i.e. the back-to-back reuse protocol (epochs, cumulative targets, buffer releases). It
does not model CTAs of one launch progressing partially (a kernel is all-or-nothing here).
"""

from __future__ import annotations

import random
from typing import Callable, List, Sequence, Tuple

Launch = Tuple[str, Callable[[], None]]


class Deadlock(AssertionError):
    """Every unfinished rank is blocked; the message names the kernel and signal each one waits for."""


def run_schedule(heaps: Sequence, queues: List[List[Launch]], seed: int, max_steps: int = 100_000) -> List[str]:
    """Run the per-rank launch queues in a random interleaving (``seed``); returns the trace of launches run
    (``"r<rank>:<name>"``). Raises :class:`Deadlock` when no rank can progress, AssertionError if a wait error is
    left recorded after a completed launch (the heaps' error records must stay clean)."""
    rng = random.Random(seed)
    pos = [0] * len(queues)
    trace: List[str] = []
    for _ in range(max_steps):
        live = [r for r in range(len(queues)) if pos[r] < len(queues[r])]
        if not live:
            return trace
        rng.shuffle(live)
        blocked = {}
        for r in live:
            name, fn = queues[r][pos[r]]
            snap = [h.local.clone() for h in heaps]
            fn()
            err = heaps[r].wait_error()  # the launching rank's own record names its kernel and signal
            if err is None and any(h.wait_error() for h in heaps):
                err = next(h.wait_error() for h in heaps if h.wait_error())
            if err is not None:
                for h, s in zip(heaps, snap):
                    h.local.copy_(s)
                blocked[r] = f"rank {r} at {name}: {err}"
                continue
            pos[r] += 1
            trace.append(f"r{r}:{name}")
            break
        else:
            raise Deadlock("deadlock after " + (", ".join(trace[-8:]) or "nothing") + " | "
                           + " | ".join(blocked[r] for r in sorted(blocked)))
    raise AssertionError(f"schedule did not finish in {max_steps} steps")
