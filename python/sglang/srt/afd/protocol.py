"""The AFD wire protocol between attention and FFN workers, over an M2N group (:mod:`sgl_kernel.m2n`).

Ranks: attention worker ``a`` (its TP rank 0) is M2N rank ``a``; FFN worker ``j`` is rank ``N_A + j``.
Messages (``meta[0]`` is the op):

* ``DISPATCH`` attention -> FFN j: rows ``(x [H] model dtype, topk_ids [k] int32, topk_weights [k] fp32)``
  of the micro-batch's tokens with at least one (token, slot) routed to j (weights of slots routed elsewhere
  are 0); meta ``(DISPATCH, layer, micro-batch key, placement version)``. Every FFN worker gets one
  DISPATCH per (layer, micro-batch), possibly of 0 rows, so the attention side always expects N_E replies.
* ``RESULT`` FFN j -> attention: rows ``(out [H])``, the weighted expert sum of the same rows; meta
  ``(RESULT, layer, key, version, compute microseconds)``.
* ``ERROR`` FFN -> attention: the FFN could not compute (e.g. a stale placement); the attention side raises.
* ``STEP`` attention -> FFN j (device-driven transports, :mod:`sglang.srt.afd.device_m2n`): the only host message
  of a device-driven step; ``m`` rows whose ``topk_ids[:, 0]`` are the micro-batches' token counts; meta
  ``(STEP, m, 0, version)``. The step's dispatches and results then travel without headers, in a fixed order.
* ``PLACE`` attention -> FFN j: rows whose ``topk_ids[:, 0]`` are the experts j must hold from now on
  (every MoE layer); meta ``(PLACE, 0, 0, new version)``; answered by ``PLACED``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sgl_kernel.m2n import PayloadTransport, RowLayout, create_transport

DISPATCH, RESULT, ERROR, PLACE, PLACED, STEP = 1, 2, 3, 4, 5, 6
# ``--afd-transport`` names of the device-driven transports (``sgl_kernel.m2n.cuda_push``, flag or low-latency
# protocol): the executor steps them with STEP messages (sglang.srt.afd.device_m2n) unless rebalancing is on
DEVICE_TRANSPORTS = ("cuda_push", "cuda_push_ll")


def create_afd_transport(name: str) -> PayloadTransport:
    """The M2N payload transport ``--afd-transport`` names (``inline`` | ``nccl`` | ``cuda_ipc`` | ``cuda_push`` |
    ``cuda_push_ll`` | ``nixl``); ``nixl`` gets the PD transfer layer's NIXL agent injected (``m2n_read_agent``;
    nixl itself is imported at attach).
    Raises ValueError for an unknown name."""
    factory = None
    if name == "nixl":
        from sglang.srt.disaggregation.transfer.nixl_backend import m2n_read_agent

        factory = m2n_read_agent
    return create_transport(name, nixl_agent_factory=factory)


def dispatch_layout(hidden: int, top_k: int, dtype: torch.dtype) -> RowLayout:
    """Rows attention -> FFN: hidden state, top-k ids (int32), top-k weights (fp32)."""
    return RowLayout(((dtype, hidden), (torch.int32, top_k), (torch.float32, top_k)))


def result_layout(hidden: int, dtype: torch.dtype) -> RowLayout:
    """Rows FFN -> attention: the weighted expert output."""
    return RowLayout(((dtype, hidden),))


@dataclass(frozen=True)
class AfdTopology:
    """Who is where: ``num_attention`` N_A, ``num_ffn`` N_E, the M2N ``addresses`` (N_A + N_E control inboxes),
    ``max_rows`` per message, ``transport`` name, ``timeout_s``."""

    num_attention: int
    num_ffn: int
    addresses: tuple[str, ...]
    max_rows: int
    transport: str = "inline"
    timeout_s: float = 60.0

    def ffn_rank(self, j: int) -> int:
        """M2N rank of FFN worker ``j``."""
        return self.num_attention + j
