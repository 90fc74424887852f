"""Torch references of the tdist kernels (fp32 math, then cast), for tests and the benchmark.

All take per-rank lists of tensors (the simulated group's view) so one process can check N ranks.
"""

from __future__ import annotations

from typing import List, Sequence, Tuple

import torch


def ag_gemm_ref(shards: Sequence[torch.Tensor], b: torch.Tensor) -> torch.Tensor:
    """``cat(shards) @ b`` in fp32, cast to the shards' dtype: [sum M_r, N]."""
    return (torch.cat([s.float() for s in shards]) @ b.float()).to(shards[0].dtype)


def gemm_rs_ref(a_per_rank: Sequence[torch.Tensor], b_per_rank: Sequence[torch.Tensor],
                rows: Sequence[int]) -> List[torch.Tensor]:
    """``sum_r a_r @ b_r`` in fp32 ([M, N]), split by ``rows``; rank r gets its rows cast to a's dtype."""
    total = sum(a.float() @ b.float() for a, b in zip(a_per_rank, b_per_rank))
    return [t.to(a_per_rank[0].dtype) for t in torch.split(total, list(rows))]


def all_to_all_ref(xs: Sequence[torch.Tensor], send_counts: Sequence[Sequence[int]]
                   ) -> Tuple[List[torch.Tensor], List[List[int]]]:
    """``all_to_all_single`` semantics: rank r's x rows are grouped by destination (``send_counts[r][d]`` rows for
    d in order); rank d receives, in source order, the rows every source sent it. Returns (outputs, recv_counts)."""
    world = len(xs)
    pieces = [list(torch.split(x, list(c))) for x, c in zip(xs, send_counts)]
    outs = [torch.cat([pieces[s][d] for s in range(world)]) for d in range(world)]
    recv = [[int(send_counts[s][d]) for s in range(world)] for d in range(world)]
    return outs, recv


def compare(got: torch.Tensor, ref: torch.Tensor, tag: str, rel: float = 2e-2) -> List[str]:
    """Failures (empty list = pass) of ``got`` vs ``ref``: shape mismatch, non-finite values (unwritten rows), or
    max abs error above ``rel * max(1, max|ref|)``. Empty tensors (a rank that owns no rows) compare equal when the
    shapes match: the GPU group of 2026-11-25 stalled because the old test helper called ``.max()`` on an empty
    reference, which raised on that rank only, so it abandoned the remaining collective calls and its peers waited
    forever for its GEMM-RS tiles."""
    if tuple(got.shape) != tuple(ref.shape):
        return [f"{tag}: shape {tuple(got.shape)} != reference {tuple(ref.shape)}"]
    if got.numel() == 0:
        return []
    g, r = got.float(), ref.float().to(got.device)
    if not torch.isfinite(g).all():
        return [f"{tag}: non-finite output (unwritten rows?)"]
    scale = max(1.0, float(r.abs().max()))
    err = float((g - r).abs().max())
    return [] if err <= rel * scale else [f"{tag}: max error {err:.4g} (scale {scale:.3g})"]
