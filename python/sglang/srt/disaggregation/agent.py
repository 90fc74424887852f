"""The worker side of the KV connector: one :class:`DisaggAgent` per scheduler rank.

It owns the rank's transfer agent (:class:`~sglang.srt.disaggregation.transfer.base.TransferBackend`,
with the rank's KV region registered), knows every rank's published info of its own server, and gives
the scheduler-side connectors (``prefill.py``, ``decode.py``) the few collective operations lockstep TP
needs: control messages arrive on the leader's ZMQ socket and are broadcast to every rank (like the
scheduler's own input), so all ranks change room states at the same step; per-rank transfer states are
agreed with one min-all-reduce.
"""

from __future__ import annotations

import logging
import time
import uuid
import zlib
from typing import Any, Optional, Sequence

import msgspec
import torch
import zmq

from sglang.srt.disaggregation.bootstrap import encode_metadata
from sglang.srt.disaggregation.messages import ControlMsg, decode_control, encode_control
from sglang.srt.disaggregation.slot_plan import kv_head_range

logger = logging.getLogger(__name__)
# --disaggregation-nixl-threads > 0: a transfer of at least this many descriptors is split over the threads (NIXL UCX
# split_batch_size; a 1K-token Llama-3.1-8B pull is 64 descriptors, one per (layer, K/V), with layer-major pools, and
# one per slot run with token-major ones, --kv-cache-layout)
NIXL_SPLIT_BATCH = 8


class DisaggAgent:
    """Transfer agent, rank infos and control channel of one scheduler rank.

    Args:
        server_args: the frozen ServerArgs (``disaggregation_*`` options, ``host``).
        kv_cache: the rank's :class:`~sglang.srt.mem_cache.kv_cache.KVCache` (its region is registered).
        tp_rank / tp_size: this rank; total_kv_heads: the model's KV heads.
        group: the scheduler's CPU control group (None without TP).
    Attributes:
        ranks: per rank of this server ``{"rank", "agent", "metadata" (b64 str), "kv" (descriptor dict),
            "head_lo", "head_hi"}``; endpoint: the leader's control socket (``tcp://host:port``).
        queue: this rank's :class:`~sglang.srt.disaggregation.transfer.queue.TransferQueue` (KVDirect sec. 4.2)
            over ``backend``: the decode side posts its pull-mode READs and COMPLETEs through it, the prefill
            side ACKs COMPLETEs with it; ``progress()`` once per scheduler step.
    Raises:
        ImportError: the nixl backend was asked for but is not installed.
    """

    def __init__(self, server_args, kv_cache, tp_rank: int, tp_size: int, total_kv_heads: int, group=None):
        from sglang.srt.disaggregation.transfer.base import MemRegion, TransferConfig, make_transfer_backend

        self.args = server_args
        self.kv = kv_cache
        self.tp_rank, self.tp_size, self.group = tp_rank, tp_size, group
        self.is_leader = tp_rank == 0
        self.desc = kv_cache.describe()
        self.heads = kv_head_range(tp_rank, tp_size, total_kv_heads)
        self.total_kv_heads = total_kv_heads
        mode = server_args.disaggregation_mode
        self.agent_name = f"{mode}-{uuid.uuid4().hex[:12]}-tp{tp_rank}"
        threads = server_args.disaggregation_nixl_threads
        cfg = TransferConfig(transfer_timeout_s=server_args.disaggregation_transfer_timeout,
                             host=server_args.host, nixl_num_threads=threads,
                             nixl_split_batch_size=NIXL_SPLIT_BATCH if threads else 0)
        from sglang.srt.disaggregation.transfer.fault_hook import maybe_hold_transfers

        # maybe_hold_transfers: the backend itself unless the test-only SGLANG_PD_FAULT_HOLD_TRANSFER_S is set
        self.backend = maybe_hold_transfers(
            make_transfer_backend(server_args.disaggregation_transfer_backend, self.agent_name, cfg))
        self.backend.register([MemRegion(addr=self.desc.base_address, nbytes=self.desc.nbytes,
                                         device=self.desc.device)])
        from sglang.srt.disaggregation.transfer.queue import TransferQueue

        # the initiator's operation: decode reads (pull), prefill writes (push); either side may be the target
        self.queue = TransferQueue(self.backend, mode="read" if mode == "decode" else "write")
        self.connected: set[str] = set()
        mine = {"rank": tp_rank, "agent": self.agent_name, "metadata": encode_metadata(self.backend.local_metadata()),
                "kv": self.desc.to_dict(), "head_lo": self.heads[0], "head_hi": self.heads[1]}
        self.ranks = self._all_gather_json(mine)
        self.endpoint = ""
        self._push: dict[str, Any] = {}
        self._injected: list[bytes] = []
        if self.is_leader:
            from sglang.srt.utils.common import free_tcp_ports

            self.ctx = zmq.Context(1)
            self.pull = self.ctx.socket(zmq.PULL)
            port = free_tcp_ports(1, server_args.host)[0]
            self.pull.bind(f"tcp://{server_args.host}:{port}")
            self.endpoint = f"tcp://{server_args.host}:{port}"
        self.endpoint = self._broadcast_str(self.endpoint)
        logger.info("disaggregation agent %s (%s backend, heads %s, control %s)", self.agent_name,
                    server_args.disaggregation_transfer_backend, self.heads, self.endpoint)

    # ---- collectives over the control group -------------------------------------------------------
    def _broadcast_bytes(self, msgs: Optional[list[bytes]], src: int = 0) -> list[bytes]:
        if self.tp_size <= 1:
            return list(msgs or [])
        from sglang.srt.distributed.parallel_state import broadcast_bytes_list

        return broadcast_bytes_list(msgs if self.tp_rank == src else None, self.group, src=src)

    def _broadcast_str(self, s: str) -> str:
        return self._broadcast_bytes([s.encode()])[0].decode()

    def _all_gather_json(self, obj: dict) -> list[dict]:
        data = msgspec.json.encode(obj)
        return [msgspec.json.decode(self._broadcast_bytes([data], src=r)[0]) for r in range(self.tp_size)]

    def agree(self, values: Sequence[int]) -> list[int]:
        """Element-wise minimum of ``values`` over the ranks (e.g. transfer states 0 failed < 1 pending < 2 done)."""
        if self.tp_size <= 1 or not values:
            return list(values)
        import torch.distributed as dist

        t = torch.tensor(list(values), dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return t.tolist()

    def gather_concat(self, values: Sequence[int]) -> list[int]:
        """Concatenation over ranks (rank order) of equally long int lists (checksums of each rank's heads)."""
        if self.tp_size <= 1:
            return list(values)
        import torch.distributed as dist

        t = torch.tensor(list(values), dtype=torch.int64)
        parts = [torch.empty_like(t) for _ in range(self.tp_size)]
        dist.all_gather(parts, t, group=self.group)
        return torch.cat(parts).tolist()

    # ---- control channel (leader sends; every rank sees what the leader received) --------------------
    def recv(self) -> list[ControlMsg]:
        """This step's control messages, the same list on every rank (malformed ones are dropped)."""
        raw: list[bytes] = []
        if self.is_leader:
            raw, self._injected = self._injected, []
            while True:
                try:
                    raw.append(self.pull.recv(zmq.NOBLOCK))
                except zmq.Again:
                    break
        raw = self._broadcast_bytes(raw)
        out = []
        for data in raw:
            try:
                out.append(decode_control(data))
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                logger.warning("dropping a malformed control message: %s", e)
        return out

    def inject(self, msg: ControlMsg) -> None:
        """Leader: deliver ``msg`` to every rank with the next :meth:`recv` (decisions only the leader may take,
        e.g. timeouts measured on its clock, reach all ranks at the same step)."""
        if self.is_leader:
            self._injected.append(encode_control(msg))

    def send(self, endpoint: str, msg: ControlMsg) -> None:
        """Leader only (a no-op elsewhere): send ``msg`` to a peer leader's control socket without blocking
        (a dead peer's messages are dropped; heartbeats detect it)."""
        if not self.is_leader:
            return
        sock = self._push.get(endpoint)
        if sock is None:
            sock = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 10000)
            sock.connect(endpoint)
            self._push[endpoint] = sock
        try:
            sock.send(encode_control(msg), zmq.NOBLOCK)
        except zmq.Again:
            logger.warning("control message to %s dropped (peer not reading)", endpoint)

    def forget(self, endpoint: str) -> None:
        """Close the socket to a peer that left."""
        sock = self._push.pop(endpoint, None)
        if sock is not None:
            sock.close(0)

    # ---- transfer agents ------------------------------------------------------------------------------
    def ensure_connected(self, rank_info: dict) -> str:
        """Connect this rank's agent to a peer rank (lazily, once); returns the peer agent's name.

        Raises:
            TransferError / ValueError: bad metadata (from the backend).
        """
        from sglang.srt.disaggregation.bootstrap import decode_metadata

        name = rank_info["agent"]
        if name not in self.connected:
            self.backend.connect(name, decode_metadata(rank_info["metadata"]))
            self.connected.add(name)
        return name

    def drop_peer(self, name: str) -> None:
        """Disconnect a peer agent (its pending transfers fail)."""
        if name in self.connected:
            self.connected.discard(name)
            try:
                self.backend.disconnect(name)
            except Exception as e:  # a dead peer must not take the scheduler down
                logger.warning("disconnecting %s: %s", name, e)

    # ---- verification ---------------------------------------------------------------------------------
    def checksums(self, slots: Sequence[int]) -> list[int]:
        """crc32 of the KV at ``slots`` for every (layer, K/V, local head), layer-major (``--disaggregation-verify``)."""
        pool = self.kv.token_to_kv_pool
        idx = torch.tensor(list(slots), dtype=torch.int64, device=pool.kv_data.device)
        sel = pool.kv_layer_view.index_select(2, idx).cpu()  # [layer, 2, n, head, head_dim], any storage order
        out = []
        for layer in range(sel.shape[0]):
            for kv in range(2):
                for h in range(sel.shape[3]):
                    out.append(zlib.crc32(sel[layer, kv, :, h].contiguous().view(torch.uint8).numpy().tobytes()))
        return out

    def close(self) -> None:
        """Close the transfer agent and the sockets."""
        try:
            self.backend.close()
        finally:
            if self.is_leader:
                for s in self._push.values():
                    s.close(0)
                self.pull.close(0)
                self.ctx.term()


def now() -> float:
    """Monotonic seconds (one clock for every timeout here)."""
    return time.monotonic()
