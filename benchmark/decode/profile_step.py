"""Where does a decode step's time go? GPU kernel time vs host overhead, top kernels.

For each batch size: prefill a static batch (1K context, dummy Llama-3.1-8B bf16 weights by default), then
time decode steps three ways: the whole step as bench_gpu_targets measures it (host batch building +
forward + sampling, synchronized), the GPU time of the step (CUDA events), and a torch.profiler trace whose
kernel table shows what the GPU runs. Prints tables; writes nothing else.

Usage: python benchmark/decode/profile_step.py [--batches 1 128] [--context 1024] [--steps 8]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from sglang.srt.utils.nvls_env import NVLS_OFF_ENV  # noqa: E402  (pure Python: no torch/CUDA import)

os.environ.update(NVLS_OFF_ENV)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the benchmark package

import torch  # noqa: E402

from sglang.bench_one_batch import StaticBatch  # noqa: E402

DEFAULT_MODEL = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "..", "shared", "data",
                             "configs", "meta-llama--Meta-Llama-3.1-8B")


def profile_batch(runner, bs: int, context: int, steps: int, top: int) -> None:
    """Prefill a random ``bs`` x ``context`` batch, time ``steps`` decode steps (wall and CUDA events), profile three
    more, and print the top ``top`` CUDA kernels and host ops. Needs CUDA."""
    gen = torch.Generator().manual_seed(bs)
    prompts = torch.randint(0, runner.model_config.vocab_size, (bs, context), generator=gen).tolist()
    batch = StaticBatch(runner, prompts, steps * 3 + 4)
    try:
        ids = batch.step(prompts)
        for _ in range(2):  # warm up
            ids = batch.step([[t] for t in ids])
        torch.cuda.synchronize()
        wall, gpu = [], []
        for _ in range(steps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            w0 = time.perf_counter()
            start.record()
            ids = batch.step([[t] for t in ids])
            end.record()
            torch.cuda.synchronize()
            wall.append(time.perf_counter() - w0)
            gpu.append(start.elapsed_time(end) / 1e3)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                ids = batch.step([[t] for t in ids])
            torch.cuda.synchronize()
    finally:
        batch.free()
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    kernel_us = sum(e.self_device_time_total for e in events) / 3
    print(f"\n## batch {bs} x context {context}: step wall median {statistics.median(wall) * 1e3:.3f} ms, "
          f"CUDA-event span {statistics.median(gpu) * 1e3:.3f} ms, summed kernel time {kernel_us / 1e3:.3f} ms/step")
    print("| kernel | calls/step | ms/step | share |\n|---|---:|---:|---:|")
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:top]:
        t = e.self_device_time_total / 3
        print(f"| {e.key[:90]} | {e.count / 3:.0f} | {t / 1e3:.3f} | {t / max(kernel_us, 1e-9):.1%} |")
    cpu = sorted((e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CPU),
                 key=lambda e: -e.self_cpu_time_total)[:top]
    print("\n| host op | calls/step | self ms/step |\n|---|---:|---:|")
    for e in cpu:
        print(f"| {e.key[:90]} | {e.count / 3:.0f} | {e.self_cpu_time_total / 3 / 1e3:.3f} |")


def main() -> int:
    """CLI entry: build a dummy-weight bf16 runner on CUDA and profile each batch size; returns 0."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-path", default=DEFAULT_MODEL)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 128])
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--top", type=int, default=15)
    a = p.parse_args()
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.server_args import ServerArgs

    sa = ServerArgs(model_path=a.model_path, load_format="dummy", dtype="bfloat16", device="cuda",
                    context_length=a.context + 64, max_total_tokens=max(a.batches) * (a.context + 64) + 4096)
    runner = ModelRunner(ModelConfig.from_path(sa.model_path, sa.context_length, sa.dtype, "cuda"), sa, "cuda")
    print(f"backend {getattr(runner, 'attention_backend_name', '?')}, "
          f"CUDA graphs {getattr(runner, 'cuda_graph_runner', None) is not None}")
    for bs in a.batches:
        profile_batch(runner, bs, a.context, a.steps, a.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
