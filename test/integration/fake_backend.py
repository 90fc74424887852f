"""A fake scheduler behind the real HTTP server + TokenizerManager (real ZMQ sockets, real tokenizer),
shared by ``test_http_fake_backend*.py``.

The fake answers each TokenizedGenerateReqInput with BatchStrOut deltas of deterministic tokens
(:func:`fake_ids`), so every response can be checked against the tokenizer; ``srv`` / ``auth_srv``
are module-scoped server fixtures (the second with ``--api-key``).
"""

from __future__ import annotations

import os
import threading
import time

import pytest
import zmq

from sglang.srt.managers.io_struct import (
    AbortReq,
    BatchStrOut,
    FlushCacheReqInput,
    FlushCacheReqOutput,
    GetInternalStateReq,
    GetInternalStateReqOutput,
    SchedulerStats,
    TokenizedGenerateReqInput,
    decode_msg,
    encode_msg,
)
from sglang.srt.server_args import PortArgs, ServerArgs

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL = os.path.join(REPO, "..", "shared", "data", "models", "stories260K")
CONTEXT_LEN = 512
SLOW_MAX_NEW = 200  # requests asking for at least this many tokens are streamed slowly
PACED_RID_PREFIX = "paced-"  # requests whose rid starts with this get one output every 50 ms (2 tokens each), so a
# streaming client sees separate chunks even on a loaded machine (outputs that arrive together are coalesced)


def fake_ids(input_ids: list[int], n: int) -> list[int]:
    """The fake's output tokens: merged pieces (ids 259..511) derived from the prompt."""
    s = sum(input_ids) * 7
    return [259 + (s + 13 * k) % 253 for k in range(n)]


class FakeScheduler(threading.Thread):
    """Scheduler + detokenizer stand-in on the TokenizerManager's real IPC endpoints."""

    def __init__(self, port_args: PortArgs, tokenizer) -> None:
        super().__init__(daemon=True)
        self.tok = tokenizer
        self.ctx = zmq.Context()
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.bind(port_args.scheduler_input_ipc)
        self.push = self.ctx.socket(zmq.PUSH)
        self.push.connect(port_args.tokenizer_ipc)
        self.received: list = []
        self.aborts: list[str] = []
        self.active: dict[str, dict] = {}
        self.stop_event = threading.Event()

    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.pull, zmq.POLLIN)
        while not self.stop_event.is_set():
            if poller.poll(2):
                self._on(decode_msg(self.pull.recv()))
            self._step()
        self.pull.close(0)
        self.push.close(0)
        self.ctx.term()

    def _send(self, msg) -> None:
        self.push.send(encode_msg(msg))

    def _on(self, msg) -> None:
        self.received.append(msg)
        if isinstance(msg, TokenizedGenerateReqInput):
            sp = msg.sampling_params
            if sp.get("regex") == "FAIL":
                self._out(msg, [], "", {"type": "abort", "message": "regex FAIL cannot be compiled",
                                        "status_code": 400})
                return
            n = sp["max_new_tokens"]
            self.active[msg.rid] = {"req": msg, "ids": fake_ids(msg.input_ids, n), "done": 0, "text": "",
                                    "first": True, "next": 0.0, "slow": n >= SLOW_MAX_NEW}
        elif isinstance(msg, AbortReq):
            self.aborts.append(msg.rid)
            st = self.active.pop(msg.rid, None)
            if st is not None:
                self._out(st["req"], [], "", {"type": "abort", "message": "aborted"})
        elif isinstance(msg, FlushCacheReqInput):
            self._send(FlushCacheReqOutput(success=not self.active, seq=msg.seq))
        elif isinstance(msg, GetInternalStateReq):
            self._send(GetInternalStateReqOutput(state={"num_running_reqs": len(self.active), "used_tokens": 0},
                                                 seq=msg.seq))

    def _out(self, req, ids, text, reason, st=None) -> None:
        base = 0 if st is None else st["done"] - len(ids)  # position of ids[0] in the output
        lp = [(-0.1 * (base + k + 1), t) for k, t in enumerate(ids)]
        tops = [[(-0.1 * (base + k + 1), t), (-2.0 - k, 300)][: req.top_logprobs_num] for k, t in enumerate(ids)]
        first = st is None or st["first"]
        in_lp = in_top = None
        if req.return_logprob and first and req.logprob_start_len >= 0:
            rest = req.input_ids[req.logprob_start_len:]
            in_lp = [(None, rest[0])] + [(-0.5, t) for t in rest[1:]]
            in_top = [[]] + [[(-0.5, t)][: req.top_logprobs_num] for t in rest[1:]]
        done = len(ids) if st is None else st["done"]
        self._send(BatchStrOut(
            rids=[req.rid], finished_reasons=[reason], output_strs=[text], output_ids=[ids],
            prompt_tokens=[len(req.input_ids)], completion_tokens=[done], cached_tokens=[3],
            output_token_logprobs=[lp] if req.return_logprob else None,
            output_top_logprobs=[tops] if req.return_logprob else None,
            input_token_logprobs=[in_lp] if req.return_logprob else None,
            input_top_logprobs=[in_top] if req.return_logprob else None))
        if st is not None:
            st["first"] = False

    def _step(self) -> None:
        now = time.time()
        for rid, st in list(self.active.items()):
            if now < st["next"]:
                continue
            paced = st["slow"] or str(st["req"].rid).startswith(PACED_RID_PREFIX)
            st["next"] = now + (0.05 if paced else 0.0)
            k = 1 if st["slow"] else 2
            new = st["ids"][st["done"]: st["done"] + k]
            st["done"] += len(new)
            full = self.tok.decode(st["ids"][: st["done"]])
            delta, st["text"] = full[len(st["text"]):], full
            finished = st["done"] >= len(st["ids"])
            reason = {"type": "length", "length": len(st["ids"])} if finished else None
            self._out(st["req"], new, delta, reason, st)
            if finished:
                del self.active[rid]
                self._send(SchedulerStats(num_running_reqs=len(self.active), num_queue_reqs=0, token_usage=0.25,
                                          used_tokens=7, max_total_tokens=4096, cache_hit_rate=0.5))


def _free_port() -> int:
    from sglang.srt.utils.common import free_tcp_ports  # below the ephemeral range: see server_utils.free_port

    return free_tcp_ports(1)[0]


class Server:
    """A uvicorn server in a thread serving create_app over a TokenizerManager + FakeScheduler."""

    def __init__(self, **server_kw) -> None:
        import uvicorn

        from sglang.srt.entrypoints.http_server import create_app
        from sglang.srt.managers.tokenizer_manager import TokenizerManager

        port = _free_port()
        self.args = ServerArgs(model_path=MODEL, port=port, served_model_name="stories", **server_kw)
        self.port_args = PortArgs.init_new()
        info = {"context_len": CONTEXT_LEN, "max_total_tokens": 4096, "vocab_size": 512, "max_req_input_len": 506}
        self.tm = TokenizerManager(self.args, self.port_args, info, disconnect_poll_s=0.2, control_timeout_s=5)
        self.fake = FakeScheduler(self.port_args, self.tm.tokenizer)
        self.fake.start()
        self.url = f"http://127.0.0.1:{port}"
        config = uvicorn.Config(create_app(self.tm, self.args), host="127.0.0.1", port=port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 20
        while not self.server.started:
            assert time.time() < deadline, "uvicorn did not start"
            time.sleep(0.02)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.fake.stop_event.set()
        self.fake.join(timeout=5)


@pytest.fixture(scope="module")
def srv():
    if not os.path.isdir(MODEL):
        pytest.skip(f"stories260K checkpoint not found at {MODEL} (needs ../shared/data beside the repo)")
    s = Server(enable_metrics=True)
    yield s
    s.close()


@pytest.fixture(scope="module")
def auth_srv():
    if not os.path.isdir(MODEL):
        pytest.skip(f"stories260K checkpoint not found at {MODEL} (needs ../shared/data beside the repo)")
    s = Server(api_key="sekret-key")
    yield s
    s.close()


def _sse_events(resp) -> list[str]:
    body = resp.content.decode()
    assert body.endswith("data: [DONE]\n\n"), body[-200:]
    parts = body.split("\n\n")
    assert parts[-1] == ""
    assert all(p.startswith("data: ") for p in parts[:-1]), body[:300]
    return [p[len("data: "):] for p in parts[:-2]]


def _wait_idle(tm, timeout=5.0) -> None:
    deadline = time.time() + timeout
    while tm.num_inflight and time.time() < deadline:
        time.sleep(0.02)
    assert tm.num_inflight == 0
