"""``nixl`` transfer backend: one-sided READ/WRITE through NVIDIA NIXL (UCX plugin by default).

NIXL moves registered memory between agents without the owner's CPU touching each block: host memory
(DRAM) on CPU machines, GPU memory (VRAM) via CUDA IPC inside a node and RDMA across nodes. This is the
transport KVDirect's pull design assumes (Chen et al. 2024, sec. 4.1: the decode worker reads prefill KV
with one-sided RDMA reads). The package is imported lazily (``pip install '.[pd]'``); the plain server
never imports this module.

Metadata published at CONNECT: msgpack ``{"backend": "nixl", "name", "nixl": <agent metadata>,
"regions": [[addr, nbytes, device], ...]}``. Call :meth:`register` before :meth:`local_metadata`
(NIXL's metadata carries the registered memory keys). ``send_notif`` / ACKs need ``connect`` on the
sending side as well (NIXL addresses notifications by loaded remote metadata).
"""

from __future__ import annotations

import logging
import os
import threading
from typing import MutableMapping, Optional

import msgspec
import numpy as np

from sglang.srt.disaggregation.transfer.base import (MemRegion, OpsLike, TransferBackend, TransferConfig,
                                                     TransferError, TransferHandle, TransferState)

logger = logging.getLogger(__name__)

# agents given up by NixlTransferBackend.abandon(): kept referenced so their destructor (which closes UCX endpoints
# and may wait on a dead peer) never runs while the process serves; the process exit reclaims them
_ABANDONED: list = []

_NIXL_MODULES = ("nixl._api", "nixl_cu13._api", "nixl_cu12._api")

UCX_ENV_DEFAULTS: dict[str, str] = {
    # Keep one-sided READs of GPU memory on cuda_ipc (a cuMemcpyDtoDAsync from the peer's mapped buffer) between
    # the GPUs of one host. UCX turns cuda_ipc's get_zcopy off when NVML reports no active NVLink (PCIe-only
    # hosts, and VMs/containers whose NVML cannot see the links); a READ then falls back to a software-emulated get
    # over another transport (tcp: about 0.5 GB/s, see vllm-project/vllm#52607 and ai-dynamo/nixl#1097), while
    # WRITEs stay on cuda_ipc. KVDirect pulls (READ), so it must not depend on that detection.
    "UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "on",
    # NIXL's UCX plugin posts a WRITE request's descriptors as one UCX scatter-gather list (one batched cuda_ipc
    # copy) instead of one ucp_put per descriptor. It only changes WRITEs (push and layerwise push; the plugin
    # ignores it for READs). 128 MiB GPU 0 -> GPU 1 on H200 (benchmark/results/archive/disaggregation/2026-11-27_nixl_read_4xh200.md):
    # 64 WRITE descriptors 0.58 ms instead of 1.05 ms, 512 descriptors 1.11 ms instead of 4.91 ms, READs unchanged.
    "NIXL_UCX_SGL_ENABLE": "1",
}
"""UCX (and NIXL UCX plugin) settings a :class:`NixlTransferBackend` applies by default
(``TransferConfig.nixl_ucx_defaults``): each only where the environment does not set that variable already. The NIXL
UCX plugin itself already sets ``UCX_RNDV_THRESH=inf`` and ``UCX_MAX_RMA_RAILS=2`` the same way. Measured by
``benchmark/disaggregation/bench_nixl_read.py``."""


def apply_ucx_env_defaults(environ: MutableMapping[str, str]) -> dict[str, str]:
    """Set each of :data:`UCX_ENV_DEFAULTS` in ``environ`` (normally ``os.environ``) that is not set there yet.

    UCX reads its configuration from the environment when a NIXL agent creates its UCX context, so this must run
    before the process's NIXL agents are created (:class:`NixlTransferBackend` calls it first). Nothing is set
    on a machine without the CUDA driver (UCX would warn that the cuda_ipc variables are unused there). Returns
    the variables it set (empty when the user set them all).
    """
    import ctypes.util

    if ctypes.util.find_library("cuda") is None:
        return {}
    added = {k: v for k, v in UCX_ENV_DEFAULTS.items() if k not in environ}
    environ.update(added)
    return added


def import_nixl():
    """Return NIXL's ``_api`` module (``nixl``, else ``nixl_cu13``/``nixl_cu12`` wheels).

    Raises:
        ImportError: none is installed (``pip install 'sglang[pd]'`` or ``pip install nixl-cu13``).
    """
    import importlib

    errors = []
    for mod in _NIXL_MODULES:
        try:
            return importlib.import_module(mod)
        except ImportError as e:  # also a broken meta package whose variant is missing
            errors.append(f"{mod}: {e}")
    raise ImportError("NIXL is not installed (pip install 'sglang[pd]' or nixl-cu13): " + "; ".join(errors))


def _mem_type(device: str) -> str:
    return "DRAM" if device == "cpu" else "VRAM"


def _dev_id(device: str) -> int:
    return 0 if device == "cpu" else int(device.split(":")[1])


class NixlTransferBackend(TransferBackend):
    """:class:`TransferBackend` over a ``nixl_agent``.

    Raises:
        ImportError: NIXL missing. RuntimeError: NIXL has no usable plugin (from NIXL).
    """

    name = "nixl"

    def __init__(self, agent_name: str, config: TransferConfig):
        super().__init__(agent_name, config)
        api = import_nixl()
        if config.nixl_ucx_defaults:
            added = apply_ucx_env_defaults(os.environ)
            if added:
                logger.info("nixl agent %s: UCX defaults %s (set a variable to override it)", agent_name, added)
        conf = api.nixl_agent_config(enable_prog_thread=True, enable_listen_thread=False, backends=[])
        self._agent = api.nixl_agent(agent_name, conf)
        missing = [b for b in config.nixl_backends if b not in self._agent.get_plugin_list()]
        if missing:
            raise RuntimeError(f"NIXL has no plugin {missing} (available: {self._agent.get_plugin_list()})")
        for b in config.nixl_backends:  # created here (not by the config) to pass the UCX thread-pool parameters
            params = {"num_threads": str(config.nixl_num_threads)} if config.nixl_num_threads else {}
            if b == "UCX" and config.nixl_num_threads and config.nixl_split_batch_size:
                params["split_batch_size"] = str(config.nixl_split_batch_size)
            self._agent.create_backend(b, params)
        self._reg_dlists = []
        self._peer_md: dict[str, bytes] = {}
        self._peer_regions: dict[str, list[MemRegion]] = {}
        self._pending: set[TransferHandle] = set()
        self._stuck: dict[int, object] = {}  # handle id -> NIXL transfer handle whose release (abort) failed
        self._lock = threading.Lock()
        self._closed = False

    # ---- memory ----------------------------------------------------------------------------------
    def register(self, regions: list[MemRegion]) -> None:
        for device in sorted({r.device for r in regions}):
            descs = [(r.addr, r.nbytes, r.device_id, "") for r in regions if r.device == device]
            self._reg_dlists.append(self._agent.register_memory(descs, _mem_type(device)))
        self._regions.extend(regions)

    # ---- peers -----------------------------------------------------------------------------------
    def local_metadata(self) -> bytes:
        if not self._regions:
            logger.warning("nixl agent %s publishes metadata before register(): peers cannot read it",
                           self.agent_name)
        return msgspec.msgpack.encode({"backend": "nixl", "name": self.agent_name,
                                       "nixl": self._agent.get_agent_metadata(),
                                       "regions": [[r.addr, r.nbytes, r.device] for r in self._regions]})

    def connect(self, peer: str, peer_metadata: bytes) -> None:
        if self._closed:
            raise TransferError("agent is closed")
        if self._peer_md.get(peer) == peer_metadata:
            return
        try:
            md = msgspec.msgpack.decode(peer_metadata)
            regions = [MemRegion(int(a), int(n), str(d)) for a, n, d in md["regions"]]
            if md.get("backend") != "nixl" or md["name"] != peer:
                raise ValueError(f"metadata is for {md.get('backend')!r} agent {md.get('name')!r}")
        except (msgspec.DecodeError, KeyError, TypeError, ValueError) as e:
            raise TransferError(f"malformed nixl metadata for peer {peer!r}: {e}") from e
        if peer in self._peer_md:
            self.disconnect(peer)
        try:
            name = self._agent.add_remote_agent(md["nixl"])
        except Exception as e:  # nixl raises its own exception types
            raise TransferError(f"nixl could not load metadata of {peer!r}: {e}") from e
        if isinstance(name, bytes):
            name = name.decode()
        if name != peer:
            raise TransferError(f"nixl metadata belongs to agent {name!r}, expected {peer!r}")
        self._peer_md[peer] = peer_metadata
        self._peer_regions[peer] = regions

    def disconnect(self, peer: str) -> None:
        if self._peer_md.pop(peer, None) is None:
            return
        self._peer_regions.pop(peer, None)
        with self._lock:
            doomed = [h for h in self._pending if h.peer == peer]
        for h in doomed:
            self._fail(h, f"peer {peer} disconnected")
        try:
            self._agent.remove_remote_agent(peer)
        except Exception as e:
            logger.warning("nixl remove_remote_agent(%s) failed: %s", peer, e)

    # ---- data ------------------------------------------------------------------------------------
    def _descs(self, peer: str, ops: OpsLike):
        """(Nx3 array, local Nx3 descs, local mem type, remote Nx3 descs, remote mem type)."""
        regions = self._peer_regions.get(peer)
        if regions is None:
            raise TransferError(f"unknown peer {peer!r}; connect() it first")
        arr = self._check_local(ops)

        def device(addr: np.ndarray, regs: list[MemRegion], side: str) -> str:
            which = np.full(len(arr), -1)
            for i, r in enumerate(regs):
                which[(which < 0) & (addr >= r.addr) & (addr + arr[:, 2] <= r.addr + r.nbytes)] = i
            if (which < 0).any():
                k = int(np.flatnonzero(which < 0)[0])
                raise ValueError(f"{side} range [{int(addr[k]):#x}, +{int(arr[k, 2])}) is outside the regions "
                                 f"{side} registered")
            devs = {regs[i].device for i in np.unique(which)}
            if len(devs) != 1:
                raise ValueError(f"one transfer must stay on one {side} device, got {sorted(devs)}; split it")
            return devs.pop()

        ldev, rdev = device(arr[:, 1], self._regions, "local"), device(arr[:, 0], regions, "remote")
        n = len(arr)
        local = np.stack([arr[:, 1], arr[:, 2], np.full(n, _dev_id(ldev), np.int64)], axis=1).astype(np.uint64)
        remote = np.stack([arr[:, 0], arr[:, 2], np.full(n, _dev_id(rdev), np.int64)], axis=1).astype(np.uint64)
        return arr, local, _mem_type(ldev), remote, _mem_type(rdev)

    def _post(self, op: str, peer: str, ops: OpsLike, notif: Optional[bytes]) -> TransferHandle:
        if self._closed:
            raise TransferError("agent is closed")
        arr, local, lmt, remote, rmt = self._descs(peer, ops)
        handle = self._new_handle(peer, op, arr)
        with self._lock:
            self._pending.add(handle)
        try:
            ldl = self._agent.get_xfer_descs(local, lmt)
            rdl = self._agent.get_xfer_descs(remote, rmt)
            handle.impl = self._agent.initialize_xfer(op, ldl, rdl, peer, b"" if notif is None else bytes(notif))
            status = self._agent.transfer(handle.impl)
        except Exception as e:  # e.g. nixlRemoteDisconnectError: the peer died -> FAILED, as mid-transfer
            self._fail(handle, f"nixl could not post the {op}: {type(e).__name__}: {e}")
            self._release(handle)
            return handle
        self._settle(handle, status)
        return handle

    def _settle(self, handle: TransferHandle, status: str) -> None:
        if status == "DONE":
            handle.finish(TransferState.DONE)
        elif status == "ERR":
            self._fail(handle, "nixl reported ERR")
        if handle.state is not TransferState.PENDING:
            self._release(handle)

    def _release(self, handle: TransferHandle) -> None:
        with self._lock:
            self._pending.discard(handle)
        xh, handle.impl = handle.impl, None
        if xh is not None:
            try:
                self._agent.release_xfer_handle(xh)  # aborts an active transfer where the plugin can
            except Exception as e:  # it may still be moving bytes: in_flight() reports it until it settles
                logger.warning("nixl could not release transfer %d: %s", handle.id, e)
                with self._lock:
                    self._stuck[handle.id] = xh

    def in_flight(self, handle: TransferHandle) -> bool:
        """True while ``handle`` is posted and not settled, or its release (abort) failed and NIXL still reports
        it in progress (then it is released once it settles)."""
        with self._lock:
            if handle in self._pending:
                return True
            xh = self._stuck.get(handle.id)
        if xh is None:
            return False
        try:
            if self._agent.check_xfer_state(xh) == "PROC":
                return True
            self._agent.release_xfer_handle(xh)
        except Exception as e:  # noqa: BLE001 - unknown: treat as in flight (the caller's deadline bounds it)
            logger.debug("nixl transfer %d not settled: %s", handle.id, e)
            return True
        with self._lock:
            self._stuck.pop(handle.id, None)
        return False

    def _fail(self, handle: TransferHandle, reason: str) -> None:
        super()._fail(handle, reason)
        if handle.impl is not None:
            self._release(handle)

    def read(self, peer: str, ops: OpsLike, notif: Optional[bytes] = None) -> TransferHandle:
        return self._post("READ", peer, ops, notif)

    def write(self, peer: str, ops: OpsLike, notif: Optional[bytes] = None) -> TransferHandle:
        return self._post("WRITE", peer, ops, notif)

    def poll(self, handle: TransferHandle) -> TransferState:
        if handle.state is TransferState.PENDING and handle.impl is not None:
            try:
                status = self._agent.check_xfer_state(handle.impl)
            except Exception as e:
                status = "ERR"
                logger.warning("nixl check_xfer_state failed: %s", e)
            self._settle(handle, status)
        self._timed_out(handle)
        return handle.state

    # ---- control ---------------------------------------------------------------------------------
    def send_notif(self, peer: str, msg: bytes) -> None:
        if peer not in self._peer_md:
            raise TransferError(f"unknown peer {peer!r}; connect() it first")
        try:
            self._agent.send_notif(peer, bytes(msg))
        except Exception as e:
            raise TransferError(f"nixl could not notify {peer!r}: {e}") from e

    def get_notifs(self) -> dict[str, list[bytes]]:
        out = self._agent.get_new_notifs()
        return {(k.decode() if isinstance(k, bytes) else k): list(v) for k, v in out.items() if v}

    def close(self) -> None:
        if self._closed:
            return
        for peer in list(self._peer_md):
            self.disconnect(peer)
        with self._lock:
            pending = list(self._pending)
        for h in pending:
            self._fail(h, "agent closed")
        for dl in self._reg_dlists:
            try:
                self._agent.deregister_memory(dl)
            except Exception as e:
                logger.warning("nixl deregister_memory failed: %s", e)
        self._reg_dlists.clear()
        self._closed = True

    def abandon(self, reason: str) -> None:
        """Give the agent up without talking to any peer (after a peer fault: a SIGKILLed peer can make NIXL/UCX
        teardown - ``remove_remote_agent``, releasing transfers, deregistration, the agent's destructor - wait
        without bound on that peer). Pending handles become FAILED without a NIXL call, the agent stays referenced
        until the process exits (its registrations are not returned), and every later call fails with
        TransferError ("agent is closed"). Never blocks. Idempotent; a no-op after :meth:`close`."""
        if self._closed:
            return
        self._closed = True
        with self._lock:
            pending, self._pending = list(self._pending), set()
        for h in pending:
            h.impl = None
            TransferBackend._fail(self, h, f"agent abandoned: {reason}")
        _ABANDONED.append(self._agent)
        self._peer_md.clear()
        self._peer_regions.clear()
        self._reg_dlists = []
        logger.warning("nixl agent %s abandoned without teardown (%s); its memory stays registered until exit",
                       self.agent_name, reason)

def m2n_read_agent(name: str, timeout_s: float, backends: tuple, regions: list) -> NixlTransferBackend:
    """The NIXL agent of an M2N NIXL transport (``sgl_kernel.m2n.nixl_transport.ReadAgentFactory``, injected because
    sgl_kernel never imports sglang): a :class:`NixlTransferBackend` named ``name`` whose transfers fail after
    ``timeout_s`` seconds, with the NIXL plugins ``backends``, and ``regions`` ``[(addr, nbytes, "cpu" | "cuda:N")]``
    registered. Raises ImportError when nixl is missing (the message names ``pip install 'sglang[pd]'``)."""
    agent = NixlTransferBackend(name, TransferConfig(transfer_timeout_s=timeout_s, nixl_backends=tuple(backends)))
    agent.register([MemRegion(int(a), int(n), str(d)) for a, n, d in regions])
    return agent
