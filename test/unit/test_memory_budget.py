"""The KV budget keeps the activation memory of the largest forward free (fake memory numbers),
the profiling forward's shapes, and ``bench_one_batch``'s chunked prefill (equal tokens to one forward)."""

from __future__ import annotations

import pytest
import torch

from conftest import shared_path

from sglang.bench_one_batch import StaticBatch, chunk_size, prefill_chunks
from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.mem_cache import memory_budget as mb
from sglang.srt.model_executor import worker_builder
from sglang.srt.model_executor.cuda_graph_runner import (DEFAULT_MAX_BS, capture_batch_sizes,
                                                         default_cuda_graph_max_bs)
from sglang.srt.model_executor.model_runner import ModelRunner
from sglang.srt.server_args import ServerArgs

GiB = 1 << 30


def test_kv_pool_bytes_keeps_the_larger_of_slack_and_reserve():
    # 80 GiB device, 64 GiB free after weights, f = 0.85: the slack 12 GiB dominates a 3 GiB reserve
    assert mb.kv_pool_bytes(64 * GiB, 80 * GiB, 0.85, 3 * GiB) == 64 * GiB - 12 * GiB
    # a 20 GiB reserve (large chunk / many rows) dominates the slack: the pool shrinks to keep it free
    assert mb.kv_pool_bytes(64 * GiB, 80 * GiB, 0.85, 20 * GiB) == 44 * GiB
    # the req_to_token table comes out of the pool's share, not out of the reserve
    assert mb.kv_pool_bytes(64 * GiB, 80 * GiB, 0.85, 20 * GiB, fixed_bytes=GiB) == 43 * GiB
    assert mb.kv_pool_bytes(10 * GiB, 80 * GiB, 0.85, 3 * GiB) == 0  # nothing left: 0, never negative
    # memory left beside the pool always covers the reserve, for any fake numbers
    gen = torch.Generator().manual_seed(27)
    for _ in range(200):
        total = int(torch.randint(8, 200, (1,), generator=gen)) * GiB
        free = int(torch.randint(0, total // GiB + 1, (1,), generator=gen)) * GiB
        reserve = int(torch.randint(0, 40 * 1024, (1,), generator=gen)) << 20
        f = float(torch.rand(1, generator=gen)) * 0.98 + 0.01
        kv = mb.kv_pool_bytes(free, total, f, reserve)
        assert 0 <= kv <= free
        assert kv == 0 or free - kv >= reserve
        assert kv == 0 or total - (free - kv) <= f * total + 1  # weights + KV within f of the device


@pytest.mark.parametrize("bad", [0.0, 1.0, -0.1, 1.5])
def test_kv_pool_bytes_rejects_bad_fraction(bad):
    with pytest.raises(ValueError, match="mem-fraction-static"):
        mb.kv_pool_bytes(GiB, 2 * GiB, bad, 0)
    with pytest.raises(ValueError, match="negative"):
        mb.kv_pool_bytes(GiB, 2 * GiB, 0.5, -1)


def test_forward_limits_follow_the_scheduler_rules(monkeypatch):
    args = ServerArgs(model_path="x")
    lim = mb.forward_limits(args, 1024, graphs_on=True)  # defaults: chunk 8192, graphs up to 160 (no device)
    assert (lim.max_tokens, lim.max_rows, lim.graph_max_bs) == (8192, 1024, DEFAULT_MAX_BS)
    assert lim.graph_rows_total == DEFAULT_MAX_BS  # one shared logits buffer of the largest graph
    monkeypatch.setenv("SGLANG_GRAPH_SHARED_LOGITS", "0")  # before: one logits output per captured size
    assert mb.forward_limits(args, 1024, graphs_on=True).graph_rows_total == sum(capture_batch_sizes(DEFAULT_MAX_BS))
    monkeypatch.setenv("SGLANG_GRAPH_SHARED_LOGITS", "yes")
    with pytest.raises(ValueError, match="SGLANG_GRAPH_SHARED_LOGITS"):
        mb.forward_limits(args, 1024, graphs_on=True)
    monkeypatch.delenv("SGLANG_GRAPH_SHARED_LOGITS")
    # on an 80 GB device the graph default is SGLang's 256 (fake memory numbers)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (60 * GiB, 80 * GiB))
    on_h100 = mb.forward_limits(args, 1024, graphs_on=True, device=torch.device("cuda", 0))
    assert (on_h100.graph_max_bs, on_h100.graph_rows_total) == (256, 256)
    assert mb.forward_limits(args, 100, graphs_on=True, device=torch.device("cuda", 0)).graph_max_bs == 100
    assert mb.forward_limits(args, 20000, graphs_on=False) == mb.ForwardLimits(20000, 20000)  # decode > chunk
    assert mb.forward_limits(ServerArgs(model_path="x", chunked_prefill_size=-1), 64, False).max_tokens == 16384 + 64
    small = mb.forward_limits(ServerArgs(model_path="x", chunked_prefill_size=512, cuda_graph_max_bs=24), 48, True)
    assert (small.max_tokens, small.max_rows, small.graph_max_bs, small.graph_rows_total) == (512, 48, 24, 24)
    with pytest.raises(ValueError, match="max_running"):
        mb.forward_limits(args, 0, True)


def test_graph_reserve_counts_kept_logits():
    lim = mb.ForwardLimits(8192, 1024, 160, 1000)
    assert mb.graph_reserve_bytes(5 << 20, lim, 128256) == 2 * (5 << 20) + 1000 * 128256 * 4
    assert mb.graph_reserve_bytes(5 << 20, mb.ForwardLimits(8192, 1024), 128256) == 0


def test_kv_budget_tokens_uses_the_reserve(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (64 * GiB, 80 * GiB))
    args = ServerArgs(model_path="x")  # mem_fraction_static unset: 0.88 (SGLang's TP-1 value before its heuristic)
    dev = torch.device("cuda", 0)
    per_token = 128 << 10  # Llama-3.1-8B bf16: 32 layers x 8 KV heads x 128 x 2 (K, V) x 2 bytes
    plain = worker_builder.kv_budget_tokens(args, dev, per_token, 1)
    assert plain == int(64 * GiB - int(0.12 * 80 * GiB)) // per_token
    old = worker_builder.kv_budget_tokens(ServerArgs(model_path="x", mem_fraction_static=0.85), dev, per_token, 1)
    assert old == int(64 * GiB - int(0.15 * 80 * GiB)) // per_token < plain
    big = worker_builder.kv_budget_tokens(args, dev, per_token, 16, reserve_bytes=20 * GiB, fixed_bytes=GiB)
    assert big == (43 * GiB // per_token) // 16 * 16
    fixed = ServerArgs(model_path="x", max_total_tokens=1000)
    assert worker_builder.kv_budget_tokens(fixed, dev, per_token, 1, reserve_bytes=60 * GiB) == 1000


def test_measure_activation_reserve_sums_its_parts(monkeypatch):
    calls = []

    def fake_peak(runner, tokens, rows, sampled):
        calls.append((tokens, rows, sampled))
        return 3 * GiB if sampled else 100 << 20

    class FakeRunner:
        attention_backend_name = "triton"
        model_config = type("MC", (), {"vocab_size": 1000})()

    monkeypatch.setattr(mb, "profile_peak_bytes", fake_peak)
    monkeypatch.setattr(mb, "profiling_applies", lambda runner, args: True)
    args = ServerArgs(model_path="x")
    got = mb.measure_activation_reserve(FakeRunner(), args, 1024)
    assert calls == [(8192, 1024, True), (DEFAULT_MAX_BS, DEFAULT_MAX_BS, False)]
    assert got == 3 * GiB + 2 * (100 << 20) + DEFAULT_MAX_BS * 1000 * 4 + mb.HEADROOM_BYTES
    calls.clear()
    off = ServerArgs(model_path="x", disable_cuda_graph=True)
    assert mb.measure_activation_reserve(FakeRunner(), off, 1024) == 3 * GiB + mb.HEADROOM_BYTES
    assert calls == [(8192, 1024, True)]


@pytest.fixture(scope="module")
def cpu_runner():
    path = shared_path("models", "stories260K")
    args = ServerArgs(model_path=path, device="cpu", max_total_tokens=4096, random_seed=3)
    return ModelRunner(ModelConfig.from_path(path), args, "cpu")


def test_profiling_is_off_on_cpu(cpu_runner):
    assert not mb.profiling_applies(cpu_runner, ServerArgs(model_path="x", device="cpu"))
    assert mb.measure_activation_reserve(cpu_runner, ServerArgs(model_path="x", device="cpu"), 64) == 0


def test_dummy_forward_runs_and_leaves_the_runner_untouched(cpu_runner):
    free0 = cpu_runner.kv_cache.available_size()
    gen_state = cpu_runner.sampler._generator(cpu_runner.device).get_state()
    ids = mb.run_dummy_forward(cpu_runner, 300, 17, sampled=True)
    assert ids.shape == (17,) and ids.dtype == torch.int64
    assert 0 <= int(ids.min()) and int(ids.max()) < cpu_runner.model_config.vocab_size
    assert mb.run_dummy_forward(cpu_runner, 16, 16, sampled=False).shape == (16,)
    assert cpu_runner.kv_cache.available_size() == free0
    # on the runner's own pool: its slots and rows come back
    rows0 = cpu_runner.req_to_token_pool.available_size()
    assert mb.run_dummy_forward(cpu_runner, 64, 8, sampled=True, kv=cpu_runner.kv_cache).shape == (8,)
    assert cpu_runner.kv_cache.available_size() == free0
    assert cpu_runner.req_to_token_pool.available_size() == rows0
    with pytest.raises(RuntimeError, match="free slots"):
        mb.run_dummy_forward(cpu_runner, free0 + 1, 1, sampled=False, kv=cpu_runner.kv_cache)
    assert cpu_runner.req_to_token_pool.available_size() == rows0
    assert torch.equal(cpu_runner.sampler._generator(cpu_runner.device).get_state(), gen_state)
    with pytest.raises(ValueError, match="rows"):
        mb.run_dummy_forward(cpu_runner, 4, 5, sampled=False)


def test_prefill_chunks_cover_every_token_in_order():
    assert prefill_chunks([5, 3], None) == [[(0, 0, 5), (1, 0, 3)]]
    assert prefill_chunks([5, 3], 4) == [[(0, 0, 4)], [(0, 4, 5), (1, 0, 3)]]
    assert prefill_chunks([1024] * 128, 8192) == [[(i, 0, 1024) for i in range(k, k + 8)] for k in range(0, 128, 8)]
    gen = torch.Generator().manual_seed(5)
    for _ in range(100):
        lens = torch.randint(1, 50, (int(torch.randint(1, 9, (1,), generator=gen)),), generator=gen).tolist()
        chunk = int(torch.randint(1, 60, (1,), generator=gen))
        pieces = prefill_chunks(lens, chunk)
        assert all(sum(b - a for _, a, b in p) <= chunk for p in pieces)
        flat = [x for p in pieces for x in p]
        for i, n in enumerate(lens):
            mine = [(a, b) for j, a, b in flat if j == i]
            assert mine[0][0] == 0 and mine[-1][1] == n
            assert all(x[1] == y[0] for x, y in zip(mine, mine[1:]))
    with pytest.raises(ValueError, match="chunk_tokens"):
        prefill_chunks([3], 0)
    with pytest.raises(ValueError, match="input lengths"):
        prefill_chunks([0], 4)


def test_chunk_size_follows_the_flag():
    assert chunk_size(ServerArgs(model_path="x")) == 8192
    assert chunk_size(ServerArgs(model_path="x", chunked_prefill_size=-1)) is None
    assert chunk_size(ServerArgs(model_path="x", chunked_prefill_size=100)) == 100


def test_chunked_static_prefill_equals_one_forward(cpu_runner):
    gen = torch.Generator().manual_seed(11)
    vocab = cpu_runner.model_config.vocab_size
    prompts = torch.randint(0, vocab, (4, 37), generator=gen).tolist()
    runs = []
    for chunk in (None, 50, 16):
        batch = StaticBatch(cpu_runner, prompts, 6)
        try:
            ids = batch.prefill(prompts, chunk)
            for _ in range(4):
                ids = batch.step([[t] for t in ids])
            runs.append([r.output_ids for r in batch.reqs])
        finally:
            batch.free()
    assert all(len(o) == 5 for o in runs[0])
    assert runs[1] == runs[0] and runs[2] == runs[0]


def test_graph_max_bs_default_follows_device_memory_as_sglang():
    assert default_cuda_graph_max_bs(None) == DEFAULT_MAX_BS == 160
    assert [default_cuda_graph_max_bs(g * GiB) for g in (16, 24, 40, 80, 141, 192)] == [8, 24, 32, 256, 256, 512]
    assert [default_cuda_graph_max_bs(g * GiB, tp_size=4) for g in (24, 40, 80)] == [80, 160, 512]
