"""The deployment plan: every technique resolved once, into frozen worker specs that the launchers only carry out.

``plan_deployment(server_args)`` is the only code outside ``server_args.py`` and the technique packages that reads
the technique flags (``enable_tokenweave``, ``enable_afd``, ``enable_tdist_overlap``, ``disaggregation_mode``,
``use_ray``, ``comm_backend``, ``enable_dp_attention``). It asks each technique package (:mod:`sglang.srt.deployment.techniques`) to
validate the flags, then lists every model worker to start as a :class:`WorkerSpec`: its :class:`WorkerRole`,
placement (node slice, device slot, explicit device), parallel ranks, and what its process builds: an
:class:`ExecutorSpec` (how the layers run), a :class:`CommunicatorSpec` (TP collectives) and an optional
:class:`ConnectorSpec` (PD KV transfer). What is only known at launch time (socket addresses, the TP rendezvous,
the AFD M2N inboxes, a Ray node's IP) is added by the launcher as a :class:`Wiring` (:meth:`WorkerSpec.bind`).

``python -m sglang.launch_server --dry-run ...`` prints :func:`sglang.srt.deployment.render.render_plan`.
This module imports no torch and no technique runtime (it is safe for ``--dry-run`` and the CLI).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any, Mapping, Optional

if TYPE_CHECKING:
    from sglang.srt.server_args import PortArgs, ServerArgs


class WorkerRole(str, Enum):
    """What a model worker process is for (the one role vocabulary of the server).

    ``aggregated``: the whole model and a KV cache (prefill and decode together); ``prefill`` / ``decode``: PD
    disaggregation (KVDirect, Chen et al. 2024): both hold the whole model and a KV cache, prefill publishes its KV
    region; ``attention``: MegaScale-Infer's attention worker (Zhu et al. 2025, sec. 3): everything but the routed
    experts, plus the KV cache; ``ffn``: the routed experts only, no KV cache.
    """

    AGGREGATED = "aggregated"
    PREFILL = "prefill"
    DECODE = "decode"
    ATTENTION = "attention"
    FFN = "ffn"


def _options(options: Optional[Mapping[str, Any]]) -> tuple:
    """``options`` as a sorted tuple of ``(name, value)`` pairs (hashable, printable in a stable order)."""
    return tuple(sorted((options or {}).items()))


@dataclass(frozen=True)
class ExecutorSpec:
    """How a worker's layers run over a batch: the executor registry name (``sequential``, ``tokenweave``,
    ``tdist_sp``, ``afd``, ...; see :func:`sglang.srt.model_executor.executors.build_executor`) and its options
    as sorted ``(name, value)`` pairs."""

    name: str = "sequential"
    options: tuple = ()

    @classmethod
    def of(cls, name: str, **options: Any) -> "ExecutorSpec":
        """An ExecutorSpec with keyword options."""
        return cls(name, _options(options))

    def opts(self) -> dict:
        """The options as a dict."""
        return dict(self.options)

    def describe(self) -> str:
        """``name(k=v, ...)`` for the plan table."""
        return self.name + (f"({', '.join(f'{k}={v}' for k, v in self.options)})" if self.options else "")


@dataclass(frozen=True)
class CommunicatorSpec:
    """The TP communicator of a worker (:func:`sglang.srt.deployment.communicator.make_communicator`).

    Attributes:
        backend: ``auto`` | ``torch`` | ``custom`` | ``tw`` | ``nocomm`` | ``module:factory``.
        tokenweave: TokenWeave's choice: tw-comm when ``backend`` is auto/tw and it can be built, NCCL/gloo
            otherwise (logged).
        comm_sms: SM budget of tw-comm's overlapped kernel (None: tw-comm's default).
        disable_custom_all_reduce: never use the symmetric-memory custom all-reduce.
        max_tokens: the most new tokens one forward carries (TokenWeave: sizes tw-comm's workspace with the
            model's hidden size; None: tw-comm's default size).
    """

    backend: str = "auto"
    tokenweave: bool = False
    comm_sms: Optional[int] = None
    disable_custom_all_reduce: bool = False
    max_tokens: Optional[int] = None

    def describe(self) -> str:
        """Short form for the plan table."""
        return self.backend + (" [tokenweave]" if self.tokenweave else "")


@dataclass(frozen=True)
class ConnectorSpec:
    """The PD KV connector of a prefill or decode worker (``disaggregation/``): its side, the one-sided
    transport (``nixl`` | ``fake``) and the transfer mode (``pull``: KVDirect; ``push``)."""

    side: WorkerRole
    transfer_backend: str = "nixl"
    transfer_mode: str = "pull"

    def describe(self) -> str:
        """Short form for the plan table."""
        return f"pd-{self.side.value}({self.transfer_backend}, {self.transfer_mode})"


@dataclass(frozen=True)
class DpAttentionSpec:
    """SGLang's DP attention for one worker (``--enable-dp-attention``; the LMSYS blog on DeepSeek's data-parallel MLA
    attention, 2025; DeepSeek-V3 technical report, sec. 3.4): the worker is DP rank ``dp_rank`` of ``dp_size``, schedules
    its own requests with its own KV cache and replicated attention / dense weights, and runs the MoE layers expert
    parallel over all ``dp_size`` ranks of one torch.distributed world (made by ``sglang.srt.dp_attention``).

    Attributes:
        dp_rank / dp_size: this rank and the DP size (= ``--tp-size``; the world of the MoE collectives).
        moe_ep_size: ``--ep-size``: expert groups over the ranks (experts split ``moe_ep_size`` ways, each expert's
            intermediate dim over ``dp_size / moe_ep_size`` ranks).
        moe_a2a_backend: ``none`` (gather every rank's tokens, run the local experts, reduce-scatter back: the
            all-reduce EP of ``fused_moe.py`` over the DP world) or an all-to-all token dispatcher's name.
    """

    dp_rank: int
    dp_size: int
    moe_ep_size: int = 1
    moe_a2a_backend: str = "none"

    def describe(self) -> str:
        """Short form for the plan table."""
        return f"dp {self.dp_rank}/{self.dp_size}, moe ep {self.moe_ep_size} ({self.moe_a2a_backend})"


@dataclass(frozen=True)
class MoeA2aSpec:
    """Expert parallelism by all-to-all of a worker's MoE layers (``--moe-a2a-backend``; see
    ``sglang.srt.expert_parallel``): the worker builds one token dispatcher and installs it on every MoE block.

    Attributes:
        backend: ``nccl`` (``torch.distributed.all_to_all_single``; gloo on CPU) or ``tdist`` (Triton-distributed
            low-latency all-to-all).
        token_scope: which tokens a rank dispatches: ``tp_slice`` (TP attention: each rank 1/tp of the batch, so each
            token is dispatched once) or ``local`` (DP attention: each rank its own requests' tokens).
        max_inflight: dispatches that may be pending combine at once (low-latency buffer sets; 2 for two-batch
            overlap).
    """

    backend: str
    token_scope: str = "tp_slice"
    max_inflight: int = 2

    def describe(self) -> str:
        """Short form for the plan table."""
        return f"a2a-{self.backend}({self.token_scope})"


@dataclass(frozen=True)
class Wiring:
    """What a launcher adds to a :class:`WorkerSpec` when it starts it (addresses exist only then).

    Attributes:
        port_args: the ZMQ endpoints this worker binds / connects (scheduler workers).
        dist_init: the TP group's rendezvous (``tcp://HOST:PORT``), None without TP.
        afd_topology: the :class:`~sglang.srt.afd.protocol.AfdTopology` (M2N inboxes) of an AFD worker.
        tokenizer: the front end's :class:`~sglang.srt.managers.backend_tokenizer.BackendTokenizerSpec` when the
            launcher loaded one (a scheduler rebuilds its tokenizer from it); None: the worker loads the HF tokenizer.
    """

    port_args: Optional["PortArgs"] = None
    dist_init: Optional[str] = None
    afd_topology: Any = None
    tokenizer: Any = None


@dataclass(frozen=True)
class WorkerSpec:
    """One model worker process of the plan.

    Attributes:
        role: its :class:`WorkerRole`.
        name: process name (``sglang::scheduler_TP1``, ``sglang::attention0``, ``sglang::ffn2``).
        group: index of its worker group inside the role (AFD attention worker ``a``; 0 otherwise).
        rank: its rank inside the group (TP rank; FFN worker index for ``ffn``).
        tp_size: ranks of its TP group (1 for FFN workers).
        index: its position in the plan (unique; the launcher's handle order).
        node: node slice it runs on (``--nnodes``; Ray places slices on distinct nodes).
        local_index: device slot on its node (``--base-gpu-id + local_index * --gpu-id-step``).
        device: explicit device (``cuda:3``, ``cpu``; under Ray ``cuda:0`` = the GPU Ray assigned).
        executor / communicator / connector: what the worker builds (connector None unless PD).
        dp_attention: its :class:`DpAttentionSpec` under ``--enable-dp-attention`` (None otherwise); then ``group``
            is the DP rank (its own scheduler sockets), ``rank`` / ``tp_size`` its place in the MoE world.
        moe_a2a: expert parallelism by all-to-all of its MoE layers (None: the all-reduce EP of ``--ep-size``).
        resources: what a placement-aware launcher reserves, e.g. ``{"CPU": 1, "GPU": 1}``.
        args: the frozen ServerArgs the worker sizes itself with (not printed).
        wiring: filled by the launcher (:meth:`bind`).
    """

    role: WorkerRole
    name: str
    group: int = 0
    rank: int = 0
    tp_size: int = 1
    index: int = 0
    node: int = 0
    local_index: int = 0
    device: str = "cpu"
    executor: ExecutorSpec = ExecutorSpec()
    communicator: CommunicatorSpec = CommunicatorSpec()
    connector: Optional[ConnectorSpec] = None
    dp_attention: Optional[DpAttentionSpec] = None
    moe_a2a: Optional[MoeA2aSpec] = None
    resources: Mapping[str, float] = field(default_factory=dict, compare=False)
    args: Optional["ServerArgs"] = field(default=None, repr=False, compare=False)
    wiring: Wiring = Wiring()

    def bind(self, wiring: Wiring, **arg_changes: Any) -> "WorkerSpec":
        """This spec with the launcher's ``wiring`` (and ServerArgs fields the launcher decides, e.g. the
        ``host`` a Ray node is known by)."""
        args = self.args.replace(**arg_changes) if arg_changes else self.args
        return dataclasses.replace(self, wiring=wiring, args=args)

    @property
    def is_scheduler(self) -> bool:
        """Runs a scheduler (every role but ``ffn``)."""
        return self.role is not WorkerRole.FFN


@dataclass(frozen=True)
class DeploymentPlan:
    """Every process this launch starts.

    Attributes:
        workers: the model workers, in start order (schedulers first, rank 0 of group 0 leading; then FFN workers).
        launcher: ``multiprocessing`` (``spawn`` on this node) or ``ray`` (actors in placement groups).
        techniques: the techniques in use, e.g. ``("tokenweave",)``.
        detokenizer: whether this node starts the detokenizer (node 0 / the Ray driver's side).
        zmq_transport: ``ipc`` or ``tcp`` (Ray: always tcp).
        node_rank / nnodes: this launcher's node and the node count (multiprocessing multi-node: one launcher per
            node, ``workers`` lists this node's only).
        notes: resolved choices worth showing (e.g. ``afd transport auto -> cuda_ipc``).
        stay_up_on_worker_death: a dead worker fails in-flight requests and turns ``/health`` to 503 instead of
            stopping the server (AFD: an FFN worker's death).
    """

    workers: tuple
    launcher: str = "multiprocessing"
    techniques: tuple = ()
    detokenizer: bool = True
    zmq_transport: str = "ipc"
    node_rank: int = 0
    nnodes: int = 1
    notes: tuple = ()
    stay_up_on_worker_death: bool = False

    @property
    def schedulers(self) -> tuple:
        """The scheduler workers (every role but ``ffn``), in order."""
        return tuple(w for w in self.workers if w.is_scheduler)

    @property
    def ffn_workers(self) -> tuple:
        """The AFD FFN workers, in order."""
        return tuple(w for w in self.workers if w.role is WorkerRole.FFN)

    @property
    def uses_ray(self) -> bool:
        """Workers are Ray actors."""
        return self.launcher == "ray"

    @property
    def scheduler_groups(self) -> int:
        """Data-parallel scheduler groups (AFD attention workers, DP attention ranks; 1 otherwise)."""
        return 1 + max((w.group for w in self.schedulers), default=0)
