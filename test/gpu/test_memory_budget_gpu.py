"""On one GPU, at the defaults (no --mem-fraction-static, no --max-total-tokens) the Llama-3.1-8B
config (dummy bf16 weights) runs a static batch of 128 x 1024 prompt tokens, and the largest forward the scheduler
can form, beside a full-size KV pool, without running out of memory; the activation peak of the batch stays within
the reserve the profiling forwards measured at start."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from conftest import shared_path  # noqa: E402


@pytest.mark.gpu_extended  # the smoke test of the 8B shape at the defaults is test_server_dummy_llama8b.py
def test_llama8b_batch128_x_1k_fits_at_the_defaults():
    """The ModelRunner lives in this pytest process and takes most of the device (the default pool); test/conftest.py
    releases it after the test, pass or fail, before a later test starts a server (which sizes its KV pool from the
    device's free memory)."""
    import torch

    from sglang.bench_one_batch import chunk_size, run_latency
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.mem_cache import memory_budget as mb
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.server_args import ServerArgs

    cfg = shared_path("configs", "meta-llama--Meta-Llama-3.1-8B")
    args = ServerArgs(model_path=cfg, load_format="dummy", dtype="bfloat16", device="cuda",
                      tokenizer_path=shared_path("tokenizers", "llama3"))
    runner = ModelRunner(ModelConfig.from_path(cfg, None, "bfloat16", "cuda"), args, "cuda:0")
    dev = runner.device
    reserve = runner.activation_reserve_bytes
    kv_gib = runner.token_to_kv_pool.kv_size_bytes() / 2**30
    print(f"KV pool {runner.max_total_tokens} tokens ({kv_gib:.1f} GiB), activation reserve "
          f"{reserve / 2**20:.0f} MiB, max running {runner.max_running_requests}, "
          f"graphs up to {runner.cuda_graph_runner.max_bs if runner.cuda_graph_runner else 0}")
    assert reserve > mb.HEADROOM_BYTES  # a profile ran and measured something
    assert runner.max_total_tokens >= 128 * (1024 + 4)  # the batch fits the pool: the test does not pass vacuously
    assert runner.cuda_graph_runner is not None

    torch.cuda.synchronize(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    res0 = torch.cuda.memory_reserved(dev)
    r = run_latency(runner, 128, 1024, 4, seed=0, chunk_tokens=chunk_size(args))  # 16 prefill forwards of 8192
    assert len(r["decode_latencies"]) == 3
    assert all(len(t) >= 4 for t in r["first_tokens"])
    grew = torch.cuda.max_memory_reserved(dev) - res0
    print(f"batch 128 x 1024: prefill {r['prefill_latency']:.2f} s, activation peak {grew / 2**20:.0f} MiB")
    assert grew <= reserve, f"the run's activation peak {grew} B exceeds the measured reserve {reserve} B"

    # the largest forward the scheduler can form at these flags (chunk + decode rows + sampling) runs beside the pool
    lim = mb.forward_limits(args, runner.max_running_requests, graphs_on=True)
    torch.cuda.reset_peak_memory_stats(dev)
    res0 = torch.cuda.memory_reserved(dev)
    ids = mb.run_dummy_forward(runner, lim.max_tokens, lim.max_rows, sampled=True, kv=runner.kv_cache)
    assert ids.shape == (lim.max_rows,)
    torch.cuda.synchronize(dev)
    grew = torch.cuda.max_memory_reserved(dev) - res0
    print(f"largest step ({lim.max_tokens} tokens, {lim.max_rows} rows, sampled): peak {grew / 2**20:.0f} MiB")
    assert grew <= reserve
