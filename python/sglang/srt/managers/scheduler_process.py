"""The scheduler's process: ZMQ in, one :class:`Scheduler` step at a time, ZMQ out.

The loop (nano-vllm style, one screen)::

    while alive:
        handle every message that arrived (requests, aborts, control)
        outputs = scheduler.step()          # no-op when idle
        push outputs to the detokenizer; push stats now and then
"""

from __future__ import annotations

import logging
import os
import signal
import time
import traceback
from typing import Optional

import zmq

from sglang.srt.managers.io_struct import (
    AbortReq,
    FlushCacheReqInput,
    FlushCacheReqOutput,
    GetInternalStateReq,
    GetInternalStateReqOutput,
    TokenizedGenerateReqInput,
    decode_msg,
    encode_msg,
)
from sglang.srt.utils.common import configure_logger, get_tokenizer, get_zmq_socket

logger = logging.getLogger(__name__)

STATS_INTERVAL_S = 1.0
IDLE_POLL_MS = 500


class SchedulerProcess:
    """Wires a :class:`Scheduler` to its sockets (see the module docstring)."""

    def __init__(self, server_args, port_args, scheduler):
        self.scheduler = scheduler
        ctx = zmq.Context(2)
        self.recv_sock = get_zmq_socket(ctx, zmq.PULL, port_args.scheduler_input_ipc, bind=True)
        self.to_detok = get_zmq_socket(ctx, zmq.PUSH, port_args.detokenizer_ipc, bind=False)
        self.to_tokenizer = get_zmq_socket(ctx, zmq.PUSH, port_args.tokenizer_ipc, bind=False)
        self.poller = zmq.Poller()
        self.poller.register(self.recv_sock, zmq.POLLIN)
        self.last_stats = 0.0

    def handle(self, msg) -> None:
        s = self.scheduler
        if isinstance(msg, TokenizedGenerateReqInput):
            try:
                s.add_request(msg)
            except ValueError as e:  # bad sampling params that slipped through: report, keep serving
                from sglang.srt.managers.io_struct import BatchTokenIDOut

                logger.warning("rejecting request %s: %s", msg.rid, e)
                self.to_detok.send(encode_msg(BatchTokenIDOut(
                    rids=[msg.rid], finished_reasons=[{"type": "abort", "message": str(e), "status_code": 400}],
                    output_ids=[[]], prompt_tokens=[len(msg.input_ids)], completion_tokens=[0], cached_tokens=[0],
                    skip_special_tokens=[True], spaces_between_special_tokens=[True], no_stop_trim=[False],
                    stop_strs=[[]])))
        elif isinstance(msg, AbortReq):
            s.abort(msg)
        elif isinstance(msg, FlushCacheReqInput):
            ok, why = s.flush_cache()
            self.to_tokenizer.send(encode_msg(FlushCacheReqOutput(success=ok, message=why)))
        elif isinstance(msg, GetInternalStateReq):
            self.to_tokenizer.send(encode_msg(GetInternalStateReqOutput(state=s.internal_state())))
        else:
            logger.warning("scheduler ignores unexpected message %s", type(msg).__name__)

    def recv_all(self, block: bool) -> None:
        timeout = IDLE_POLL_MS if block else 0
        while self.poller.poll(timeout):
            self.handle(decode_msg(self.recv_sock.recv()))
            timeout = 0

    def event_loop(self, parent_pid: Optional[int]) -> None:
        s = self.scheduler
        while True:
            self.recv_all(block=not s.has_work())
            for out in s.step():
                self.to_detok.send(encode_msg(out))
            now = time.monotonic()
            if now - self.last_stats > STATS_INTERVAL_S:
                self.last_stats = now
                self.to_tokenizer.send(encode_msg(s.stats()))
                if parent_pid is not None and os.getppid() != parent_pid:
                    logger.error("parent process %d is gone; scheduler exits", parent_pid)
                    return


def run_scheduler_process(server_args, port_args, ready_pipe, parent_pid: Optional[int] = None) -> None:
    """Entry point of the scheduler subprocess.

    Sends ``{"status": "ready", ...scheduler info}`` through ``ready_pipe`` once
    the model and KV cache are set up, or ``{"status": "error", "message": ...}``
    if startup fails (unknown architecture, missing/corrupt weights, ...).
    """
    configure_logger(server_args.log_level, "Scheduler")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent coordinates shutdown
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    try:
        from sglang.srt.configs.model_config import ModelConfig
        from sglang.srt.managers.scheduler import Scheduler
        from sglang.srt.model_executor.model_runner import ModelRunner

        device = server_args.resolved_device
        mc = ModelConfig.from_path(server_args.model_path, server_args.context_length, server_args.dtype, device)
        runner = ModelRunner(mc, server_args, device)
        tokenizer = None if server_args.skip_tokenizer_init else get_tokenizer(
            server_args.resolved_tokenizer_path, server_args.trust_remote_code)
        scheduler = Scheduler(server_args, runner, tokenizer)
        proc = SchedulerProcess(server_args, port_args, scheduler)
    except Exception as e:  # report any startup failure to the launcher
        logger.error("scheduler failed to start: %s\n%s", e, traceback.format_exc())
        ready_pipe.send({"status": "error", "message": f"{type(e).__name__}: {e}"})
        return
    ready_pipe.send({
        "status": "ready",
        "max_total_tokens": runner.max_total_tokens,
        "max_running_requests": runner.max_running_requests,
        "context_len": mc.context_len,
        "max_req_input_len": min(mc.context_len - 1, runner.max_total_tokens - 1),
        "vocab_size": mc.vocab_size,
        "device": str(runner.device),
        "dtype": str(mc.dtype).replace("torch.", ""),
        "architecture": mc.architecture,
    })
    try:
        proc.event_loop(parent_pid)
    except Exception:
        logger.error("scheduler crashed:\n%s", traceback.format_exc())
        if parent_pid is not None:
            try:
                os.kill(parent_pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        raise
