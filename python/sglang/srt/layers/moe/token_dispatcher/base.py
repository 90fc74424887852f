"""The token-dispatcher contract: expert parallelism by all-to-all (dispatch, experts, combine).

With ``--moe-a2a-backend`` other than ``none`` every EP rank holds ``E / ep`` contiguous experts and runs them only on
the (token, top-k slot) pairs routed to them. A :class:`TokenDispatcher` moves the pairs:

* :meth:`TokenDispatcher.dispatch` sends the hidden state of every (token, slot) to the EP rank holding expert
  ``topk_ids[t, j]`` (GShard, Lepikhin et al. 2020, sec. 3.2: the all-to-all dispatch/combine of an MoE layer) and
  returns a :class:`DispatchHandle` whose received rows are grouped by local expert;
* the caller runs its local experts on ``handle.recv_x`` (unweighted outputs, one row per received row);
* :meth:`TokenDispatcher.combine` sends the expert outputs back and sums them per token with the routing weights,
  in the original token order (``[T, H]``), returning a :class:`CombineHandle`.

Two modes, as DeepEP (DeepSeek 2025) has two kernel families and DeepSeek-V3 (tech report, sec. 3.4) separates the
prefill and decode deployments of EP:

* :attr:`DispatchMode.NORMAL` (prefill, mixed batches): variable counts. The ranks first exchange how many rows each
  sends each other (a count all-to-all), the host reads them (one device -> host sync), then the rows move with
  exact sizes; the handle's ``num_recv`` is the host count. Any number of tokens up to the dispatcher's
  ``max_tokens_normal``.
* :attr:`DispatchMode.LOW_LATENCY` (decode): a fixed per-rank token capacity (``max_tokens_low_latency``), so every
  shape is known on the host: no host sync, capturable in a CUDA graph. Received rows live in a buffer of fixed
  size ``recv_capacity``; rows past the valid ones are padding (expert id ``-1``, weight 0, data unspecified but
  finite when the caller's inputs are finite). ``num_recv`` is None.

Collective rules (what every caller must keep, or the ranks hang or mix data):

* dispatch and combine are collectives over the EP group: every EP rank calls them the same number of times, in the
  same order, with the same ``mode`` (a rank with no tokens passes ``T = 0``: an idle rank still takes part);
* one handle is combined exactly once, and handles of one dispatcher are combined in dispatch order
  (low-latency buffers are reused round-robin: see ``max_inflight``);
* every call of one dispatcher is stream-ordered after the previous one (issue them all on one communication
  stream, or make the next stream wait): the backends reuse their receive buffers from call to call;
* with DP attention the caller must agree on ``mode`` across ranks (a rank's token count may differ; low-latency
  needs every rank's ``T <= max_tokens_low_latency``).

Streams (CUDA): dispatch/combine enqueue their work on the *current* stream, which may be a side (communication)
stream, so that one micro-batch's dispatch overlaps another's compute. The caller makes that stream wait for the
inputs (``side.wait_stream(compute)``). Each handle records ``event`` on that stream after its last op;
``handle.wait()`` makes the then-current stream wait for it (no host block) and marks the handle's tensors as used
by that stream (``Tensor.record_stream``), so the caching allocator does not reuse them early. NORMAL-mode dispatch
blocks the host once (the count read) until the stream reaches the count exchange; LOW_LATENCY never blocks it.
On CPU (gloo) everything is synchronous, ``event`` is None and ``wait()`` returns at once.

This module is the stable contract; backends live beside it (``nccl.py``: ``torch.distributed.all_to_all_single``,
gloo on CPU; ``tdist.py``: the Triton-distributed low-latency all-to-all of ``sgl_kernel.tdist``). Build one with
:func:`sglang.srt.layers.moe.token_dispatcher.create_token_dispatcher`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Optional

import torch


class DispatchMode(str, Enum):
    """How one dispatch/combine moves its rows (module docstring): ``normal`` (count exchange, exact sizes, one host
    sync; prefill and mixed batches) or ``low_latency`` (fixed capacity, no host sync, CUDA-graph capturable;
    decode)."""

    NORMAL = "normal"
    LOW_LATENCY = "low_latency"


# MoE a2a backends of ``--moe-a2a-backend`` (``none`` = the all-reduce EP of layers/moe/fused_moe.py)
A2A_BACKENDS = ("nccl", "tdist")


@dataclass(frozen=True)
class DispatcherConfig:
    """Sizes of one rank's dispatcher (frozen; the same on every EP rank except ``ep_rank``).

    Attributes:
        num_experts: E, global routed experts (a multiple of ``ep_size``).
        top_k: k, experts per token.
        hidden_size: H, elements per token row.
        ep_size / ep_rank: the EP group and this rank's index in it; rank r holds experts
            ``[r * E/ep, (r + 1) * E/ep)`` (contiguous placement, as the all-reduce EP).
        max_tokens_normal: most tokens one rank dispatches in one NORMAL call (from ``--chunked-prefill-size``
            and the running-request limit); a larger call raises ValueError.
        max_tokens_low_latency: the per-rank token capacity C of LOW_LATENCY calls (from the largest CUDA-graph
            batch; with TP attention divided by the TP size, since each rank dispatches its slice).
        dtype: the dtype of x and of the expert outputs (bf16 / fp16 / fp32).
        device: ``"cpu"`` or ``"cuda:N"`` (this rank's device).
        max_inflight: LOW_LATENCY calls that may be dispatched and not yet combined at once (2 for two-batch
            overlap); the fixed buffers are this many sets, used round-robin.
    Raises:
        ValueError: any inconsistent value (the message names it).
    """

    num_experts: int
    top_k: int
    hidden_size: int
    ep_size: int
    ep_rank: int
    max_tokens_normal: int
    max_tokens_low_latency: int
    dtype: torch.dtype = torch.bfloat16
    device: str = "cpu"
    max_inflight: int = 2

    def __post_init__(self) -> None:
        if self.ep_size < 1 or not 0 <= self.ep_rank < self.ep_size:
            raise ValueError(f"ep_rank={self.ep_rank} must be in [0, ep_size={self.ep_size})")
        if self.num_experts < 1 or self.num_experts % self.ep_size:
            raise ValueError(f"num_experts={self.num_experts} must be a positive multiple of --ep-size={self.ep_size}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k={self.top_k} must be in [1, num_experts={self.num_experts}]")
        if self.hidden_size < 1 or self.max_tokens_normal < 1 or self.max_tokens_low_latency < 1:
            raise ValueError(f"hidden_size={self.hidden_size}, max_tokens_normal={self.max_tokens_normal}, "
                             f"max_tokens_low_latency={self.max_tokens_low_latency} must be >= 1")
        if self.max_inflight < 1:
            raise ValueError(f"max_inflight={self.max_inflight} must be >= 1")
        if self.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise ValueError(f"dtype={self.dtype} must be bfloat16, float16 or float32")

    @property
    def num_local_experts(self) -> int:
        """E / ep experts per rank."""
        return self.num_experts // self.ep_size

    @property
    def expert_start(self) -> int:
        """The first (global) expert id this rank holds."""
        return self.ep_rank * self.num_local_experts

    @property
    def slots_per_rank(self) -> int:
        """Most rows one token can send to one rank: ``min(k, E/ep)`` (its k experts are distinct)."""
        return min(self.top_k, self.num_local_experts)

    @property
    def pair_capacity(self) -> int:
        """LOW_LATENCY rows one source may send one destination per call: ``C * min(k, E/ep)``."""
        return self.max_tokens_low_latency * self.slots_per_rank

    @property
    def recv_capacity(self) -> int:
        """LOW_LATENCY received rows per call (the fixed receive size): ``ep * C * min(k, E/ep)``."""
        return self.ep_size * self.pair_capacity

    @property
    def element_size(self) -> int:
        """Bytes per element of ``dtype``."""
        return torch.empty((), dtype=self.dtype).element_size()


@dataclass
class DispatchHandle:
    """What :meth:`TokenDispatcher.dispatch` returns; pass it to :meth:`TokenDispatcher.combine` once.

    Attributes (all on the rank's device; R = ``num_recv`` in NORMAL mode, ``config.recv_capacity`` in LOW_LATENCY):
        mode: the :class:`DispatchMode` of the call.
        num_tokens: T, the tokens this rank dispatched (rows of the combined output).
        recv_x: [R, H] ``config.dtype``: the received rows, grouped by local expert (expert 0's rows first, each
            group in (source rank, source token, slot) order); LOW_LATENCY padding rows come last.
        recv_expert_ids: [R] int64 local expert ids in ``[0, E/ep)``; ``-1`` on padding rows.
        recv_weights: [R] fp32 routing weights of the rows (0 on padding rows); :meth:`TokenDispatcher.combine`
            applies them unless told the expert outputs are already weighted.
        expert_counts: [E/ep] int64: rows per local expert (``recv_x`` holds them contiguously in expert order).
        num_recv: the valid received rows as a host int (NORMAL); None in LOW_LATENCY (no host sync).
        event: ``torch.cuda.Event`` recorded on the dispatching stream after the last op (CUDA); None on CPU.
        state: the backend's private data for combine (do not touch).
    """

    mode: DispatchMode
    num_tokens: int
    recv_x: torch.Tensor
    recv_expert_ids: torch.Tensor
    recv_weights: torch.Tensor
    expert_counts: torch.Tensor
    num_recv: Optional[int] = None
    event: Optional[Any] = None
    state: Any = field(default=None, repr=False)

    def wait(self) -> None:
        """Make the current CUDA stream wait for the dispatch (no host block) and mark the received tensors as used
        by it (not inside a CUDA-graph capture, where the graph's memory pool keeps them); no-op on CPU."""
        _wait(self.event, (self.recv_x, self.recv_expert_ids, self.recv_weights, self.expert_counts))


@dataclass
class CombineHandle:
    """What :meth:`TokenDispatcher.combine` returns.

    Attributes:
        out: [T, H] ``config.dtype``: per token, ``sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t])``
            accumulated in fp32 (the sum of the all-reduce EP, over all EP ranks' experts).
        event: ``torch.cuda.Event`` recorded on the combining stream after the last op (CUDA); None on CPU.
    """

    out: torch.Tensor
    event: Optional[Any] = None

    def wait(self) -> torch.Tensor:
        """Make the current CUDA stream wait for the combine (no host block); returns :attr:`out`. CPU: returns at
        once."""
        _wait(self.event, (self.out,))
        return self.out


def _wait(event: Optional[Any], tensors: tuple) -> None:
    """The current stream waits for ``event`` and the tensors are recorded on it (CUDA); nothing otherwise."""
    if event is None:
        return
    stream = torch.cuda.current_stream(tensors[0].device)
    stream.wait_event(event)
    if torch.cuda.is_current_stream_capturing():  # inside a CUDA-graph capture the graph's pool owns the memory
        return
    for t in tensors:
        if t is not None and t.is_cuda:
            t.record_stream(stream)


def record_event(device: torch.device) -> Optional[Any]:
    """A ``torch.cuda.Event`` recorded now on the current stream of ``device`` (CUDA), else None."""
    if device.type != "cuda":
        return None
    ev = torch.cuda.Event()
    ev.record(torch.cuda.current_stream(device))
    return ev


class TokenDispatcher(ABC):
    """One rank's long-lived dispatcher (DeepEP's "one Buffer"): built once per rank and per model (every MoE layer
    shares it), its fixed buffers sized from :class:`DispatcherConfig` and allocated in ``__init__``.

    Args:
        config: the sizes (see :class:`DispatcherConfig`).
        group: the EP process group (``torch.distributed``; NCCL on GPU, gloo on CPU) whose size is
            ``config.ep_size`` and whose rank is ``config.ep_rank``.
    Construction is collective over ``group`` where the backend exchanges handles (tdist).
    """

    name = "abstract"

    def __init__(self, config: DispatcherConfig, group: Any):
        self.config = config
        self.group = group
        self.calls = {m.value: 0 for m in DispatchMode}  # dispatches per mode (validated calls), for logs and tests

    @staticmethod
    @abstractmethod
    def buffer_bytes(config: DispatcherConfig) -> int:
        """Device bytes of the fixed buffers ``__init__`` allocates for ``config`` (counted in the memory budget;
        NORMAL-mode transients are counted by the profiling forward instead)."""

    @abstractmethod
    def dispatch(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                 mode: DispatchMode) -> DispatchHandle:
        """Send every (token, top-k slot) to the EP rank holding its expert (collective; see the module docstring).

        Args:
            x: [T, H] ``config.dtype`` on the rank's device (T may be 0).
            topk_ids: [T, k] int32/int64 global expert ids in ``[0, E)`` (distinct per token).
            topk_weights: [T, k] fp32 routing weights.
            mode: :class:`DispatchMode`, the same on every EP rank for this call.
        Returns:
            a :class:`DispatchHandle` (received rows grouped by local expert, an event on CUDA).
        Raises:
            ValueError: bad shapes/dtypes, ``T > max_tokens_normal`` (NORMAL) or ``T > max_tokens_low_latency``
                (LOW_LATENCY), ids outside ``[0, E)`` (checked only in NORMAL mode, where the host reads counts).
            RuntimeError: a peer failed (the backend's error, e.g. gloo's closed connection or a tdist wait that
                timed out) -- fail closed, never a hang.
        """

    @abstractmethod
    def combine(self, expert_out: torch.Tensor, handle: DispatchHandle, *,
                weights_applied: bool = False) -> CombineHandle:
        """Return the expert outputs of ``handle``'s rows to their tokens (collective, like dispatch).

        Args:
            expert_out: [R, H] ``config.dtype``, row i = local expert ``handle.recv_expert_ids[i]`` applied to
                ``handle.recv_x[i]`` (same row order as ``recv_x``; padding rows are ignored).
            handle: the handle of the matching dispatch (combined once, in dispatch order).
            weights_applied: the rows are already multiplied by ``handle.recv_weights`` (the combine then only sums);
                default False: the combine multiplies by the routing weights in fp32 at the source.
        Returns:
            a :class:`CombineHandle` whose ``out`` is ``[T, H]`` in token order.
        Raises:
            ValueError: ``expert_out`` of the wrong shape/dtype, or a handle combined twice.
            RuntimeError: a peer failed (as :meth:`dispatch`).
        """

    def close(self) -> None:
        """Free the fixed buffers (collective where the backend mapped peers' memory). Idempotent."""

    # ---- helpers every backend shares -----------------------------------------------------------------------
    def check_dispatch_inputs(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                              mode: DispatchMode) -> DispatchMode:
        """Validate :meth:`dispatch`'s arguments (ValueError naming the bad one); returns ``mode`` as an enum and
        counts the call in :attr:`calls`."""
        cfg = self.config
        mode = DispatchMode(mode)
        if x.dim() != 2 or x.shape[1] != cfg.hidden_size or x.dtype != cfg.dtype:
            raise ValueError(f"dispatch: x must be [T, {cfg.hidden_size}] {cfg.dtype}, got {tuple(x.shape)} {x.dtype}")
        t = x.shape[0]
        if tuple(topk_ids.shape) != (t, cfg.top_k) or tuple(topk_weights.shape) != (t, cfg.top_k):
            raise ValueError(f"dispatch: topk_ids {tuple(topk_ids.shape)} and topk_weights "
                             f"{tuple(topk_weights.shape)} must be [T={t}, k={cfg.top_k}]")
        if topk_ids.dtype not in (torch.int32, torch.int64) or topk_weights.dtype != torch.float32:
            raise ValueError(f"dispatch: topk_ids must be int32/int64 and topk_weights fp32, got {topk_ids.dtype} / "
                             f"{topk_weights.dtype}")
        limit = cfg.max_tokens_normal if mode is DispatchMode.NORMAL else cfg.max_tokens_low_latency
        if t > limit:
            raise ValueError(f"dispatch: {t} tokens exceed the {mode.value} capacity {limit} of this rank's "
                             f"dispatcher (sized from --chunked-prefill-size / --cuda-graph-max-bs)")
        self.calls[mode.value] += 1
        return mode
