"""The communicator each ``benchmark/tokenweave/bench_layer.py`` layer-mode variant runs, and the ratio pairs of its table.

* baselines (``nocomm``, ``nccl``, ``nccl_symm``, ``custom``) get their communicator with the same fused
  add-RMSNorm kernel TokenWeave runs (:func:`nccl_symm.fused_norm`), so only the communication differs;
* ``tokenweave`` builds its own, as the server does (``--enable-tokenweave``: tw-comm with the packaged calibrated
  crossover table, which on H200 x2/x4 puts the overlapped calls of >= ~360 tokens at hidden 8192 on the bulk-copy
  two-shot ``p2p_twoshot_bulk``; TokenWeave, Gond et al. 2025, sec. 3.3, runs that kernel on 16 CTAs), with the
  server's default sharded residual (the split forward's fused calls update only the rank's residual rows and
  gather only the normed rows, TokenWeave sec. 3-4);
* ``tokenweave_oldcomm`` the same TokenWeave executor on tw-comm with the bulk kernel forbidden
  (``TwCommConfig.bulk_twoshot=False``: the pre-bulk two-shot), so bulk vs old comm is one run's A/B;
* ``tokenweave_full`` TokenWeave with ``--tokenweave-full-residual`` (the server's communicator; every rank keeps
  and gathers every residual row), so sharded (``tokenweave``) vs full residual is one run's A/B;
* ``tokenweave_oldsplit`` TokenWeave with the legacy unbounded split planner (the server's communicator; the
  benchmark calls ``executor.set_split_skew(None)``), so the balanced cut (``tokenweave``) vs the old one is one
  run's A/B (the overlap diagnosis, ``benchmark/tokenweave/overlap_timeline.py``);
* ``tokenweave_selcarve`` TokenWeave with the GEMM SM carveout only on the GEMMs that run beside the other split's
  AllReduce (``executor.set_carveout_scope("overlap")``, :mod:`sglang.srt.tokenweave.overlap`), the others (and the
  planner's waves of them) on every SM, so capping every GEMM (``tokenweave``) vs only the overlapped ones is one
  run's A/B.
"""

from __future__ import annotations

from typing import Any, Optional

OLDCOMM = "tokenweave_oldcomm"
FULL = "tokenweave_full"
OLDSPLIT = "tokenweave_oldsplit"
SELCARVE = "tokenweave_selcarve"


def variant_comm(variant: str, ps: Any, mc: Any, tokens: list[int], device: str, notes: set,
                 comm_sms: Optional[int] = None):
    """The communicator of ``variant``'s ModelRunner (None: the runner builds its own, as the server would);
    ``False`` when the variant cannot run here (reason added to ``notes``).

    ps: the rank's ParallelState; mc: the model config (``hidden_size``, ``dtype``); tokens: the run's token
    counts (the largest sizes the symmetric / tw-comm buffers); comm_sms: ``--comm-sms`` (the overlap SM budget
    of ``tokenweave_oldcomm``, None: tw-comm's default 16)."""
    from benchmark.comm.nccl_symm import fused_norm, nccl_symm_communicator
    from sglang.srt.distributed.communicator import NoCommCommunicator, create_communicator

    if variant in ("nocomm", "split_nocomm"):
        return fused_norm(NoCommCommunicator.create(ps))
    if variant == "nccl":
        return fused_norm(create_communicator(ps, "torch"))
    if variant == "custom" and device == "cuda":
        return fused_norm(create_communicator(ps, "custom"))
    if variant == "nccl_symm":
        comm = nccl_symm_communicator(ps, max(tokens) * mc.hidden_size, mc.dtype, notes)
        return False if comm is None else fused_norm(comm)
    if variant == OLDCOMM:
        return old_tw_communicator(ps, max(tokens), mc.hidden_size, comm_sms)
    return None


def old_tw_communicator(ps: Any, max_tokens: int, hidden_size: int, comm_sms: Optional[int] = None):
    """tw-comm's TokenWeave communicator without the bulk-copy kernel (the comm before the bulk two-shot):
    workspace for ``max_tokens`` x ``hidden_size`` bf16 rows (at least 64 MiB), overlapped calls on ``comm_sms``
    CTAs. Raises ValueError on a bad ``comm_sms``; ImportError/OSError when tw-comm cannot load (on GPU)."""
    from sglang.srt.distributed.tw_communicator import TwCommunicator, workspace_bytes

    return TwCommunicator(ps, comm_sms=comm_sms, max_bytes=workspace_bytes(max_tokens, hidden_size),
                          bulk_twoshot=False)


def tune_executor(variant: str, executor: Any) -> None:
    """Set a TokenWeave variant's executor knobs (after the runner built it as the server would): no carveout
    (``tokenweave_nocarve``), the legacy split planner (:data:`OLDSPLIT`), the selective carveout
    (:data:`SELCARVE`); other variants: nothing."""
    if variant == "tokenweave_nocarve":
        executor.set_gemm_carveout(0)
    elif variant == OLDSPLIT:
        executor.set_split_skew(None)
    elif variant == SELCARVE:
        executor.set_carveout_scope("overlap")


def ratio_pairs(variants: list[str]) -> list[tuple[str, str]]:
    """(numerator, denominator) variant pairs of the layer table: TokenWeave vs every baseline in the run, tdist vs
    tp, the no-carveout, old-comm, full-residual and old-split TokenWeave rows vs nccl, TokenWeave (bulk comm) vs
    TokenWeave (old comm), TokenWeave (the default sharded residual) vs the full residual and TokenWeave (balanced
    cut) vs the old split planner, and the selective-carveout row vs nccl and vs TokenWeave."""
    have = set(variants)
    pairs = [("tokenweave", b) for b in ("nccl", "nccl_symm", "custom", "nocomm") if b in have and "tokenweave" in have]
    pairs += [("tdist", "tp")] if {"tdist", "tp"} <= have else []
    pairs += [(v, "nccl") for v in ("tokenweave_nocarve", OLDCOMM, FULL, OLDSPLIT, SELCARVE) if {v, "nccl"} <= have]
    pairs += [("tokenweave", OLDCOMM)] if {"tokenweave", OLDCOMM} <= have else []
    pairs += [("tokenweave", FULL)] if {FULL, "tokenweave"} <= have else []
    pairs += [("tokenweave", OLDSPLIT)] if {OLDSPLIT, "tokenweave"} <= have else []
    pairs += [(SELCARVE, "tokenweave")] if {SELCARVE, "tokenweave"} <= have else []
    return pairs
