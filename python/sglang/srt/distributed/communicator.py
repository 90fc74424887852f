"""The tensor-parallel communicator: the one interface through which model layers talk to other ranks.

Layers never call ``torch.distributed`` themselves; they hold a :class:`Communicator` and call its four
operations. Which implementation runs is decided once per process by :func:`create_communicator`
and logged. Implementations:

* :class:`TorchCommunicator`: ``torch.distributed`` on the TP device group (NCCL on GPU, gloo on CPU).
* :class:`~sglang.srt.distributed.custom_all_reduce.CustomAllReduceCommunicator`: small all-reduces on GPU
  through torch symmetric memory (P2P one-shot / two-shot, never multicast), the rest as torch.
* :class:`NoCommCommunicator`: benchmark-only counterfactual that skips every collective (outputs are
  wrong), as the TokenWeave paper (Gond et al. 2025, sec. 2) uses to bound what hiding communication can win.

Plugging in another implementation (e.g. tw-comm) touches no model file: add a ``name -> "module:factory"``
entry to :data:`COMMUNICATOR_BACKENDS`, or pass ``"module:factory"`` itself as the backend name. A factory
is called as ``factory(parallel_state)`` and returns a :class:`Communicator`.
"""

from __future__ import annotations

import importlib
import logging
from abc import ABC, abstractmethod
from types import MappingProxyType
from typing import Any, Mapping, Optional

import torch
import torch.distributed as dist

from sglang.srt.ops_ref import rmsnorm_ref

logger = logging.getLogger(__name__)

NOCOMM_LABEL = "NO-COMM COUNTERFACTUAL (outputs are wrong)"


class Communicator(ABC):
    """Collectives over the TP group, used by layers (contract; every implementation must honour it).

    All tensors live on the rank's compute device; every rank calls the same operation with tensors of
    the same shape and dtype, in the same order (a collective). ``world_size == 1`` makes every operation
    the identity (a copy may or may not be made).

    * ``all_reduce(x)``: elementwise sum over ranks, same shape/dtype as x. ``x`` may be overwritten
      (callers must use the returned tensor and not reuse ``x``).
    * ``all_gather(x, dim=-1)``: concatenation of every rank's x along ``dim`` in rank order;
      ``[..., n, ...] -> [..., world*n, ...]``.
    * ``reduce_scatter(x)``: x ``[N, ...]`` with ``N % world == 0``; returns this rank's rows
      ``[rank*N/world, (rank+1)*N/world)`` of the elementwise sum.
    * ``all_reduce_add_rmsnorm(x, residual, weight, eps) -> (out, residual)`` (TokenWeave, Gond et al.
      2025, sec. 3.3): ``residual += all_reduce(x)`` (the sum rounded to x.dtype) and
      ``out = rmsnorm(residual) * weight``; exactly
      ``rmsnorm_ref(all_reduce(x), weight, eps, residual)`` of :mod:`sglang.srt.layers.layernorm`.
      x, residual ``[T, H]``, weight ``[H]``. The input ``residual`` may be updated in place; callers
      use the returned one.

    Attributes:
        rank, world_size: this rank and the TP size.
        name: short name for logs ("torch", "custom", "nocomm", ...).
        supports_overlap: True when ``all_reduce_add_rmsnorm`` also accepts ``overlap=True`` (the call runs on a
            communication stream next to compute, on a bounded SM budget: TokenWeave, Gond et al. 2025,
            sec. 3.1.2); False here. Passing ``overlap`` (True or False) marks a TokenWeave split-half call: only
            TokenWeave's executor does, and a TokenWeave worker's composed communicator
            (:class:`~sglang.srt.distributed.tw_communicator.TokenWeaveCommunicator`) runs those on tw-comm and every
            other call on the plain communicator the server would use without TokenWeave.
        fuses_add_rmsnorm: True when ``all_reduce_add_rmsnorm`` is a fused kernel; False here (its default is
            ``all_reduce`` + the torch reference norm, and ``RMSNorm`` runs its own fused kernel instead).
    """

    name = "abstract"
    supports_overlap = False
    fuses_add_rmsnorm = False  # True: all_reduce_add_rmsnorm is one fused kernel, callers use it as is

    def __init__(self, rank: int, world_size: int):
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"communicator: rank={rank} must be in [0, world_size={world_size})")
        self.rank, self.world_size = rank, world_size

    @abstractmethod
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of x over ranks (see the class contract)."""

    @abstractmethod
    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Rank-ordered concatenation along ``dim`` (see the class contract)."""

    @abstractmethod
    def reduce_scatter(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's 1/world of the rows of the sum (see the class contract)."""

    def all_reduce_add_rmsnorm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                               eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Fused AllReduce + residual add + RMSNorm; default: :meth:`all_reduce`, then :func:`rmsnorm_ref` (fp32
        sum of squares, sum rounded first). Communicators without a fused kernel keep ``fuses_add_rmsnorm``
        False, and :class:`~sglang.srt.layers.layernorm.RMSNorm` then runs :meth:`all_reduce` followed by its
        own fused add + RMSNorm kernel on CUDA (this module stays independent of the layers)."""
        return rmsnorm_ref(self.all_reduce(x), weight, eps, residual)

    def describe(self) -> str:
        """One line for the startup log."""
        return f"{type(self).__name__}(world_size={self.world_size})"


def _check_scatter(x: torch.Tensor, world: int) -> int:
    if x.dim() == 0 or x.shape[0] % world:
        raise ValueError(f"reduce_scatter: x of shape {tuple(x.shape)} needs dim 0 divisible by world_size={world}")
    return x.shape[0] // world


def concat_gathered(flat: torch.Tensor, shape: torch.Size, world: int, dim: int) -> torch.Tensor:
    """``[world * shape[0], ...]`` (rank-major blocks of ``shape``) -> rank-ordered concatenation along ``dim``."""
    dim = dim % len(shape)
    if dim == 0:
        return flat
    stacked = flat.view(world, *shape).movedim(0, dim)
    return stacked.reshape(*shape[:dim], world * shape[dim], *shape[dim + 1:])


class TorchCommunicator(Communicator):
    """``torch.distributed`` collectives on ``group`` (NCCL or gloo).

    Args:
        group: the TP device group (None with ``world_size == 1``).
    gloo lacks reduce-scatter, so on gloo it is an all-reduce followed by taking this rank's rows.
    """

    name = "torch"

    def __init__(self, group: Any, rank: int, world_size: int):
        super().__init__(rank, world_size)
        if world_size > 1 and group is None:
            raise ValueError("TorchCommunicator with world_size > 1 needs a process group")
        self.group = group
        self.backend = dist.get_backend(group) if world_size > 1 else "local"

    @classmethod
    def create(cls, ps: Any) -> "TorchCommunicator":
        """Factory over a :class:`~sglang.srt.distributed.parallel_state.ParallelState` (None: world 1)."""
        if ps is None:
            return cls(None, 0, 1)
        return cls(ps.device_group, ps.tp_rank, ps.tp_size)

    def all_reduce(self, x):
        """Sum of x over ranks with ``dist.all_reduce`` on a contiguous x (in place; returned)."""
        if self.world_size == 1:
            return x
        x = x.contiguous()
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x, dim=-1):
        """Rank-ordered concatenation along ``dim``: ``all_gather_into_tensor`` on NCCL, ``dist.all_gather`` + cat on
        gloo."""
        if self.world_size == 1:
            return x
        x = x.contiguous()
        if self.backend == "nccl":
            flat = torch.empty((self.world_size * x.shape[0], *x.shape[1:]) if x.dim() else (self.world_size,),
                               dtype=x.dtype, device=x.device)
            dist.all_gather_into_tensor(flat, x, group=self.group)
            return concat_gathered(flat, x.shape, self.world_size, dim) if x.dim() else flat
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=dim)

    def reduce_scatter(self, x):
        """This rank's rows of the sum: ``reduce_scatter_tensor`` on NCCL, all-reduce + narrow on gloo. Raises
        ValueError if ``x.shape[0] % world_size``."""
        n = _check_scatter(x, self.world_size)
        if self.world_size == 1:
            return x
        x = x.contiguous()
        if self.backend == "nccl":
            out = torch.empty((n, *x.shape[1:]), dtype=x.dtype, device=x.device)
            dist.reduce_scatter_tensor(out, x, group=self.group)
            return out
        dist.all_reduce(x, group=self.group)
        return x.narrow(0, self.rank * n, n)

    def describe(self) -> str:
        """``TorchCommunicator(backend=..., world_size=...)`` for the startup log."""
        return f"TorchCommunicator(backend={self.backend}, world_size={self.world_size})"


class NoCommCommunicator(Communicator):
    """BENCHMARK-ONLY counterfactual: every collective is skipped, so model outputs are WRONG.

    Shapes are kept (all_gather repeats the local tensor, reduce_scatter takes the local rows,
    all-reduces return the local partial sums) so the forward's compute is unchanged; the difference
    in latency against a real communicator is the exposed communication time. Logs a warning at
    construction.
    """

    name = "nocomm"

    def __init__(self, rank: int, world_size: int):
        super().__init__(rank, world_size)
        logger.warning("!!! %s: NoCommCommunicator skips every all-reduce/all-gather of the TP group; "
                       "use it only to measure what communication costs !!!", NOCOMM_LABEL)

    @classmethod
    def create(cls, ps: Any) -> "NoCommCommunicator":
        """Factory over a ParallelState (its TP rank and size; None: world 1)."""
        return cls(0, 1) if ps is None else cls(ps.tp_rank, ps.tp_size)

    def all_reduce(self, x):
        """Returns x unchanged (the local partial sum; wrong by design)."""
        return x

    def all_gather(self, x, dim=-1):
        """Local x repeated ``world_size`` times along ``dim`` (right shape, wrong values)."""
        if self.world_size == 1:
            return x
        reps = [1] * x.dim()
        reps[dim % x.dim()] = self.world_size
        return x.repeat(*reps)

    def reduce_scatter(self, x):
        """This rank's rows of the local x, no sum. Raises ValueError if ``x.shape[0] % world_size``."""
        n = _check_scatter(x, self.world_size)
        return x.narrow(0, self.rank * n, n)

    def describe(self) -> str:
        """One log line, labelled as the no-communication counterfactual."""
        return f"NoCommCommunicator(world_size={self.world_size}) -- {NOCOMM_LABEL}"


class SwitchCommunicator(Communicator):
    """BENCHMARK-ONLY: delegates to ``real`` while ``use_real`` is True, else to ``nocomm``.

    Lets ``bench_one_batch --profile-comm`` time the same loaded model with and without communication.
    """

    name = "switch"

    def __init__(self, real: Communicator, nocomm: Communicator):
        super().__init__(real.rank, real.world_size)
        self.real, self.nocomm, self.use_real = real, nocomm, True

    def _c(self) -> Communicator:
        return self.real if self.use_real else self.nocomm

    def all_reduce(self, x):
        """Delegates to the active communicator (``real`` or ``nocomm``)."""
        return self._c().all_reduce(x)

    def all_gather(self, x, dim=-1):
        """Delegates to the active communicator (``real`` or ``nocomm``)."""
        return self._c().all_gather(x, dim)

    def reduce_scatter(self, x):
        """Delegates to the active communicator (``real`` or ``nocomm``)."""
        return self._c().reduce_scatter(x)

    @property
    def fuses_add_rmsnorm(self) -> bool:  # type: ignore[override]
        """The active communicator's ``fuses_add_rmsnorm``."""
        return self._c().fuses_add_rmsnorm

    def all_reduce_add_rmsnorm(self, x, residual, weight, eps):
        """Delegates to the active communicator (``real`` or ``nocomm``)."""
        return self._c().all_reduce_add_rmsnorm(x, residual, weight, eps)

    def describe(self) -> str:
        """One log line naming both wrapped communicators."""
        return f"SwitchCommunicator({self.real.describe()} | {self.nocomm.describe()})"


def _create_custom(ps: Any) -> Communicator:
    from sglang.srt.distributed.custom_all_reduce import CustomAllReduceCommunicator

    return CustomAllReduceCommunicator.create(ps)


COMMUNICATOR_BACKENDS: Mapping[str, str] = MappingProxyType({
    "torch": "sglang.srt.distributed.communicator:TorchCommunicator.create",
    "custom": "sglang.srt.distributed.communicator:_create_custom",
    "nocomm": "sglang.srt.distributed.communicator:NoCommCommunicator.create",
    "tw": "sglang.srt.distributed.tw_communicator:TwCommunicator.create",
})
"""Backend name -> ``"module:factory"`` (a dotted attribute path is allowed after the colon)."""


def resolve_factory(spec: str):
    """Import ``"module:attr.attr"``; raises ValueError naming the spec when it cannot be imported."""
    module, _, attr = spec.partition(":")
    try:
        obj = importlib.import_module(module)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"communicator factory {spec!r} cannot be imported: {e}") from e
    return obj


def choose_backend(requested: str, device: str, world_size: int, disable_custom_all_reduce: bool) -> tuple[str, str]:
    """(backend name or ``module:factory``, reason) for :func:`create_communicator` (pure).

    ``auto`` picks ``custom`` on GPU with world size 2..8 unless ``--disable-custom-all-reduce``,
    else ``torch``. Raises ValueError for a name that is neither registered nor ``module:factory``.
    """
    if requested != "auto":
        if requested not in COMMUNICATOR_BACKENDS and ":" not in requested:
            raise ValueError(f"communicator backend {requested!r} is unknown; use auto, "
                             f"{', '.join(COMMUNICATOR_BACKENDS)} or a 'module:factory' path")
        if requested == "custom" and disable_custom_all_reduce:
            return "torch", "custom requested but --disable-custom-all-reduce is set"
        return requested, "requested explicitly"
    if world_size == 1:
        return "torch", "world size 1 (every collective is the identity)"
    if device != "cuda":
        return "torch", f"device {device} (custom all-reduce is GPU-only)"
    if disable_custom_all_reduce:
        return "torch", "--disable-custom-all-reduce"
    if world_size > 8:
        return "torch", f"world size {world_size} > 8 (custom all-reduce covers one NVLink domain)"
    return "custom", "auto: GPU, world size 2..8"


def create_communicator(ps: Optional[Any], backend: str = "auto", disable_custom_all_reduce: bool = False) -> Communicator:
    """Build this rank's communicator and log which one and why.

    Args:
        ps: the rank's :class:`~sglang.srt.distributed.parallel_state.ParallelState` (None: single rank).
        backend: "auto", a key of :data:`COMMUNICATOR_BACKENDS`, or "module:factory".
        disable_custom_all_reduce: ``--disable-custom-all-reduce``.
    Raises:
        ValueError: unknown backend, or a factory that returns something else than a Communicator.
    """
    world = 1 if ps is None else ps.tp_size
    device = "cpu" if ps is None else ps.device
    name, reason = choose_backend(backend, device, world, disable_custom_all_reduce)
    factory = resolve_factory(COMMUNICATOR_BACKENDS.get(name, name))
    comm = factory(ps)
    if not isinstance(comm, Communicator):
        raise ValueError(f"communicator factory {name!r} returned {type(comm).__name__}, not a Communicator")
    log = logger.warning if isinstance(comm, NoCommCommunicator) else logger.info
    log("TP communicator (rank %d/%d): %s [requested %r; %s]", 0 if ps is None else ps.tp_rank, world,
        comm.describe(), backend, reason)
    return comm
