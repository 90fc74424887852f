"""``benchmark/serving/bench_gpu_targets.py``: floor formulas, FLOP counting, table formatting, argument parsing,
and a tiny CPU smoke run of the floors/decode/prefill timing path (stories260K config, dummy weights)."""

from __future__ import annotations

import json
import os
import random
import statistics
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from conftest import load_benchmark, shared_path  # noqa: E402

bgt = load_benchmark("serving.bench_gpu_targets")


def _tiny_llama(tmp_path, rng: random.Random, tied: bool):
    """A small random Llama config folder, loaded with dummy float32 weights on CPU; returns (model, dims)."""
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_loader.loader import load_model

    kv, d = rng.choice([1, 2]), rng.choice([8, 16])
    heads = kv * rng.choice([1, 2, 4])
    dims = dict(hidden_size=rng.choice([32, 48, 64]), intermediate_size=rng.randint(40, 120), num_hidden_layers=
                rng.randint(1, 3), num_attention_heads=heads, num_key_value_heads=kv, head_dim=d,
                vocab_size=rng.randint(100, 300))
    cfg = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu", rms_norm_eps=1e-5,
               max_position_embeddings=256, rope_theta=10000.0, tie_word_embeddings=tied, torch_dtype="float32",
               bos_token_id=1, eos_token_id=2, **dims)
    folder = tmp_path / ("tied" if tied else "untied")
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(cfg))
    mc = ModelConfig.from_path(str(folder), None, "float32", "cpu")
    return load_model(mc, "dummy", "cpu"), dims


@pytest.mark.parametrize("tied", [False, True])
def test_param_stats_matches_llama_shapes(tmp_path, tied):
    rng = random.Random(tied + 7)
    model, c = _tiny_llama(tmp_path, rng, tied)
    h, i, L, H, kv, d, V = (c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], c["num_attention_heads"],
                            c["num_key_value_heads"], c["head_dim"], c["vocab_size"])
    per_layer = h * H * d + 2 * h * kv * d + H * d * h + 3 * h * i  # q, k, v, o, gate, up, down
    norms = L * 2 * h + h
    stats = bgt.model_param_stats(model)
    assert stats.layer_matmul_params == L * per_layer
    assert stats.lm_head_params == V * h
    assert stats.tied == tied
    assert stats.embed_bytes == V * h * 4
    assert stats.total_bytes == ((1 if tied else 2) * V * h + L * per_layer + norms) * 4
    # a decode step reads every weight except the (untied) embedding table
    assert stats.decode_weight_bytes == (stats.total_bytes if tied else (V * h + L * per_layer + norms) * 4)


def test_param_stats_needs_an_embedding():
    with pytest.raises(ValueError, match="embed_tokens"):
        bgt.param_stats([("model.layers.0.mlp.down_proj.weight", (4, 4), 2)])


def test_kv_bytes_matches_the_pool_formula():
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    rng = random.Random(1)
    for _ in range(5):
        kv, d, L, tokens = rng.randint(1, 8), rng.choice([64, 128]), rng.randint(1, 40), rng.randint(1, 10000)
        dt = rng.choice([torch.bfloat16, torch.float32])
        assert bgt.kv_bytes(tokens, L, kv, d, dt.itemsize) == tokens * MHATokenToKVPool.bytes_per_token(kv, d, L, dt)


def test_mean_decode_context_is_the_average_attended_length():
    rng = random.Random(2)
    for _ in range(5):
        ctx, steps = rng.randint(1, 2000), rng.randint(1, 50)
        # decode step j (0-based) writes position ctx + j and attends ctx + j + 1 tokens
        brute = sum(ctx + j + 1 for j in range(steps)) / steps
        assert bgt.mean_decode_context(ctx, steps) == pytest.approx(brute)


def test_attention_and_prefill_flops_against_brute_force():
    rng = random.Random(3)
    T, L, H, d = rng.randint(5, 60), rng.randint(1, 4), rng.randint(1, 8), rng.choice([8, 64])
    pairs = sum(1 for q in range(T) for k in range(T) if k <= q)  # causal (query, key) pairs
    attn = pairs * L * H * (2 * d + 2 * d)  # QK^T and PV: d multiply-adds each per pair
    assert bgt.attention_flops(T, L, H, d) == attn
    stats = bgt.ParamStats(total_bytes=0, embed_bytes=0, layer_matmul_params=rng.randint(1000, 9999),
                           lm_head_params=rng.randint(100, 999), tied=False)
    expect = 2 * T * stats.layer_matmul_params + 2 * stats.lm_head_params + attn
    assert bgt.prefill_flops(T, stats, L, H, d) == expect


def test_matmul_flops_matches_torch_flop_counter():
    from torch.utils.flop_counter import FlopCounterMode

    n = random.Random(4).randint(8, 40)
    a, b = torch.randn(n, n), torch.randn(n, n)
    with FlopCounterMode(display=False) as fc:
        a @ b
    assert bgt.matmul_flops(n) == fc.get_total_flops()


def test_copy_bandwidth_and_memory_floor():
    rng = random.Random(5)
    n, t = rng.randint(1, 1 << 30), rng.uniform(1e-4, 1.0)
    assert bgt.copy_bandwidth(n, t) == pytest.approx(2 * n / t)
    w, kv, bw = rng.uniform(1e9, 2e10), rng.uniform(0, 2e10), rng.uniform(1e12, 5e12)
    assert bgt.memory_floor_s(w, kv, bw) == pytest.approx((w + kv) / bw)
    with pytest.raises(ValueError, match="bandwidth"):
        bgt.memory_floor_s(w, kv, 0.0)


def test_target_row_met_and_table():
    rng = random.Random(6)
    under, over = rng.uniform(0.5, 1.29), rng.uniform(1.31, 3.0)
    rows = [bgt.TargetRow("decode a", "1 ms", "x", under, "<=", 1.3),
            bgt.TargetRow("decode b", "1 ms", "y", over, "<=", 1.3),
            bgt.TargetRow("prefill", "f", "z", under / 2, ">=", 0.6),
            bgt.TargetRow("serving", "-", "w", None, "", None)]
    assert [r.met for r in rows] == [True, False, False, None]
    lines = bgt.format_table(rows).splitlines()
    assert lines[0].startswith("| metric | floor / baseline | measured | ratio | target | met? |")
    assert len(lines) == 2 + len(rows)
    cells = [[c.strip() for c in ln.strip("|").split("|")] for ln in lines[2:]]
    assert all(len(c) == 6 for c in cells)
    assert cells[0][3] == f"{under:.2f}" and cells[0][4] == "<= 1.30" and cells[0][5] == "yes"
    assert cells[1][5] == "NO" and cells[2][4] == ">= 0.60" and cells[3][5] == "n/a" and cells[3][4] == "report"


def test_si_prefixes():
    assert bgt.si(4.8e12, "B/s") == "4.80 TB/s"
    assert bgt.si(2.5e6, "FLOP/s") == "2.50 MFLOP/s"
    assert bgt.si(12.0, "B/s") == "12.00 B/s"


def test_parse_attention_rows_reads_bench_decode_format():
    rng = random.Random(7)
    times = [rng.uniform(100, 900) for _ in range(3)]
    lines = ["| layout / config | time (us) | KV GB/s | HBM copy GB/s | ratio |", "|---|---|---|---|---|"]
    lines += [f"| {k}, splits=8 (default) | {t:.1f} | 1 | 2 | 0.5 |" for k, t in zip(("a", "b", "c"), times)]
    lines.append("| pages16, BLOCK_N=128 | failed: OutOfResources | | | |")
    rows = bgt.parse_attention_rows(lines)
    assert [r["name"] for r in rows] == ["a, splits=8 (default)", "b, splits=8 (default)", "c, splits=8 (default)"]
    assert [r["time_us"] for r in rows] == [float(f"{t:.1f}") for t in times]


def test_summarize_serving_reads_bench_serving_metrics():
    from sglang.benchmark_utils import RequestOutput, compute_metrics

    rng = random.Random(8)
    outs = []
    for _ in range(6):
        n = rng.randint(2, 9)
        outs.append(RequestOutput(success=True, prompt_len=rng.randint(5, 50), output_len=n, generated_text="x",
                                  latency=rng.uniform(0.5, 2), ttft=rng.uniform(0.01, 0.2),
                                  itl=[rng.uniform(0.001, 0.05) for _ in range(n - 1)]))
    duration = rng.uniform(2, 5)
    s = bgt.summarize_serving(json.loads(json.dumps(compute_metrics(outs, duration))))
    assert s["output_throughput"] == pytest.approx(sum(o.output_len for o in outs) / duration)
    assert s["mean_ttft_ms"] == pytest.approx(1e3 * sum(o.ttft for o in outs) / len(outs))
    assert s["median_itl_ms"] == pytest.approx(1e3 * statistics.median(x for o in outs for x in o.itl))
    assert set(bgt.SERVING_KEYS) <= set(s)
    with pytest.raises(KeyError):
        bgt.summarize_serving({"output_throughput": 1.0})


def test_parse_args_defaults_smoke_and_subsets():
    full = bgt.parse_args([])
    assert full.parts == bgt.PARTS and full.decode_batches == (1, 32, 128) and full.decode_context == 1024
    assert (full.prefill_tokens, full.attn_batch, full.attn_context, full.matmul_n) == (8192, 64, 4096, 8192)
    assert (full.serving_prompts, full.serving_concurrency, full.serving_input_len, full.serving_output_len) == \
        (256, 64, 1024, 256)
    assert full.attention_backend is None and full.device == "cuda"  # the engine's default (triton on cuda)
    assert full.model_path.endswith("meta-llama--Meta-Llama-3.1-8B")
    assert full.context_length >= full.prefill_tokens + 1
    assert full.kv_pool_tokens >= 128 * (1024 + full.decode_steps + 1)
    smoke = bgt.parse_args(["--smoke", "--prefill-tokens", "77", "--device", "cpu", "--attention-backend", "triton"])
    assert smoke.prefill_tokens == 77 and smoke.decode_context < full.decode_context and smoke.matmul_n < 8192
    assert smoke.attention_backend == "triton"
    sub = bgt.parse_args(["--only", "decode,prefill,serving", "--skip-serving", "--decode-batches", "2,3"])
    assert sub.parts == ("decode", "prefill") and sub.decode_batches == (2, 3)
    with pytest.raises(ValueError, match="--only"):
        bgt.parse_args(["--only", "decode,bogus"])
    with pytest.raises(ValueError, match="--decode-batches"):
        bgt.parse_args(["--decode-batches", "1,x"])
    with pytest.raises(ValueError, match="--decode-batches"):
        bgt.parse_args(["--decode-batches", "0"])
    with pytest.raises(ValueError, match="--hbm-gib"):
        bgt.parse_args(["--hbm-gib", "-1"])


def test_serving_commands_carry_the_target_workload():
    cfg = bgt.parse_args([])
    srv = bgt.server_command(cfg, 12345)
    for flag, val in (("--load-format", "dummy"), ("--dtype", "bfloat16"), ("--device", "cuda"), ("--port", "12345"),
                      ("--tokenizer-path", cfg.tokenizer_path), ("--model-path", cfg.model_path)):
        assert srv[srv.index(flag) + 1] == val
    assert "--attention-backend" not in srv  # the server's default, like the in-process runner
    srv = bgt.server_command(bgt.parse_args(["--attention-backend", "flashinfer"]), 1)
    assert srv[srv.index("--attention-backend") + 1] == "flashinfer"
    b = bgt.bench_serving_command(cfg, 12345, "/tmp/x.jsonl")
    for flag, val in (("--dataset-name", "random"), ("--random-input-len", "1024"), ("--random-output-len", "256"),
                      ("--random-range-ratio", "1"), ("--max-concurrency", "64"), ("--num-prompts", "256"),
                      ("--output-file", "/tmp/x.jsonl")):
        assert b[b.index(flag) + 1] == val


def test_cpu_smoke_run_writes_every_part(tmp_path):
    model = shared_path("models", "stories260K")
    argv = ["--device", "cpu", "--dtype", "float32", "--smoke", "--only", "floors,attention,decode,prefill",
            "--model-path", model, "--out", str(tmp_path), "--decode-batches", "1,3", "--prefill-tokens", "96"]
    res = bgt.run(bgt.parse_args(argv), "cmd-under-test")
    parts = res["parts"]
    assert parts["floors"]["status"] == "ok" and parts["floors"]["hbm_bytes_per_s"] > 0
    assert parts["attention"]["status"] == "error" and "cuda" in parts["attention"]["error"]  # CPU: recorded, not fatal
    assert parts["runner"]["status"] == "ok" and parts["runner"]["tied_embeddings"] is True
    dec = parts["decode"]
    assert dec["status"] == "ok" and [b["batch"] for b in dec["batches"]] == [1, 3]
    bw = parts["floors"]["hbm_bytes_per_s"]
    for b in dec["batches"]:
        assert len(b["step_latencies_s"]) == b["steps"] and b["median_step_s"] > 0
        assert b["floor_s"] == pytest.approx((b["weight_bytes"] + b["kv_read_bytes"]) / bw)
        assert b["ratio"] == pytest.approx(b["median_step_s"] / b["floor_s"])
    pre = parts["prefill"]
    assert pre["status"] == "ok" and pre["tokens"] == 96
    assert pre["flops_per_s"] == pytest.approx(pre["flops"] / pre["median_latency_s"])
    assert pre["ratio"] == pytest.approx(pre["flops_per_s"] / parts["floors"]["matmul_flops_per_s"])
    files = sorted(p.name for p in tmp_path.iterdir())
    assert len(files) == 2 and files[0].endswith("_gpu_targets.json") and files[1].endswith("_gpu_targets.md")
    saved = json.loads((tmp_path / files[0]).read_text())
    assert saved["parts"]["decode"]["batches"][1]["median_step_s"] == dec["batches"][1]["median_step_s"]
    md = (tmp_path / files[1]).read_text()
    assert "cmd-under-test" in md and "| metric | floor / baseline |" in md
    assert "decode step, batch 3 x" in md and "prefill 96 tokens" in md and "attention: error" in md


FAKE_ENV = {"git_commit": "0" * 40, "git_dirty": False, "date": "2026-12-07T12:00:00+00:00",
            "gpu": {"model": "NVIDIA H100 80GB HBM3", "count": 1, "driver": "x"}, "platform": "test",
            "versions": {"python": "3", "torch": None, "cuda": None, "nccl": None, "triton": None}}


def test_targets_record_rows_floor_and_headline(tmp_path):
    from benchmark.common import records
    from benchmark.serving.gpu_targets_record import make_targets_record

    cfg = bgt.parse_args(["--record-dir", str(tmp_path)])
    assert cfg.record_dir == str(tmp_path) and bgt.parse_args([]).record_dir is None
    res = {"command": "python benchmark/serving/bench_gpu_targets.py", "parts": {
        "floors": {"status": "ok", "hbm_bytes_per_s": 4e12, "matmul_flops_per_s": 8e14},
        "decode": {"status": "ok", "batches": [
            {"batch": b, "context": 1024, "median_step_s": s, "floor_s": 0.005, "ratio": s / 0.005}
            for b, s in ((1, 0.006), (128, 0.008))]},
        "prefill": {"status": "ok", "tokens": 8192, "flops_per_s": 4e14, "ratio": 0.5},
        "attention": {"status": "error", "error": "RuntimeError: x"},
        "serving": {"status": "ok", "output_throughput": 5000.0, "mean_ttft_ms": 100.0, "p99_ttft_ms": 300.0,
                    "mean_itl_ms": 10.0, "p99_itl_ms": 30.0}}}
    goals = {"decode": bgt.DECODE_TARGET, "prefill": bgt.PREFILL_TARGET, "attention": bgt.ATTENTION_TARGET}
    js, _ = records.write_record(make_targets_record(res, cfg, goals, env=FAKE_ENV), tmp_path)
    rec = records.load_record(js)
    assert rec["subject"] == "serving" and rec["what"] == "gpu_targets" and rec["floor"]["column"] == "floor"
    assert [r["target"] for r in rec["rows"]] == ["decode step"] * 2 + ["prefill", "bench_serving output"]
    assert [r["met"] for r in rec["rows"]] == [True, False, False, None]
    h = rec["headline"]
    assert "batch 128" in h[0]["label"] and (h[0]["value"], h[0]["baseline"], h[0]["ratio"]) == (8.0, 5.0, 1.6)
    assert (h[1]["value"], h[1]["baseline"], h[1]["ratio"]) == (400.0, 800.0, 0.5) and h[2]["value"] == 5000.0
    assert any("attention failed" in n for n in rec["notes"])
