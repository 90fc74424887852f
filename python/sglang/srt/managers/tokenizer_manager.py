"""TokenizerManager: the HTTP process's bridge to the scheduler.

It tokenizes and validates requests (everything that can be checked is
checked before anything is sent), ships them to the scheduler as
:class:`~sglang.srt.managers.io_struct.TokenizedGenerateReqInput`, and runs one
background asyncio task that receives detokenized deltas
(:class:`~sglang.srt.managers.io_struct.BatchStrOut`) and control replies and
hands them to the waiting request coroutines. Outputs are SGLang's
``/generate`` dicts: cumulative ``text``/``output_ids`` and a ``meta_info``.

Sockets: a PULL socket bound on ``port_args.tokenizer_ipc`` (zmq.asyncio),
a plain PUSH socket connected to ``port_args.scheduler_input_ipc`` (sends
never block: high-water marks are off, so they are safe in ``finally``
blocks of cancelled tasks).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, AsyncIterator, Optional

import zmq
import zmq.asyncio

from sglang.srt.managers.dp_router import DpRouter
from sglang.srt.managers.generate_req import GenerateReqInput, SingleGenerateReq
from sglang.srt.managers.io_struct import (
    AbortReq,
    BatchStrOut,
    FlushCacheReqOutput,
    GetInternalStateReqOutput,
    SchedulerStats,
    TokenizedGenerateReqInput,
    WakeUpReq,
    decode_msg,
    encode_msg,
)
from sglang.srt.managers.req_state import ReqState
from sglang.srt.managers.request_preparer import RequestPreparer, tokenize_one
from sglang.srt.managers.template_manager import load_chat_template
from sglang.srt.managers.tokenizer_control import TokenizerControlMixin
from sglang.srt.managers.tokenizer_text import TokenizerTextMixin
from sglang.srt.utils.common import get_tokenizer, get_zmq_socket

logger = logging.getLogger(__name__)

ABORT_GRACE_S = 5.0  # how long an /abort_request'ed request waits for the scheduler's final output
ABORTED_BY_ROUTE = {"type": "abort", "message": "aborted by /abort_request"}


class RequestError(Exception):
    """A request failed with an HTTP status (e.g. the scheduler aborted it with ``status_code``).

    Attributes:
        status_code: HTTP status to answer with (400 bad input, 499 client gone, 503 unavailable).
        message: human-readable reason.
    """

    def __init__(self, status_code: int, message: str) -> None:
        super().__init__(message)
        self.status_code = int(status_code)
        self.message = message


class TokenizerManager(TokenizerControlMixin, TokenizerTextMixin):
    """Tokenize, validate and forward requests; collect their outputs.

    Args:
        server_args: :class:`~sglang.srt.server_args.ServerArgs`.
        port_args: :class:`~sglang.srt.server_args.PortArgs` (IPC endpoints).
        scheduler_info: dict with ``context_len``, ``max_total_tokens``, ``vocab_size``,
            ``max_req_input_len`` (ints) reported by the scheduler at startup.
        disconnect_poll_s: how often (s) a waiting request checks whether its client left.
        control_timeout_s: how long (s) flush_cache/get_internal_state wait for the scheduler.
        inbox: ``(zmq.asyncio.Context, PULL socket)`` already bound on ``port_args.tokenizer_ipc`` by the launcher
            (``--use-ray`` binds it before any worker starts); owned and closed by this manager. None: bind here.
        tokenizer: the HF tokenizer of ``server_args.resolved_tokenizer_path`` when the launcher already loaded it
            (for the detokenizer's decode spec); None: load it here (unless ``skip_tokenizer_init``).

    Raises:
        ValueError: the tokenizer cannot be loaded, or ``scheduler_info`` lacks a key.
    """

    def __init__(self, server_args, port_args, scheduler_info: dict, *,
                 disconnect_poll_s: float = 1.0, control_timeout_s: float = 30.0,
                 inbox: Optional[tuple] = None, tokenizer: Any = None) -> None:
        for key in ("context_len", "max_total_tokens", "vocab_size", "max_req_input_len"):
            if key not in scheduler_info:
                raise ValueError(f"scheduler_info lacks {key!r}; the scheduler must report it at startup")
        self.server_args = server_args
        self.port_args = port_args
        self.scheduler_info = dict(scheduler_info)
        self.context_len = int(scheduler_info["context_len"])
        self.vocab_size = int(scheduler_info["vocab_size"])
        self.max_req_input_len = int(scheduler_info["max_req_input_len"] or self.context_len)
        self.model_name = server_args.model_name
        self.disconnect_poll_s = disconnect_poll_s
        self.control_timeout_s = control_timeout_s
        self.tokenizer = None
        if tokenizer is not None:
            self.tokenizer = tokenizer
        elif not server_args.skip_tokenizer_init:
            self.tokenizer = get_tokenizer(server_args.resolved_tokenizer_path, server_args.trust_remote_code)
        self.chat_template = load_chat_template(server_args.chat_template)
        self.grammar_enabled = (server_args.grammar_backend != "none"
                                and self.tokenizer is not None)
        self._grammar_validator = None
        if self.grammar_enabled:
            from sglang.srt.constrained.xgrammar_backend import GrammarValidator

            self._grammar_validator = GrammarValidator()
        self.preparer = RequestPreparer(self._prepare, self.tokenizer, self.context_len,
                                        getattr(server_args, "max_n", 128), self.grammar_enabled,
                                        self._grammar_validator)
        self.metrics = None
        if server_args.enable_metrics:
            from sglang.srt.metrics.collector import MetricsCollector

            self.metrics = MetricsCollector(self.model_name)
        self.last_scheduler_stats: Optional[SchedulerStats] = None

        if inbox is not None:
            self._recv_ctx, self._recv_sock = inbox
        else:
            self._recv_ctx = zmq.asyncio.Context()
            self._recv_sock = get_zmq_socket(self._recv_ctx, zmq.PULL, port_args.tokenizer_ipc, bind=True)
        self._send_ctx = zmq.Context()
        self._send_sock = get_zmq_socket(self._send_ctx, zmq.PUSH, port_args.scheduler_input_ipc, bind=False)
        # data-parallel schedulers (AFD attention workers, DP-attention ranks): a request goes to the one the router
        # picks (--load-balance-method); its aborts follow it; with DP attention the others are woken
        self._dp_socks = [get_zmq_socket(self._send_ctx, zmq.PUSH, a, bind=False)
                          for a in port_args.dp_scheduler_inputs]
        self._dp_router = DpRouter(max(len(self._dp_socks), 1), getattr(server_args, "load_balance_method",
                                                                          "shortest_queue"))
        self._dp_wake = encode_msg(WakeUpReq()) if getattr(port_args, "dp_wake_peers", False) else None
        self._states: dict[str, ReqState] = {}
        self._control_futs: dict[str, asyncio.Future] = {}
        self._control_locks: dict[str, asyncio.Lock] = {}
        self._control_replies: dict[str, tuple[int, int, list]] = {}  # key -> (round, replies awaited, so far)
        self._control_seq = 0  # the last control round sent
        self._recv_task: Optional[asyncio.Task] = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._failure: Optional[str] = None  # set once a child process died: new requests get 503
        self._token_text_cache: dict[int, str] = {}
        self._closed = False

    # ------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Start the receive loop on the running event loop (idempotent).

        Raises:
            RuntimeError: no event loop is running, or the manager was closed.
        """
        if self._closed:
            raise RuntimeError("TokenizerManager is closed")
        if self._recv_task is not None and not self._recv_task.done():
            return
        self._loop = asyncio.get_running_loop()
        self._recv_task = self._loop.create_task(self._recv_loop(), name="tokenizer-recv")

    def close(self) -> None:
        """Stop the receive loop, fail in-flight requests with 503, close the sockets (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self.preparer.close()
        if self._recv_task is not None and not self._recv_task.done():
            self._recv_task.cancel()
        for s in list(self._states.values()):
            self._finish_locally(s, {"type": "abort", "message": "the server is shutting down",
                                     "status_code": 503})
        for fut in self._control_futs.values():
            if not fut.done():
                fut.set_exception(RequestError(503, "the server is shutting down"))
        self._recv_sock.close(linger=0)
        self._send_sock.close(linger=0)
        for sock in self._dp_socks:
            sock.close(linger=0)
        self._recv_ctx.term()
        self._send_ctx.term()

    def fail_all_threadsafe(self, message: str, status_code: int = 503) -> None:
        """From any thread (the child watchdog): a child process died, so finish every in-flight
        request now with ``status_code`` and ``message`` (the client gets an HTTP error naming the
        cause instead of waiting forever), and refuse new requests the same way. Idempotent.
        """
        self._failure = message
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(self._fail_all, message, status_code)
        except RuntimeError:  # the loop closed meanwhile
            pass

    def _fail_all(self, message: str, status_code: int) -> None:
        for s in list(self._states.values()):
            self._finish_locally(s, {"type": "abort", "message": message, "status_code": status_code})
        for fut in self._control_futs.values():
            if not fut.done():
                fut.set_exception(RequestError(status_code, message))

    @property
    def failure(self) -> Optional[str]:
        """Why the server cannot serve (a child died, the watchdog fired, shutdown), or None."""
        return self._failure

    @property
    def num_inflight(self) -> int:
        """Requests sent to the scheduler and not yet finished or dropped."""
        return len(self._states)

    # -------------------------------------------------------------- request
    async def generate_request(self, obj: GenerateReqInput, request=None) -> AsyncIterator[Any]:
        """Run one ``/generate`` request.

        Args:
            obj: the request; validated and expanded with :meth:`GenerateReqInput.normalize`.
            request: the ``fastapi.Request`` (or None); polled for client disconnects.

        Yields:
            Single request: output dicts ``{"text", "output_ids", "meta_info"}``: every update
            when ``obj.stream`` (cumulative text, ids and logprobs), else the final one only.
            Batch (a list of prompts or ``n`` > 1): with ``stream``, output dicts carrying an
            ``"index"`` (position in the batch); without, one list of final dicts in batch order.

        Raises:
            ValueError: invalid input (naming the field); nothing was sent to the scheduler.
            RequestError: the scheduler aborted the request with a status code, or the client
                disconnected (499). Unfinished requests are aborted (AbortReq) whenever this
                generator exits early (error, cancellation, close).
        """
        self.start()
        if self._failure is not None:
            raise RequestError(503, f"the server cannot serve requests: {self._failure}")
        states, prepared, encoded = await self.preparer.prepare(obj)  # off the loop; all or nothing
        for p in prepared:
            if p.rid in self._states:
                raise ValueError(f"rid {p.rid!r} is already used by a running request; use a unique rid")
        self._states.update((p.rid, s) for s, p in zip(states, prepared))
        try:
            for i, p in enumerate(prepared):
                if not self._closed:
                    self._send(p, encoded[i])
                if self.server_args.log_requests:
                    logger.info("request %s: %d prompt tokens, %s", p.rid, len(p.input_ids), p.sampling_params)
                if i % 256 == 255:
                    await asyncio.sleep(0)  # a large batch never holds the loop for long
            if not obj.is_batch:
                async for _, out in self._consume(states, request, obj.stream):
                    yield out
            elif obj.stream:
                async for i, out in self._consume(states, request, True):
                    out["index"] = i
                    yield out
            else:
                finals: list[Any] = [None] * len(states)
                async for i, out in self._consume(states, request, False):
                    finals[i] = out
                yield finals
        finally:
            for s in states:
                if not s.finished:
                    self._send(AbortReq(rid=s.req.rid))
                    s.finished = True
                if self._states.get(s.req.rid) is s:
                    del self._states[s.req.rid]
                    self._dp_router.release(s.req.rid)

    def _prepare(self, req: SingleGenerateReq) -> TokenizedGenerateReqInput:
        """Tokenize and validate one request (ValueError naming the field on bad input); see
        :func:`~sglang.srt.managers.request_preparer.tokenize_one`."""
        return tokenize_one(req, self.tokenizer, self.preparer, vocab_size=self.vocab_size,
                            context_len=self.context_len, max_req_input_len=self.max_req_input_len,
                            server_args=self.server_args)

    async def _consume(self, states: list[ReqState], request, stream: bool):
        """Yield ``(index, output)`` as the states change: every update if ``stream``, else finals."""
        pending = list(range(len(states)))
        event = states[0].event
        poll = [asyncio.get_running_loop().time()]
        while pending:
            await self._wait(event, states, request, poll)
            event.clear()
            for i in list(pending):
                s = states[i]
                if not s.dirty:
                    continue
                s.dirty = False
                if s.finished:
                    pending.remove(i)
                    fr = s.finish_reason or {}
                    if fr.get("type") == "abort" and fr.get("status_code"):
                        raise RequestError(fr["status_code"], fr.get("message") or "request aborted")
                    yield i, s.to_output()
                elif stream:
                    yield i, s.to_output()

    async def _wait(self, event: asyncio.Event, states: list[ReqState], request, poll: list[float]) -> None:
        """Wait for ``event``; abort everything and raise RequestError(499) if the client left.

        ``request.is_disconnected()`` is polled at most every ``disconnect_poll_s`` (``poll[0]`` holds
        the loop time of the last poll), even while outputs keep arriving.
        """
        loop = asyncio.get_running_loop()
        while True:
            # no client to poll (Engine, /health_generate): wait for the event alone (a 0 timeout never saw it)
            timeout = None if request is None else max(self.disconnect_poll_s - (loop.time() - poll[0]), 0.0)
            try:
                await asyncio.wait_for(event.wait(), timeout=timeout)
                woke = True
            except asyncio.TimeoutError:
                woke = False
            if loop.time() - poll[0] >= self.disconnect_poll_s:
                # restart the poll window even without a request (the in-process Engine): otherwise the
                # timeout stays 0 and wait_for(event.wait(), 0) never sees the event (a busy loop, no wake-up)
                poll[0] = loop.time()
                if request is not None and await request.is_disconnected():
                    for s in states:
                        if not s.finished:
                            logger.info("client disconnected; aborting request %s", s.req.rid)
                            self._send(AbortReq(rid=s.req.rid))
                            s.finished = True
                    raise RequestError(499, "the client disconnected")
            if woke:
                return

    # ---------------------------------------------------------------- abort
    async def abort_request(self, rid: str = "", abort_all: bool = False) -> int:
        """Abort request ``rid`` (also every ``n``-sample of a request the client named ``rid``),
        or all of them; the scheduler frees their KV at once. The waiting client gets its output
        so far with ``finish_reason`` ``{"type": "abort", ...}``.

        Returns:
            How many in-flight requests matched.
        """
        if abort_all:
            self._send(AbortReq(abort_all=True))
            matched = list(self._states.values())
        else:
            matched = [s for s in self._states.values() if rid in (s.req.rid, s.req.parent_rid)]
            for s in matched:
                self._send(AbortReq(rid=s.req.rid))
            if not matched:
                self._send(AbortReq(rid=rid))
        # The scheduler answers an abort with the request's output so far; wait for it, but not forever
        # (a request the scheduler no longer knows gets no answer).
        loop = asyncio.get_running_loop()
        for s in matched:
            s.abort_requested = True
            loop.call_later(ABORT_GRACE_S, self._finish_locally, s, dict(ABORTED_BY_ROUTE))
        return len(matched)

    def _finish_locally(self, s: ReqState, reason: dict[str, Any]) -> None:
        if s.finished:
            return
        s.finished = True
        s.finish_reason = reason
        s.finished_time = time.time()
        s.dirty = True
        s.event.set()

    # -------------------------------------------------------------- receive
    def _send(self, msg, data: Optional[bytes] = None) -> None:
        """Send ``msg`` (``data``: its encoding when already made) to the scheduler, or with several
        data-parallel schedulers (AFD attention workers) to the one owning its request."""
        if self._closed:
            return
        data = encode_msg(msg) if data is None else data
        if not self._dp_socks:
            self._send_sock.send(data)
            return
        if isinstance(msg, TokenizedGenerateReqInput):  # data parallel: the router's pick, remembered for aborts
            idx = self._dp_router.pick(msg.rid)
            self._dp_socks[idx].send(data)
            if self._dp_wake is not None:  # DP attention: the other ranks step with it
                for i, sock in enumerate(self._dp_socks):
                    if i != idx:
                        sock.send(self._dp_wake)
        elif isinstance(msg, AbortReq) and not msg.abort_all and self._dp_router.owner(msg.rid) is not None:
            self._dp_socks[self._dp_router.owner(msg.rid)].send(data)
        elif isinstance(msg, AbortReq):  # abort_all, or a rid not (or no longer) placed: every scheduler
            for sock in self._dp_socks:
                sock.send(data)
        else:  # control requests (flush cache, internal state): one per scheduler, addressed by dp_rank
            self._dp_socks[msg.dp_rank].send(data)

    async def _recv_loop(self) -> None:
        while True:
            data = await self._recv_sock.recv()
            try:
                msg = decode_msg(data)
                self._dispatch(msg)
            except Exception:  # a bad message must not kill the loop
                logger.exception("failed to handle a message from the scheduler/detokenizer")

    def _dispatch(self, msg) -> None:
        if isinstance(msg, BatchStrOut):
            self._handle_batch_str_out(msg)
        elif isinstance(msg, SchedulerStats):
            self.last_scheduler_stats = msg
            if self.metrics is not None:
                self.metrics.update_scheduler_stats(msg)
        elif isinstance(msg, (FlushCacheReqOutput, GetInternalStateReqOutput)):
            self._on_control_reply(msg)
        else:
            logger.warning("unexpected message %s", type(msg).__name__)

    def _handle_batch_str_out(self, msg: BatchStrOut) -> None:
        now = time.time()
        for i, rid in enumerate(msg.rids):
            s = self._states.get(rid)
            if s is None or s.finished:
                continue
            new_ids = msg.output_ids[i]
            s.text += msg.output_strs[i]
            s.output_ids.extend(new_ids)
            s.prompt_tokens = msg.prompt_tokens[i]
            s.completion_tokens = msg.completion_tokens[i]
            s.cached_tokens = msg.cached_tokens[i]
            if msg.disagg_info is not None and msg.disagg_info[i] is not None:
                s.disagg_info = msg.disagg_info[i]
            if s.req.return_logprob:
                s.add_logprobs(msg, i, self.token_text)
            if new_ids and self.metrics is not None:
                if not s.first_token_time:
                    self.metrics.observe_time_to_first_token(now - s.created_time)
                else:
                    self.metrics.observe_inter_token_latency(now - s.last_token_time, len(new_ids))
            if new_ids:
                s.first_token_time = s.first_token_time or now
                s.last_token_time = now
            reason = msg.finished_reasons[i]
            if reason is not None and s.abort_requested and reason.get("type") == "abort":
                reason = ABORTED_BY_ROUTE  # an answer to /abort_request: output so far, not an error
            if reason is not None:
                s.finished = True
                s.finish_reason = dict(reason)
                s.finished_time = now
                if self.metrics is not None:
                    self.metrics.observe_request_finished(now - s.created_time, s.prompt_tokens,
                                                          s.completion_tokens)
                if s.disagg_info is not None and self.metrics is not None:
                    self.metrics.observe_kv_transfer(s.disagg_info)
            s.dirty = True
            s.event.set()
