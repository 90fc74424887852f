"""The FFN worker process of attention/FFN disaggregation (MegaScale-Infer, Zhu et al. 2025, sec. 3-4).

It holds routed experts only (expert parallel over FFN workers: contiguous blocks at start, any redundant
placement after load balancing) and loops::

    receive every DISPATCH waiting from all attention workers (at least one)
    per MoE layer: concatenate their rows (tokens of many attention workers and micro-batches aggregated
        per expert: one grouped expert computation), compute, split, send each RESULT back (N2M)
    apply PLACE messages (load the newly assigned experts) and acknowledge them
    serve a STEP message's whole device-driven step (one CUDA graph on a GPU: sglang.srt.afd.device_m2n)

Entry point :func:`run_ffn_worker` takes only picklable arguments and a ``parent_watch``, so any
:class:`~sglang.srt.entrypoints.worker_launcher.WorkerLauncher` (multiprocessing, Ray) can start it.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
import traceback
from collections import defaultdict
from typing import Optional

import torch

from sglang.srt.afd.device_m2n import FfnDeviceSteps
from sglang.srt.afd.protocol import DISPATCH, ERROR, PLACE, PLACED, RESULT, STEP, AfdTopology, \
    create_afd_transport, dispatch_layout, result_layout

logger = logging.getLogger(__name__)


class FfnServer:
    """The FFN worker's state: its expert shards (one per MoE layer), the M2N endpoint, the placement version.

    Args:
        mc: model config; specs: MoE layers; expert_ids: experts held at start; load_format, device, seed: how
        to load them; topo: the group; index: this FFN worker's index j; alive: liveness of the launcher.
    """

    def __init__(self, mc, specs, expert_ids, load_format: str, device: torch.device, topo: AfdTopology, index: int,
                 alive=None, seed: int = 0):
        from sgl_kernel.m2n import M2NConfig, M2NEndpoint

        from sglang.srt.afd.experts import load_expert_weights

        if device.type == "cuda":  # kernels (Triton launches on the current device) and IPC events of this worker
            torch.cuda.set_device(device)
        self.mc, self.specs, self.load_format, self.device, self.seed = mc, specs, load_format, device, seed
        self.index, self.topo = index, topo
        self.layers = {s.layer: s for s in specs}
        self.shards = {sh.spec.layer: sh for sh in load_expert_weights(mc, specs, expert_ids, load_format, device,
                                                                       seed)}
        self.version = 0
        s0 = specs[0]
        self.ep = M2NEndpoint(
            M2NConfig(topo.ffn_rank(index), topo.addresses, topo.max_rows, device=str(device), timeout_s=topo.timeout_s),
            result_layout(s0.hidden, mc.dtype), recv_layout=dispatch_layout(s0.hidden, s0.top_k, mc.dtype),
            transport=create_afd_transport(topo.transport), alive=alive)
        self.steps = 0
        self.device_steps = FfnDeviceSteps(self)  # STEP messages (device-driven transports)
        self._timings: list = []  # (start, end) CUDA events of computations not yet read
        self._gpu_us = None  # GPU microseconds of the latest finished computation

    @property
    def expert_ids(self) -> list[int]:
        """Experts held now (the same for every layer)."""
        return next(iter(self.shards.values())).expert_ids

    def place(self, expert_ids: list[int], version: int) -> None:
        """Hold exactly ``expert_ids`` from now on (weights of experts already held are kept, new ones loaded)."""
        from sglang.srt.afd.experts import ExpertShard, load_expert_weights

        old = self.expert_ids
        new = [e for e in expert_ids if e not in old]
        fresh = {sh.spec.layer: sh for sh in load_expert_weights(self.mc, self.specs, new, self.load_format,
                                                                 self.device, self.seed)} if new else {}
        for layer, sh in list(self.shards.items()):
            w13, w2 = [], []
            for e in expert_ids:
                src, i = (sh, old.index(e)) if e in old else (fresh[layer], new.index(e))
                w13.append(src.w13[i])
                w2.append(src.w2[i])
            self.shards[layer] = ExpertShard(sh.spec, expert_ids, torch.stack(w13), torch.stack(w2))
        self.version = version
        logger.info("FFN worker %d: placement v%d, experts %s (loaded %s)", self.index, version, expert_ids, new)

    def serve_once(self, timeout_s: float = 1.0) -> bool:
        """Receive and answer everything waiting (see the module docstring); False when nothing came."""
        try:
            first = self.ep.recv(timeout_s=timeout_s)
        except TimeoutError:
            return False
        first.tensors = [t.clone() for t in first.tensors]  # the receive buffer is reused by the next recv
        msgs = [first]
        while (more := self.ep.recv_nowait()) is not None:  # data only: a waiting control message never blocks
            more.tensors = [t.clone() for t in more.tensors]
            msgs.append(more)
        by_layer = defaultdict(list)
        for m in msgs:
            op = m.meta[0]
            if op == DISPATCH:
                by_layer[m.meta[1]].append(m)
            elif op == STEP:  # a device-driven step: its dispatches follow without headers (afd.device_m2n)
                self.device_steps.run(m.src, [int(n) for n in m.tensors[1][:, 0].tolist()])
            elif op == PLACE:
                self.place([int(e) for e in m.tensors[1][:, 0].tolist()], m.meta[3])
                self._reply(m.src, [torch.zeros(0, self.specs[0].hidden, dtype=self.mc.dtype, device=self.device)],
                            (PLACED, 0, 0, self.version))
            else:
                logger.warning("FFN worker %d ignores op %d from %d", self.index, op, m.src)
        for layer, group in by_layer.items():
            t0 = time.perf_counter()
            try:
                shard = self.shards.get(layer)
                if shard is None:
                    raise ValueError(f"layer {layer} is not a MoE layer of this model")
                x, ids, w = (torch.cat([m.tensors[i] for m in group]) if len(group) > 1 else group[0].tensors[i]
                             for i in range(3))  # one message: its (private) tensors as they are
                ev = self._mark()
                out = shard.compute(x, ids, w)
                us = self._compute_us(t0, ev)
                for m, o in zip(group, torch.split(out, [m.tensors[0].shape[0] for m in group])):
                    self._reply(m.src, [o], (RESULT, layer, m.meta[2], self.version, us))
            except ValueError as e:
                logger.error("FFN worker %d: %s", self.index, e)
                for m in group:
                    self._reply(m.src, [torch.zeros(0, self.specs[0].hidden, dtype=self.mc.dtype,
                                                    device=self.device)], (ERROR, layer, m.meta[2], self.version))
        self.steps += 1
        return True

    def _mark(self):
        """A timed CUDA event recorded now on the current stream (None off CUDA)."""
        if self.device.type != "cuda":
            return None
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def _compute_us(self, t0: float, ev0) -> int:
        """The expert-compute microseconds reported as Tf: on CUDA the GPU time (CUDA events) of the latest
        computation already finished on the device (this one's pair is queued and read later, so nothing waits);
        elsewhere, or before any has finished, the host time since ``t0``."""
        host = int((time.perf_counter() - t0) * 1e6)
        if ev0 is None:
            return host
        self._timings.append((ev0, self._mark()))
        while self._timings and self._timings[0][1].query():
            e0, e1 = self._timings.pop(0)
            self._gpu_us = int(e0.elapsed_time(e1) * 1e3)
        del self._timings[:-64]
        return self._gpu_us if self._gpu_us is not None else host

    def _reply(self, dst: int, tensors, meta) -> None:
        self.ep.send(dst, tensors, meta)


def run_ffn_worker(spec, ready_pipe, parent_watch=None) -> None:
    """Entry point of an FFN worker, carrying out its :class:`~sglang.srt.deployment.plan.WorkerSpec` (role ``ffn``,
    index ``spec.rank``, ``spec.device``, the topology in ``spec.wiring.afd_topology``): load its experts (the static
    EP block, ``E / N_E`` experts), report ``{"status": "ready"|"error", ...}`` on ``ready_pipe``, then serve until
    the launcher is gone or the group closes. Any failure after start exits the process (the launcher's watchdog
    reports it)."""
    from sglang.srt.utils.common import configure_logger

    server_args, topo, index, device = spec.args, spec.wiring.afd_topology, spec.rank, spec.device

    configure_logger(server_args.log_level, f"FFN{index}")
    if threading.current_thread() is threading.main_thread():  # a Ray actor runs us on one of its threads
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    try:
        from sglang.srt.afd.experts import moe_layer_specs
        from sglang.srt.afd.load_balance import static_placement
        from sglang.srt.configs.model_config import ModelConfig

        mc = ModelConfig.from_path(server_args.model_path, server_args.context_length, server_args.dtype,
                                   server_args.resolved_device)
        specs = moe_layer_specs(mc)
        held = static_placement(specs[0].num_experts, topo.num_ffn).worker_experts()[index]
        torch.manual_seed(server_args.random_seed)
        alive = parent_watch.parent_alive if parent_watch is not None else None
        server = FfnServer(mc, specs, held, server_args.load_format, torch.device(device), topo, index, alive)
    except Exception as e:
        logger.error("FFN worker %d failed to start: %s\n%s", index, e, traceback.format_exc())
        ready_pipe.send({"status": "error", "message": f"FFN worker {index}: {type(e).__name__}: {e}"})
        return
    nbytes = sum(sh.w13.numel() * sh.w13.element_size() + sh.w2.numel() * sh.w2.element_size()
                 for sh in server.shards.values())
    logger.info("role ffn holds %d parameter bytes (%.1f MiB, routed experts only) and 0 KV bytes", nbytes,
                nbytes / 2**20)
    ready_pipe.send({"status": "ready", "experts": held, "pid": os.getpid(), "param_bytes": nbytes})
    logger.info("FFN worker %d (pid %d) serving experts %s of %d MoE layers on %s", index, os.getpid(), held,
                len(specs), device)
    try:
        while parent_watch is None or parent_watch.parent_alive():
            server.serve_once(timeout_s=1.0)
    except ConnectionError as e:
        logger.info("FFN worker %d stops: %s", index, e)
    finally:
        server.ep.close()
