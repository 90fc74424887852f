"""The serving benchmark tools on CPU: ``serving_runs.py``'s case specs, SGLang CI bars and server-log facts, and
``sched_sim.py``'s cost model and a small simulated run through the real scheduler (cheap: 12 short requests)."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmark" / "serving"))
import sched_sim  # noqa: E402
import serving_runs  # noqa: E402


def test_case_spec_parsing_and_errors():
    c = serving_runs.Case.parse("old|SGLANG_DECODE_SPLIT_POLICY=wave A=1|--mem-fraction-static 0.85|offline,online")
    assert (c.name, c.env, c.flags, c.workloads) == ("old", {"SGLANG_DECODE_SPLIT_POLICY": "wave", "A": "1"},
                                                     ["--mem-fraction-static", "0.85"], ["offline", "online"])
    assert serving_runs.Case.parse("new|||offline").env == {}
    for bad in ("new||offline", "New|||offline", "x|NOEQUALS||offline", "x|||warmup", "x|||"):
        with pytest.raises(ValueError, match="--case"):
            serving_runs.Case.parse(bad)


def test_bars_follow_sglang_ci_and_ours():
    tri = serving_runs.Case.parse("t||--attention-backend triton --context-length 8192|offline")
    assert serving_runs.bar_key(tri, "offline") == "offline_triton8k"
    assert serving_runs.bar_key(serving_runs.Case.parse("n|||offline"), "offline") == "offline"
    b = serving_runs.check_bars("offline", {"output_throughput": 4200.0})["output_throughput"]
    assert b["meets_sglang"] and not b["meets_ours"] and b["our_bar"] == "> 4400"
    on = serving_runs.check_bars("online", {"median_e2e_latency_ms": 8000.0, "median_ttft_ms": 70.0,
                                            "median_itl_ms": None})
    assert on["median_e2e_latency_ms"]["meets_ours"] and not on["median_ttft_ms"]["meets_ours"]
    assert on["median_ttft_ms"]["meets_sglang"] and not on["median_itl_ms"]["meets_sglang"]


def test_server_facts_from_log():
    log = ("model x loaded on cuda (bf16, role aggregated); KV cache 437000 tokens (53.3 MiB), max running requests "
           "1024; ... CUDA graphs up to batch 256\nactivation reserve 4100 MiB: ...\ncaptured CUDA graphs for decode "
           "batch sizes [1] in 12.5 s (100 MiB)\n")
    assert serving_runs.server_facts(log) == {"kv_tokens": 437000, "graph_max_bs": 256, "reserve_mib": 4100,
                                              "capture_s": 12.5, "max_running": 1024}


def test_cost_model_roofline():
    cm = sched_sim.CostModel(decode_eff=1.0, eager_ms=2.0)
    dec = SimpleNamespace(prefix_lens=[999, 99], extend_lens=[1, 1], seq_lens=[1000, 100])
    floor = (cm.weight_bytes + 1100 * cm.kv_bytes) / cm.bw * 1e3
    assert cm.forward_ms(dec, graph_max_bs=2) == pytest.approx(floor)
    assert cm.forward_ms(dec, graph_max_bs=1) == pytest.approx(floor + 2.0)  # above the largest graph: eager
    pre = SimpleNamespace(prefix_lens=[0], extend_lens=[8192], seq_lens=[8192])
    want = 2 * cm.matmul_params * 8192 / (cm.gemm_tflops * 1e12) * 1e3 + \
        4.0 * 8192 * 4096 * cm.attn_flop_unit / (cm.attn_tflops * 1e12) * 1e3
    assert cm.forward_ms(pre, 256) == pytest.approx(want)


def test_small_simulation_runs_the_real_scheduler():
    reqs = sched_sim.workload(12, 300, 40, seed=3)
    assert reqs == sched_sim.workload(12, 300, 40, seed=3) and all(1 <= len(p) <= 300 for p, _ in reqs)
    cost = sched_sim.CostModel()
    a = sched_sim.run_case({"pool": "4000", "graph": "4", "chunk": "256", "chunk_cache": "0"}, reqs, cost)
    b = sched_sim.run_case({"pool": "4000", "graph": "4", "chunk": "256", "chunk_cache": "1"}, reqs, cost)
    assert a["waits"] > 0 and b["waits"] == 0 and b["s"] < a["s"]  # waiting for chunk results costs host gaps
    assert a["eager"] > 0 and 0 < a["prefill_share"] < 1 and a["tok_s"] > 0



def test_ci_headline_holds_each_throughput_row_to_sglangs_bar():
    wr = {"bars": serving_runs.check_bars("offline", {"output_throughput": 4535.4})}
    bar = serving_runs._throughput_bar(wr)
    assert bar == serving_runs.BARS["offline"]["output_throughput"][1]
    rows = [{"case": "fp8", "workload": "offline", "flags": "--quantization fp8", "output_throughput": 4535.4,
             "sglang_ci_throughput_bar": bar},
            {"case": "new", "workload": "online", "flags": "", "output_throughput": 950.0,
             "sglang_ci_throughput_bar": serving_runs._throughput_bar({"bars": serving_runs.check_bars("online", {})})}]
    (h,) = serving_runs.ci_headline(rows)  # the online test has no throughput bar: no headline entry
    assert h["value"] == 4535.4 and h["baseline"] == bar and h["ratio"] == round(4535.4 / bar, 3)
    assert "fp8" in h["label"] and "--quantization fp8" in h["label"]
