"""bench_tokenweave_e2e.py: the off/on alternation, the complete-pair medians, greedy equality
rows and the engine arguments, on fake runs; plus one real CPU run (stories260K, TP2 over gloo, TokenWeave on
vs off) whose greedy ids must be equal and whose "on" log must show a split."""

from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import pytest  # noqa: E402

from conftest import shared_path  # noqa: E402


def _args(*extra):
    from benchmark.tokenweave import bench_e2e as b

    return b.parse_args(["--model-path", shared_path("models", "stories260K"), *extra])


def test_engine_kwargs_only_on_side_enables_tokenweave():
    from benchmark.tokenweave import bench_e2e as b

    a = _args("--tp", "4", "--min-tokens", "64", "--comm-sms", "16", "--chunked-prefill-size", "8192",
              "--disable-cuda-graph")
    off, on = b.engine_kwargs(a, "off"), b.engine_kwargs(a, "on")
    assert "enable_tokenweave" not in off and on["enable_tokenweave"] is True
    assert on["tokenweave_min_tokens"] == 64 and on["tokenweave_comm_sms"] == 16
    assert {k: v for k, v in on.items() if not k.startswith(("enable_tokenweave", "tokenweave_"))} == off
    assert "tokenweave_sharded_residual" not in on  # the server's default: the sharded residual
    full = b.engine_kwargs(_args("--tp", "4", "--full-residual"), "on")
    assert full["tokenweave_sharded_residual"] is False
    assert "tokenweave_sharded_residual" not in b.engine_kwargs(_args("--tp", "4", "--full-residual"), "off")
    assert off["disable_radix_cache"] and off["skip_tokenizer_init"] and off["max_prefill_tokens"] == 8192
    with pytest.raises(ValueError, match="side"):
        b.engine_kwargs(a, "maybe")


def test_bad_flags_are_refused():
    from benchmark.tokenweave import bench_e2e as b

    for bad in (["--reps", "0"], ["--budget", "-1"], ["--tp", "0"]):
        with pytest.raises(SystemExit):
            _args(*bad)
    with pytest.raises(SystemExit):
        b.parse_args(["--model-path", "/nonexistent/folder"])


def test_make_prompts_is_seeded_and_in_range():
    from benchmark.tokenweave import bench_e2e as b

    p = b.make_prompts(3, 50, 512, seed=5)
    assert p == b.make_prompts(3, 50, 512, seed=5) and p != b.make_prompts(3, 50, 512, seed=6)
    assert all(10 <= t < 502 for row in p for t in row) and [len(r) for r in p] == [50, 50, 50]
    with pytest.raises(ValueError, match="vocab"):
        b.make_prompts(1, 1, 8, seed=0)


def _fake(side, rnd, tps, ids):
    return {"side": side, "round": rnd, "start_s": 1.0, "warmup_s": 0.1, "reps_s": [1.0] * len(tps),
            "prefill_tok_s": tps, "total_tok_s": tps, "output_ids": ids}


def test_alternation_order_and_budget_stop():
    from benchmark.tokenweave import bench_e2e as b

    a = _args("--rounds", "3", "--budget", "1000")
    order = []
    runs = b.alternate(a, run=lambda a_, side, left: order.append(side) or _fake(side, 0, [1.0], [[1]]))
    assert order == ["off", "on"] * 3 and [r["round"] for r in runs] == [1, 1, 2, 2, 3, 3]


def test_medians_use_complete_pairs_and_greedy_rows():
    from benchmark.tokenweave import bench_e2e as b

    a = _args("--reps", "1")
    runs = [_fake("off", 1, [100.0], [[1, 2], [3, 4]]), _fake("on", 1, [150.0], [[1, 2], [3, 9]]),
            _fake("off", 2, [900.0], [[1, 2], [3, 4]]),
            {"side": "on", "round": 2, "error": "rc=timeout after 9s", "log_tail": "x", "wall_s": 9}]
    assert b.complete_rounds(runs) == {1}
    text = b.report(a, runs)
    assert "| off | 100 | 100 | 1 |" in text and "| on | 150 | 150 | 1 |" in text  # the second pair's off run left out
    assert "| on / off | 1.500 | 1.500 | |" in text
    assert "| on (round 1) vs off (round 1) | 1/2 | first diff: prompt 1 token 1 |" in text
    assert "| off (round 2) vs off (round 1) | 2/2 | all equal |" in text
    assert "FAILED: rc=timeout" in text


def test_e2e_record_carries_baseline_ratio_headline(tmp_path):
    """--record-dir: complete rounds only, TokenWeave off as the same-run baseline, on/off ratios, greedy equality
    per row, and the report's medians (prefill, total) as the headline."""
    from benchmark.common import records
    from benchmark.tokenweave import bench_e2e as b

    a = _args("--reps", "2", "--tp", "4")
    runs = [_fake("off", 1, [100.0, 110.0], [[1, 2], [3, 4]]), _fake("on", 1, [150.0, 160.0], [[1, 2], [3, 9]]),
            _fake("off", 2, [900.0, 900.0], [[1, 2], [3, 4]]),
            {"side": "on", "round": 2, "error": "rc=timeout after 9s", "log_tail": "x", "wall_s": 9}]
    env = {"git_commit": "abc", "git_dirty": False, "date": "2026-12-07T00:00:00+00:00",
           "gpu": {"model": "NVIDIA H100 80GB HBM3", "count": 8, "driver": None}, "versions": {"python": "3"}}
    js, md = records.write_record(b.e2e_record(a, runs, env=env, command="python x.py"), tmp_path)
    rec = records.load_record(js)
    assert js.name == "2026-12-07_tokenweave_e2e_4xh100.json" and md.exists()
    (row,) = rec["rows"]
    assert (row["off_prefill_tok_s"], row["on_prefill_tok_s"], row["on_over_off_prefill"]) == (105.0, 155.0, 1.476)
    assert row["on_greedy_equal"] == 1 and row["prompts"] == 2 and rec["units"]["on_total_tok_s"] == "tok/s"
    assert rec["baselines"] == ["off_prefill_tok_s", "off_total_tok_s"] and rec["units"]["on_start_s"] == "s"
    assert [(h["value"], h["baseline"], h["ratio"]) for h in rec["headline"]] == [(155.0, 105.0, 1.476)] * 2


def test_cpu_gloo_tp2_on_off_greedy_equal(tmp_path):
    """Real engines (stories260K trained weights, CPU, TP2 over gloo): one off/on pair, equal greedy ids."""
    from benchmark.tokenweave import bench_e2e as b

    out = tmp_path / "e2e.md"
    rc = b.main(["--model-path", shared_path("models", "stories260K"), "--load-format", "auto", "--device", "cpu",
                 "--tp", "2", "--num-prompts", "3", "--input-len", "40", "--output-len", "6", "--min-tokens", "8",
                 "--reps", "1", "--rounds", "1", "--budget", "240", "--out", str(out)])
    text = out.read_text()
    assert rc == 0, text
    assert "| on (round 1) vs off (round 1) | 3/3 | all equal |" in text
    assert "tokens split" in text  # the on run's log shows TokenWeave split a batch
