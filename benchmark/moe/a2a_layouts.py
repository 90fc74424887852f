"""The all-to-all layouts of the MoE benchmark: expert parallelism by all-to-all (``--moe-a2a-backend nccl|tdist``)
installed on a loaded model, the all-to-all's own time, and its no-communication twin.

Everything here needs the token dispatcher (``sglang.srt.layers.moe.token_dispatcher``) and its installer
(``sglang.srt.expert_parallel``); :func:`skip_reason` says why a layout cannot run in this checkout or on this device.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any, Optional

import torch


def skip_reason(backend: str, device: torch.device) -> Optional[str]:
    """Why the ``a2a_<backend>`` layout cannot run here (None when it can)."""
    if importlib.util.find_spec("sglang.srt.expert_parallel") is None:
        return "expert parallelism by all-to-all (--moe-a2a-backend) is not in this checkout"
    if backend == "tdist" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return "tdist on CPU needs TRITON_INTERPRET=1 (the Triton interpreter)"
    return None


def install(model: Any, backend: str, ps: Any, device: torch.device, max_tokens: int, max_decode: int,
            model_path: str) -> Any:
    """Install ``backend``'s token dispatcher on every MoE block of ``model`` (collective over the EP group = every
    rank), sized for prefills of ``max_tokens`` and decode batches of ``max_decode`` requests; returns it."""
    from sglang.srt.deployment.plan import MoeA2aSpec
    from sglang.srt.expert_parallel.install import install_moe_a2a
    from sglang.srt.server_args import ServerArgs

    world = ps.tp_size
    args = ServerArgs(model_path=model_path, device=device.type, tp_size=world, ep_size=world,
                      moe_a2a_backend=backend, chunked_prefill_size=max_tokens, cuda_graph_max_bs=max_decode,
                      max_running_requests=max_decode)
    return install_moe_a2a(model, MoeA2aSpec(backend), ps, args, device, max_running=max_decode)


def runner_of(model: Any) -> Any:
    """The model's all-to-all runner (``block.a2a`` of its first MoE block; every block shares it)."""
    from sglang.srt.expert_parallel.install import moe_blocks

    return moe_blocks(model)[0].a2a


def loopback_of(dispatcher: Any):
    """A :class:`LoopbackDispatcher` with ``dispatcher``'s sizes."""
    return make_loopback_class()(dispatcher.config, None)


def make_loopback_class() -> type:
    """The :class:`LoopbackDispatcher` class (defined on first use: it subclasses the dispatcher contract)."""
    from sglang.srt.layers.moe.token_dispatcher.base import (
        CombineHandle,
        DispatchHandle,
        DispatchMode,
        TokenDispatcher,
        record_event,
    )

    class LoopbackDispatcher(TokenDispatcher):
        """BENCHMARK-ONLY no-communication twin of a token dispatcher (outputs are WRONG by design): every (token,
        slot) this rank dispatches goes to a LOCAL expert (global id mod E/ep), grouped by expert as a real receive,
        and comes back locally with the routing weights. The expert work of a balanced routing (low-latency calls
        padded to the fixed receive capacity, as the real buffers are) without any all-to-all: the benchmark's
        ``nocomm`` arms of the all-to-all layouts."""

        name = "loopback"

        @staticmethod
        def buffer_bytes(config) -> int:
            return 0

        def dispatch(self, x, topk_ids, topk_weights, mode):
            mode = DispatchMode(mode)
            cfg = self.config
            t, k = topk_ids.shape
            ids = topk_ids.reshape(-1) % cfg.num_local_experts
            order = torch.argsort(ids, stable=True)
            rows = x.repeat_interleave(k, dim=0)[order]
            rid, w = ids[order], topk_weights.reshape(-1)[order]
            counts = torch.bincount(ids, minlength=cfg.num_local_experts)
            if mode is DispatchMode.LOW_LATENCY and cfg.recv_capacity > rows.shape[0]:
                pad = cfg.recv_capacity - rows.shape[0]
                rows = torch.cat([rows, rows.new_zeros(pad, rows.shape[1])])
                rid = torch.cat([rid, rid.new_full((pad,), -1)])
                w = torch.cat([w, w.new_zeros(pad)])
            return DispatchHandle(mode, t, rows, rid, w, counts,
                                  num_recv=t * k if mode is DispatchMode.NORMAL else None,
                                  event=record_event(x.device), state=(order, t, k))

        def combine(self, expert_out, handle, *, weights_applied: bool = False):
            order, t, k = handle.state
            n = t * k
            y = expert_out[:n].float()
            if not weights_applied:
                y = y * handle.recv_weights[:n].unsqueeze(1)
            back = torch.empty_like(y)
            back[order] = y
            out = back.view(t, k, -1).sum(1).to(expert_out.dtype)
            return CombineHandle(out, record_event(out.device))

    return LoopbackDispatcher


def a2a_ms(model: Any, tokens: int, decode: bool, device: torch.device, warmup: int, rounds: int, barrier,
           compare_arms) -> float:
    """One dispatch + combine of the first MoE layer (this rank's share of ``tokens``, in the mode the layer would
    use; the combine returns the received rows themselves, no expert work), in ms: the all-to-all alone."""
    runner = runner_of(model)
    layer = next(l for l in model.decoder_layers if "moe_route" in l.stage_names())
    block = layer.mlp
    lo, hi = runner.scope.local_range(tokens)
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(tokens, model.config.hidden_size, generator=gen) * 0.5).to(model.config.dtype).to(device)
    mode = runner.resolve_mode("low_latency" if decode else "normal", tokens)
    disp = runner.dispatcher
    with torch.inference_mode():
        xl = x[lo:hi]
        w, ids = block.experts.route(block.gate(xl))  # routing outside the timed window

        def once() -> None:
            h = disp.dispatch(xl, ids, w, mode)
            disp.combine(h.recv_x, h).wait()

        return compare_arms({"a2a": (once, None, None)}, device, warmup, rounds, barrier)["a2a"]


def expert_rows_ms(model: Any, tokens: int, device: torch.device, warmup: int, rounds: int, barrier,
                   compare_arms) -> float:
    """The local experts on the rows this rank would receive for ``tokens`` tokens under a balanced routing (this
    rank's share times top-k rows, from the loopback dispatch), in ms (``FusedMoE.compute_rows``)."""
    runner = runner_of(model)
    layer = next(l for l in model.decoder_layers if "moe_route" in l.stage_names())
    block = layer.mlp
    lo, hi = runner.scope.local_range(tokens)
    gen = torch.Generator().manual_seed(4)
    x = (torch.randn(hi - lo, model.config.hidden_size, generator=gen) * 0.5).to(model.config.dtype).to(device)
    with torch.inference_mode():
        w, ids = block.experts.route(block.gate(x))
        h = loopback_of(runner.dispatcher).dispatch(x, ids, w, "normal")
        return compare_arms({"experts": (lambda: block.experts.compute_rows(h.recv_x, h.recv_expert_ids), None,
                                         None)}, device, warmup, rounds, barrier)["experts"]
