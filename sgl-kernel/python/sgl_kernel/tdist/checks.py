"""Argument checks shared by the tdist ops (pure torch: importing this imports no Triton, so the decomposition ops
and CPU tests can use it without fixing Triton's interpreter mode for the process)."""

from __future__ import annotations

from typing import Sequence

import torch

DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def check_tensor(name: str, t: torch.Tensor, ndim: int, device: torch.device, dtype=None) -> None:
    """ValueError naming ``name`` unless ``t`` is a ``ndim``-D tensor on ``device`` (and of ``dtype`` if given)."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, the heap on {device}: move it to the heap's device")
    if dtype is not None and t.dtype != dtype:
        raise ValueError(f"{name} has dtype {t.dtype}, expected {dtype}")
    if t.dtype not in DTYPES and dtype is None:
        raise ValueError(f"{name} has dtype {t.dtype}; use one of {DTYPES}")


def check_rows(rows: Sequence[int], world: int, rank: int, have: int, what: str) -> tuple:
    """Validate per-rank row counts: ``world`` non-negative ints, this rank's equal to ``have``."""
    rows = tuple(int(r) for r in rows)
    if len(rows) != world:
        raise ValueError(f"{what}: rows has {len(rows)} entries, expected world={world}")
    if any(r < 0 for r in rows):
        raise ValueError(f"{what}: rows={rows} must be >= 0")
    if rows[rank] != have:
        raise ValueError(f"{what}: rows[{rank}]={rows[rank]} but this rank's tensor has {have} rows")
    return rows
