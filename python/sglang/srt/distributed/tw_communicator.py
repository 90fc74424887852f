"""The tw-comm communicator (``--comm-backend tw``): TokenWeave's fused AllReduce + residual + RMSNorm.

``all_reduce_add_rmsnorm`` is the call site TokenWeave replaces (Gond et al. 2025, sec. 3.2-3.3): on GPU
it runs tw-comm's kernels over a long-lived :class:`~sglang.srt.distributed.tw_comm.TwCommWorkspace`
(one-shot for small inputs; for large ones the *RMSNorm reordering* -- ReduceScatter, residual add +
RMSNorm on this rank's 1/N of the tokens, AllGather -- fused in one kernel, or the copy-engine variant on
few SMs when the call overlaps compute); on CPU (gloo) it runs the same ReduceScatter -> add + RMSNorm
-> AllGather decomposition with torch collectives, so CPU tests exercise the reordered math. The other
collectives are plain ``torch.distributed``.

Calls are stream-ordered on the caller's current stream; an overlapped caller (TokenWeave's executor on
its communication stream) passes ``overlap=True`` and the SM budget ``--tokenweave-comm-sms``.

``residual_sharded=True`` (TokenWeave's split forwards by default, unless ``--tokenweave-full-residual``;
TokenWeave sec. 3-4 keeps the residual sharded between layers): the call reads and updates only this rank's rows
``owned_range(T, world, rank)`` of ``residual`` and all-gathers just the normed rows, so the other rows of the
residual are stale afterwards. A caller may pass it only when every call on that residual chain does (the fused
AllReduce + add + RMSNorm is the residual's only consumer) with the same row count T, so each call's owned rows are
the previous call's; every backend then honours it (one-shot / Lamport picks become the two-shot kernel, the NCCL
fallback and the CPU path reduce to the owner and gather the normed rows only).

A ``--enable-tokenweave`` worker (``--comm-backend auto``) runs :class:`TokenWeaveCommunicator`: this communicator for
the split halves only, the plain server's communicator for every other call (so unsplit forwards are never
slower than without TokenWeave).
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch

from sglang.srt.distributed.communicator import Communicator, TorchCommunicator

logger = logging.getLogger(__name__)


DEFAULT_WORKSPACE_BYTES = 64 << 20


def workspace_bytes(max_tokens: int, hidden_size: int, elem_size: int = 2) -> int:
    """Workspace input capacity in bytes for calls of up to ``max_tokens`` x ``hidden_size`` elements of
    ``elem_size`` bytes (the largest prefill chunk), at least tw-comm's 64 MiB default: with it no call of the
    model -- split or unsplit -- falls back to NCCL + copy + a separate norm (TokenWeave sec. 3.3). Raises
    ValueError for non-positive sizes."""
    if min(max_tokens, hidden_size, elem_size) <= 0:
        raise ValueError(f"workspace_bytes: max_tokens={max_tokens}, hidden_size={hidden_size}, "
                         f"elem_size={elem_size} must be positive")
    return max(DEFAULT_WORKSPACE_BYTES, max_tokens * hidden_size * elem_size)


class TwCommunicator(Communicator):
    """tw-comm collectives over a TP group (see the module docstring).

    Args:
        ps: the rank's :class:`~sglang.srt.distributed.parallel_state.ParallelState` (world >= 1).
        comm_sms: SM budget of overlapped calls (None: the workspace's ``overlap_sms``).
        max_bytes: the largest ``[T, H]`` input in bytes the workspace stages (None: tw-comm's 64 MiB default);
            size it from the largest prefill (:func:`workspace_bytes`) so no call falls back to NCCL.
        bulk_twoshot: ``TwCommConfig.bulk_twoshot``: None (default) the calibrated table of this GPU / world
            decides (H200 x2/x4: the bulk-copy two-shot ``p2p_twoshot_bulk`` for overlapped calls of >= ~360
            tokens at hidden 8192); True every two-shot call on the bulk kernel (sm_90+); False never (the
            pre-bulk comm, e.g. as a benchmark baseline).
    Raises:
        ValueError: ``comm_sms`` outside [1, 256] or ``max_bytes <= 0``.
    """

    name = "tw"
    supports_overlap = True
    fuses_add_rmsnorm = True
    supports_out = True  # all_reduce_add_rmsnorm(..., out=) writes the normed rows into the caller's tensor
    supports_sharded_residual = True  # all_reduce_add_rmsnorm(..., residual_sharded=True) (module docstring)

    def __init__(self, ps: Any, comm_sms: Optional[int] = None, max_bytes: Optional[int] = None,
                 bulk_twoshot: Optional[bool] = None):
        world = 1 if ps is None else ps.tp_size
        super().__init__(0 if ps is None else ps.tp_rank, world)
        if comm_sms is not None and not 1 <= comm_sms <= 256:
            raise ValueError(f"--tokenweave-comm-sms={comm_sms} must be in [1, 256]")
        self.torch = TorchCommunicator.create(ps)
        self.comm_sms = comm_sms
        self.group = None if ps is None else ps.device_group
        self.ws = None
        if ps is not None and world > 1 and ps.device == "cuda":
            from sglang.srt.distributed.tw_comm import TwCommConfig, TwCommWorkspace

            cfg = TwCommConfig(bulk_twoshot=bulk_twoshot)
            if max_bytes is not None:
                cfg = TwCommConfig(max_bytes=max_bytes, bulk_twoshot=bulk_twoshot)
            self.ws = TwCommWorkspace(ps.device_group, ps.torch_device(), cfg)

    @classmethod
    def create(cls, ps: Any) -> "TwCommunicator":
        """Factory for :func:`~sglang.srt.distributed.communicator.create_communicator` (default SM budget)."""
        return cls(ps)

    def all_reduce(self, x):
        """Elementwise sum over the TP ranks, same shape/dtype/device as ``x`` (torch.distributed on the TP
        device group; see the :class:`~sglang.srt.distributed.communicator.Communicator` contract)."""
        return self.torch.all_reduce(x)

    def all_gather(self, x, dim=-1):
        """Every rank's ``x`` concatenated along ``dim`` in rank order: ``[..., n, ...] -> [..., world*n, ...]``
        (torch.distributed)."""
        return self.torch.all_gather(x, dim)

    def reduce_scatter(self, x):
        """This rank's rows ``[rank*N/world, (rank+1)*N/world)`` of the elementwise sum of ``x`` ``[N, ...]``
        (torch.distributed). Raises ValueError when ``N % world != 0``."""
        return self.torch.reduce_scatter(x)

    def all_reduce_add_rmsnorm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                               overlap: bool = False, out: Optional[torch.Tensor] = None,
                               residual_sharded: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rmsnorm(residual + allreduce(x)) * weight, residual + allreduce(x))``, x/residual ``[T, H]``.

        GPU: tw-comm's fused kernel (bf16/fp16; variant by size, ``overlap`` selects the few-SM variant and
        the ``comm_sms`` budget); CPU/other dtypes: ReduceScatter -> add + RMSNorm on owned rows -> AllGather.
        ``out``: a contiguous ``[T, H]`` tensor of x's dtype the normed rows are written into (and returned; the
        fused kernel writes it directly, other paths copy), e.g. a row range of a preallocated output.
        ``residual_sharded``: only this rank's rows ``owned_range(T, world, rank)`` of the residual are read and
        updated (the returned residual's other rows are stale; see the module docstring); the normed rows are
        complete on every rank either way.
        """
        if self.ws is not None and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16):
            x, residual = x.contiguous(), residual.contiguous()
            kw = {}
            if residual_sharded:
                kw = self._sharded_backend(x.shape[0], x.shape[1], overlap, x.element_size())
                if kw is None:  # no staging room: NCCL reduce to the owners, gather the normed rows
                    return self._sharded_torch(x, residual, weight, eps, out)
            normed = self.ws.allreduce_rmsnorm(x, residual, weight, eps, out=out, overlap=overlap,
                                               max_sms=self.comm_sms if overlap else None, **kw)
            return normed, residual
        if self.world_size == 1:
            from sglang.srt.ops_ref import rmsnorm_ref

            normed, residual = rmsnorm_ref(x, weight, eps, residual)
        elif x.is_cuda and not residual_sharded:  # fp32 on GPU: no fused kernel; NCCL all-reduce, reference norm
            normed, residual = super().all_reduce_add_rmsnorm(x, residual, weight, eps)
        else:
            return self._sharded_torch(x, residual, weight, eps, out, gather_residual=not residual_sharded)
        if out is not None:
            normed = out.copy_(normed)
        return normed, residual

    def _sharded_backend(self, tokens: int, hidden: int, overlap: bool, elem: int) -> Optional[dict]:
        """The ``allreduce_rmsnorm`` keywords of a residual-sharded call: the selected backend when it updates only
        the owned rows (two-shot / pipe / bulk / CE), the two-shot kernel (bulk when ``bulk_twoshot``) instead of a
        one-shot or Lamport pick (those read every residual row), None when two-shot staging does not fit (NCCL)."""
        from sglang.srt.distributed.tw_comm import TwBackend

        b = self.ws.select(tokens, hidden, overlap, elem)
        if b in (TwBackend.ONESHOT, TwBackend.LAMPORT):
            b = TwBackend.BULK if self.ws.config.bulk_twoshot else TwBackend.TWOSHOT
        if b not in (TwBackend.TWOSHOT, TwBackend.PIPE, TwBackend.BULK, TwBackend.CE):
            return None
        return {"backend": b, "residual_sharded": True}

    def _sharded_torch(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                       out: Optional[torch.Tensor], gather_residual: bool = False
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """The torch.distributed RS -> add + RMSNorm -> AG decomposition (:func:`rs_norm_ag_dist`, fp32 sums);
        without ``gather_residual`` only this rank's residual rows are new (the others are the input's, stale) and
        only the normed rows are gathered. Returns ``(normed [T, H] in x's dtype, new residual [T, H])``."""
        from sgl_kernel.tw_comm.reference import rs_norm_ag_dist

        new_res, normed = rs_norm_ag_dist(x, residual, weight, eps, group=self.group,
                                          gather_residual=gather_residual)
        normed, residual = normed.to(x.dtype), new_res.to(residual.dtype)
        if out is not None:
            normed = out.copy_(normed)
        return normed, residual

    def describe(self) -> str:
        """One log line: world size, workspace (GPU) or the torch reordered path (CPU), SM budget."""
        where = "tw-comm workspace" if self.ws is not None else "RS -> add+RMSNorm -> AG over torch.distributed"
        return f"TwCommunicator(world_size={self.world_size}, {where}, comm_sms={self.comm_sms})"


class TokenWeaveCommunicator(Communicator):
    """A TokenWeave worker's communicator: the plain server's communicator for every unsplit call, tw-comm's only
    for the split halves (so an unsplit forward under ``--enable-tokenweave`` runs exactly as without it).

    Contract (the one place that routes a TokenWeave worker's calls):

    * ``all_reduce`` / ``all_gather`` / ``reduce_scatter``, ``fuses_add_rmsnorm`` and the four-argument
      ``all_reduce_add_rmsnorm(x, residual, weight, eps)`` are ``plain``'s: the layers' own calls (every forward
      below ``--tokenweave-min-tokens``, every decode step and its CUDA graph, the embedding / logits collectives)
      are bit for bit the calls the same server makes without ``--enable-tokenweave`` (``plain`` is
      :func:`~sglang.srt.distributed.communicator.create_communicator`'s pick for ``--comm-backend``: custom
      all-reduce / NCCL on GPU, gloo on CPU).
    * ``all_reduce_add_rmsnorm(..., overlap=<bool>, out=, residual_sharded=)``: a call that passes ``overlap`` (True
      or False), ``out`` or ``residual_sharded`` is a TokenWeave split-half call (only
      :class:`~sglang.srt.tokenweave.executor.TokenWeaveExecutor` makes them, from its split forwards) and runs on
      ``split`` (:class:`TwCommunicator`: the fused, sharded, few-SM overlapped kernels; TokenWeave, Gond et al.
      2025, sec. 3.2-3.3). A split forward makes every norm call of its residual chain this way, so the sharded
      residual's chain never mixes the two communicators.

    Args:
        plain: the non-TokenWeave communicator of the same ranks (any :class:`Communicator`).
        split: tw-comm's communicator of the same ranks.
    Raises:
        ValueError: the two disagree on rank or world size.
    """

    name = "tokenweave"
    supports_overlap = True
    supports_out = True
    supports_sharded_residual = True

    def __init__(self, plain: Communicator, split: TwCommunicator):
        if (plain.rank, plain.world_size) != (split.rank, split.world_size):
            raise ValueError(f"TokenWeaveCommunicator: plain rank/world {plain.rank}/{plain.world_size} != split's "
                             f"{split.rank}/{split.world_size}")
        super().__init__(plain.rank, plain.world_size)
        self.plain, self.split = plain, split

    @property
    def fuses_add_rmsnorm(self) -> bool:  # type: ignore[override]
        """``plain``'s: the layers' norm path of an unsplit forward is the plain server's."""
        return self.plain.fuses_add_rmsnorm

    @property
    def comm_sms(self) -> Optional[int]:
        """The SM budget of the split halves' overlapped calls (``--tokenweave-comm-sms``; None: tw-comm's)."""
        return self.split.comm_sms

    @property
    def ws(self):
        """tw-comm's workspace of the split halves (None on CPU)."""
        return self.split.ws

    def all_reduce(self, x):
        """``plain.all_reduce`` (see the class contract)."""
        return self.plain.all_reduce(x)

    def all_gather(self, x, dim=-1):
        """``plain.all_gather`` (see the class contract)."""
        return self.plain.all_gather(x, dim)

    def reduce_scatter(self, x):
        """``plain.reduce_scatter`` (see the class contract)."""
        return self.plain.reduce_scatter(x)

    def all_reduce_add_rmsnorm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                               overlap: Optional[bool] = None, out: Optional[torch.Tensor] = None,
                               residual_sharded: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rmsnorm(residual + allreduce(x)) * weight, residual + allreduce(x))``, x/residual ``[T, H]``: a split-half
        call (``overlap`` given, or ``out`` / ``residual_sharded``) on ``split`` with those keywords
        (:meth:`TwCommunicator.all_reduce_add_rmsnorm`), any other on ``plain`` (see the class contract)."""
        if overlap is None and out is None and not residual_sharded:
            return self.plain.all_reduce_add_rmsnorm(x, residual, weight, eps)
        return self.split.all_reduce_add_rmsnorm(x, residual, weight, eps, overlap=bool(overlap), out=out,
                                                 residual_sharded=residual_sharded)

    def describe(self) -> str:
        """One log line naming both communicators and what each serves."""
        return (f"TokenWeaveCommunicator(unsplit forwards: {self.plain.describe()} [as without --enable-tokenweave]; "
                f"split halves: {self.split.describe()})")
