"""Control requests with several data-parallel schedulers (AFD attention workers): ``/flush_cache`` reaches
every one of them, and the reply says which ones refused; the internal states come from every one. Fake schedulers on the TokenizerManager's real
ZMQ endpoints; no model runs."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import threading

import pytest
import zmq

from sglang.srt.managers.io_struct import (
    FlushCacheReqInput,
    FlushCacheReqOutput,
    GetInternalStateReq,
    GetInternalStateReqOutput,
    decode_msg,
    encode_msg,
)
from sglang.srt.managers.tokenizer_manager import RequestError, TokenizerManager
from sglang.srt.server_args import PortArgs, ServerArgs

N_DP = 3


class FakeDpSchedulers(threading.Thread):
    """``N_DP`` schedulers: each answers FlushCacheReqInput with success unless its rank is in ``busy``,
    stays silent when its rank is in ``mute``, and answers its first request only after the next one arrives
    when its rank is in ``late`` (a reply that comes after its round timed out)."""

    def __init__(self, port_args: PortArgs, busy=(), mute=(), late=()) -> None:
        super().__init__(daemon=True)
        self.ctx = zmq.Context()
        self.pulls = []
        for addr in port_args.dp_scheduler_inputs:
            s = self.ctx.socket(zmq.PULL)
            s.bind(addr)
            self.pulls.append(s)
        self.push = self.ctx.socket(zmq.PUSH)
        self.push.connect(port_args.tokenizer_ipc)
        self.busy, self.mute, self.late = set(busy), set(mute), set(late)
        self.held: dict[int, bytes] = {}
        self.flushed: list[int] = []
        self.stop = threading.Event()

    def run(self) -> None:
        poller = zmq.Poller()
        for s in self.pulls:
            poller.register(s, zmq.POLLIN)
        while not self.stop.is_set():
            for sock, _ in poller.poll(50):
                rank = self.pulls.index(sock)
                msg = decode_msg(sock.recv())
                assert isinstance(msg, (FlushCacheReqInput, GetInternalStateReq)) and msg.dp_rank == rank, (rank, msg)
                if rank in self.mute:
                    continue
                if isinstance(msg, GetInternalStateReq):
                    self.push.send(encode_msg(GetInternalStateReqOutput(state={"worker": rank}, dp_rank=rank,
                                                                        seq=msg.seq)))
                    continue
                ok = rank not in self.busy
                reply = encode_msg(FlushCacheReqOutput(
                    success=ok, message="" if ok else "cannot flush the cache while requests are running",
                    dp_rank=msg.dp_rank, seq=msg.seq))
                if rank in self.late:  # answer this one only when the next request comes (after its timeout)
                    self.late.discard(rank)
                    self.held[rank] = reply
                    self.busy.discard(rank)  # idle by then
                    continue
                if rank in self.held:
                    self.push.send(self.held.pop(rank))  # the stale answer first, as a slow scheduler sends it
                if ok:
                    self.flushed.append(rank)
                self.push.send(reply)
        for s in self.pulls + [self.push]:
            s.close(linger=0)
        self.ctx.term()


def _control(call, busy=(), mute=(), late=()):
    pa = PortArgs.init_new()
    pa = dataclasses.replace(pa, dp_scheduler_inputs=tuple(f"{pa.scheduler_input_ipc}-dp{a}" for a in range(N_DP)))
    args = ServerArgs(model_path=os.devnull, skip_tokenizer_init=True)
    fake = FakeDpSchedulers(pa, busy, mute, late)
    fake.start()
    info = {"context_len": 64, "max_total_tokens": 256, "vocab_size": 512, "max_req_input_len": 63}

    async def go():
        tm = TokenizerManager(args, pa, info, control_timeout_s=2.0)
        try:
            return await call(tm)
        finally:
            tm.close()

    try:
        return asyncio.run(go()), fake
    finally:
        fake.stop.set()
        fake.join(5)


def _flush(busy=(), mute=()):
    return _control(lambda tm: tm.flush_cache(), busy, mute)


def test_flush_and_internal_state_reach_every_data_parallel_scheduler():
    out, fake = _flush()
    states, _ = _control(lambda tm: tm.get_internal_states())
    assert states == [{"worker": a} for a in range(N_DP)]
    assert out.success, out
    assert sorted(fake.flushed) == list(range(N_DP))


def test_flush_reply_names_each_refusing_scheduler():
    out, fake = _flush(busy={1, 2})
    assert not out.success
    assert "2 of 3" in out.message and "scheduler 1:" in out.message and "scheduler 2:" in out.message, out.message
    assert "scheduler 0:" not in out.message and "requests are running" in out.message
    assert fake.flushed == [0]


def test_flush_without_an_answer_from_one_scheduler_is_503():
    with pytest.raises(RequestError) as e:
        _flush(mute={2})
    assert e.value.status_code == 503 and "2 of 3 answered" in e.value.message


def test_a_late_reply_is_not_taken_for_the_next_round():
    async def two_rounds(tm):
        with pytest.raises(RequestError):  # scheduler 1 answers (refusing) only after this round timed out
            await tm.flush_cache()
        return await tm.flush_cache()

    out, fake = _control(two_rounds, busy={1}, late={1})
    assert out.success, out.message  # second flush: scheduler 1's fresh answer, not its stale refusal
    assert sorted(fake.flushed) == [0, 0, 1, 2, 2]
