"""Process groups for tensor (and expert) parallelism, and the small control collectives the ranks share.

One process per TP rank (no Ray, no torchrun): the launcher spawns ``tp_size / nnodes`` ranks per node,
every rank calls :func:`init_parallel_state`, which runs ``torch.distributed.init_process_group`` over TCP
(``dist_init_addr`` of node 0, or a free local port chosen by the launcher).

Groups (Megatron-LM, Shoeybi et al. 2019, sec. 3: one TP group all-reduces the row-parallel outputs):

* ``device_group``: the whole TP group on the compute device, NCCL on GPU, gloo on CPU; model
  collectives go through a :class:`~sglang.srt.distributed.communicator.Communicator` built on it.
* ``cpu_group``: gloo over the same ranks, for control data (the scheduler's per-step broadcast of the
  requests rank 0 received, the KV budget agreement); it never touches the GPU.
* ``ep_group``: ranks that hold different expert slices and the same slice of every expert's
  intermediate dim (None unless ``1 < ep_size``). The all-reduce EP reduces the MoE output over the whole TP
  group and does not need it; expert parallelism by all-to-all (``--moe-a2a-backend``) dispatches and combines
  tokens over it.
"""

from __future__ import annotations

import logging
import struct
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from sglang.srt.distributed.rendezvous import create_store

logger = logging.getLogger(__name__)

DEFAULT_DIST_TIMEOUT_S = 1800.0


@dataclass(frozen=True)
class DistConfig:
    """Where this rank sits and how to reach the others.

    Attributes:
        tp_rank, tp_size: this rank and the TP world size (``0 <= tp_rank < tp_size``).
        ep_size: expert-parallel size, a divisor of ``tp_size`` (experts split over ``ep_size`` groups,
            every expert's intermediate dim over ``tp_size / ep_size`` ranks).
        nnodes, node_rank: nodes of the job and this node; ``tp_size % nnodes == 0``.
        init_method: ``tcp://host:port`` of rank 0's rendezvous store.
        device: ``"cpu"`` (gloo everywhere) or ``"cuda"`` (NCCL for ``device_group``).
        timeout_s: init and collective timeout (seconds); a peer that died surfaces as an error
            after at most this long (usually at once: gloo sees the closed connection).
        device_index: the explicit GPU index the launcher assigned (``--base-gpu-id`` + step); None falls
            back to ``local_rank`` (contiguous GPUs).
        device_backend: the device group's torch.distributed backend: None picks NCCL on GPU and gloo on CPU;
            ``"gloo"`` on GPU is the correctness-only mode where several ranks share one GPU
            (``--tp-ranks-share-gpu``: NCCL refuses two ranks per GPU; gloo moves CUDA tensors through host).
    Raises:
        ValueError: any inconsistent value (the message names it and the fix).
    """

    tp_rank: int
    tp_size: int
    init_method: str
    device: str = "cpu"
    ep_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    timeout_s: float = DEFAULT_DIST_TIMEOUT_S
    device_index: Optional[int] = None
    device_backend: Optional[str] = None

    def __post_init__(self) -> None:
        if self.tp_size < 1 or not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank={self.tp_rank} must be in [0, tp_size={self.tp_size})")
        if self.ep_size < 1 or self.tp_size % self.ep_size:
            raise ValueError(f"--ep-size={self.ep_size} must divide --tp-size={self.tp_size}")
        if self.nnodes < 1 or self.tp_size % self.nnodes:
            raise ValueError(f"--tp-size={self.tp_size} must be a multiple of --nnodes={self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank={self.node_rank} must be in [0, --nnodes={self.nnodes})")
        if not self.tp_rank // self.ranks_per_node == self.node_rank:
            raise ValueError(f"tp_rank={self.tp_rank} does not live on node {self.node_rank} "
                             f"({self.ranks_per_node} ranks per node)")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device={self.device!r} must be 'cpu' or 'cuda'")
        if self.device_backend not in (None, "nccl", "gloo"):
            raise ValueError(f"device_backend={self.device_backend!r} must be None, 'nccl' or 'gloo'")
        if self.device_backend == "nccl" and self.device != "cuda":
            raise ValueError("device_backend='nccl' needs device='cuda'")
        if not self.init_method.startswith(("tcp://", "file://", "env://")):
            raise ValueError(f"init_method={self.init_method!r} must look like tcp://HOST:PORT")

    @property
    def ranks_per_node(self) -> int:
        """TP ranks on each node (``tp_size // nnodes``)."""
        return self.tp_size // self.nnodes

    @property
    def local_rank(self) -> int:
        """Index of this rank on its node."""
        return self.tp_rank % self.ranks_per_node

    @property
    def gpu_index(self) -> int:
        """The GPU this rank uses: ``device_index`` when the launcher assigned one, else ``local_rank``."""
        return self.local_rank if self.device_index is None else self.device_index


@dataclass(frozen=True)
class ParallelState:
    """The groups of one rank (see the module docstring). ``ep_rank = tp_rank // moe_tp_size``,
    ``moe_tp_rank = tp_rank % moe_tp_size`` with ``moe_tp_size = tp_size / ep_size``."""

    tp_rank: int
    tp_size: int
    ep_size: int
    local_rank: int
    device: str
    device_group: Any
    cpu_group: Any
    ep_group: Optional[Any] = None
    gpu_index: Optional[int] = None
    role: str = "aggregated"

    @property
    def moe_tp_size(self) -> int:
        """TP size inside one expert-parallel group (``tp_size // ep_size``)."""
        return self.tp_size // self.ep_size

    @property
    def ep_rank(self) -> int:
        """This rank's expert-parallel index (``tp_rank // moe_tp_size``)."""
        return self.tp_rank // self.moe_tp_size

    @property
    def moe_tp_rank(self) -> int:
        """This rank's TP index inside its expert-parallel group (``tp_rank % moe_tp_size``)."""
        return self.tp_rank % self.moe_tp_size

    @property
    def device_backend(self) -> str:
        """The torch.distributed backend of the device group (e.g. ``nccl`` or ``gloo``)."""
        return dist.get_backend(self.device_group)

    def torch_device(self) -> torch.device:
        """``cuda:<gpu_index>`` on GPU (the launcher's explicit index, else ``local_rank``), ``cpu`` otherwise."""
        if self.device != "cuda":
            return torch.device("cpu")
        return torch.device(f"cuda:{self.local_rank if self.gpu_index is None else self.gpu_index}")


def dist_init_method(dist_init_addr: Optional[str], fallback_port: Optional[int] = None) -> str:
    """``tcp://HOST:PORT`` from ``--dist-init-addr`` (``HOST:PORT``) or ``127.0.0.1:fallback_port``.

    Raises:
        ValueError: neither given, or an address without a numeric port.
    """
    if dist_init_addr:
        host, sep, port = dist_init_addr.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"--dist-init-addr={dist_init_addr!r} must be HOST:PORT (e.g. 10.0.0.1:5000)")
        return f"tcp://{host}:{port}"
    if fallback_port is None:
        raise ValueError("no --dist-init-addr and no local port to rendezvous on")
    return f"tcp://127.0.0.1:{fallback_port}"


def init_parallel_state(cfg: DistConfig) -> ParallelState:
    """Join the job: initialize torch.distributed and build the groups (collective over all ranks).

    On GPU it first selects ``cuda:<local_rank>``. Blocks until every rank joined or
    ``cfg.timeout_s`` passed.
    Raises:
        RuntimeError: torch.distributed is already initialized in this process, or the rendezvous
            failed / timed out (the message says which rank and address).
    """
    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialized in this process; one rank per process")
    timeout = timedelta(seconds=cfg.timeout_s)
    device_id = None
    if cfg.device == "cuda":
        torch.cuda.set_device(cfg.gpu_index)
        device_id = torch.device(f"cuda:{cfg.gpu_index}")
    backend = cfg.device_backend or ("nccl" if cfg.device == "cuda" else "gloo")
    if backend != "nccl":
        device_id = None  # device_id binds NCCL communicators only
    logger.info("TP rank %d/%d joining %s (%s, timeout %.0f s)", cfg.tp_rank, cfg.tp_size, cfg.init_method,
                backend, cfg.timeout_s)
    try:
        store = create_store(cfg.init_method, cfg.tp_rank, cfg.tp_size, timeout)  # listens on HOST only
        kwargs = dict(backend=backend, store=store, rank=cfg.tp_rank, world_size=cfg.tp_size, timeout=timeout)
        if device_id is not None:
            kwargs["device_id"] = device_id
        dist.init_process_group(**kwargs)
    except Exception as e:
        raise RuntimeError(f"TP rank {cfg.tp_rank}: torch.distributed rendezvous at {cfg.init_method} failed: "
                           f"{type(e).__name__}: {e}") from e
    world = dist.group.WORLD
    cpu_group = world if backend == "gloo" else dist.new_group(backend="gloo", timeout=timeout)
    ep_group = None
    if 1 < cfg.ep_size:
        moe_tp = cfg.tp_size // cfg.ep_size
        for m in range(moe_tp):  # every rank creates every group, in the same order
            g = dist.new_group([e * moe_tp + m for e in range(cfg.ep_size)], timeout=timeout)
            if cfg.tp_rank % moe_tp == m:
                ep_group = g
    state = ParallelState(cfg.tp_rank, cfg.tp_size, cfg.ep_size, cfg.local_rank, cfg.device, world, cpu_group,
                          ep_group, gpu_index=cfg.gpu_index)
    logger.info("TP rank %d/%d ready (device group %s, EP %d x MoE-TP %d)", cfg.tp_rank, cfg.tp_size, backend,
                cfg.ep_size, state.moe_tp_size)
    return state


def init_role_parallel_state(world_rank: int, roles: Sequence[tuple[str, Sequence[int]]], init_method: str,
                             device: str = "cpu", gpu_index: Optional[int] = None,
                             timeout_s: float = DEFAULT_DIST_TIMEOUT_S) -> ParallelState:
    """Join a job of several roles and build this rank's groups *inside its role* (collective over all ranks).

    ``roles``: ``[(role name, world ranks), ...]`` partitioning ``0 .. world_size-1`` (e.g. attention workers
    ``[0, 1]`` and FFN workers ``[2, 3]``). The returned state's ``tp_rank``/``tp_size``, ``device_group``
    and ``cpu_group`` are those of the role's TP group, so a model worker's collectives never involve
    another role; cross-role traffic goes through transports (M2N, KV transfer), not these groups.
    Raises:
        ValueError: the roles do not partition the ranks, or ``world_rank`` is in none.
        RuntimeError: as :func:`init_parallel_state`.
    """
    ranks = sorted(r for _, rs in roles for r in rs)
    world_size = len(ranks)
    if ranks != list(range(world_size)) or len({name for name, _ in roles}) != len(roles):
        raise ValueError(f"roles {list(roles)} must partition ranks 0..{world_size - 1} under distinct names")
    if not 0 <= world_rank < world_size:
        raise ValueError(f"world_rank={world_rank} outside [0, {world_size})")
    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialized in this process; one rank per process")
    timeout = timedelta(seconds=timeout_s)
    backend = "nccl" if device == "cuda" else "gloo"
    kwargs = dict(backend=backend, rank=world_rank, world_size=world_size, timeout=timeout)
    if device == "cuda":
        idx = 0 if gpu_index is None else gpu_index
        torch.cuda.set_device(idx)
        kwargs["device_id"] = torch.device(f"cuda:{idx}")
    try:
        kwargs["store"] = create_store(init_method, world_rank, world_size, timeout)  # listens on HOST only
        dist.init_process_group(**kwargs)
    except Exception as e:
        raise RuntimeError(f"rank {world_rank}: torch.distributed rendezvous at {init_method} failed: "
                           f"{type(e).__name__}: {e}") from e
    mine = None
    for name, rs in roles:  # every rank creates every group, in the same order
        dev_g = dist.new_group(list(rs), backend=backend, timeout=timeout)
        cpu_g = dev_g if backend == "gloo" else dist.new_group(list(rs), backend="gloo", timeout=timeout)
        if world_rank in rs:
            mine = (name, list(rs), dev_g, cpu_g)
    name, rs, dev_g, cpu_g = mine
    tp_rank = rs.index(world_rank)
    logger.info("rank %d joined role %s as TP rank %d/%d", world_rank, name, tp_rank, len(rs))
    return ParallelState(tp_rank, len(rs), 1, tp_rank, device, dev_g, cpu_g, None, gpu_index=gpu_index, role=name)


def destroy_parallel_state() -> None:
    """Leave the job (no-op when torch.distributed is not initialized)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def broadcast_bytes_list(msgs: Optional[Sequence[bytes]], group: Any, src: int = 0) -> list[bytes]:
    """Broadcast a list of byte strings from ``src`` to every rank of ``group`` (a gloo CPU group).

    Args:
        msgs: the list on ``src`` (ignored elsewhere; pass None).
    Returns:
        the same list on every rank. One broadcast of a header (int64 ``[count, payload bytes]``) when
        the list is empty; two when it is not (the payload is the int64 lengths then the bytes).
        Nothing is pickled.
    Raises:
        RuntimeError: a peer left (from torch.distributed).
    """
    rank = dist.get_rank(group)
    if rank == src:
        msgs = [bytes(m) for m in (msgs or [])]
        head = struct.pack(f"<{len(msgs)}q", *map(len, msgs))
        blob = head + b"".join(msgs)
        header = torch.tensor([len(msgs), len(blob)], dtype=torch.int64)
    else:
        header = torch.empty(2, dtype=torch.int64)
    dist.broadcast(header, src, group=group)
    n, total = int(header[0]), int(header[1])
    if n == 0:
        return []
    if rank == src:
        dist.broadcast(torch.frombuffer(bytearray(blob), dtype=torch.uint8), src, group=group)
        return msgs
    payload = torch.empty(total, dtype=torch.uint8)
    dist.broadcast(payload, src, group=group)
    data = payload.numpy().tobytes()
    sizes = struct.unpack_from(f"<{n}q", data)
    out, pos = [], 8 * n
    for size in sizes:
        out.append(data[pos:pos + size])
        pos += size
    return out


def all_reduce_min_int(value: int, group: Any) -> int:
    """The minimum of ``value`` over ``group`` (gloo CPU group), e.g. to agree on one KV cache size."""
    t = torch.tensor([int(value)], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return int(t.item())


def local_kv_heads(total_kv_heads: int, tp_size: int) -> int:
    """KV heads one rank holds: ``total / tp`` or 1 when KV heads are replicated (``tp >= total``)."""
    return 1 if tp_size >= total_kv_heads else total_kv_heads // tp_size


def validate_tp_config(model_config: Any, tp_size: int, ep_size: int = 1, nnodes: int = 1) -> None:
    """Check that ``tp_size`` (and ``ep_size``) shard this model; called by the launcher before any rank starts.

    Args:
        model_config: a :class:`~sglang.srt.configs.model_config.ModelConfig`.
    Raises:
        ValueError: ``num_attention_heads``, the KV heads, ``intermediate_size``, the MoE sizes or
            ``nnodes`` do not divide; the message names the value and the valid ``--tp-size`` choices.
    """
    mc = model_config
    heads, kv = mc.num_attention_heads, mc.num_key_value_heads
    valid = [t for t in range(1, heads + 1) if heads % t == 0 and (kv % t == 0 or t % kv == 0)]
    if heads % tp_size:
        raise ValueError(f"--tp-size={tp_size} does not divide num_attention_heads={heads} of {mc.path}; "
                         f"use one of {valid}")
    if not (kv % tp_size == 0 or tp_size % kv == 0):
        raise ValueError(f"--tp-size={tp_size} and num_key_value_heads={kv} of {mc.path}: one must divide the "
                         f"other (KV heads are split or replicated); use one of {valid}")
    if ep_size < 1 or tp_size % ep_size:
        raise ValueError(f"--ep-size={ep_size} must divide --tp-size={tp_size}")
    if nnodes < 1 or tp_size % nnodes:
        raise ValueError(f"--tp-size={tp_size} must be a multiple of --nnodes={nnodes}")
    moe_tp = tp_size // ep_size
    inter = mc.get("intermediate_size")
    n_exp = mc.get("num_local_experts") or mc.get("num_experts") or 0
    moe_inter = mc.get("moe_intermediate_size") or (inter if n_exp else None)
    checks = [("intermediate_size", inter, tp_size), ("moe_intermediate_size", moe_inter if n_exp else None, moe_tp),
              ("shared_expert_intermediate_size", mc.get("shared_expert_intermediate_size") or None, tp_size)]
    if n_exp:
        checks.append(("num_experts", n_exp, ep_size))
    elif ep_size > 1:
        raise ValueError(f"--ep-size={ep_size} needs a MoE model; {mc.path} has no experts")
    for name, value, div in checks:
        if value and int(value) % div:
            raise ValueError(f"{name}={value} of {mc.path} is not divisible by {div} "
                             f"(--tp-size={tp_size}, --ep-size={ep_size}); pick sizes that divide it")
