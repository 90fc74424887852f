"""The decode role's per-request state (:class:`DecodeRoom`), the prefill servers it talks to
(:class:`PrefillServer`), and what an activated room hands to its request: the prefill's first token, cached-token
count and logprobs, and the hand-off timings of ``meta_info["disaggregation"]`` (used by decode.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Optional

from sglang.srt.disaggregation.agent import now
from sglang.srt.disaggregation.messages import RoomReady


@dataclass
class DecodeRoom:
    """One request waiting for its KV on the decode side."""

    room: int
    req: Any
    server: tuple[str, int]  # (bootstrap host, bootstrap port)
    state: str = "connect"  # connect | wait_ready | transfer
    created: float = field(default_factory=now)
    ready: Optional[RoomReady] = None
    row: Optional[int] = None
    loc: Any = None  # allocated KV slots (int64 tensor on the pool device) or None
    slots: Optional[list] = None  # the same slots as a host list (planning never reads them back from the GPU)
    keys: list = field(default_factory=list)  # this rank's TransferQueue requests: "<room>:<prefill rank>"
    done_keys: set = field(default_factory=set)
    reads: int = 0  # READs posted after coalescing (this rank; summed over ranks at activation)
    ops: int = 0  # per-(layer, K/V, token) ops planned before coalescing
    nbytes: int = 0
    t_alloc: float = 0.0
    t_ready: float = 0.0  # RoomReady taken (monotonic)
    t_post: float = 0.0  # first READ posted (TransferQueue stamp)
    t_done: float = 0.0  # last READ DONE as seen by the backend poll
    queue_s: float = 0.0
    fail_reason: str = ""
    expiring: bool = False
    stage: Optional[tuple[int, int]] = None  # staging chunk (offset, nbytes) and staged sources (staging.py)
    staged: list = field(default_factory=list)


@dataclass
class PrefillServer:
    """A prefill server this decode server talks to (learned lazily from its bootstrap server)."""

    route: dict
    endpoint: str
    last_seen: float = field(default_factory=now)
    last_ping: float = 0.0
    forgetting: bool = False


def resume_request(r: DecodeRoom, pull: bool) -> int:
    """Make ``r.req`` continue as if it had prefilled locally: its request row and prompt KV (``r.row`` /
    ``r.loc``), the prefill's first token, cached-token count and (when asked for) logprobs from ``r.ready``, and
    the hand-off facts in ``req.disagg_info`` (:func:`handoff_timings`; pull: READ ops before coalescing and the
    time they waited in the queue; push: whether the prefill side pushed layer by layer). Returns the prompt
    length in tokens."""
    req, ready = r.req, r.ready
    n = len(req.origin_input_ids)
    req.req_pool_idx, req.kv_len = r.row, n
    req.admitted_once = True
    req.cached_tokens = ready.cached_tokens
    req.output_ids.append(ready.first_token)
    if req.return_logprob:
        if ready.input_token_logprobs is not None:
            req.input_token_logprobs = [tuple(x) for x in ready.input_token_logprobs]
            req.input_top_logprobs = [[tuple(y) for y in x] for x in (ready.input_top_logprobs or [])]
        req.sent_input_logprobs = True
        if ready.output_logprob is not None:
            req.output_token_logprobs.append(tuple(ready.output_logprob))
            if req.top_logprobs_num:
                req.output_top_logprobs.append([tuple(x) for x in (ready.output_top_logprobs or [])])
    req.disagg_info.update(handoff_timings(r, ready, req, pull, time.monotonic()))
    if pull:  # ops before coalescing and the time the reads waited in the queue
        req.disagg_info.update(transfer_ops_planned=r.ops, transfer_queue_s=r.queue_s)
    else:
        req.disagg_info["push_layerwise"] = ready.push_layerwise
    return n


def handoff_timings(r: DecodeRoom, ready: RoomReady, req, pull: bool, t: float) -> dict:
    """``meta_info["disaggregation"]`` facts of an activated room (this rank's clock, seconds):
    ``transfer_time_s`` pure transfer (pull: first READ posted -> last READ DONE as the backend reported it; push:
    the prefill side's WRITE time); ``transfer_setup_s`` RoomReady taken -> first READ posted (allocation, waiting
    for pool room, planning, coalescing); ``transfer_wait_s`` last READ DONE -> activation (waiting for the step
    boundary and the ranks' agreement); ``handoff_s`` RoomReady taken -> activation (the whole decode-side hand-off
    after the prefill side's KV was ready); push: ``transfer_tail_s``, the part of the WRITE time after the prefill
    forward (``RoomReady.push_tail_s``); plus the byte/READ counts and the queue times."""
    t_ready = r.t_ready or t
    post = r.t_post or t_ready
    done = r.t_done or t
    out = dict(transfer_bytes=r.nbytes, transfer_reads=r.reads,
               transfer_time_s=max(done - post, 0.0) if pull else ready.push_time_s,
               handoff_s=max(t - t_ready, 0.0), prefill_queue_s=ready.prefill_queue_s,
               decode_queue_s=r.t_alloc - req.arrival_time)
    if pull:
        out.update(transfer_setup_s=max(post - t_ready, 0.0), transfer_wait_s=max(t - done, 0.0))
    else:
        out["transfer_tail_s"] = getattr(ready, "push_tail_s", 0.0)
    return out


def room_of(key: str) -> Optional[int]:
    """The room of a TransferQueue request key ``"<room>:<prefill rank>"`` (None for a foreign key)."""
    try:
        return int(str(key).split(":", 1)[0])
    except ValueError:
        return None
