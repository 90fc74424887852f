"""``benchmark/common``: the shared timing (medians, percentiles, A/B order alternation, warm-ups, host timer with an
injected clock) and the result record (validation, file naming, markdown rendering, provenance) on CPU."""

from __future__ import annotations

import json
import subprocess

import pytest

from conftest import REPO_ROOT
from benchmark.common import records, timing


def test_median_and_percentile_match_numpy():
    np = pytest.importorskip("numpy")
    rng = np.random.default_rng(0)
    for n in (1, 2, 5, 10, 33):
        xs = rng.random(n).tolist()
        assert timing.median(xs) == pytest.approx(float(np.median(xs)))
        for q in (0, 10, 50, 90, 100):
            assert timing.percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))
    with pytest.raises(ValueError, match="no samples"):
        timing.median([])
    with pytest.raises(ValueError, match="outside"):
        timing.percentile([1.0], 101)


def test_ab_order_alternates_and_balances_positions():
    order = timing.ab_order(["a", "b", "c"], 4)
    assert order == [["a", "b", "c"], ["c", "b", "a"], ["a", "b", "c"], ["c", "b", "a"]]
    mean_pos = {arm: sum(r.index(arm) for r in order) / len(order) for arm in "abc"}
    assert len(set(mean_pos.values())) == 1
    with pytest.raises(ValueError, match="repeat"):
        timing.ab_order(["a", "a"], 2)
    with pytest.raises(ValueError, match="rounds"):
        timing.ab_order(["a"], 0)


def test_time_cpu_counts_warmup_inner_and_uses_the_clock():
    calls, syncs = [], []
    ticks = iter(range(0, 10 ** 9, 2_000_000))  # every clock read advances 2 ms

    t = timing.time_cpu(lambda: calls.append(1), iters=3, warmup=2, inner=4, sync=lambda: syncs.append(1),
                        clock=lambda: next(ticks))
    assert len(calls) == 2 + 3 * 4 and len(syncs) == 1 + 3
    assert t.samples_ms == (0.5, 0.5, 0.5) and t.timer == timing.HOST_CLOCK and t.inner == 4
    assert t.summary("x_")["x_median_ms"] == 0.5 and t.summary("x_")["x_n"] == 3
    for bad in (dict(iters=0), dict(warmup=-1), dict(inner=0)):
        with pytest.raises(ValueError):
            timing.time_cpu(lambda: None, **bad)


def test_time_fn_falls_back_to_the_host_clock_without_cuda():
    t = timing.time_fn(lambda: sum(range(100)), device="cpu", iters=3, warmup=1)
    assert t.timer == timing.HOST_CLOCK and t.n == 3 and all(s >= 0 for s in t.samples_ms)
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        assert timing.time_fn(lambda: None, device="cuda", iters=2).timer == timing.HOST_CLOCK
        with pytest.raises(RuntimeError, match="CUDA"):
            timing.time_cuda_events(lambda: None)


def test_compare_warms_every_arm_then_alternates_rounds():
    log = []

    def fake_timer(fn, *, iters, warmup, inner):
        for _ in range(warmup + iters * inner):
            fn()
        return timing.Timing(tuple([1.0] * iters), "fake", inner)

    arms = {"base": lambda: log.append("base"), "new": lambda: log.append("new")}
    out = timing.compare(arms, rounds=4, iters=2, warmup=3, timer=fake_timer)
    assert list(out) == ["base", "new"] and all(t.n == 8 and t.timer == "fake" for t in out.values())
    warm = log[: 2 * (3 + 1)]
    assert warm == ["base"] * 4 + ["new"] * 4  # warm-up (and one sample) of each arm before any round
    rounds = [log[8 + 4 * r: 8 + 4 * (r + 1)] for r in range(4)]
    assert [r[0] for r in rounds] == ["base", "new", "base", "new"]
    assert timing.ratio(2.0, 4.0) == 0.5 and timing.ratio(1.0, 0) is None and timing.ratio(None, 1.0) is None


ENV = {"git_commit": "abc123", "git_dirty": False, "date": "2026-12-01T10:00:00+00:00",
       "gpu": {"model": "NVIDIA H100 80GB HBM3", "count": 1, "driver": "580.65"},
       "versions": {"python": "3.12.3", "torch": "2.11.0", "cuda": "13.0", "nccl": "2.28.3", "triton": "3.6.0"},
       "platform": "Linux"}


def _record(**kw):
    rows = records.add_ratio([{"batch": 1, "nccl_us": 30.0, "tw_us": 20.0}, {"batch": 8, "nccl_us": 40.0,
                                                                            "tw_us": 0}],
                             "speedup", "nccl_us", "tw_us")
    args = dict(subject="comm", benchmark="benchmark.comm.allreduce", mode="fused", what="allreduce_rmsnorm",
                rows=rows, command="python -m benchmark.comm.allreduce --mode fused", env=ENV,
                baselines=["nccl_us"], units={"nccl_us": "us", "tw_us": "us"},
                headline=[{"label": "AR+RMSNorm batch 1", "value": 20.0, "unit": "us", "baseline": "NCCL 30 us",
                           "ratio": 1.5}])
    args.update(kw)
    return records.make_record(**args)


def test_record_fields_ratios_and_validation():
    rec = _record()
    assert rec["rows"][0]["speedup"] == 1.5 and rec["rows"][1]["speedup"] is None
    assert rec["gpu"]["model"].endswith("HBM3") and rec["versions"]["nccl"] == "2.28.3"
    assert _record(gpu_count=4)["gpu"]["count"] == 4
    with pytest.raises(ValueError, match="subject"):
        _record(subject="misc")
    with pytest.raises(ValueError, match="what="):
        _record(what="Decode Sweep")
    with pytest.raises(ValueError, match="baselines"):
        _record(baselines=["nope"])
    with pytest.raises(ValueError, match="lacks"):
        records.validate_record({"schema": 1})
    with pytest.raises(ValueError, match="JSON"):
        _record(params={"x": object()})


@pytest.mark.parametrize("model,count,slug", [("NVIDIA H100 80GB HBM3", 1, "h100"), ("NVIDIA H200", 4, "4xh200"),
                                              ("NVIDIA A100-SXM4-80GB", 2, "2xa100"), ("cpu", 0, "cpu"),
                                              ("NVIDIA L40S", 1, "l40s"), ("Some Card", 1, "some-card")])
def test_gpu_slug(model, count, slug):
    assert records.gpu_slug(model, count) == slug


def test_write_record_names_files_and_keeps_earlier_runs(tmp_path):
    rec = _record()
    js, md = records.write_record(rec, tmp_path)
    assert js == tmp_path / "comm" / "2026-12-01_allreduce_rmsnorm_h100.json" and md.with_suffix(".json") == js
    js2, _ = records.write_record(rec, tmp_path)
    assert js2.name == "2026-12-01_allreduce_rmsnorm_h100-2.json" and js.exists()
    assert records.load_record(js) == json.loads(js.read_text()) == rec
    text = md.read_text()
    assert "`abc123`" in text and "nccl_us (us) [baseline]" in text and "| 1 | 30.00 | 20.00 | 1.500 |" in text
    assert "python -m benchmark.comm.allreduce --mode fused" in text and "NCCL 30 us" in text


def test_environment_reports_this_checkout():
    env = records.environment()
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True).stdout.strip()
    assert env["git_commit"] == head and env["date"][:2] == "20" and env["versions"]["python"]
    assert env["gpu"]["count"] >= 0 and env["gpu"]["model"]


def test_format_value():
    assert [records.format_value(v) for v in (None, True, 1.23456, 123.456, 0.0123456, 0.0, 7, 2e7, "a|b")] == \
        ["-", "yes", "1.235", "123.5", "0.01235", "0", "7", "2.000e+07", "a\\|b"]
    assert records.command_line(["benchmark/x.py", "--a", "b c"]) == "python benchmark/x.py --a 'b c'"
    assert records.command_line(["x", "--a"], module="benchmark.decode.bench") == \
        "python -m benchmark.decode.bench --a"
