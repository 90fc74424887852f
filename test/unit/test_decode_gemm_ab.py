"""benchmark/decode/gemm_ab.py on CPU (stories260K, eager): both graph sets are captured with the autotune switch
0 then 1 (and the environment restored), each serving run uses its set with that set's table installed on every
linear, the order alternates, rows carry served and replay ratios, and a failed profile is reported, not raised."""

from __future__ import annotations

import os
import sys
import types

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))
from conftest import shared_path  # noqa: E402


class FakeTable:
    tune_s = 1.5

    def lookup(self, n, k, dtype, m):
        return None

    def describe(self):
        return ["N=8 K=8 bfloat16 M<=1: cublas 1.0 us, skinny - -> cublas"]


class FakeGraphs:
    """Stands in for a CudaGraphRunner: never replays (the runner runs eagerly), records which table the model's
    linears hold at each forward."""

    def __init__(self, runner, sizes, table):
        self.runner, self.sizes, self.decode_gemm_table, self.seen = runner, sizes, table, []
        self.seq_lens = torch.full((max(sizes),), 40, dtype=torch.int64)
        self.graphs = {}

    def padded_size(self, bs):
        return min(s for s in self.sizes if s >= bs)

    def can_run(self, batch):
        from sglang.srt.layers.linear import LinearBase

        tables = {id(m.decode_gemm) for m in self.runner.model.modules() if isinstance(m, LinearBase)}
        self.seen.append(tables == {id(self.decode_gemm_table)})
        return False


@pytest.fixture(scope="module")
def runner():
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.server_args import ServerArgs

    path = shared_path("models", "stories260K")
    args = ServerArgs(model_path=path, device="cpu", max_total_tokens=4096, random_seed=3)
    return ModelRunner(ModelConfig.from_path(path), args, "cpu")


def test_gemm_ab_alternates_sets_with_their_tables(runner, monkeypatch):
    from benchmark.decode import gemm_ab as ab

    from sglang.srt.layers import decode_gemm

    monkeypatch.delenv(decode_gemm.AUTOTUNE_ENV, raising=False)
    captured, replays = [], []

    def capture(r, sizes):
        on = os.environ.get(decode_gemm.AUTOTUNE_ENV) == "1"
        captured.append((on, list(sizes), FakeGraphs(r, sizes, FakeTable() if on else None)))
        return captured[-1][2]

    def replay_ms(g, bs):
        replays.append(g.decode_gemm_table is not None)
        return 2.0

    cfg = types.SimpleNamespace(batches=[1, 3], seed=0, context=24, serving_reps=2, serving_warmup=1,
                                serving_steps=3, model_path=shared_path("models", "stories260K"))
    seen_rows = []
    res = ab.gemm_ab(runner, cfg, 1e11, 2e6, capture, replay_ms, lambda r: seen_rows.append(len(r["rows"])))
    assert seen_rows == [2, 4]
    assert [c[:2] for c in captured] == [(False, [1, 3]), (True, [1, 3])]
    for _, _, g in captured:  # every forward of a set's serving runs saw that set's table on every linear
        assert g.seen and all(g.seen)
    assert decode_gemm.AUTOTUNE_ENV not in os.environ  # restored
    assert [(r["batch"], r["set"]) for r in res["rows"]] == [(b, s) for b in (1, 3) for s in ab.SETS]
    for r in res["rows"]:
        assert r["steps"] == 2 * 3 and r["ratio"] == pytest.approx(r["step_ms"] / r["floor_ms"])
        assert r["replay_ms"] == 2.0 and r["replay_ratio"] == pytest.approx(2.0 / r["replay_floor_ms"])
    assert replays == [False, True, True, False] * 2 * 2  # 2 x serving_reps per batch, order alternated
    assert res["table"] == FakeTable().describe() and res["tune_s"] == 1.5
    assert len(res["breakdown"]) == 4 and all("error" in b for b in res["breakdown"])  # no CUDA profiler here
    assert [t["batch"] for t in res["timeline"]] == [1, 3] and all("error" in t for t in res["timeline"])
    assert runner.cuda_graph_runner.decode_gemm_table is None  # left on the cuBLAS set
    lines = ab.render_ab(res, 1e11)
    assert any(line.startswith("| 3 | autotune |") for line in lines) and "## Autotune table (tuned in 1.5 s)" in lines
    runner.cuda_graph_runner = None
