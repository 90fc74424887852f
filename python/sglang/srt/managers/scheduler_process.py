"""The scheduler's process: ZMQ in, one :class:`Scheduler` step at a time, ZMQ out.

The loop (nano-vllm style, one screen)::

    while alive:
        handle every message that arrived (requests, aborts, control)
        outputs = scheduler.step()          # no-op when idle
        push outputs to the detokenizer; push stats now and then

With overlap scheduling (``Scheduler.overlap``) ``step()`` returns while its batch is still running
on the overlap worker's thread, so this loop's message handling and output sending also overlap the
forward; the loop does not block for messages while a batch is in flight (``has_work()``).

Tensor parallelism: one such process per TP rank. Only rank 0 binds/connects the ZMQ sockets. Each
iteration rank 0 drains its socket and broadcasts the raw message bytes over the CPU (gloo) group
(:func:`~sglang.srt.distributed.parallel_state.broadcast_bytes_list`); every rank then handles the same
messages in the same order and runs the same deterministic :meth:`Scheduler.step`, so all ranks build
identical batches and enter the model's collectives together (sampled tokens are made identical by the
ModelRunner). Only rank 0 sends outputs, replies and stats. A rank whose peer died gets an error from
the next collective and exits; the launcher notices any dead rank and stops the server.

DP attention (``WorkerSpec.dp_attention``): every DP rank is a leader with its own sockets and requests; with MoE layers
the ranks step together through the scheduler's per-step agreement (``sglang.srt.dp_attention``), so a rank blocks
on its socket only while no rank has work, and the front end wakes the others (:class:`WakeUpReq`) when it sends a
request to one.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
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
    WakeUpReq,
    decode_msg,
    encode_msg,
)
from sglang.srt.utils.common import configure_logger, get_tokenizer, get_zmq_socket

logger = logging.getLogger(__name__)

STATS_INTERVAL_S = 1.0
IDLE_POLL_MS = 500


class SchedulerProcess:
    """Wires a :class:`Scheduler` to its sockets (see the module docstring)."""

    def __init__(self, server_args, port_args, scheduler, parallel_state=None):
        self.scheduler = scheduler
        self.parallel_state = parallel_state
        self.is_leader = parallel_state is None or parallel_state.tp_rank == 0
        self.last_stats = 0.0
        self.watchdog = None  # a SchedulerWatchdog, started by run_scheduler_process
        if not self.is_leader:
            return
        ctx = zmq.Context(2)
        self.recv_sock = get_zmq_socket(ctx, zmq.PULL, port_args.scheduler_input_ipc, bind=True)
        self.to_detok = get_zmq_socket(ctx, zmq.PUSH, port_args.detokenizer_ipc, bind=False)
        self.to_tokenizer = get_zmq_socket(ctx, zmq.PUSH, port_args.tokenizer_ipc, bind=False)
        self.poller = zmq.Poller()
        self.poller.register(self.recv_sock, zmq.POLLIN)

    def send_detok(self, msg) -> None:
        """Rank 0 only: send ``msg`` to the detokenizer (other ranks drop it)."""
        if self.is_leader:
            self.to_detok.send(encode_msg(msg))

    def send_tokenizer(self, msg) -> None:
        """Rank 0 only: send ``msg`` to the TokenizerManager (other ranks drop it)."""
        if self.is_leader:
            self.to_tokenizer.send(encode_msg(msg))

    def handle(self, msg) -> None:
        """Dispatch one control/input message: add a request (a ValueError is reported back as a 400 abort), abort,
        flush the cache, or report the internal state."""
        s = self.scheduler
        if isinstance(msg, TokenizedGenerateReqInput):
            try:
                s.add_request(msg)
            except ValueError as e:  # bad sampling params that slipped through: report, keep serving
                from sglang.srt.managers.io_struct import BatchTokenIDOut

                logger.warning("rejecting request %s: %s", msg.rid, e)
                self.send_detok(BatchTokenIDOut(
                    rids=[msg.rid], finished_reasons=[{"type": "abort", "message": str(e), "status_code": 400}],
                    output_ids=[[]], prompt_tokens=[len(msg.input_ids)], completion_tokens=[0], cached_tokens=[0],
                    skip_special_tokens=[True], spaces_between_special_tokens=[True], no_stop_trim=[False],
                    stop_strs=[[]]))
        elif isinstance(msg, AbortReq):
            s.abort(msg)
        elif isinstance(msg, WakeUpReq):  # DP attention: leaving the idle wait was the point
            pass
        elif isinstance(msg, FlushCacheReqInput):
            ok, why = s.flush_cache()
            self.send_tokenizer(FlushCacheReqOutput(success=ok, message=why, dp_rank=msg.dp_rank, seq=msg.seq))
        elif isinstance(msg, GetInternalStateReq):
            self.send_tokenizer(GetInternalStateReqOutput(state=s.internal_state(), dp_rank=msg.dp_rank,
                                                        seq=msg.seq))
        else:
            logger.warning("scheduler ignores unexpected message %s", type(msg).__name__)

    def recv_raw(self, block: bool) -> list[bytes]:
        """Rank 0: every message waiting on the input socket (waits up to IDLE_POLL_MS when ``block``)."""
        timeout = IDLE_POLL_MS if block else 0
        raw = []
        while self.poller.poll(timeout):
            raw.append(self.recv_sock.recv())
            timeout = 0
        return raw

    def recv_all(self, block: bool) -> None:
        """Receive (rank 0) and share (TP) this iteration's messages, then handle them on every rank."""
        raw = self.recv_raw(block) if self.is_leader else None
        ps = self.parallel_state
        if ps is not None and ps.tp_size > 1:
            from sglang.srt.distributed.parallel_state import broadcast_bytes_list

            group = self.scheduler.control_group or ps.cpu_group
            raw = broadcast_bytes_list(raw, group, src=0)
        for data in raw:
            self.handle(decode_msg(data))

    def _step(self) -> list:
        """One scheduler step. With ``--enable-afd``, a forward that fails because an FFN worker does not answer
        (TimeoutError / ConnectionError) fails every request this attention worker holds with 503 and frees all of its
        KV (``Scheduler.fail_all``); the worker stays up (``/get_server_info`` shows the freed pool) while the launcher
        reports the dead worker (``/health`` 503, new requests 503). Any other error propagates (the worker exits)."""
        s = self.scheduler
        recoverable = getattr(getattr(s.runner, "executor", None), "recoverable_errors", ())
        try:
            return s.step()
        except Exception as e:
            if not recoverable or not isinstance(e, recoverable):
                raise
            logger.error("a forward failed, an FFN worker did not answer (%s: %s): failing every request of this "
                         "attention worker and freeing its KV", type(e).__name__, e)
            s.fail_all(f"the AFD forward failed: an FFN worker did not answer ({type(e).__name__}: {e})", 503)
            return s.collect_outputs()

    def event_loop(self, parent_watch=None) -> None:
        """Receive messages, run one scheduler step, send its outputs, and send stats every ``STATS_INTERVAL_S``;
        returns when ``parent_watch`` (a :class:`~sglang.srt.entrypoints.worker_launcher.ParentWatch`) reports the
        launcher gone."""
        s = self.scheduler
        watchdog = self.watchdog
        while True:
            if watchdog is not None:
                watchdog.beat()
            self.recv_all(block=s.may_block())
            for out in self._step():
                self.send_detok(out)
            now = time.monotonic()
            if now - self.last_stats > STATS_INTERVAL_S:
                self.last_stats = now
                self.send_tokenizer(s.stats())
                if parent_watch is not None and not parent_watch.parent_alive():
                    logger.error("the launcher is gone; scheduler exits")
                    return


def torch_device_index(device: str) -> Optional[int]:
    """The index in an explicit device string (``"cuda:3"`` -> 3), None for ``"cuda"``/``"cpu"``."""
    _, sep, idx = device.partition(":")
    return int(idx) if sep and idx.isdigit() else None


def make_device_current(device: str) -> None:
    """Make an explicit CUDA device (``"cuda:1"``) this process's current device; no-op for ``cpu``/``cuda``.

    A single-rank server on ``--base-gpu-id 1`` builds its tensors on ``cuda:1``, but Triton launches kernels (and
    ``torch.cuda.current_stream()`` answers) on the *current* device, ``cuda:0`` unless set: its kernels would
    run on the wrong GPU. TP > 1 sets it in ``init_parallel_state``; this covers every rank."""
    idx = torch_device_index(device)
    if idx is not None and device.startswith("cuda"):
        import torch

        torch.cuda.set_device(idx)


def _start(spec, parent_watch):
    """Build this worker's model runner, scheduler and socket loop from ``spec`` (see :func:`run_scheduler_process`);
    returns ``(SchedulerProcess, ModelRunner, ModelConfig)``."""
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.model_executor.model_runner import ModelRunner

    args, tp_rank, tp_size = spec.args, spec.rank, spec.tp_size
    device_type = args.resolved_device
    device = spec.device or device_type
    mc = ModelConfig.from_path(args.model_path, args.context_length, args.dtype, device_type)
    alive = parent_watch.parent_alive if parent_watch is not None else None
    tokenizer_spec = spec.wiring.tokenizer if spec.wiring is not None else None
    tokenizer = (None if args.skip_tokenizer_init else tokenizer_spec.load() if tokenizer_spec is not None
                 else get_tokenizer(args.resolved_tokenizer_path, args.trust_remote_code))
    if spec.dp_attention is not None:  # one DP rank: attention TP 1, its own requests; the MoE world over all ranks
        from sglang.srt.dp_attention.rank import DpAttentionRank

        dp = DpAttentionRank.join(spec.dp_attention, spec.wiring.dist_init or "", device_type,
                                  torch_device_index(device), args.dist_timeout, share_gpu=args.tp_ranks_share_gpu)
        if device_type == "cuda":
            device = str(dp.parallel_state.torch_device())
        make_device_current(device)
        runner = ModelRunner(mc, args, device, worker=spec, alive=alive, dp_attention=dp)
        scheduler = Scheduler(args, runner, tokenizer, connector=spec.connector)
        return SchedulerProcess(args, spec.wiring.port_args, scheduler, None), runner, mc
    ps = None
    if tp_size > 1:
        from sglang.srt.distributed.parallel_state import DistConfig, init_parallel_state, validate_tp_config

        validate_tp_config(mc, tp_size, args.ep_size, args.nnodes)
        ps = init_parallel_state(DistConfig(
            tp_rank=tp_rank, tp_size=tp_size, init_method=spec.wiring.dist_init or "", device=device_type,
            device_index=torch_device_index(device), ep_size=args.ep_size, nnodes=args.nnodes, node_rank=spec.node,
            device_backend="gloo" if args.tp_ranks_share_gpu else None,
            **({"timeout_s": float(args.dist_timeout)} if args.dist_timeout else {})))
        if device_type == "cuda":
            device = str(ps.torch_device())
    make_device_current(device)
    runner = ModelRunner(mc, args, device, tp_rank=tp_rank, tp_size=tp_size, parallel_state=ps, worker=spec,
                         alive=alive)
    scheduler = Scheduler(args, runner, tokenizer, connector=spec.connector)
    return SchedulerProcess(args, spec.wiring.port_args, scheduler, ps), runner, mc


def run_scheduler_process(spec, ready_pipe, parent_watch=None) -> None:
    """Entry point of a scheduler worker: carries out one :class:`~sglang.srt.deployment.plan.WorkerSpec`.

    ``spec`` gives the role, the TP rank and group size, the explicit device (e.g. ``cuda:3``), the executor,
    communicator and connector specs, the ServerArgs, and the launcher's wiring (``port_args`` to bind/connect, the
    TP rendezvous ``dist_init``, the AFD topology). Sends ``{"status": "ready", ...scheduler info}`` through
    ``ready_pipe`` once the model and KV cache are set up, or ``{"status": "error", "message": ...}`` if startup
    fails (unknown architecture, missing/corrupt weights, a failed TP rendezvous, ...). ``parent_watch``: the
    launcher's liveness (the loop returns when it is gone). A crash while serving is raised (the launcher's
    watchdog reports the dead worker).
    """
    tp_rank, tp_size, args = spec.rank, spec.tp_size, spec.args
    dp = spec.dp_attention
    who = f"DP rank {dp.dp_rank}" if dp is not None else f"TP rank {tp_rank}" if tp_size > 1 else "scheduler"
    configure_logger(args.log_level, f"Scheduler DP{dp.dp_rank}" if dp is not None else
                     f"Scheduler TP{tp_rank}" if tp_size > 1 else "Scheduler")
    if threading.current_thread() is threading.main_thread():  # a Ray actor runs us on one of its threads
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent coordinates shutdown
        signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    try:
        proc, runner, mc = _start(spec, parent_watch)
    except Exception as e:  # report any startup failure to the launcher
        logger.error("scheduler (%s) failed to start: %s\n%s", who, e, traceback.format_exc())
        ready_pipe.send({"status": "error", "message": f"{who}: {type(e).__name__}: {e}"
                         if tp_size > 1 else f"{type(e).__name__}: {e}"})
        return
    ready_pipe.send(ready_info(runner, mc, tp_rank, tp_size))
    from sglang.srt.managers.watchdog import SchedulerWatchdog

    proc.watchdog = SchedulerWatchdog(getattr(args, "watchdog_timeout", 300.0), who).start()
    try:
        proc.event_loop(parent_watch)
    except Exception:
        logger.error("scheduler (%s) crashed:\n%s", who, traceback.format_exc())
        raise


def ready_info(runner, mc, tp_rank: int, tp_size: int) -> dict:
    """The scheduler's ``{"status": "ready", ...}`` message: limits, model facts, and the settings as resolved at
    startup, which ``/get_server_info`` shows beside the raw server args (those keep SGLang's meaning, e.g.
    ``kv_cache_layout`` "auto"): ``kv_cache_layout_resolved`` (the KV pool's storage order, None without a KV pool)
    and ``tokenweave_sharded_residual_resolved`` (the executor keeps the residual sharded between layers).
    ``runner``: the ModelRunner; ``mc``: its ModelConfig."""
    return {
        "status": "ready",
        "max_total_tokens": runner.max_total_tokens,
        "max_running_requests": runner.max_running_requests,
        "context_len": mc.context_len,
        "max_req_input_len": min(mc.context_len - 1, runner.max_total_tokens - 1),
        "vocab_size": mc.vocab_size,
        "device": str(runner.device),
        "dtype": str(mc.dtype).replace("torch.", ""),
        "architecture": mc.architecture,
        "tp_size": tp_size,
        "tp_rank": tp_rank,
        "pid": os.getpid(),
        "kv_cache_layout_resolved": runner.token_to_kv_pool.layout if runner.kv_cache else None,
        "tokenweave_sharded_residual_resolved": bool(getattr(runner.executor, "sharded_residual", False)),
        **(runner.dp_attention.ready_info() if getattr(runner, "dp_attention", None) is not None else {}),
    }
