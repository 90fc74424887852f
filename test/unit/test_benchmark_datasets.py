"""Bench datasets (random, random-ids, sharegpt), serving metrics, result blocks and the plot."""

from __future__ import annotations

import json
import os
import random
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from conftest import shared_path  # noqa: E402

from sglang.benchmark_datasets import (DatasetConfig, count_tokens, get_dataset, load_sharegpt,  # noqa: E402
                                       usable_token_ids)
from sglang.benchmark_utils import (RequestOutput, compute_metrics, format_offline_result,  # noqa: E402
                                    format_serving_result, plot_latency_vs_load)


class WordTokenizer:
    """A whitespace tokenizer over words ``w0..w{n-1}``; ids 0 and 1 are special (BOS/EOS)."""

    def __init__(self, n: int = 97):
        self.n = n
        self.all_special_ids = [0, 1]

    def __len__(self) -> int:
        return self.n

    def encode(self, text, add_special_tokens=True, verbose=True):
        ids = [int(w[1:]) for w in text.split()]
        return ([0] if add_special_tokens else []) + ids

    def decode(self, ids):
        return " ".join(f"w{i}" for i in ids)


def _rand_seed() -> int:
    return random.SystemRandom().randrange(1 << 30)


@pytest.mark.parametrize("name", ["random", "random-ids"])
def test_random_lengths_vocab_and_determinism(name):
    tok = WordTokenizer()
    seed = _rand_seed()
    in_len, out_len, ratio = random.randint(8, 40), random.randint(4, 30), random.choice([0.0, 0.25, 0.5])
    cfg = DatasetConfig(name=name, num_prompts=50, seed=seed, random_input_len=in_len, random_output_len=out_len,
                        random_range_ratio=ratio)
    rows = get_dataset(cfg, tok)
    assert len(rows) == 50
    for r in rows:
        assert max(1, int(in_len * ratio)) <= r.prompt_len <= in_len
        assert max(1, int(out_len * ratio)) <= r.output_len <= out_len
        ids = r.prompt if name == "random-ids" else tok.encode(r.prompt, add_special_tokens=False)
        assert isinstance(r.prompt, list) == (name == "random-ids")
        assert len(ids) == r.prompt_len
        assert not set(ids) & {0, 1}, "special tokens must not appear in random prompts"
        assert all(2 <= i < len(tok) for i in ids)
    assert get_dataset(cfg, tok) == rows
    other = get_dataset(DatasetConfig(**{**cfg.__dict__, "seed": seed + 1}), tok)
    assert other != rows
    assert len({r.prompt_len for r in rows}) > 1 or ratio == 1.0


def test_range_ratio_one_gives_exact_lengths():
    cfg = DatasetConfig(name="random-ids", num_prompts=20, seed=_rand_seed(), random_input_len=17,
                        random_output_len=9, random_range_ratio=1.0)
    rows = get_dataset(cfg, WordTokenizer())
    assert {r.prompt_len for r in rows} == {17} and {r.output_len for r in rows} == {9}
    assert all(len(r.prompt) == 17 for r in rows)


def test_random_text_with_real_tokenizer_counts_reencoded_tokens():
    from sglang.srt.utils.common import get_tokenizer

    tok = get_tokenizer(shared_path("models", "stories260K"))
    assert set(usable_token_ids(tok)).isdisjoint(tok.all_special_ids)
    rows = get_dataset(DatasetConfig(name="random", num_prompts=10, seed=_rand_seed(), random_input_len=64,
                                     random_output_len=8, random_range_ratio=1.0), tok)
    for r in rows:
        assert isinstance(r.prompt, str) and r.prompt
        assert r.prompt_len == len(tok.encode(r.prompt, add_special_tokens=False))
        assert 0.85 * 64 <= r.prompt_len <= 64, "re-encoded prompt must be cut to the drawn length"


def _write_sharegpt(path, items):
    with open(path, "w") as f:
        json.dump(items, f)


def test_sharegpt_sglang_format_reply_lengths_and_filters(tmp_path):
    tok = WordTokenizer()
    rng = random.Random(_rand_seed())
    items, expect = [], {}
    for k in range(40):
        p_len, r_len = rng.randint(0, 30), rng.randint(0, 30)
        prompt = " ".join(f"w{rng.randint(2, 96)}" for _ in range(p_len))
        reply = " ".join(f"w{rng.randint(2, 96)}" for _ in range(r_len))
        items.append({"id": f"c{k}", "conversations": [{"from": "human", "value": prompt},
                                                       {"from": "gpt", "value": reply}]})
        if p_len >= 2 and r_len >= 2 and p_len + r_len <= 40:
            expect[prompt] = (p_len, r_len)
    path = tmp_path / "sg.json"
    _write_sharegpt(path, items)
    rows = get_dataset(DatasetConfig(name="sharegpt", num_prompts=1000, dataset_path=str(path),
                                     sharegpt_context_len=40), tok)
    assert {r.prompt: (r.prompt_len, r.output_len) for r in rows} == expect
    fixed = get_dataset(DatasetConfig(name="sharegpt", num_prompts=3, seed=_rand_seed(), dataset_path=str(path),
                                      sharegpt_output_len=5), tok)
    assert len(fixed) == 3 and {r.output_len for r in fixed} == {5}


def test_sharegpt_folder_dedupes_by_id_and_accepts_role_content(tmp_path):
    a = [{"id": "x", "conversations": [{"from": "human", "value": "w2 w3 w4"}]},
         {"id": "y", "conversation": [{"role": "user", "content": "w5 w6"}, {"role": "assistant", "content": "w7 w8"}]}]
    b = [{"id": "x", "conversations": [{"from": "human", "value": "w2 w3 w4"}]},
         {"id": "z", "conversations": [{"from": "human", "value": "w9 w10 w11 w12"}]}]
    _write_sharegpt(tmp_path / "a.json", a)
    _write_sharegpt(tmp_path / "b.json", b)
    assert [c["id"] for c in load_sharegpt(str(tmp_path))] == ["x", "y", "z"]
    rows = get_dataset(DatasetConfig(name="sharegpt", num_prompts=10, dataset_path=str(tmp_path),
                                     sharegpt_output_len=4), WordTokenizer())
    assert sorted(r.prompt for r in rows) == ["w2 w3 w4", "w5 w6", "w9 w10 w11 w12"]


def test_sharegpt_shared_data_folder():
    from sglang.srt.utils.common import get_tokenizer

    folder = shared_path("datasets", "sharegpt")
    tok = get_tokenizer(shared_path("models", "stories260K"))
    seed = _rand_seed()
    cfg = DatasetConfig(name="sharegpt", num_prompts=12, seed=seed, dataset_path=folder + "/",
                        sharegpt_output_len=16, sharegpt_context_len=300)
    rows = get_dataset(cfg, tok)
    assert len(rows) == 12
    for r in rows:
        assert r.output_len == 16 and 2 <= r.prompt_len <= 300 - 16
        assert r.prompt_len == count_tokens(tok, r.prompt)
    assert get_dataset(cfg, tok) == rows


@pytest.mark.parametrize("kw,flag", [({"name": "bogus"}, "--dataset-name"), ({"num_prompts": 0}, "--num-prompts"),
                                     ({"random_range_ratio": 1.5}, "--random-range-ratio"),
                                     ({"random_input_len": 0}, "--random-input-len")])
def test_bad_config_names_the_flag(kw, flag):
    base = {"name": "random", "num_prompts": 4}
    with pytest.raises(ValueError, match=flag):
        DatasetConfig(**{**base, **kw})


def test_sharegpt_path_errors(tmp_path):
    for path in ("", str(tmp_path / "missing.json"), str(tmp_path)):
        with pytest.raises(ValueError, match="--dataset-path"):
            get_dataset(DatasetConfig(name="sharegpt", num_prompts=2, dataset_path=path), WordTokenizer())
    _write_sharegpt(tmp_path / "one.json", [{"conversations": [{"from": "human", "value": "w3"}]}])
    with pytest.raises(ValueError, match="no usable ShareGPT rows"):
        get_dataset(DatasetConfig(name="sharegpt", num_prompts=2, dataset_path=str(tmp_path / "one.json")),
                    WordTokenizer())


def _random_outputs(rng: np.random.Generator, n: int) -> list[RequestOutput]:
    outs = []
    for _ in range(n):
        k = int(rng.integers(1, 20))
        itl = list(rng.uniform(0.001, 0.05, size=k - 1))
        ttft = float(rng.uniform(0.01, 0.3))
        outs.append(RequestOutput(success=bool(rng.random() > 0.15), prompt_len=int(rng.integers(1, 100)),
                                  output_len=k, ttft=ttft, itl=itl, latency=ttft + sum(itl) + 0.001))
    return outs


def test_compute_metrics_matches_numpy_reference():
    rng = np.random.default_rng(_rand_seed())
    outs = _random_outputs(rng, 60)
    retok = [int(x) for x in rng.integers(1, 30, size=60)]
    dur = float(rng.uniform(1, 10))
    m = compute_metrics(outs, dur, retok)
    ok = [o for o in outs if o.success]
    assert m["completed"] == len(ok) and m["failed"] == len(outs) - len(ok)
    assert m["total_output_tokens"] == sum(o.output_len for o in ok)
    assert m["total_output_tokens_retokenized"] == sum(r for o, r in zip(outs, retok) if o.success)
    assert m["request_throughput"] == pytest.approx(len(ok) / dur)
    assert m["total_throughput"] == pytest.approx(sum(o.prompt_len + o.output_len for o in ok) / dur)
    assert m["concurrency"] == pytest.approx(sum(o.latency for o in ok) / dur)
    ttft = np.array([o.ttft for o in ok]) * 1000
    assert m["mean_ttft_ms"] == pytest.approx(ttft.mean()) and m["p99_ttft_ms"] == pytest.approx(np.percentile(ttft, 99))
    itl = np.concatenate([o.itl for o in ok]) * 1000
    assert m["median_itl_ms"] == pytest.approx(np.median(itl)) and m["max_itl_ms"] == pytest.approx(itl.max())
    tpot = np.array([(o.latency - o.ttft) / (o.output_len - 1) for o in ok if o.output_len > 1]) * 1000
    assert m["mean_tpot_ms"] == pytest.approx(tpot.mean())
    with pytest.raises(ValueError, match="duration"):
        compute_metrics(outs, 0.0)


SERVING_LABELS = ["Backend:", "Traffic request rate:", "Max request concurrency:", "Successful requests:",
                  "Benchmark duration (s):", "Total input tokens:", "Total generated tokens:",
                  "Request throughput (req/s):", "Input token throughput (tok/s):", "Output token throughput (tok/s):",
                  "Total token throughput (tok/s):", "Concurrency:", "End-to-End Latency", "Mean E2E Latency (ms):",
                  "Median E2E Latency (ms):", "P99 E2E Latency (ms):", "Time to First Token", "Mean TTFT (ms):",
                  "Median TTFT (ms):", "P99 TTFT (ms):", "Mean TPOT (ms):", "Median TPOT (ms):", "P99 TPOT (ms):",
                  "Inter-Token Latency", "Mean ITL (ms):", "Median ITL (ms):", "P99 ITL (ms):"]


def test_serving_block_labels_and_values():
    rng = np.random.default_rng(_rand_seed())
    m = compute_metrics(_random_outputs(rng, 20), 3.0)
    m.update(backend="sglang", request_rate=float("inf"), max_concurrency=8)
    text = format_serving_result(m)
    assert text.startswith("============ Serving Benchmark Result ============")
    for label in SERVING_LABELS:
        assert label in text, label
    line = next(ln for ln in text.splitlines() if ln.startswith("Mean TTFT (ms):"))
    assert float(line.split()[-1]) == pytest.approx(m["mean_ttft_ms"], abs=0.006)
    assert "Traffic request rate:                    inf" in text


def test_offline_block_labels():
    r = {"backend": "engine", "successful_requests": 7, "total_latency": 1.5, "total_input_tokens": 70,
         "total_output_tokens": 35, "last_gen_throughput": 20.0, "request_throughput": 4.67,
         "input_throughput": 46.7, "output_throughput": 23.3, "total_throughput": 70.0}
    text = format_offline_result(r)
    assert "Offline Throughput Benchmark Result" in text.splitlines()[0]
    for label in ("Successful requests:", "Benchmark duration (s):", "Last generation throughput (tok/s):",
                  "Output token throughput (tok/s):", "Total token throughput (tok/s):"):
        assert label in text


def test_plot_writes_png(tmp_path):
    pytest.importorskip("matplotlib")
    rng = np.random.default_rng(_rand_seed())
    results = []
    for rate in (1.0, 4.0, float("inf")):
        m = compute_metrics(_random_outputs(rng, 10), float(rng.uniform(1, 5)))
        m.update(backend="sglang", request_rate=rate, max_concurrency=None)
        results.append(m)
    out = plot_latency_vs_load(results, str(tmp_path / "sub" / "lat.png"))
    with open(out, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert os.path.getsize(out) > 5000


def test_plot_without_matplotlib_fails_before_any_request(monkeypatch):
    from sglang import bench_serving

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import of matplotlib now fails
    with pytest.raises(ImportError, match="pip install matplotlib"):
        bench_serving.main(["--port", "1", "--model", "m", "--tokenizer", "t", "--plot", "x.png"])
    with pytest.raises(ImportError, match="pip install matplotlib"):
        plot_latency_vs_load([{"request_throughput": 1.0}], "x.png")


@pytest.mark.parametrize("flag,value", [("--request-rate", "0"), ("--request-rate", "fast"),
                                        ("--max-concurrency", "-2")])
def test_bench_serving_bad_load_flags(flag, value):
    from sglang import bench_serving

    with pytest.raises(ValueError, match=flag):
        bench_serving.main(["--port", "1", "--model", "m", "--tokenizer", "t", flag, value])


def test_both_benchmarks_parse_the_same_dataset_flags():
    """bench_serving and bench_offline_throughput share add_dataset_args / DatasetConfig.from_args."""
    from sglang.bench_offline_throughput import build_parser as offline_parser
    from sglang.bench_serving import build_parser as serving_parser

    argv = ["--dataset-name", "random-ids", "--num-prompts", "7", "--random-input-len", "5", "--random-output-len",
            "3", "--random-range-ratio", "0.5", "--seed", "9", "--sharegpt-context-len", "100"]
    serving = DatasetConfig.from_args(serving_parser().parse_args(argv))
    offline = DatasetConfig.from_args(offline_parser().parse_args(argv + ["--model-path", "m"]))
    assert serving == offline == DatasetConfig(name="random-ids", num_prompts=7, seed=9, random_input_len=5,
                                               random_output_len=3, random_range_ratio=0.5, sharegpt_context_len=100)
    assert DatasetConfig.from_args(serving_parser().parse_args([]), "random").name == "random"
    with pytest.raises(ValueError, match="--num-prompts=0"):
        DatasetConfig.from_args(serving_parser().parse_args(["--num-prompts", "0"]))
