"""benchmark/tdist/bench_kernels.py on CPU: argument validation, Llama TP shapes from the real config, and the ratio table (max over
ranks, baseline / best tdist, unavailable baselines shown as '-' with the reason)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmark.tdist import bench_kernels as bench_tdist  # noqa: E402
from benchmark.tdist.kernels_lib import UNAVAILABLE_SHARED, llama_shapes, table  # noqa: E402


def test_llama_tp8_shapes(tmp_path):
    cfg = Path(bench_tdist.DEFAULT_CONFIG)
    if not cfg.is_file():
        cfg = tmp_path / "config.json"
        cfg.write_text('{"hidden_size": 8192, "intermediate_size": 28672, "num_attention_heads": 64, '
                       '"num_key_value_heads": 8}')
    s = llama_shapes(str(cfg), 8)
    assert s == {"qkv": ("ag", 8192, 1280), "gate_up": ("ag", 8192, 7168), "o_proj": ("rs", 1024, 8192),
                 "down": ("rs", 3584, 8192)}


def test_parse_args_rejects_bad_values(tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text("{}")
    with pytest.raises(SystemExit):
        bench_tdist.parse_args(["--world", "1", "--config", str(cfg)])
    with pytest.raises(SystemExit):
        bench_tdist.parse_args(["--world", "4", "--tokens", "2", "--config", str(cfg)])
    with pytest.raises(SystemExit):
        bench_tdist.parse_args(["--config", str(tmp_path / "missing.json")])
    a = bench_tdist.parse_args(["--world", "2", "--share-gpu", "--config", str(cfg)])
    assert a.world == 2 and a.share_gpu


def test_table_ratios_use_slowest_rank_and_best_tdist():
    r0 = [{"op": "AG-GEMM", "shape": "qkv", "M": 1024, "tdist_sm": 1.0, "tdist_decomp": 0.5, "torch_seq": 0.9,
           "symm_fused": 1.2, "cublas_only": 0.3, "plan": 4, "decomp_p1": 0.7},
          {"op": "all-to-all", "shape": "H=7168", "M": 128, "tdist_sm": 0.2, "torch_seq_note": UNAVAILABLE_SHARED}]
    r1 = [{"op": "AG-GEMM", "shape": "qkv", "M": 1024, "tdist_sm": 1.1, "tdist_decomp": 0.6, "torch_seq": 1.2,
           "symm_fused": 1.5, "cublas_only": 0.4, "plan": 4, "decomp_p1": 0.8},
          {"op": "all-to-all", "shape": "H=7168", "M": 128, "tdist_sm": 0.25, "torch_seq_note": UNAVAILABLE_SHARED}]
    lines = table([r0, r1])
    assert len(lines) == 4
    ag = lines[2].split("|")
    assert ag[4].strip() == "1.100" and ag[5].strip() == "0.600" and ag[6].strip() == "-" and ag[7].strip() == "1.200"
    assert ag[10].strip() == "2.00x" and ag[11].strip() == "2.50x"
    assert ag[13].strip() == "4 pieces, 1: 0.800"  # the planned piece count, other counts' slowest-rank ms
    a2a = lines[3]
    assert "| - |" in a2a and "NCCL refuses duplicate GPUs" in a2a


def test_table_ratios_use_the_auto_op_when_measured():
    rows = [[{"op": "GEMM-RS", "shape": "o_proj", "M": 8192, "tdist_decomp": 0.57, "tdist_auto": t, "torch_seq": 0.68,
              "symm_fused": 0.56, "auto_path": "symm"}] for t in (0.55, 0.56)]
    rs = table(rows)[2].split("|")
    assert rs[6].strip() == "0.560 (symm)" and rs[11].strip() == "1.00x" and rs[10].strip() == "1.21x"


def test_kernels_record_carries_baselines_ratios_headline(tmp_path):
    """--record-dir: slowest-rank times, tdist = the auto op where measured, NCCL + cuBLAS / symm-mem as baselines,
    cuBLAS alone as the floor; headline per AG-GEMM / GEMM-RS: the worst shape at the largest M."""
    from types import SimpleNamespace

    from benchmark.common import records

    def rank(scale):
        return [{"op": "AG-GEMM", "kind": "ag", "shape": "qkv", "M": 8192, "tdist_sm": 2.0 * scale,
                 "tdist_decomp": 1.0 * scale, "torch_seq": 1.3 * scale, "cublas_only": 0.8},
                {"op": "AG-GEMM", "kind": "ag", "shape": "gate_up", "M": 8192, "tdist_decomp": 2.0 * scale,
                 "torch_seq": 2.2 * scale, "symm_fused": 2.4, "cublas_only": 1.5},
                {"op": "GEMM-RS", "kind": "rs", "shape": "o_proj", "M": 8192, "tdist_decomp": 0.57,
                 "tdist_auto": 0.56, "torch_seq": 0.68, "symm_fused": 0.56, "auto_path": "symm"},
                {"op": "all-to-all", "kind": "a2a", "shape": "H=7168", "M": 128, "tdist_sm": 0.2}]
    a = SimpleNamespace(world=2, tp_shapes=8, tokens=[8192], a2a_tokens=[128], a2a_hidden=7168, ops=["qkv"],
                        iters=30, variants=["sm", "decomp", "auto"], config="/x/Llama/config.json")
    env = {"git_commit": "abc", "git_dirty": False, "date": "2026-12-07T00:00:00+00:00",
           "gpu": {"model": "NVIDIA H100 80GB HBM3", "count": 8, "driver": None}, "versions": {"python": "3"}}
    js, _ = records.write_record(bench_tdist.kernels_record([rank(1.0), rank(1.1)], a, False, env=env,
                                                            command="python benchmark/tdist/bench_kernels.py"),
                                 tmp_path)
    rec = records.load_record(js)
    assert js.name == "2026-12-07_tdist_kernels_2xh100.json" and rec["mode"] == "sm,decomp,auto"
    assert rec["baselines"] == ["torch_seq_ms", "symm_fused_ms"] and rec["floor"]["column"] == "cublas_only_ms"
    qkv, gate_up, rs, a2a = rec["rows"]
    assert qkv["tdist_ms"] == 1.1 and qkv["nccl_over_tdist"] == 1.3 and rs["tdist_ms"] == 0.56
    assert a2a["tdist_ms"] == 0.2 and a2a["nccl_over_tdist"] is None
    ag, rsh = rec["headline"]
    assert (ag["value"], round(ag["baseline"], 6), ag["ratio"]) == (2.2, 2.42, 1.1) and "gate_up" in ag["label"]
    assert (rsh["value"], rsh["ratio"]) == (0.56, 1.214) and "GEMM-RS" in rsh["label"]


def test_status_table_against_the_tdist_targets():
    from benchmark.tdist.targets_status import parse, status

    rows = [[{"op": "AG-GEMM", "shape": "gate_up K=8192 N=14336", "M": 8192, "tdist_decomp": 2.7, "tdist_auto": 2.65,
              "auto_path": "decomp", "auto_pieces": 2, "torch_seq": 3.08, "symm_fused": 2.8},
             {"op": "GEMM-RS", "shape": "o_proj K=2048 N=8192", "M": 8192, "tdist_decomp": 0.57, "tdist_auto": 0.56,
              "auto_path": "symm", "torch_seq": 0.68, "symm_fused": 0.55},
             {"op": "GEMM-RS", "shape": "down K=7168 N=8192", "M": 2048, "tdist_decomp": 0.49, "tdist_auto": 0.41,
              "auto_path": "nccl", "torch_seq": 0.40, "symm_fused": 0.54},
             {"op": "all-to-all", "shape": "H=7168 random counts", "M": 1024, "tdist_sm": 0.09, "torch_seq": 0.072}]]
    st = status(parse("\n".join(table(rows))))
    assert st[2].startswith("| AG-GEMM >= 1.15x") and st[2].endswith("| yes |")  # 3.08 / 2.65 = 1.16x
    assert st[3].endswith("| yes |")  # 2.8 / 2.65
    assert st[4].startswith("| GEMM-RS >= 1.1x") and st[4].endswith("| yes |")  # 0.68 / 0.56 = 1.21x
    assert "fallback to the fused op" in st[5]
    assert st[6].endswith("| yes (fallback) |")  # 0.98x but the auto op took NCCL + cuBLAS
    assert "1.25x NCCL time" in st[7] and st[7].endswith("| yes |")


def test_status_reads_only_the_results_table():
    """The bench file also holds a profile table (same first columns op / shape / M) and notes broken over lines:
    tdist_status must read only the results table's rows (at world 4 the profile rows came out as bogus
    targets), and the table writer keeps a note on one line."""
    from benchmark.tdist.kernels_lib import table
    from benchmark.tdist.call_profile import profile_lines
    from benchmark.tdist.targets_status import parse, status

    rows = [{"op": "AG-GEMM", "shape": "qkv K=8192 N=2560", "M": 8192, "tdist_decomp": 0.64, "tdist_auto": 0.50,
             "auto_path": "symm", "torch_seq": 0.78, "symm_fused": 0.495, "decomp_graph_note": "Err: a\nb | c",
             "profile": {"span_ms": 1.0, "idle_ms": 0.5, "what": "1 pc, ring"}},
            {"op": "GEMM-RS", "shape": "down K=7168 N=8192", "M": 8192, "tdist_decomp": 1.5, "tdist_auto": 1.49,
             "auto_path": "symm", "torch_seq": 1.73, "symm_fused": 1.42}]
    lines = table([rows])
    assert len(lines) == 4 and "Err: a b / c" in lines[2]
    text = "\n".join(["# x", "", *lines[:2], lines[2].replace("a b", "a\nb"), lines[3], "", "calibration: `{}`", "",
                      "## profile", "", *profile_lines(rows)])
    got = parse(text)
    assert [r["shape"] for r in got] == ["qkv K=8192 N=2560", "down K=7168 N=8192"]
    st = status(got)
    assert len(st) == 2 + 4 and all("8192" in line for line in st[2:])


def test_profile_summary_intervals():
    """benchmark.tdist.call_profile.summarize: GEMM / copy unions, their overlap, idle time inside the span, copy bandwidth."""
    from benchmark.tdist.call_profile import intersect, profile_lines, summarize, union

    assert union([(5, 7), (0, 2), (1, 3)]) == [(0, 3), (5, 7)]
    assert intersect([(0, 3), (5, 7)], [(2, 6)]) == 2
    ev = [{"ph": "X", "cat": "kernel", "name": "nvjet_tst_256x128", "ts": 0, "dur": 100},
          {"ph": "X", "cat": "kernel", "name": "sm90_xmma_gemm_bf16", "ts": 80, "dur": 40},
          {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy PtoP", "ts": 50, "dur": 100, "args": {"bytes": 10 ** 7}},
          {"ph": "X", "cat": "kernel", "name": "vectorized_elementwise_kernel", "ts": 300, "dur": 10},
          {"ph": "i", "cat": "kernel", "name": "marker", "ts": 999}]
    p = summarize(ev)
    assert p["span_ms"] == pytest.approx(0.31) and p["gemm_ms"] == pytest.approx(0.12)
    assert p["copy_ms"] == pytest.approx(0.1) and p["overlap_ms"] == pytest.approx(0.07)
    assert p["idle_ms"] == pytest.approx(0.31 - 0.15 - 0.01) and p["n_gemm"] == 2 and p["n_copy"] == 1
    assert p["copy_gbps"] == pytest.approx(100.0)
    assert summarize([]) == {"span_ms": 0.0}
    lines = profile_lines([{"op": "AG-GEMM", "shape": "qkv", "M": 8192, "profile": {**p, "what": "1 pc, ring"}},
                           {"op": "GEMM-RS", "shape": "down", "M": 8192, "profile": {"error": "boom"}}])
    assert "1 pc, ring" in lines[2] and "profile failed: boom" in lines[3]
