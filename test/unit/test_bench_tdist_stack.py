"""``benchmark/tdist/bench_layer_stack.py`` (``--enable-tdist-overlap`` on a layer stack, on vs off): the smoke
run on CPU (gloo, TP 2, tiny Llama) takes the sequence-parallel path in both SP variants (2 row-parallel calls per
layer) and its outputs equal the plain TP forward's exactly (fp32, two-term sums commute); the pass rule rejects a
distance beyond the tolerance and a lost greedy token. Times are not checked (they mean nothing on CPU)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT)]


def test_smoke_runs_sequence_parallel_and_matches_plain_tp(tmp_path):
    p = subprocess.run([sys.executable, str(ROOT / "benchmark" / "tdist" / "bench_layer_stack.py"), "--smoke", "--results-dir",
                        str(tmp_path), "--record-dir", str(tmp_path / "rec")], capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    from benchmark.common.records import load_record

    (rec,) = [load_record(f) for f in (tmp_path / "rec" / "tdist").glob("*_tdist_stack_smoke_cpu.json")]
    assert [r["tokens"] for r in rec["rows"]] == [64, 130] and rec["headline"][0]["ratio"] is not None
    (md,), (js,) = list(tmp_path.glob("*_tdist_stack_smoke.md")), list(tmp_path.glob("*_tdist_stack_smoke.json"))
    text = md.read_text()
    assert "- date: " in text and "- hardware: " in text and "- command: " in text
    per_rank = json.loads(js.read_text())
    assert len(per_rank) == 2 and per_rank[0]["off_executor"] == "sequential"
    for t in ("64", "130"):
        for rank in per_rank:
            for chk in rank[t]["check"]:
                assert "tdist: 8 linear_rs calls per forward" in chk["paths"]  # 4 layers x (o_proj, down)
                assert "sp_nccl: 8 linear_rs calls per forward" in chk["paths"]
                assert "ref32: 8 linear_rs calls per forward" in chk["paths"]
                for v in ("tdist", "sp_nccl", "ref32"):
                    assert chk[v]["rel_l2"] == 0.0 and chk[v]["greedy_equal"] == chk[v]["greedy_n"] > 0
            assert all(rank[t]["time"][v]["gpu"] > 0 for v in ("off", "tdist", "sp_nccl"))
    assert text.count("| yes (rel L2 vs ref32: 0.000e+00) |") == 2 and "| NO " not in text


def _per_rank(tdist_l2: float, sp_l2: float, tdist_equal: int = 10, ref_l2: float = 0.0) -> list:
    one = lambda l2, eq=10: {"rel_l2": l2, "max_abs_rel": l2, "greedy_equal": eq, "greedy_n": 10,  # noqa: E731
                             "flip_margin": None}
    chk = {"tdist": one(tdist_l2, tdist_equal), "sp_nccl": one(sp_l2), "ref32": one(ref_l2), "tdist_vs_ref32": 0.0,
           "paths": [], "wall_ms": {v: 1.0 for v in ("off", "tdist", "sp_nccl", "ref32")}}
    tm = {v: {"gpu": 1.0, "host": 1.0} for v in ("off", "tdist", "sp_nccl")}
    return [{"8": {"check": [chk, chk], "time": tm}}]


def test_pass_rule():
    from benchmark.tdist.bench_layer_stack import BF16_U, _worst

    assert _worst(_per_rank(1e-3, 1e-3), 8)["check"]["pass"]
    assert _worst(_per_rank(1.9e-2, 1e-2), 8)["check"]["pass"]  # within 2x the reassociation floor
    assert not _worst(_per_rank(2.1e-2, 1e-2), 8)["check"]["pass"]
    assert _worst(_per_rank(1.9e-2, 0.0, ref_l2=1e-2), 8)["check"]["pass"]  # within 2x off's own rounding error
    assert not _worst(_per_rank(2.1e-2, 0.0, ref_l2=1e-2), 8)["check"]["pass"]
    assert _worst(_per_rank(2 * BF16_U, 0.0), 8)["check"]["pass"]  # exact baselines: 2 bf16 unit roundoffs
    assert not _worst(_per_rank(2.01 * BF16_U, 0.0), 8)["check"]["pass"]
    assert _worst(_per_rank(0.0, 0.0, tdist_equal=9), 8)["check"]["pass"]  # one flip more than the floor's
    assert not _worst(_per_rank(0.0, 0.0, tdist_equal=8), 8)["check"]["pass"]


def test_stack_record_carries_baselines_ratios_headline(tmp_path):
    """--record-dir: per T the slowest rank's times, off and sp_nccl as baselines, off / tdist as the ratio and the
    headline at the largest T, with the output check."""
    from types import SimpleNamespace

    from benchmark.common import records
    from benchmark.tdist.bench_layer_stack import stack_record

    per_rank = _per_rank(1e-3, 1e-3)
    per_rank[0]["16"] = json.loads(json.dumps(per_rank[0]["8"]))
    per_rank[0]["16"]["time"] = {"off": {"gpu": 12.0, "host": 1.0}, "tdist": {"gpu": 10.0, "host": 2.0},
                                 "sp_nccl": {"gpu": 11.0, "host": 1.5}}
    a = SimpleNamespace(model_path="/c/meta-llama--Llama-3.3-70B-Instruct", tp=4, layers=4, tokens=[8, 16, 32],
                        warmup=1, iters=2, check_positions=10, smoke=False)
    env = {"git_commit": "abc", "git_dirty": False, "date": "2026-12-07T00:00:00+00:00",
           "gpu": {"model": "NVIDIA H200", "count": 8, "driver": None}, "versions": {"python": "3"}}
    js, _ = records.write_record(stack_record(per_rank, a, env=env, command="python x.py"), tmp_path)
    rec = records.load_record(js)
    assert js.name == "2026-12-07_tdist_stack_4xh200.json" and rec["baselines"] == ["off_ms", "sp_nccl_ms"]
    assert [r["tokens"] for r in rec["rows"]] == [8, 16] and rec["rows"][0]["pass"] is True
    assert rec["rows"][1]["off_over_tdist"] == 1.2 and rec["rows"][1]["sp_nccl_over_tdist"] == 1.1
    (h,) = rec["headline"]
    assert (h["value"], h["baseline"], h["ratio"]) == (10.0, 12.0, 1.2) and "T=16" in h["label"]
