"""Rank body of the token dispatcher's GPU test (``test/gpu/test_token_dispatcher_gpu.py``; imported by spawned
ranks, see tp_worker.spawn_ranks). Runs on CPU too (no streams, no CUDA graph; tdist under the interpreter) as a
dry run."""

from __future__ import annotations

import os

import torch

from ep_a2a_worker import interpreter_patch_once


def gpu_dispatcher_checks(ps, backends: list, seed: int, graph: bool = True) -> list:
    """Rank body on CUDA: for each backend, fresh random bf16 inputs (``seed``), both modes: dispatch ->
    ``FusedMoE.compute_rows`` on the Triton fused-MoE kernel -> combine, against the torch reference
    (``fused_moe_ref`` over all experts, on this rank's tokens; every rank builds every rank's inputs); NORMAL and
    LOW_LATENCY dispatched from a side stream with the expert kernel on the main stream; LOW_LATENCY also captured
    in a CUDA graph and replayed on new inputs copied into the static ones. Returns records (name, max abs error,
    reference scale). Runs on CPU too (no streams, no graph; tdist under the interpreter), as a dry run."""
    import contextlib

    from sglang.srt.layers.moe.fused_moe import FusedMoE
    from sglang.srt.layers.moe.token_dispatcher import DispatcherConfig, DispatchMode, create_token_dispatcher
    from sglang.srt.ops_ref import fused_moe_ref

    world, rank = ps.tp_size, ps.tp_rank
    dev = ps.torch_device()
    group = ps.ep_group if ps.ep_group is not None else ps.device_group
    e, k, h, inter, cap = 8 * world, 4, 256, 128, 32
    dt = torch.bfloat16
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(e, 2 * inter, h, generator=g) * 0.05).to(dt)
    w2 = (torch.randn(e, h, inter, generator=g) * 0.05).to(dt)
    moe = FusedMoE(e, k, h, inter, params_dtype=dt, tp_rank=rank, tp_size=world, ep_size=world).to(dev)
    lo = moe.expert_start
    with torch.no_grad():
        moe.w13_weight.copy_(w13[lo:lo + moe.num_local_experts])
        moe.w2_weight.copy_(w2[lo:lo + moe.num_local_experts])

    def inputs(t: int):
        xs = [torch.randn(t, h, generator=g).to(dt) for _ in range(world)]
        logits = [torch.randn(t, e, generator=g) for _ in range(world)]
        routed = [torch.topk(torch.softmax(lg, -1), k, dim=-1) for lg in logits]
        return xs[rank].to(dev), routed[rank].indices.to(dev), routed[rank].values.float().to(dev)

    def reference(x, ids, w):
        return fused_moe_ref(x.cpu(), w13, w2, w.cpu(), ids.cpu()).float()

    out = []
    on_gpu = dev.type == "cuda"
    if "tdist" in backends and not on_gpu:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        interpreter_patch_once()
    side = torch.cuda.Stream(dev) if on_gpu else None

    def on_side():
        return torch.cuda.stream(side) if on_gpu else contextlib.nullcontext()

    def side_waits():
        if on_gpu:
            side.wait_stream(torch.cuda.current_stream(dev))

    for backend in backends:
        cfg = DispatcherConfig(num_experts=e, top_k=k, hidden_size=h, ep_size=world, ep_rank=rank,
                               max_tokens_normal=512, max_tokens_low_latency=cap, dtype=dt, device=str(dev))
        disp = create_token_dispatcher(backend, cfg, group)
        try:
            for mode, t in ((DispatchMode.NORMAL, 300), (DispatchMode.NORMAL, 0), (DispatchMode.LOW_LATENCY, cap),
                            (DispatchMode.LOW_LATENCY, 5)):
                x, ids, w = inputs(t)
                side_waits()
                with on_side():  # communication on the side stream
                    hd = disp.dispatch(x, ids, w, mode)
                hd.wait()
                y = moe.compute_rows(hd.recv_x, hd.recv_expert_ids)
                side_waits()
                with on_side():
                    ch = disp.combine(y, hd)
                got = ch.wait().float().cpu()
                ref = reference(x, ids, w)
                out.append(dict(name=f"{backend}/{mode.value}/T{t}/side_stream", err=_maxdiff(got, ref),
                                scale=float(ref.abs().max()) if ref.numel() else 0.0))
            if graph and on_gpu:
                out.append(_graph_check(disp, moe, inputs, reference, cap, dev, f"{backend}/low_latency/graph"))
        finally:
            if on_gpu:
                torch.cuda.synchronize(dev)
            disp.close()
    return out


def _maxdiff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max()) if a.numel() else 0.0


def _graph_check(disp, moe, inputs, reference, cap: int, dev, name: str) -> dict:
    """Capture LOW_LATENCY dispatch -> experts -> combine of ``cap`` tokens in a CUDA graph, replay it twice on new
    inputs (copied into the static tensors) and compare with the reference."""
    from sglang.srt.layers.moe.token_dispatcher import DispatchMode

    sx, sids, sw = inputs(cap)
    stream = torch.cuda.Stream(dev)

    def step():
        hd = disp.dispatch(sx, sids, sw, DispatchMode.LOW_LATENCY)
        hd.wait()
        return disp.combine(moe.compute_rows(hd.recv_x, hd.recv_expert_ids), hd).wait()

    stream.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(stream):
        for _ in range(2):  # warm-up (Triton JIT, allocator)
            step()
    stream.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        static_out = step()
    errs, scale = [], 0.0
    for _ in range(2):
        x, ids, w = inputs(cap)
        sx.copy_(x)
        sids.copy_(ids)
        sw.copy_(w)
        graph.replay()
        torch.cuda.synchronize(dev)
        ref = reference(x, ids, w)
        errs.append(_maxdiff(static_out.float().cpu(), ref))
        scale = max(scale, float(ref.abs().max()))
    return dict(name=name, err=max(errs), scale=scale)
