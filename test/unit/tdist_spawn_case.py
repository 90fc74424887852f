"""Rank bodies for test_tdist_spawn.py (importable by the spawned ranks; no GPU, host stand-in heap)."""

from __future__ import annotations

import os
import time


def three_cases(heap, note, nccl, hang_in, raise_in):
    """Report cases c0..c2 one by one; rank 1 hangs (sleeps) in case ``hang_in`` or raises in ``raise_in``."""
    for i in range(3):
        note(f"c{i} start")
        if heap.rank == 1 and i == hang_in:
            time.sleep(600)
        if heap.rank == 1 and i == raise_in:
            raise RuntimeError(f"boom in c{i}")
        note.result(f"c{i}", {"rank": heap.rank, "world": heap.world})
        note(f"c{i} done")
    return {"finished": heap.rank, "connections": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS")}
