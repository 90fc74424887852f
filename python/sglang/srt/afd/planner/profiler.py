"""Measure the AFD performance model's pieces on this machine (MegaScale-Infer sec. 4.2: k1..k4 are fitted
from profiles of the attention and expert GEMMs at several batch sizes).

``python -m sglang.srt.afd.planner.profiler --model-path CONFIG --out prof.json [--gpu H100] [--device cuda]``

Times one decode layer's attention piece per tensor-parallel shard (QKV projection, attention over a KV
cache of ``--seq-len`` tokens, output projection, router, shared experts) at batch sizes ``b_a``, and one
routed expert's SwiGLU shard at token counts ``b_e``, with random weights in ``--dtype``.  TP shards are
timed on one device (heads and intermediate sizes divided by ``tp``); the TP all-reduce is not measured.
The JSON (schema ``sglang-afd-profile/1``) is what ``plan --profile`` reads.  On CPU it runs as a smoke
test (``--device cpu``, tiny sizes); the numbers are then the CPU's, labelled with ``--gpu``.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from typing import Optional, Sequence

from sglang.srt.afd.planner.gpu_specs import get_gpu_spec, gpu_kinds
from sglang.srt.afd.planner.model_spec import MoEModelSpec
from sglang.srt.afd.planner.perf_model import PROFILE_SCHEMA

logger = logging.getLogger(__name__)


def _timer(device):
    import torch

    def run(fn, iters: int, warmup: int) -> float:
        """Median seconds of ``fn()`` over ``iters`` runs (after ``warmup``)."""
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(iters):
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
        return statistics.median(times)

    return run


def time_attention(model: MoEModelSpec, tp: int, batch: int, seq_len: int, device, dtype,
                   iters: int = 20, warmup: int = 3) -> float:
    """Seconds of one attention-side decode layer shard for ``batch`` tokens (tensors on ``device``).

    Raises:
        ValueError: ``tp`` does not divide the attention heads.
    """
    import torch
    import torch.nn.functional as F

    if model.num_heads % tp:
        raise ValueError(f"tp={tp} does not divide num_heads={model.num_heads}")
    h, d = model.hidden_size, model.head_dim
    nq, nkv = model.num_heads // tp, max(model.num_kv_heads // tp, 1)
    g = torch.Generator(device=device).manual_seed(0)

    def rnd(*shape):
        return (torch.randn(*shape, generator=g, device=device, dtype=torch.float32) * 0.02).to(dtype)

    w_qkv, w_o = rnd(h, (nq + 2 * nkv) * d), rnd(nq * d, h)
    w_router = rnd(h, model.num_experts)
    shared = model.shared_intermediate_size // tp
    w_s13, w_s2 = (rnd(h, 2 * shared), rnd(shared, h)) if shared else (None, None)
    k_cache, v_cache = rnd(batch, nkv, seq_len, d), rnd(batch, nkv, seq_len, d)
    x = rnd(batch, h)

    def step():
        qkv = x @ w_qkv
        q = qkv[:, : nq * d].view(batch, nq, 1, d)
        o = F.scaled_dot_product_attention(q, k_cache, v_cache, enable_gqa=nq != nkv)
        y = o.reshape(batch, nq * d) @ w_o
        _ = y @ w_router
        if w_s13 is not None:
            gu = y @ w_s13
            _ = (F.silu(gu[:, :shared]) * gu[:, shared:]) @ w_s2

    with torch.inference_mode():
        return _timer(torch.device(device))(step, iters, warmup)


def time_expert(model: MoEModelSpec, tp: int, tokens: int, device, dtype, iters: int = 20, warmup: int = 3) -> float:
    """Seconds of one routed expert's SwiGLU shard (``I / tp``) on ``tokens`` tokens.

    Raises:
        ValueError: ``tp`` does not divide the expert intermediate size.
    """
    import torch
    import torch.nn.functional as F

    if model.moe_intermediate_size % tp:
        raise ValueError(f"tp={tp} does not divide moe_intermediate_size={model.moe_intermediate_size}")
    h, inter = model.hidden_size, model.moe_intermediate_size // tp
    g = torch.Generator(device=device).manual_seed(1)

    def rnd(*shape):
        return (torch.randn(*shape, generator=g, device=device, dtype=torch.float32) * 0.02).to(dtype)

    w13, w2, x = rnd(h, 2 * inter), rnd(inter, h), rnd(tokens, h)

    def step():
        gu = x @ w13
        return (F.silu(gu[:, :inter]) * gu[:, inter:]) @ w2

    with torch.inference_mode():
        return _timer(torch.device(device))(step, iters, warmup)


def profile(model: MoEModelSpec, gpu: str, device: str, tps: Sequence[int], attn_batches: Sequence[int],
            expert_tokens: Sequence[int], seq_len: int, dtype_name: str = "bfloat16", iters: int = 20) -> dict:
    """Measure all points; returns the profile dict (see module docstring)."""
    import torch

    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[dtype_name]
    dev = torch.device(device)
    out = {"schema": PROFILE_SCHEMA, "gpu": get_gpu_spec(gpu).name, "device": _device_name(dev),
           "torch": torch.__version__, "dtype": dtype_name, "seq_len": seq_len, "model": model.to_dict(),
           "attention": {}, "expert": {}}
    for tp in tps:
        if model.num_heads % tp == 0:
            out["attention"][str(tp)] = [[b, time_attention(model, tp, b, seq_len, dev, dtype, iters)]
                                         for b in attn_batches]
        if model.moe_intermediate_size % tp == 0:
            out["expert"][str(tp)] = [[t, time_expert(model, tp, t, dev, dtype, iters)] for t in expert_tokens]
        logger.info("profiled tp=%d", tp)
    return out


def _device_name(dev) -> str:
    import torch

    return torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"


def _detect_gpu(device: str) -> Optional[str]:
    import torch

    if not device.startswith("cuda") or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(torch.device(device)).upper()
    for kind in sorted(gpu_kinds(), key=len, reverse=True):
        if kind.upper() in name:
            return kind
    return None


def _ints(s: str) -> list[int]:
    try:
        vals = [int(v) for v in s.split(",") if v]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}") from None
    if not vals or min(vals) <= 0:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {s!r}")
    return vals


def main(argv: Optional[Sequence[str]] = None) -> int:
    """CLI entry point; exit status 2 with a one-line error on bad input."""
    p = argparse.ArgumentParser(prog="python -m sglang.srt.afd.planner.profiler", description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", required=True)
    p.add_argument("--out", required=True, help="profile JSON to write")
    p.add_argument("--gpu", default=None, help=f"GPU kind this machine stands for ({', '.join(gpu_kinds())}); "
                                               "detected from the CUDA device name when omitted")
    p.add_argument("--device", default="cuda")
    p.add_argument("--tp", type=_ints, default=[1, 2, 4, 8])
    p.add_argument("--attn-batch-sizes", type=_ints, default=[8, 32, 64, 128, 256])
    p.add_argument("--expert-batch-sizes", type=_ints, default=[32, 128, 256, 512, 1024, 2048])
    p.add_argument("--seq-len", type=int, default=1024, help="KV length of the timed attention (= plan --avg-seq-len)")
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--log-level", default="info")
    args = p.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        model = MoEModelSpec.from_path(args.model_path)
        gpu = args.gpu or _detect_gpu(args.device)
        if gpu is None:
            raise ValueError(f"cannot tell which GPU kind --device {args.device} is; pass --gpu "
                             f"({', '.join(gpu_kinds())})")
        if args.device.startswith("cuda"):
            import torch

            if not torch.cuda.is_available():
                raise ValueError("--device cuda but no CUDA device is visible; use --device cpu for a smoke test")
        prof = profile(model, gpu, args.device, args.tp, args.attn_batch_sizes, args.expert_batch_sizes,
                       args.seq_len, args.dtype, args.iters)
    except ValueError as e:
        sys.stderr.write(f"error: {e}\n")
        return 2
    with open(args.out, "w") as f:
        json.dump(prof, f, indent=1)
    logger.info("wrote %s", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
