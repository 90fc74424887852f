"""tw-comm workspace API: fused AllReduce + residual add + RMSNorm (TokenWeave, Gond et al. 2025, section 3.3).

One long-lived :class:`TwCommWorkspace` per process group (symmetric staging buffers and signal pads, shared
once over CUDA IPC; no multicast objects) and stateless calls :func:`allreduce_rmsnorm` / :func:`allreduce`
taking tensors + workspace. The backend is chosen per call by size, world size and overlap mode
(:func:`select_backend`) and logged:

* ``p2p_oneshot``  small inputs: push to all peers, one barrier, local reduce + norm (lowest latency);
* ``p2p_lamport``  the one-shot with the flag in the data (empty slots hold negative zero, readers spin on the data;
  no barrier), world*T*H*2 <= world * 2 MiB: auto-selected for fused, non-overlapped calls that fit where no
  calibrated table decides (the packaged H200 tables pick it only up to ~5 tokens at hidden 8192). 2 H100s, hidden
  8192, 2026-11-26, chosen explicitly, before the 1b24565 rewrite: 7.2 / 9.9 / 15.9 us at T 1 / 32 / 128 vs
  one-shot 10.0 / 11.6 / 17.9, NCCL symmetric 9.4 / 19.6 / 26.5, torch symmetric memory 11.7 / 13.4 / 17.9;
* ``p2p_twoshot``  large inputs: ReduceScatter by peer stores -> residual + RMSNorm on own 1/N rows ->
  AllGather by peer loads (line-rate traffic);
* ``p2p_twoshot_pipe``  the two-shot with per-chunk flags: the push of one chunk, the reduce + norm of another and
  the pull of a third overlap (no whole-tensor barrier), chosen where the calibrated table says it wins;
* ``p2p_twoshot_bulk``  the two-shot whose NVLink phases are Hopper bulk asynchronous copies (cp.async.bulk through
  a shared-memory ring, one issuing thread per CTA): built for few CTAs (TokenWeave sec. 3-4 overlap); chosen where
  the calibrated table says it wins, or for every two-shot call with ``TwCommConfig.bulk_twoshot``;
* ``ce``           overlap mode, large inputs: copy engines move the data, the norm kernel uses <= ``ce_sms`` SMs;
* ``nvls``         only where multicast is supported AND allowed (never on our hosts; tw-comm creates no
  multicast objects, so it is never selected by this workspace);
* ``nccl``         fallback (world not in {2, 4, 8}, capacity exceeded, no P2P); ``torch`` on CPU (gloo);
  ``local``        world size 1.

Where ``benchmark/comm/bench_allreduce_rmsnorm.py --calibrate`` measured this GPU model and world size, the workspace
loads that table (:mod:`sglang.srt.distributed.tw_comm_tuning`) and the choice (and SM count) follows it.

The caller's tensors are used in place (the kernels push x from wherever it lives and pull results straight into
``out``/``residual``), so there is no symmetric input view to write into and no copy-in / copy-out.
"""

from __future__ import annotations

import ctypes
import enum
import logging
import os
from dataclasses import dataclass
from typing import Mapping, Optional, Tuple

import torch
import torch.distributed as dist

from sglang.srt.distributed.tw_comm_tuning import Crossovers, describe, load_crossovers
from sglang.srt.utils.nvls_env import NVLS_ENV_VARS  # noqa: F401  (re-exported: tw-comm callers import it here)

logger = logging.getLogger(__name__)

_FALSE = ("0", "false", "no", "off")
_TRUE = ("1", "true", "yes", "on")


class TwBackend(str, enum.Enum):
    """Implementation chosen for one call."""

    ONESHOT = "p2p_oneshot"
    LAMPORT = "p2p_lamport"
    TWOSHOT = "p2p_twoshot"
    PIPE = "p2p_twoshot_pipe"
    BULK = "p2p_twoshot_bulk"
    CE = "ce"
    NVLS = "nvls"
    NCCL = "nccl"
    TORCH = "torch"
    LOCAL = "local"


@dataclass(frozen=True)
class TwCommConfig:
    """Workspace sizing and backend thresholds.

    max_bytes: largest input a call may stage, T * H * element size in bytes (the workspace allocates about
      4x this per GPU: two slots of input + output regions). oneshot_max_bytes: per-world-size input bytes up to
      which one-shot is used. *_sms: default SM (thread block) bounds (overlap_sms: of overlapped calls).
      ce_min_bytes: smallest input sent to the copy-engine variant in overlap mode (0: never).
      residual_sharded: two-shot/CE update only this rank's token range of the residual (TokenWeave keeps the
      residual sharded between layers; saves one AllGather). pipe_chunk_bytes: bytes of one peer's rows per
      chunk of p2p_twoshot_pipe (0: the library default, 32 KiB). crossovers: the calibrated table (empty: the
      built-in rules; filled by TwCommWorkspace from tw_comm_tuning.load_crossovers when use_calibrated).
      bulk_twoshot: None (default): the calibrated table decides where p2p_twoshot_bulk runs (on H200 at world
      2/4 TokenWeave's overlapped two-shot calls); True: every fused p2p_twoshot / p2p_twoshot_pipe
      pick becomes p2p_twoshot_bulk (sm_90+ only; same result); False: never bulk (a table's bulk pick becomes
      p2p_twoshot, the pre-bulk choice).
    """

    max_bytes: int = 64 << 20
    # crossovers measured on 8x H200 (benchmark/results/comm/2026-11-20_allreduce_rmsnorm_8xh200.md, hidden 8192)
    oneshot_max_bytes: Tuple[Tuple[int, int], ...] = ((2, 4 << 20), (4, 1 << 20), (8, 1 << 20))
    oneshot_sms: int = 64
    twoshot_sms: int = 128  # the two-shot copy phases are latency-bound per SM: time falls with SMs up to ~128
    ce_sms: int = 8
    # 0: never. CE on 8 SMs took 2-7x NCCL's time at every size measured (2 x H100 2026-11-26 17:50, 4 x H200
    # 2026-11-26 23:49), so overlapped calls
    # use the two-shot kernel on overlap_sms SMs unless a calibrated config turns CE on from this many bytes.
    ce_min_bytes: int = 0
    # overlapped calls (TokenWeave) without an explicit budget: few CTAs, so the other split's GEMMs keep the
    # rest of the GPU (TokenWeave sec. 3.3 runs its fused kernel on 16-32 SMs)
    overlap_sms: int = 16
    residual_sharded: bool = False
    # auto-select p2p_lamport for fused non-overlapped calls that fit its buffer (False: one-shot as before)
    lamport_auto: bool = True
    pipe_chunk_bytes: int = 0
    bulk_twoshot: Optional[bool] = None
    use_calibrated: bool = True
    crossovers: Crossovers = Crossovers()

    def __post_init__(self) -> None:
        if self.max_bytes <= 0:
            raise ValueError(f"max_bytes={self.max_bytes} must be > 0")
        for name in ("oneshot_sms", "twoshot_sms", "ce_sms", "overlap_sms"):
            v = getattr(self, name)
            if not 1 <= v <= 256:
                raise ValueError(f"{name}={v} must be in [1, 256]")
        if self.pipe_chunk_bytes < 0:
            raise ValueError(f"pipe_chunk_bytes={self.pipe_chunk_bytes} must be >= 0 (0: library default)")

    def oneshot_limit(self, world: int) -> int:
        """One-shot byte threshold for ``world`` ranks (0 if none configured)."""
        return dict(self.oneshot_max_bytes).get(world, 0)


def nvls_env_allows(env: Optional[Mapping[str, str]] = None) -> Tuple[bool, str]:
    """Whether the environment allows NVLink multicast: (allowed, reason).

    Refused when NCCL_NVLS_ENABLE is false-like ("0"), or TORCH_SYMM_MEM_DISABLE_MULTICAST or
    NVSHMEM_DISABLE_NVLS is true-like. Pure function of ``env`` (default ``os.environ``).
    """
    env = os.environ if env is None else env
    v = env.get("NCCL_NVLS_ENABLE")
    if v is not None and v.strip().lower() in _FALSE:
        return False, f"NCCL_NVLS_ENABLE={v}"
    for name in ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
        v = env.get(name)
        if v is not None and v.strip().lower() in _TRUE:
            return False, f"{name}={v}"
    return True, "environment allows multicast"


# payload bytes per source rank of one Lamport buffer (tw-comm/csrc/allreduce_rmsnorm/common.cuh kLamportRankBytes)
LAMPORT_RANK_BYTES = 2 << 20


def staging_bytes(tokens: int, hidden: int, world: int, elem: int = 2) -> Tuple[int, int]:
    """(two-shot, one-shot) staging bytes a call needs: world*ceil(T/world)*H*elem and world*T*H*elem."""
    stride = -(-tokens // world)
    return world * stride * hidden * elem, world * tokens * hidden * elem


def select_backend(
    tokens: int,
    hidden: int,
    world: int,
    *,
    config: TwCommConfig,
    overlap: bool = False,
    p2p_available: bool = True,
    on_cuda: bool = True,
    nvls_available: bool = False,
    capacity_bytes: int = 0,
    elem: int = 2,
    fused: bool = True,
) -> TwBackend:
    """Pick the backend for a [tokens, hidden] call (pure; logged by the caller).

    nvls_available must be True only when the gate passed AND a multicast mapping exists (never here).
    capacity_bytes: the workspace's staging region size. fused: the call is AllReduce + RMSNorm (plain AllReduce
    has no Lamport form). A calibrated table (``config.crossovers``) decides fused calls first (its plain table
    for non-overlapped calls, its overlap table otherwise), where its pick is feasible. Without one, Lamport is
    chosen for fused, non-overlapped 2-byte calls with ``world * T * H * 2 <= world * LAMPORT_RANK_BYTES``
    (T <= 128 at H 8192) when ``config.lamport_auto``. ``config.bulk_twoshot`` True / False forces / forbids
    the bulk-copy two-shot for the two-shot picks (None: as picked).
    """
    if world == 1:
        return TwBackend.LOCAL
    if not on_cuda:
        return TwBackend.TORCH
    if nvls_available:
        return TwBackend.NVLS
    b = _select_p2p(tokens, hidden, world, config, overlap, p2p_available, capacity_bytes, elem, fused)
    if config.bulk_twoshot and fused and b in (TwBackend.TWOSHOT, TwBackend.PIPE):
        return TwBackend.BULK
    if config.bulk_twoshot is False and b == TwBackend.BULK:
        return TwBackend.TWOSHOT
    return b


def _select_p2p(tokens: int, hidden: int, world: int, config: TwCommConfig, overlap: bool, p2p_available: bool,
                capacity_bytes: int, elem: int, fused: bool) -> TwBackend:
    """select_backend's choice among the P2P kernels and the NCCL fallback (CUDA, world > 1, no NVLS)."""
    if not p2p_available:
        return TwBackend.NCCL
    two_need, one_need = staging_bytes(tokens, hidden, world, elem)
    if two_need > capacity_bytes:
        return TwBackend.NCCL
    nbytes = tokens * hidden * elem
    pick = config.crossovers.pick(nbytes, overlap) if fused else None
    if pick is not None:
        b = TwBackend(pick[1])
        if b == TwBackend.LAMPORT and (overlap or elem != 2 or nbytes > LAMPORT_RANK_BYTES):
            b = None
        elif b == TwBackend.ONESHOT and one_need > capacity_bytes:
            b = None
        if b is not None:
            return b
    if overlap and config.ce_min_bytes and nbytes >= config.ce_min_bytes:
        return TwBackend.CE
    if fused and not overlap and config.lamport_auto and elem == 2 and nbytes <= LAMPORT_RANK_BYTES:
        return TwBackend.LAMPORT
    if nbytes <= config.oneshot_limit(world) and one_need <= capacity_bytes:
        return TwBackend.ONESHOT
    return TwBackend.TWOSHOT


class TwCommWorkspace:
    """Long-lived tw-comm state for one process group on one device.

    Creating it is collective over ``group`` (every rank must construct it): each rank allocates its staging
    buffers and signal pads, the CUDA IPC handles are all-gathered as uint8 tensors, and peers' buffers are
    opened. On CPU, or for a world size tw-comm does not build for (not 2/4/8), no buffers are made and calls use
    torch.distributed (``torch`` / ``nccl`` backends). ``close()`` (collective) frees everything.
    """

    def __init__(
        self,
        group: Optional[dist.ProcessGroup],
        device: torch.device,
        config: TwCommConfig = TwCommConfig(),
    ):
        self.group = group
        self.device = torch.device(device)
        self.config = config
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self._handle: Optional[int] = None
        self._lib = None
        self._logged: set = set()
        self.capacity_bytes = 0
        self.nvls_reason = nvls_env_allows()[1]
        if self.device.type == "cuda" and self.world in (2, 4, 8):
            self._open()
            if config.use_calibrated and not (config.crossovers.plain or config.crossovers.overlap):
                self._load_crossovers()

    def _load_crossovers(self) -> None:
        """Adopt the calibrated table of this GPU model and world size, if one exists (see tw_comm_tuning)."""
        import dataclasses

        gpu = torch.cuda.get_device_name(self.device)
        table = load_crossovers(gpu, self.world)
        if table.plain or table.overlap:
            self.config = dataclasses.replace(self.config, crossovers=table)
            if self.rank == 0:
                logger.info("tw-comm: calibrated crossovers for %s x%d: plain %s; overlap %s", gpu, self.world,
                            describe(table.plain), describe(table.overlap))
        elif self.rank == 0:
            logger.info("tw-comm: no calibrated crossovers for %s x%d: built-in thresholds", gpu, self.world)

    def _open(self) -> None:
        from sgl_kernel.tw_comm.lib import IPC_HANDLE_BYTES, load_library

        self._lib = lib = load_library()
        dev = self.device.index if self.device.index is not None else torch.cuda.current_device()
        self.device = torch.device("cuda", dev)
        h = ctypes.c_void_p()
        lib.call("tw_workspace_create", dev, self.rank, self.world, self.config.max_bytes, ctypes.byref(h))
        self._handle = h.value
        buf = ctypes.create_string_buffer(IPC_HANDLE_BYTES)
        lib.call("tw_workspace_ipc_handle", ctypes.c_void_p(self._handle), ctypes.cast(buf, ctypes.c_void_p))
        mine = torch.frombuffer(bytearray(buf.raw), dtype=torch.uint8)
        comm_dev = self.device if "nccl" in str(dist.get_backend(self.group)) else torch.device("cpu")
        gathered = torch.empty(self.world * IPC_HANDLE_BYTES, dtype=torch.uint8, device=comm_dev)
        dist.all_gather_into_tensor(gathered, mine.to(comm_dev), group=self.group)
        all_bytes = ctypes.create_string_buffer(bytes(gathered.cpu().tolist()), self.world * IPC_HANDLE_BYTES)
        lib.call("tw_workspace_open", ctypes.c_void_p(self._handle), ctypes.cast(all_bytes, ctypes.c_void_p))
        self.capacity_bytes = int(lib.raw("tw_workspace_capacity", ctypes.c_void_p(self._handle)))
        dist.barrier(group=self.group)
        from sgl_kernel.tw_comm.ops import nvls_gate

        self.nvls_reason = nvls_gate(dev)[1]
        logger.info(
            "tw-comm workspace: rank %d/%d on %s, staging capacity %d bytes; nvls: %s",
            self.rank, self.world, self.device, self.capacity_bytes, self.nvls_reason,
        )

    @property
    def handle(self) -> int:
        """Opaque library handle for the sgl_kernel ops; ValueError if this workspace has no P2P buffers."""
        if self._handle is None:
            raise ValueError("this workspace has no tw-comm buffers (CPU, unsupported world size, or closed)")
        return self._handle

    def select(self, tokens: int, hidden: int, overlap: bool = False, elem: int = 2, fused: bool = True) -> TwBackend:
        """Backend for a [tokens, hidden] call (``fused``: AllReduce + RMSNorm, else plain AllReduce); logs the first
        use of each (backend, overlap) pair at INFO."""
        b = select_backend(
            tokens, hidden, self.world, config=self.config, overlap=overlap,
            p2p_available=self._handle is not None, on_cuda=self.device.type == "cuda",
            nvls_available=False, capacity_bytes=self.capacity_bytes, elem=elem, fused=fused,
        )
        key = (b, overlap)
        if key not in self._logged:
            self._logged.add(key)
            logger.info("tw-comm: backend %s for T=%d H=%d world=%d overlap=%s", b.value, tokens, hidden,
                        self.world, overlap)
        else:
            logger.debug("tw-comm: backend %s for T=%d H=%d", b.value, tokens, hidden)
        return b

    def close(self) -> None:
        """Collective: wait for all ranks, then unmap peers and free this rank's buffers."""
        if self._handle is not None:
            torch.cuda.synchronize(self.device)
            dist.barrier(group=self.group)
            self._lib.call("tw_workspace_destroy", ctypes.c_void_p(self._handle))
            self._handle = None

    def __enter__(self) -> "TwCommWorkspace":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def allreduce_rmsnorm(self, x, residual, weight, eps, **kw) -> torch.Tensor:
        """Method form of :func:`allreduce_rmsnorm`."""
        return allreduce_rmsnorm(self, x, residual, weight, eps, **kw)

    def allreduce(self, x, **kw) -> torch.Tensor:
        """Method form of :func:`allreduce`."""
        return allreduce(self, x, **kw)


def _ops():
    """Import (and thereby register) the sgl_kernel torch ops."""
    from sgl_kernel.tw_comm import ops as tw_comm_ops

    return tw_comm_ops


def _sms(ws: TwCommWorkspace, backend: TwBackend, max_sms: Optional[int], overlap: bool = False,
         pick: Optional[Tuple[int, str, int]] = None) -> int:
    if max_sms is not None:
        if not 1 <= max_sms <= 256:
            raise ValueError(f"max_sms={max_sms} must be in [1, 256]")
        return max_sms
    c = ws.config
    if overlap and backend in (TwBackend.ONESHOT, TwBackend.TWOSHOT, TwBackend.LAMPORT, TwBackend.PIPE,
                               TwBackend.BULK):
        return c.overlap_sms
    if pick is not None and pick[1] == backend.value:
        return pick[2]
    return {TwBackend.ONESHOT: c.oneshot_sms, TwBackend.LAMPORT: c.oneshot_sms,
            TwBackend.CE: c.ce_sms}.get(backend, c.twoshot_sms)


def allreduce_rmsnorm(
    ws: TwCommWorkspace,
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    out: Optional[torch.Tensor] = None,
    overlap: bool = False,
    backend: Optional[TwBackend] = None,
    max_sms: Optional[int] = None,
    residual_sharded: Optional[bool] = None,
) -> torch.Tensor:
    """``residual += allreduce(x); out = rmsnorm(residual) * weight`` over ``ws.group`` (fp32 accumulation).

    x, residual: [T, H] bf16/fp16 on ``ws.device`` (H % 8 == 0, H <= 16384); weight: [H]. residual is updated
    in place (only this rank's token range when residual_sharded and the backend is two-shot/pipe/bulk/CE); returns
    ``out`` ([T, H], allocated if None). All ranks must call with the same shapes, backend and max_sms.
    ``overlap``: the call runs beside compute (TokenWeave); without ``max_sms`` it uses ``config.overlap_sms``.
    CUDA-graph capturable on the P2P/CE backends. Raises ValueError on bad arguments.
    """
    from sgl_kernel.tw_comm.validate import validate_allreduce_rmsnorm

    validate_allreduce_rmsnorm(x, residual, weight, out, eps)
    if out is None:
        out = torch.empty_like(x)
    tokens, hidden = x.shape
    b = backend or ws.select(tokens, hidden, overlap, x.element_size())
    sharded = ws.config.residual_sharded if residual_sharded is None else residual_sharded
    if tokens == 0:
        return out
    if b in (TwBackend.ONESHOT, TwBackend.TWOSHOT, TwBackend.CE, TwBackend.LAMPORT, TwBackend.PIPE, TwBackend.BULK):
        ops = _ops()
        variant = {TwBackend.ONESHOT: ops.ONESHOT, TwBackend.TWOSHOT: ops.TWOSHOT, TwBackend.CE: ops.CE,
                   TwBackend.LAMPORT: ops.LAMPORT, TwBackend.PIPE: ops.PIPE, TwBackend.BULK: ops.BULK}[b]
        pick = None if max_sms is not None else ws.config.crossovers.pick(tokens * hidden * x.element_size(), overlap)
        # eager: the launcher directly (no custom-op dispatch per call); under torch.compile: the registered op
        launch = (torch.ops.sgl_kernel.tw_allreduce_rmsnorm if torch.compiler.is_compiling()
                  else ops.launch_allreduce_rmsnorm)
        launch(ws.handle, x, residual, weight, out, float(eps), variant, _sms(ws, b, max_sms, overlap, pick),
               bool(sharded), ws.config.pipe_chunk_bytes)
        return out
    if b == TwBackend.NVLS:
        raise ValueError("backend nvls is not available: tw-comm creates no multicast objects (" +
                         ws.nvls_reason + ")")
    if b == TwBackend.LOCAL:
        total = x
    else:
        total = x.clone() if b == TwBackend.NCCL else x.float()
        dist.all_reduce(total, group=ws.group)
    if x.is_cuda and b in (TwBackend.NCCL, TwBackend.LOCAL):
        _ops()
        torch.ops.sgl_kernel.tw_fused_add_rmsnorm(total, residual, weight, out, float(eps),
                                                  _sms(ws, TwBackend.TWOSHOT, max_sms))
        return out
    from sgl_kernel.tw_comm.reference import add_rmsnorm_fp32

    new_res, normed = add_rmsnorm_fp32(total.float(), residual, weight, eps)
    residual.copy_(new_res)
    out.copy_(normed)
    return out


def allreduce(
    ws: TwCommWorkspace,
    x: torch.Tensor,
    *,
    out: Optional[torch.Tensor] = None,
    backend: Optional[TwBackend] = None,
    max_sms: Optional[int] = None,
) -> torch.Tensor:
    """Plain AllReduce (sum) of x [T, H] bf16/fp16 over ``ws.group`` into ``out`` (allocated if None)."""
    from sgl_kernel.tw_comm.validate import validate_allreduce

    validate_allreduce(x, out)
    if out is None:
        out = torch.empty_like(x)
    tokens, hidden = x.shape
    b = backend or ws.select(tokens, hidden, False, x.element_size(), fused=False)
    if tokens == 0:
        return out
    if b in (TwBackend.ONESHOT, TwBackend.TWOSHOT):
        variant = 0 if b == TwBackend.ONESHOT else 1
        _ops()
        torch.ops.sgl_kernel.tw_allreduce(ws.handle, x, out, variant, _sms(ws, b, max_sms))
        return out
    if b == TwBackend.CE:
        raise ValueError("backend ce has no plain AllReduce form; use p2p_oneshot or p2p_twoshot")
    if b == TwBackend.NVLS:
        raise ValueError("backend nvls is not available: tw-comm creates no multicast objects")
    if b == TwBackend.LOCAL:
        out.copy_(x)
        return out
    total = x.clone() if b == TwBackend.NCCL else x.float()
    dist.all_reduce(total, group=ws.group)
    out.copy_(total)
    return out
