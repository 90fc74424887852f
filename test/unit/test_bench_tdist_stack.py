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
                        str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
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
