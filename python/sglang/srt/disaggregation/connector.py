"""The scheduler side of the KV connector (the vLLM v1 / SGLang split: a scheduler-side object decides
*which* KV moves *when*; the worker-side :class:`~sglang.srt.disaggregation.agent.DisaggAgent` moves it).

:class:`KVConnector` is the contract: every method the scheduler calls (``managers/scheduler.py``,
``scheduler_intake.py``, ``scheduler_output_processor.py``), and nothing else:

* ``intercept(req, msg)`` when a request arrives (the decode side takes it into its transfer queue);
* ``poll()`` at the start of every step (control messages, transfers, timeouts);
* ``before_forward(batch, model_worker_batch)`` right before a batch's forward (push mode arms its
  layerwise KV writes, ``layerwise.py``);
* ``hold(req)`` when a request finishes (the prefill side keeps its KV until the decode side has it);
* ``abort(rid)`` and ``open_rids()`` (abort one request, or every request the connector holds);
* ``has_work()`` (keep the scheduler loop spinning), ``internal_state()`` (``/get_server_info``), ``close()``.

The connector never touches the scheduler's queues, KV release or counters. ``intercept``, ``poll`` and
``abort`` return :data:`Decision` values that the scheduler applies, in order (``Scheduler.apply_connector``):
:class:`QueueRequest` (queue it as an aggregated request), :class:`FinishRequest` (report it and give its KV
back), :class:`StartDecode` (its prompt KV arrived: it continues as if it had prefilled here). So "KV back to
zero after errors" holds exactly as for aggregated requests.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

from sglang.srt.disaggregation.agent import DisaggAgent

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class QueueRequest:
    """Queue ``req`` for prefill like an aggregated request (``Scheduler.enqueue``)."""

    req: Any


@dataclass(frozen=True)
class FinishRequest:
    """``req`` is finished (its ``finished_reason`` is set, an abort on errors): give back the KV it holds (through
    the prefix cache, as ``Scheduler._release``; nothing when it holds none) and report it."""

    req: Any


@dataclass(frozen=True)
class StartDecode:
    """The prompt KV of ``req`` is in its ``req_pool_idx`` row (``kv_len`` = prompt length, its first token in
    ``output_ids``): the scheduler locks the prefix-cache root for it, counts ``prompt_tokens`` and
    ``cached_tokens``, reports the first token and lets it decode (or releases it when that token finished it)."""

    req: Any
    prompt_tokens: int
    cached_tokens: int


Decision = Union[QueueRequest, FinishRequest, StartDecode]


class KVConnector(ABC):
    """Every call the scheduler makes on a PD connector (module docstring). Decisions are returned, never applied
    here; all TP ranks return the same decisions at the same step (the connectors agree over the control group)."""

    @abstractmethod
    def intercept(self, req, msg) -> list[Decision]:
        """A validated request arrived (``msg``: its TokenizedGenerateReqInput). ``[]``: the connector keeps it
        (e.g. the decode side's transfer queue); otherwise what to do with it (usually ``[QueueRequest(req)]``)."""

    @abstractmethod
    def poll(self) -> list[Decision]:
        """Once per scheduler step, before batching: control messages, transfers, timeouts."""

    @abstractmethod
    def before_forward(self, batch, mwb) -> None:
        """Right before ``batch``'s forward (``mwb``: its ModelWorkerBatch)."""

    @abstractmethod
    def during_forward(self, forward_done: Callable[[], bool]) -> None:
        """After a batch was launched, before its result is awaited (``forward_done``: non-blocking probe of that
        forward); transfer work that must not wait for the next step. Never applies decisions (they are returned
        by the next ``poll``)."""

    @abstractmethod
    def hold(self, req) -> bool:
        """``req`` just finished: True when the connector keeps its KV (the scheduler then neither releases nor
        reports it and drops it from ``running``; the connector finishes it later through a decision)."""

    @abstractmethod
    def abort(self, rid: str) -> list[Decision]:
        """The client aborted ``rid``: drop what the connector holds of it."""

    @abstractmethod
    def open_rids(self) -> list[str]:
        """The requests the connector holds (for abort-all)."""

    @abstractmethod
    def has_work(self) -> bool:
        """Whether the scheduler loop must keep stepping for the connector (heartbeats, timeouts, transfers)."""

    @abstractmethod
    def internal_state(self) -> dict[str, Any]:
        """Counters for ``/get_server_info``."""

    @abstractmethod
    def close(self) -> None:
        """Release transfer agents, threads and sockets."""


class BaseConnector(KVConnector):
    """Shared state of the prefill and decode connectors: the transfer agent, the KV cache, counters.

    Args:
        scheduler: the host :class:`~sglang.srt.managers.scheduler.Scheduler`; read here only (``args``,
            ``runner``, ``model_config``, ``kv``, ``control_group``), never kept.
    Raises:
        ValueError: the model config has no KV head count.
    """

    TRANSFER_STATE = ""  # the room state of a posted, unfinished transfer (subclasses; see num_transferring)

    def __init__(self, scheduler):
        args = scheduler.args
        self.args = args
        runner = scheduler.runner
        mc = scheduler.model_config
        total_heads = getattr(mc, "num_key_value_heads", None) or getattr(mc, "num_kv_heads", None)
        if total_heads is None:
            raise ValueError("the model config has no num_key_value_heads; disaggregation needs it")
        self.kv = scheduler.kv  # the KVCache: slot lookups, and the decode side's allocation of pulled KV
        self.agent = DisaggAgent(args, scheduler.kv, runner.tp_rank if hasattr(runner, "tp_rank") else 0,
                                 runner.tp_size, int(total_heads), scheduler.control_group)
        self.mode = args.disaggregation_mode
        self.transfer_mode = args.disaggregation_transfer_mode
        self.stats = {"rooms_done": 0, "rooms_failed": 0, "transfer_bytes": 0, "transfer_reads": 0}
        self._decided: list[Decision] = []  # decisions made since the last hook returned them

    def decide(self, decision: Decision) -> None:
        """Record a decision; the hook in progress (``intercept``, ``poll``, ``abort``) returns it."""
        self._decided.append(decision)

    def take_decisions(self) -> list[Decision]:
        """The decisions recorded so far, in order (and forget them)."""
        out, self._decided = self._decided, []
        return out

    def fail_request(self, req, message: str, status_code: int = 500) -> None:
        """Finish ``req`` with an abort (``status_code``; an earlier abort reason is kept), count it and decide
        :class:`FinishRequest` (its KV goes back, it is reported)."""
        if req.finished_reason is None or req.finished_reason.get("type") != "abort":
            req.finished_reason = {"type": "abort", "message": message, "status_code": status_code}
        self.stats["rooms_failed"] += 1
        self.decide(FinishRequest(req))

    def internal_state(self) -> dict[str, Any]:
        """Counters for ``/get_server_info``."""
        from sglang.srt.disaggregation.transfer.fault_hook import HeldTransferBackend

        backend = self.agent.backend  # HeldTransferBackend: the test-only fault hook (transfer/fault_hook.py)
        snapshot = backend.snapshot if isinstance(backend, HeldTransferBackend) else None
        return {"disaggregation_mode": self.mode, "disaggregation_transfer_mode": self.transfer_mode,
                **{f"disagg_{k}": v for k, v in self.stats.items()}, "disagg_open_rooms": self.num_open(),
                "disagg_rooms_transferring": self.num_transferring(),
                **({"disagg_fault_hold": snapshot()} if snapshot is not None else {})}

    def before_forward(self, batch, mwb) -> None:
        """Called right before ``batch``'s forward (``mwb``: its ModelWorkerBatch); default: nothing."""

    def during_forward(self, forward_done: Callable[[], bool]) -> None:
        """Called while the launched batch runs; default: nothing."""

    def num_open(self) -> int:  # pragma: no cover - overridden
        """Requests this connector holds (rooms with a request), for ``/get_server_info``; default 0."""
        return 0

    def num_transferring(self) -> int:
        """Rooms in state :attr:`TRANSFER_STATE` (their KV transfer posted, not finished: decode "transfer", READs or
        the push's hand-off; prefill "pushing", WRITEs), for ``/get_server_info``."""
        return sum(1 for r in getattr(self, "rooms", {}).values() if r.state == self.TRANSFER_STATE)

    def close(self) -> None:
        """Release the transfer agent and sockets."""
        self.agent.close()


def reject(req, message: str) -> FinishRequest:
    """Finish a request the connector refuses on arrival (HTTP 400 naming ``message``); it holds no KV."""
    req.finished_reason = {"type": "abort", "message": message, "status_code": 400}
    return FinishRequest(req)


def create_connector(scheduler) -> Optional[KVConnector]:
    """The connector of ``--disaggregation-mode`` (None for ``null``)."""
    mode = scheduler.args.disaggregation_mode
    if mode == "prefill":
        from sglang.srt.disaggregation.prefill import PrefillConnector

        return PrefillConnector(scheduler)
    if mode == "decode":
        from sglang.srt.disaggregation.decode import DecodeConnector

        return DecodeConnector(scheduler)
    return None


def bootstrap_fields_error(req) -> Optional[str]:
    """Why a disaggregated request's bootstrap fields are unusable (None when fine)."""
    if req.bootstrap_room is None:
        return "bootstrap_room is required on a disaggregated server (send requests through the mini_lb router)"
    if not 0 <= req.bootstrap_room < (1 << 63):
        return f"bootstrap_room must lie in [0, 2**63), got {req.bootstrap_room}"
    return None
