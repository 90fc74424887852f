"""Where ``--enable-tdist-overlap``'s sequence-parallel layout pays: the smallest batch (token count T) from which a
worker runs it instead of the plain sequential executor (each technique turns itself off where it loses).

The layout alone costs time: on 4 x H200 (2026-11-27, ``benchmark/tdist/bench_layer_stack.py``, Llama-3.3-70B cut to 4
layers, TP 4) the layout on plain NCCL collectives (all-gather + GEMM, GEMM + all-reduce + slice) took 16.8 / 33.8 ms
at T 4096 / 8192 against 14.5 / 30.0 ms for the sequential all-reduce path. Only the overlapped decomposition
(Wang et al., ASPLOS 2023, sec. 3; Zheng et al., "Triton-distributed", 2025, sec. 3.2-3.3) wins that back, and the
fused ops route a GEMM to it only from its calibrated break-even M (``sgl_kernel.tdist.auto.CalibrationTable``).
So the layout runs where the decomposition takes at least :data:`DECOMP_SHARE` of the layer's linear work (GEMM
FLOPs, K x N per row): at T 4096 the table routed only gate_up there (55% of the work) and the stack lost (0.992x);
at T 8192 qkv, gate_up and down (92%) and it won (1.091x).

:func:`min_tokens_from_table` reads that T off a table for a model's shapes; :func:`auto_min_tokens` applies it to
a worker's ops: the built-in table of the GPU model, at least :data:`UNKNOWN_GPU_MIN_TOKENS` for GPUs without one
(and for the Triton-kernel producers), never for torch collectives (nothing to overlap). CPU-safe: no CUDA import
unless the ops are the fused ones.
"""

from __future__ import annotations

import logging
from typing import Any, List, Tuple

logger = logging.getLogger(__name__)

DECOMP_SHARE = 0.75  # share of the layer's GEMM work the decomposition must take (0.55 lost, 0.92 won; see above)
UNKNOWN_GPU_MIN_TOKENS = 8192  # the only T measured faster with the layout (4 x H200); GPUs without a table
NEVER_TOKENS = 1 << 62  # a threshold no batch reaches: the layout is never used


def layer_gemm_shapes(model: Any) -> List[Tuple[str, int, int]]:
    """``(kind, K, N)`` of every column-parallel (``"ag"``: weight ``[N_local, K]``) and row-parallel (``"rs"``:
    weight ``[N, K_local]``) linear in ``model.decoder_layers``, per rank, as the fused ops see them (one entry per
    module, repeats included: the list weights shapes by how often they run)."""
    from sglang.srt.layers.linear import RowParallelLinear
    from sglang.srt.model_executor.executors.sequence_parallel import _SP_LINEARS

    out = []
    for layer in model.decoder_layers:
        for m in layer.modules():
            w = getattr(m, "weight", None)
            if isinstance(m, _SP_LINEARS) and w is not None and w.dim() == 2:
                out.append(("rs" if isinstance(m, RowParallelLinear) else "ag", int(w.shape[1]), int(w.shape[0])))
    return out


def decomp_share(shapes: List[Tuple[str, int, int]], table: Any, world: int, tokens: int) -> float:
    """Share (0..1) of the GEMM work ``sum K x N`` of ``shapes`` that ``table.choose`` sends to the decomposition
    for a batch of ``tokens`` rows at ``world`` ranks (no symmetric-memory group, as in the server)."""
    total = sum(k * n for _, k, n in shapes)
    won = sum(k * n for kind, k, n in shapes if table.choose(kind, k, n, world, tokens) == "decomp")
    return won / total if total else 0.0


def min_tokens_from_table(shapes: List[Tuple[str, int, int]], table: Any, world: int,
                          share: float = DECOMP_SHARE) -> int:
    """The smallest T from which :func:`decomp_share` stays >= ``share`` at every larger T (the table is a step
    function of T, changing only at its measured M and break-even values, which are the candidates checked), and
    never below the smallest M the table measured for these shapes (it only extrapolates there);
    :data:`NEVER_TOKENS` if it never does. Raises ValueError on share outside (0, 1]."""
    if not 0.0 < share <= 1.0:
        raise ValueError(f"share={share} must be in (0, 1]")
    keys = {(kind, k, n, world) for kind, k, n in shapes}
    measured = {int(e[4]) for e in table.best if tuple(e[:4]) in keys}
    floor = min(measured, default=1)  # below the smallest measured M the table only extrapolates: not trusted
    cands = {floor, int(table.default_min_m)} | measured
    cands |= {int(e[4]) for e in table.entries if tuple(e[:4]) in keys}
    cands = {c for c in cands if c >= floor}
    best = NEVER_TOKENS  # beyond the largest finite candidate the table no longer changes
    for t in sorted((c for c in cands if c < NEVER_TOKENS), reverse=True):
        if decomp_share(shapes, table, world, t) < share:
            break
        best = t
    return best


def _fused_table(ops: Any) -> Tuple[Any, bool]:
    """(the calibration table the fused decomposition ops use, whether it is a measured one: given explicitly or
    built in for this GPU model)."""
    import torch

    from sgl_kernel.tdist.auto import BUILTIN_TABLES, CalibrationTable, table_for

    if ops.table is not None:
        return ops.table, True
    dev = ops.heap.device
    if dev.type != "cuda":
        return CalibrationTable(), False
    name = torch.cuda.get_device_name(dev)
    return table_for(name), any(key in name for key, _ in BUILTIN_TABLES)


def auto_min_tokens(model: Any, ops: Any) -> int:
    """The token count from which ``model``'s forwards run the sequence-parallel layout on ``ops`` (logged once per
    call, with the rank): torch collectives (``ops.name != "tdist"``): never (:data:`NEVER_TOKENS`, the layout
    alone only adds work); the fused decomposition: :func:`min_tokens_from_table` of its table, at least
    :data:`UNKNOWN_GPU_MIN_TOKENS` when the GPU model has no measured table; the Triton-kernel producers
    (``"ce"`` / ``"sm"``, slower than NCCL in every measurement): :data:`UNKNOWN_GPU_MIN_TOKENS`."""
    rank = getattr(ops, "rank", 0)
    if getattr(ops, "name", "") != "tdist":
        logger.info("[rank %d] tdist overlap: %s sequence-parallel ops only add work; every forward runs the "
                    "sequential executor", rank, getattr(ops, "name", type(ops).__name__))
        return NEVER_TOKENS
    if getattr(ops, "producer", "decomp") != "decomp":
        t, why = UNKNOWN_GPU_MIN_TOKENS, f"producer {ops.producer!r} (no calibration): conservative default"
    else:
        table, measured = _fused_table(ops)
        t = min_tokens_from_table(layer_gemm_shapes(model), table, ops.world_size)
        why = f"calibration table: the decomposition takes >= {DECOMP_SHARE:.0%} of the layer's GEMM work"
        if not measured:
            t, why = max(t, UNKNOWN_GPU_MIN_TOKENS), "no measured table for this GPU model: conservative default"
    if t >= NEVER_TOKENS:
        logger.info("[rank %d] tdist overlap: the sequence-parallel layout never pays here (%s); every forward runs "
                    "the sequential executor", rank, why)
    else:
        logger.info("[rank %d] tdist overlap: sequence-parallel layout for forwards of >= %d tokens, sequential "
                    "executor below (%s)", rank, t, why)
    return t
