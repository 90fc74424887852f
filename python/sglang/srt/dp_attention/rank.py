"""One DP-attention worker's distributed state, shared by its scheduler process, model runner and scheduler.

:meth:`DpAttentionRank.join` makes the torch.distributed world of the DP ranks (the MoE collectives' group: NCCL on
GPU, gloo on CPU), a separate gloo group for the scheduler's per-step agreement (it runs on the scheduler thread
while the model's collectives may run on the overlap worker's thread) and the MoE communicator. The model runner asks
it for the model layout (:meth:`layout`), agrees its KV budget and CUDA-graph use with the other ranks
(:meth:`agree_min`), and before each forward sets the step's rows per rank (:meth:`begin_forward`); a rank with no
batch runs :meth:`run_idle`. Dense models have no MoE collective: their ranks never wait for each other
(:attr:`lockstep` False) and schedule fully independently.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

import torch
from torch import nn

from sglang.srt.dp_attention.moe import DpForwardPadding, run_idle, shard_experts
from sglang.srt.dp_attention.step_sync import DpGlobalStep, DpStepSync

logger = logging.getLogger(__name__)


class DpAttentionRank:
    """DP rank ``spec.dp_rank`` of ``spec.dp_size`` (see the module docstring).

    Args:
        spec: the worker's :class:`~sglang.srt.deployment.plan.DpAttentionSpec`.
        parallel_state: the :class:`~sglang.srt.distributed.parallel_state.ParallelState` of the DP world
            (``tp_rank = dp_rank``, ``tp_size = dp_size``, ``ep_size = moe_ep_size``).
        sync_group: a gloo group over the DP ranks for :class:`~sglang.srt.dp_attention.step_sync.DpStepSync` only.
        moe_comm: the communicator over the DP world for the MoE all-gather / reduce-scatter.
    Attributes:
        padding: the :class:`~sglang.srt.dp_attention.moe.DpForwardPadding` of the MoE layers.
        num_moe_layers: MoE layers sharded by :meth:`layout` (set once the model is built).
    """

    def __init__(self, spec: Any, parallel_state: Any, sync_group: Any, moe_comm: Any):
        self.spec = spec
        self.dp_rank, self.dp_size = spec.dp_rank, spec.dp_size
        self.parallel_state, self.sync_group, self.moe_comm = parallel_state, sync_group, moe_comm
        self.padding = DpForwardPadding()
        self.num_moe_layers = 0

    @classmethod
    def join(cls, spec: Any, init_method: str, device_type: str, device_index: Optional[int] = None,
             timeout_s: Optional[float] = None, share_gpu: bool = False) -> "DpAttentionRank":
        """Join the DP world at ``init_method`` (collective over all DP ranks; blocks until all joined) and build the
        groups (every rank creates them in the same order).

        Raises:
            ValueError: inconsistent sizes (from :class:`~sglang.srt.distributed.parallel_state.DistConfig`).
            RuntimeError: the rendezvous failed or timed out (naming the rank and the address).
        """
        import torch.distributed as dist

        from sglang.srt.distributed.communicator import TorchCommunicator
        from sglang.srt.distributed.parallel_state import DistConfig, init_parallel_state

        ps = init_parallel_state(DistConfig(
            tp_rank=spec.dp_rank, tp_size=spec.dp_size, init_method=init_method, device=device_type,
            device_index=device_index, ep_size=spec.moe_ep_size, device_backend="gloo" if share_gpu else None,
            **({"timeout_s": float(timeout_s)} if timeout_s else {})))
        sync_group = dist.new_group(backend="gloo")
        return cls(spec, ps, sync_group, TorchCommunicator.create(ps))

    @property
    def lockstep(self) -> bool:
        """The ranks must step together (the model has MoE collectives): idle batches and the step agreement."""
        return self.num_moe_layers > 0

    def layout(self, model: nn.Module) -> None:
        """The model layout of DP attention, applied by the loader right after the model (built with ``tp_size=1``)
        is constructed and before its parameters are allocated: every sparse MoE block gets this rank's expert shard
        computed over every rank's tokens (:func:`~sglang.srt.dp_attention.moe.shard_experts`)."""
        self.num_moe_layers = shard_experts(model, self.dp_rank, self.dp_size, self.spec.moe_ep_size, self.moe_comm,
                                            self.padding)

    def agree_min(self, value: int) -> int:
        """The minimum of ``value`` over the DP ranks (the KV budget, so any rank can take any request the front end
        accepts; whether CUDA graphs are used, so every rank replays or none does)."""
        from sglang.srt.distributed.parallel_state import all_reduce_min_int

        return all_reduce_min_int(value, self.parallel_state.cpu_group)

    def step_sync(self, graph_size: Optional[Callable[[int], Optional[int]]],
                  low_latency_capacity: Optional[int] = None) -> DpStepSync:
        """The scheduler's :class:`~sglang.srt.dp_attention.step_sync.DpStepSync` over the agreement group
        (``low_latency_capacity``: the all-to-all dispatcher's low-latency tokens per rank, None without one)."""
        return DpStepSync(self.dp_rank, self.dp_size, self.sync_group, graph_size=graph_size,
                          low_latency_capacity=low_latency_capacity)

    def begin_forward(self, step: Optional[DpGlobalStep]) -> None:
        """Before a forward: its rows per rank (``step`` None: agreed in-band per layer)."""
        self.padding.set(step.rows_per_rank if step is not None else None)

    def begin_forward_rows(self, rows: Optional[int]) -> None:
        """Before a forward of a known shape (a CUDA-graph capture of ``rows`` decode rows on every rank), or None to
        go back to in-band agreement."""
        self.padding.set(rows)

    def install_moe_a2a(self, model: nn.Module, spec: Any, args: Any, device: torch.device,
                        max_running: int) -> Optional[Any]:
        """After the weights are loaded: the all-to-all dispatcher of the worker's ``spec`` (a
        :class:`~sglang.srt.deployment.plan.MoeA2aSpec`, token scope ``local``) over the DP world, on every MoE block
        (:func:`~sglang.srt.dp_attention.moe_a2a.install`); None when ``spec`` is None or the model is dense.

        Raises:
            ValueError: from the install (a scope other than ``local``, experts split below whole).
        """
        if spec is None or not self.lockstep:
            return None
        from sglang.srt.dp_attention.moe_a2a import install

        return install(model, spec, self.parallel_state, args, device, max_running)

    def run_idle(self, model: nn.Module, dtype: torch.dtype, device: torch.device,
                 step: Optional[DpGlobalStep] = None) -> None:
        """This rank's idle forward (see :func:`~sglang.srt.dp_attention.moe.run_idle`), in ``step``'s all-to-all
        mode."""
        run_idle(model, dtype, device, step.moe_dispatch_mode if step is not None else "normal")

    def ready_info(self) -> dict:
        """What the worker adds to its ready message (``/get_server_info`` shows rank 0's): whether the ranks step
        together (a MoE model) or independently (a dense one)."""
        return {"dp_attention_lockstep_resolved": self.lockstep}

    def describe(self) -> str:
        """One line for the startup log."""
        return (f"DP attention rank {self.dp_rank}/{self.dp_size}: {self.num_moe_layers} MoE layers over the DP "
                f"world ({self.moe_comm.describe()}, --moe-a2a-backend {self.spec.moe_a2a_backend}), "
                f"{'lockstep with idle batches' if self.lockstep else 'independent ranks (dense model)'}")
