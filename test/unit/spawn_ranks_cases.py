"""Rank bodies of ``test_spawn_ranks.py`` (importable by the ranks: a test module's functions are not)."""

from __future__ import annotations

import os
import sys


def env_and_path(ps, extra_path: str) -> dict:
    """What this rank sees: the probe variable, whether ``extra_path`` is on ``sys.path``, its pid."""
    return {"probe": os.environ.get("SPAWN_RANKS_PROBE"), "has_path": extra_path in sys.path, "pid": os.getpid()}


def all_reduce_rank(ps) -> float:
    """All-reduce of one 1.0 per rank over the ranks' group."""
    import torch
    import torch.distributed as dist

    t = torch.ones(1)
    dist.all_reduce(t, group=ps.device_group)
    return float(t.item())


def raise_on_rank_one(ps) -> int:
    """Rank 1 raises ValueError; rank 0 returns 0."""
    if ps.tp_rank == 1:
        raise ValueError("rank one refuses")
    return 0
