"""The scheduler side of the KV connector (the vLLM v1 / SGLang split: a scheduler-side object decides
*which* KV moves *when*; the worker-side :class:`~sglang.srt.disaggregation.agent.DisaggAgent` moves it).

The scheduler calls a connector at five points and nowhere else (``managers/scheduler.py``):

* ``intercept(req, msg)`` when a request arrives (the decode side takes it into its transfer queue);
* ``poll()`` at the start of every step (control messages, transfers, timeouts);
* ``before_forward(batch, model_worker_batch)`` right before a batch's forward (push mode arms its
  layerwise KV writes, ``layerwise.py``);
* ``hold(req)`` when a request finishes (the prefill side keeps its KV until the decode side has it);
* ``abort(rid)``.

Requests the connector finishes (errors, completed hand-offs) go to ``scheduler.outputs`` and their KV
goes back through ``scheduler._release``, so "KV back to zero after errors" holds exactly as for aggregated
requests.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

from sglang.srt.disaggregation.agent import DisaggAgent

logger = logging.getLogger(__name__)


class BaseConnector:
    """Shared state of the prefill and decode connectors.

    Args:
        scheduler: the host :class:`~sglang.srt.managers.scheduler.Scheduler` (``kv``, ``running``,
            ``outputs``, ``_release``, ``runner``, ``control_group``).
    """

    def __init__(self, scheduler):
        self.s = scheduler
        args = scheduler.args
        self.args = args
        runner = scheduler.runner
        mc = scheduler.model_config
        total_heads = getattr(mc, "num_key_value_heads", None) or getattr(mc, "num_kv_heads", None)
        if total_heads is None:
            raise ValueError("the model config has no num_key_value_heads; disaggregation needs it")
        self.agent = DisaggAgent(args, scheduler.kv, runner.tp_rank if hasattr(runner, "tp_rank") else 0,
                                 runner.tp_size, int(total_heads), scheduler.control_group)
        self.mode = args.disaggregation_mode
        self.transfer_mode = args.disaggregation_transfer_mode
        self.stats = {"rooms_done": 0, "rooms_failed": 0, "transfer_bytes": 0, "transfer_reads": 0}

    def fail_request(self, req, message: str, status_code: int = 500) -> None:
        """Finish ``req`` with an abort (``status_code``), return its KV and report it."""
        if req.finished_reason is None or req.finished_reason.get("type") != "abort":
            req.finished_reason = {"type": "abort", "message": message, "status_code": status_code}
        self.s._release(req)
        self.s.outputs.append(req)
        self.stats["rooms_failed"] += 1

    def internal_state(self) -> dict[str, Any]:
        """Counters for ``/get_server_info``."""
        return {"disaggregation_mode": self.mode, "disaggregation_transfer_mode": self.transfer_mode,
                **{f"disagg_{k}": v for k, v in self.stats.items()}, "disagg_open_rooms": self.num_open()}

    def before_forward(self, batch, mwb) -> None:
        """Called right before ``batch``'s forward (``mwb``: its ModelWorkerBatch); default: nothing."""

    def num_open(self) -> int:  # pragma: no cover - overridden
        """Requests this connector holds (rooms with a request), for ``/get_server_info``; default 0."""
        return 0

    def close(self) -> None:
        """Release the transfer agent and sockets."""
        self.agent.close()


def create_connector(scheduler) -> Optional[BaseConnector]:
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
