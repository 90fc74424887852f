"""benchmark/decode/served_step.py on CPU (stories260K): every mode serves the batch to a steady all-decode state,
times exactly the requested steps at the batch's context, and the rows' ratios are step / floor."""

from __future__ import annotations

import os
import sys
import types

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))
from conftest import shared_path  # noqa: E402


@pytest.fixture(scope="module")
def runner():
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.server_args import ServerArgs

    path = shared_path("models", "stories260K")
    args = ServerArgs(model_path=path, device="cpu", max_total_tokens=4096, random_seed=3)
    return ModelRunner(ModelConfig.from_path(path), args, "cpu")


def test_serving_rows_time_steady_decode_steps(runner):
    from benchmark.decode import served_step as bds

    cfg = types.SimpleNamespace(seed=0, context=48, serving_reps=2, serving_warmup=2, serving_steps=5,
                                model_path=shared_path("models", "stories260K"), chunked_prefill_size=64)
    bw, weights = 1e11, 2e6
    rows = bds.serving_rows(runner, [1, 6], cfg, bw, weights)
    assert [(r["batch"], r["mode"]) for r in rows] == [(b, m) for b in (1, 6) for m in bds.MODES]
    for r in rows:
        assert r["steps"] == 2 * 5 and r["step_ms"] > 0 and r["p90_ms"] >= r["step_ms"]
        assert r["ratio"] == pytest.approx(r["step_ms"] / r["floor_ms"])
        # timed steps start once every request has its first token (the first of the 6 requests decode while the
        # others prefill in 64-token chunks) and after the warm-up
        assert 48 + 2 <= r["ctx"] <= 48 + 2 + 5 + 2 + 6
        assert r["floor_ms"] > weights / bw * 1e3
    assert runner.allocator.available_size() == runner.allocator.size  # every run returned its KV


def test_run_mode_fails_closed_when_the_batch_never_decodes(runner):
    from benchmark.decode import served_step as bds

    with pytest.raises(RuntimeError, match="steady decode steps"):
        bds.run_mode(runner, "overlap", [[5] * 20] * 2, 2, 5, 1e11, 1e6, "x",
                     shared_path("models", "stories260K"), max_steps=3)
    runner.kv_cache.prefix_cache.reset()
