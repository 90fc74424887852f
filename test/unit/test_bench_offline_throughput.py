"""``sglang.bench_offline_throughput``: the CLI plumbing against a stand-in engine, and (when
``sgl.Engine`` is importable) one small real run on stories260K on CPU."""

from __future__ import annotations

import importlib.util
import json
import os
import random
import sys
import types

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from conftest import shared_path  # noqa: E402

from sglang import bench_offline_throughput as bot  # noqa: E402


class FakeEngine:
    """Stand-in for ``sgl.Engine``: generates exactly ``max_new_tokens`` per request."""

    instances: list = []

    def __init__(self, **kwargs):
        self.kwargs = kwargs
        self.calls = []
        self.shut = False
        FakeEngine.instances.append(self)

    def generate(self, prompt=None, sampling_params=None, input_ids=None):
        batch = prompt if prompt is not None else input_ids
        assert isinstance(batch, list) and len(batch) == len(sampling_params)
        self.calls.append((prompt is not None, [dict(p) for p in sampling_params]))
        return [{"text": "x", "output_ids": [5] * p["max_new_tokens"],
                 "meta_info": {"prompt_tokens": len(b) if isinstance(b, list) else 3,
                               "completion_tokens": p["max_new_tokens"]}}
                for b, p in zip(batch, sampling_params)]

    def shutdown(self):
        self.shut = True


@pytest.fixture
def fake_engine(monkeypatch):
    mod = types.ModuleType("sglang.srt.entrypoints.engine")
    mod.Engine = FakeEngine
    monkeypatch.setitem(sys.modules, "sglang.srt.entrypoints.engine", mod)
    FakeEngine.instances = []
    return FakeEngine


def test_cli_passes_server_args_and_reports_totals(fake_engine, tmp_path, capsys):
    model = shared_path("models", "stories260K")
    seed, n = random.randrange(1 << 20), random.randint(5, 12)
    out = tmp_path / "r.jsonl"
    result = bot.main(["--model-path", model, "--load-format", "dummy", "--device", "cpu", "--dataset-name",
                       "random-ids", "--num-prompts", str(n), "--random-input-len", "20", "--random-output-len", "9",
                       "--random-range-ratio", "0.3", "--seed", str(seed), "--result-filename", str(out),
                       "--extra-request-body", '{"top_k": 3}'])
    eng = fake_engine.instances[-1]
    assert eng.kwargs["model_path"] == model and eng.kwargs["load_format"] == "dummy" and eng.shut
    assert len(eng.calls) == 2  # warmup + benchmark
    is_text, params = eng.calls[-1]
    assert not is_text and len(params) == n
    assert all(p["ignore_eos"] and p["top_k"] == 3 and p["temperature"] == 0.0 for p in params)
    from sglang.benchmark_datasets import DatasetConfig, get_dataset
    from sglang.srt.utils.common import get_tokenizer

    rows = get_dataset(DatasetConfig(name="random-ids", num_prompts=n, seed=seed, random_input_len=20,
                                     random_output_len=9, random_range_ratio=0.3), get_tokenizer(model))
    assert result["total_output_tokens"] == sum(r.output_len for r in rows)
    assert result["total_input_tokens"] == sum(r.prompt_len for r in rows)
    assert result["successful_requests"] == n
    assert result["output_throughput"] == pytest.approx(result["total_output_tokens"] / result["total_latency"])
    with open(out) as f:
        assert json.loads(f.readline()) == result
    text = capsys.readouterr().out
    assert "Offline Throughput Benchmark Result" in text and "Total generated tokens:" in text


def test_skip_warmup_and_text_prompts(fake_engine):
    model = shared_path("models", "stories260K")
    bot.main(["--model-path", model, "--device", "cpu", "--dataset-name", "random", "--num-prompts", "3",
              "--random-input-len", "10", "--random-output-len", "4", "--skip-warmup", "--disable-ignore-eos"])
    eng = fake_engine.instances[-1]
    assert len(eng.calls) == 1 and eng.calls[0][0] is True
    assert not any(p["ignore_eos"] for p in eng.calls[0][1])


@pytest.mark.skipif(importlib.util.find_spec("sglang.srt.entrypoints.engine") is None,
                    reason="sgl.Engine (sglang/srt/entrypoints/engine.py) is not in this tree yet")
def test_real_engine_stories260k(tmp_path):
    model = shared_path("models", "stories260K")
    result = bot.main(["--model-path", model, "--device", "cpu", "--dataset-name", "random", "--num-prompts", "6",
                       "--random-input-len", "24", "--random-output-len", "8", "--random-range-ratio", "1.0",
                       "--skip-warmup"])
    assert result["successful_requests"] == 6
    assert result["total_output_tokens"] == 6 * 8
