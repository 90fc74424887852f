"""Control messages between prefill and decode schedulers (msgspec/msgpack over ZMQ, never pickle).

One *room* (``bootstrap_room``, a 63-bit id the router draws) names one request's KV hand-off.
Pull mode (KVDirect sec. 4.3)::

    decode leader  --RoomRequest(room, decode endpoint)-->           prefill leader
    prefill leader --RoomReady(room, slots, first token, ...)-->     decode leader   (prefill done)
    decode ranks   ==one-sided READs of the prompt's KV==>           (prefill memory)
    decode ranks   --COMPLETE (transfer backend notification)-->     prefill ranks   (ACK, then free the KV)

The COMPLETE/ACK is not a ZMQ message: it goes through each rank's
:class:`~sglang.srt.disaggregation.transfer.queue.TransferQueue` (KVDirect sec. 4.2). ``RoomAck`` is push mode's
release message.

Push mode: ``RoomRequest`` carries the decode-preallocated slots; the prefill ranks WRITE into them and
``RoomReady`` then means "your KV is written". ``RoomFailed`` aborts a room from either side; a push-mode decode
side that gives up a room the prefill side may still write into sends ``RoomAbort`` instead and keeps the room's
slots quarantined until ``RoomDrained`` (``decode_quarantine.py``);
``Heartbeat`` / ``HeartbeatAck`` detect dead peers (``--disaggregation-heartbeat-timeout``).
"""

from __future__ import annotations

from typing import Any, Optional, Union

import msgspec


class RoomRequest(msgspec.Struct, tag=True):
    """Decode -> prefill: decode rank(s) want room ``room``'s KV.

    ``endpoint``: the decode leader's control socket (``tcp://host:port``) for replies.
    ``decode_ranks``: per decode rank ``{"agent", "metadata" (bytes), "kv" (KVRegionDescriptor dict),
    "head_lo", "head_hi" (global KV heads it holds)}``, needed by the prefill ranks in push mode.
    ``dst_slots``: push mode only, the decode slots of prompt positions ``0..len-1`` (same on every decode rank).
    """

    room: int
    endpoint: str
    mode: str
    decode_ranks: list[dict[str, Any]] = []
    dst_slots: Optional[list[int]] = None


class RoomReady(msgspec.Struct, tag=True):
    """Prefill -> decode: the prompt's KV is computed (pull: readable at ``slots``; push: written).

    ``slots``: prefill KV slots of prompt positions ``0..prompt_len-1``. ``first_token``: sampled on the
    prefill side; its logprob entries and the prompt's input logprobs travel along. ``checksums``: per
    (layer, K/V, global head) crc32 of the request's KV when ``--disaggregation-verify``, else empty.
    ``prefill_queue_s``: time the request waited on the prefill side before its prefill ran.
    ``push_*``: push mode's transfer facts (bytes, WRITE rows, time, whether posted layer by layer).
    ``push_tail_s``: the part of ``push_time_s`` after the forward (layerwise: last layer posted -> every WRITE
    DONE seen; after the fact: the whole push): what the transfer adds to TTFT, as the layerwise WRITEs overlap the
    forward.
    """

    room: int
    slots: list[int]
    first_token: int
    cached_tokens: int = 0
    output_logprob: Optional[tuple[float, int]] = None
    output_top_logprobs: Optional[list[tuple[float, int]]] = None
    input_token_logprobs: Optional[list[tuple[Optional[float], int]]] = None
    input_top_logprobs: Optional[list[list[tuple[float, int]]]] = None
    checksums: list[int] = []
    prefill_queue_s: float = 0.0
    push_bytes: int = 0
    push_reads: int = 0
    push_time_s: float = 0.0
    push_layerwise: bool = False  # push: the WRITEs were posted layer by layer during the forward
    push_tail_s: float = 0.0


class RoomAck(msgspec.Struct, tag=True):
    """Decode -> prefill, push mode: the room's KV arrived (and verified); the prefill side may free it (pull mode
    releases on the transfer queue's COMPLETE instead)."""

    room: int


class RoomFailed(msgspec.Struct, tag=True):
    """Either direction: the room cannot complete (``reason`` says why); the receiver frees its side.
    ``local``: injected by the receiver's own leader (a timeout it detected): tell the peer too."""

    room: int
    reason: str
    local: bool = False


class RoomAbort(msgspec.Struct, tag=True):
    """Decode -> prefill, push mode: the decode side gave up ``room`` (``reason``) while the prefill side may still
    WRITE into its slots. The prefill side fails the room (stops posting, cancels PENDING WRITEs) and answers
    :class:`RoomDrained` to ``endpoint`` (the decode leader's control socket) once none of the room's WRITEs can
    still land; until then the decode side keeps the slots out of use."""

    room: int
    reason: str
    endpoint: str


class RoomDrained(msgspec.Struct, tag=True):
    """Prefill -> decode, answer to :class:`RoomAbort`: no WRITE of ``room`` can still land in the decode slots."""

    room: int


class Heartbeat(msgspec.Struct, tag=True):
    """Liveness ping from ``endpoint`` (a leader's control socket); answered with :class:`HeartbeatAck`."""

    endpoint: str


class HeartbeatAck(msgspec.Struct, tag=True):
    """Reply to :class:`Heartbeat` from ``endpoint``."""

    endpoint: str


class BootstrapRoute(msgspec.Struct, tag=True):
    """Decode-internal: the route a decode leader fetched from ``host:port``'s bootstrap server (JSON bytes of
    ``GET /route``; empty: forget that server, it went silent), injected so that every decode rank connects
    (or disconnects) at the same step."""

    host: str
    port: int
    route: bytes


ControlMsg = Union[RoomRequest, RoomReady, RoomAck, RoomFailed, RoomAbort, RoomDrained, Heartbeat, HeartbeatAck,
                   BootstrapRoute]
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(ControlMsg)


def encode_control(msg: ControlMsg) -> bytes:
    """msgpack bytes of one control message (tagged with its type)."""
    return _encoder.encode(msg)


def decode_control(data: bytes) -> ControlMsg:
    """Inverse of :func:`encode_control`. Raises msgspec.DecodeError / ValidationError on bad bytes."""
    return _decoder.decode(data)
