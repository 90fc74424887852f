"""benchmark/disaggregation/bench_pd_serving.py without servers: several datasets per invocation (one report each), the transfer share of TTFT
as the part the transfer adds (pull: the pure READ time; push: the WRITE time after the prefill forward, since
layerwise WRITEs overlap it), the report's wording of both, and the warm-up phase before every timed run (its size,
its order before the transfer counters are read, the same phase for pd, agg and agg2)."""

from __future__ import annotations

import http.server
import json
import math
import os
import sys
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmark.disaggregation import bench_pd_serving as bp  # noqa: E402
from benchmark.disaggregation import pd_serving_warmup as pw  # noqa: E402

pytestmark = pytest.mark.timeout(60)

# counter deltas over 4 timed requests (seconds summed), as transfer_seconds() differences give them
DELTA = {"requests": 4.0, "bytes": 4 * 2**20, "reads": 8.0, "seconds": 0.040, "setup": 0.008, "wait": 0.004,
         "handoff": 0.016, "tail": 0.002}
PD = {"mean_ttft_ms": 100.0}


def test_datasets_parse_in_order_and_default_to_sharegpt():
    a = bp.parse_args(["--model-path", "m", "--dataset", "random", "sharegpt"])
    assert a.dataset == ["random", "sharegpt"]
    assert bp.parse_args(["--model-path", "m"]).dataset == ["sharegpt"]
    with pytest.raises(SystemExit):
        bp.parse_args(["--model-path", "m", "--dataset", "nope"])


def test_pull_share_is_the_pure_read_time():
    x = bp.transfer_summary("pull", DELTA, PD, 1)
    assert x["mean_ms"] == pytest.approx(10.0) and x["reads_per_request"] == 2.0
    assert x["share_of_ttft"] == pytest.approx(0.10) and x["write_share_of_ttft"] == pytest.approx(0.10)
    assert x["handoff_share_of_ttft"] == pytest.approx(0.04)


def test_push_share_is_the_write_time_after_the_forward():
    x = bp.transfer_summary("push", DELTA, PD, 1)
    assert x["tail_mean_ms"] == pytest.approx(0.5)
    assert x["share_of_ttft"] == pytest.approx(0.005)  # tail 0.5 ms of 100 ms, not the whole 10 ms WRITE time
    assert x["write_share_of_ttft"] == pytest.approx(0.10)
    no_tail = bp.transfer_summary("push", {**DELTA, "tail": float("nan")}, PD, 1)  # a server without the metric
    assert math.isnan(no_tail["share_of_ttft"])


def test_transfer_lines_say_how_the_share_is_defined():
    pull = "\n".join(bp.transfer_lines("pull", "nixl", bp.transfer_summary("pull", DELTA, PD, 1)))
    assert "10.00%" in pull and "first READ posted -> last READ DONE" in pull and "2.0 READs" in pull
    push = "\n".join(bp.transfer_lines("push", "nixl", bp.transfer_summary("push", DELTA, PD, 1)))
    assert "0.50%" in push and "after the prefill forward" in push and "10.00%" in push and "2.0 WRITEs" in push
    x = {**bp.transfer_summary("push", DELTA, PD, 1), "push_layerwise": 3, "push_after_forward": 1}
    assert "layer by layer 3, after the forward 1" in bp.transfer_lines("push", "nixl", x)[0]
    assert bp.push_paths(["http://127.0.0.1:9"]) == {}  # nothing listening: unknown, not zero


def test_one_report_per_dataset(tmp_path):
    a = bp.parse_args(["--model-path", "m", "--dataset", "random", "sharegpt", "--transfer-mode", "push",
                       "--out-dir", str(tmp_path)])
    rec = {m: 1.0 for m in bp.METRICS}
    results = {"random": {"pd": {**rec, "p99_itl_ms": 10.0}, "agg2": {**rec, "p99_itl_ms": 40.0}},
               "sharegpt": {"pd": rec}}
    xfer = {"random": bp.transfer_summary("push", DELTA, PD, 1)}
    bp.write_report(a, results, xfer, {"agg": "RuntimeError: x"})
    first = sorted(tmp_path.glob("*_pd_serving_fake_push.json"))
    second = sorted(tmp_path.glob("*_pd_serving_fake_push_sharegpt.json"))
    assert len(first) == 1 and len(second) == 1
    d1, d2 = json.loads(first[0].read_text()), json.loads(second[0].read_text())
    assert d1["dataset"] == "random" and set(d1["results"]) == {"pd", "agg2"} and d1["transfer"]["requests"] == 4
    assert d2["dataset"] == "sharegpt" and set(d2["results"]) == {"pd"} and d2["transfer"] == {}
    md = first[0].with_suffix(".md").read_text()
    assert "| p99_itl_ms | 40.000 | 10.000 | 0.250 |" in md and "**agg failed**" in md


def test_rows_table_ratios_against_the_agg2_row(tmp_path):
    sys.path.insert(0, str(ROOT / "scripts" / "gpu"))
    import pd_rows_table as pt

    rec = {m: 1.0 for m in bp.METRICS}
    runs = {"tok": ("pull", {"pd": {**rec, "p99_itl_ms": 10.0, "output_throughput": 990.0}}),
            "push": ("push", {"pd": {**rec, "p99_itl_ms": 20.0, "output_throughput": 1000.0}}),
            "agg2": ("pull", {"agg2": {**rec, "p99_itl_ms": 40.0, "output_throughput": 1000.0}})}
    argv = sys.argv
    try:
        for name, (mode, res) in runs.items():
            sys.argv = ["benchmark/disaggregation/bench_pd_serving.py", "--transfer-mode", mode]  # the report's command names the mode
            a = bp.parse_args(["--model-path", "m", "--dataset", "random", "--transfer-mode", mode,
                               "--out-dir", str(tmp_path / name)])
            (tmp_path / name).mkdir()
            xfer = {"random": bp.transfer_summary(mode, DELTA, PD, 1)} if "pd" in res else {}
            bp.write_report(a, {"random": res}, xfer, {})
    finally:
        sys.argv = argv
    lines = pt.table([("tok", str(tmp_path / "tok")), ("push", str(tmp_path / "push")),
                      ("agg2", str(tmp_path / "agg2")), ("gone", str(tmp_path / "gone"))], "random")
    tok = next(x for x in lines if x.startswith("| tok |")).split(" | ")
    push = next(x for x in lines if x.startswith("| push |")).split(" | ")
    assert tok[-2:] == ["4.00", "0.99 |"] and "10.00% (pull)" in tok and "10.000" in tok
    assert push[-2:] == ["2.00", "1.00 |"] and "0.50% (push)" in push and "0.500" in push
    assert any(x.startswith("- gone: not measured") for x in lines)
    assert any("(push) = mean WRITE time after the prefill forward" in x for x in lines)
    assert pt.table([("x", str(tmp_path / "tok"))], "sharegpt")[-1] == "- x: not measured (no result file)"


# ---- the warm-up phase before every timed run (without it the first row of a call paid the JIT compiles) ----

def test_warmup_prompts_follow_the_workloads_rate_and_burst():
    args = ["--model-path", "m", "--num-prompts", "48"]
    assert pw.warmup_prompts(bp.parse_args([*args, "--request-rate", "8"])) == 40  # 5 s (default) at 8 req/s
    assert pw.warmup_prompts(bp.parse_args([*args, "--request-rate", "8", "--warmup-seconds", "2.1"])) == 17
    assert pw.warmup_prompts(bp.parse_args([*args, "--request-rate", "100"])) == 48  # never more than the run
    assert pw.warmup_prompts(bp.parse_args([*args, "--request-rate", "0.01"])) == 1
    assert pw.warmup_prompts(bp.parse_args([*args, "--max-concurrency", "8"])) == 16  # no rate: the run's burst
    assert pw.warmup_prompts(bp.parse_args([*args, "--max-concurrency", "0"])) == 48
    assert pw.warmup_prompts(bp.parse_args([*args, "--request-rate", "8", "--warmup-seconds", "0"])) == 0
    with pytest.raises(SystemExit, match="--warmup-seconds"):
        bp.main([*args, "--warmup-seconds", "-1"])


class _FlushServer(http.server.BaseHTTPRequestHandler):
    answers: list = []  # status codes /flush_cache answers, in order (then 200)

    def do_POST(self):  # noqa: N802
        code = self.answers.pop(0) if self.answers else 200
        self.send_response(code)
        self.end_headers()
        self.wfile.write(b"cannot flush the cache while requests are running" if code != 200 else b"{}")

    def log_message(self, *a):
        pass


@pytest.fixture()
def flush_url():
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _FlushServer)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


def test_warm_phase_runs_the_workload_with_another_seed_then_flushes(flush_url, capsys):
    a = bp.parse_args(["--model-path", "m", "--num-prompts", "48", "--request-rate", "8", "--seed", "3"])
    calls = []
    _FlushServer.answers = [400, 400]  # busy twice (the warm-up's tail), then flushed
    rec = pw.warm_phase(a, flush_url, "pd/random", lambda n, seed: calls.append((n, seed)) or {"mean_ttft_ms": 300.0,
                                                                                                 "completed": n})
    assert calls == [(40, 3 + pw.WARMUP_SEED_OFFSET)] and rec["flushed"] is True and not _FlushServer.answers
    assert rec["completed"] == 40 and rec["warmup_seconds"] >= 0
    assert "warm-up phase pd/random: 40 requests" in capsys.readouterr().out
    off = bp.parse_args(["--model-path", "m", "--warmup-seconds", "0"])
    assert pw.warm_phase(off, flush_url, "x", lambda n, s: pytest.fail("no phase when off")) == {}


def test_flush_when_idle_gives_up_with_a_warning(flush_url, capsys):
    _FlushServer.answers = [400] * 1000
    assert pw.flush_when_idle(flush_url, timeout=0.3, poll=0.05) is False
    out = capsys.readouterr().out
    assert "not accepted in 0 s (HTTP 400: cannot flush" in out
    _FlushServer.answers = []
    assert pw.flush_when_idle("http://127.0.0.1:9", timeout=0.2, poll=0.05) is False  # nothing listening


class _FakeProc:
    def __init__(self, url):
        self.url = url

    def wait_healthy(self, timeout):
        return self

    def stop(self):
        pass


def _fake_servers(monkeypatch, log: list, counters: dict):
    """Stand-ins for the servers: every call is logged; the warm-up phase and the timed run add hand-offs to the
    decode server's counters (4 and 48), so the deltas show which requests the transfer window covers."""
    names = iter(f"http://s{i}" for i in range(100))
    monkeypatch.setattr(bp, "server", lambda args, extra, tag, logdir: _FakeProc(next(names)))
    monkeypatch.setattr(bp, "router", lambda args, flags, logdir: _FakeProc("http://lb"))
    monkeypatch.setattr(bp, "warm_up", lambda args, url: log.append(("warm_up", url)))
    monkeypatch.setattr(bp, "push_paths", lambda urls: {})

    def warm_run(args, url, logdir, setup, ds):
        log.append(("warm_run", url, setup, ds))
        counters["requests"] += 4
        return {"completed": 4}

    def bench(args, url, out, ds, *rest):
        log.append(("bench", url, os.path.basename(out), ds))
        counters["requests"] += 48
        return {"mean_ttft_ms": 50.0, "completed": 48}

    monkeypatch.setattr(bp, "warm_run", warm_run)
    monkeypatch.setattr(bp, "bench", bench)
    monkeypatch.setattr(bp, "transfer_seconds", lambda url: log.append(("counters", url)) or
                        {"seconds": 0.0, "bytes": 0.0, "reads": 0.0, "setup": 0.0, "wait": 0.0, "handoff": 0.0,
                         "tail": 0.0, **counters})


def test_pd_reads_the_transfer_counters_after_each_warm_up_phase(monkeypatch, tmp_path):
    a = bp.parse_args(["--model-path", "m", "--dataset", "random", "sharegpt", "--out-dir", str(tmp_path)])
    log, counters = [], {"requests": 0.0}
    _fake_servers(monkeypatch, log, counters)
    results, xfer, warm = {"random": {}, "sharegpt": {}}, {}, {"random": {}, "sharegpt": {}}
    bp.run_pd(a, str(tmp_path), results, xfer, lambda: None, warm)
    seq = [x[0] for x in log]
    assert seq == ["warm_up", "warm_run", "counters", "bench", "counters", "warm_run", "counters", "bench", "counters"]
    assert [x[1] for x in log if x[0] in ("warm_run", "bench")] == ["http://lb"] * 4  # through the router
    assert [x[3] for x in log if x[0] == "warm_run"] == ["random", "sharegpt"]
    for ds in ("random", "sharegpt"):  # the 4 warm-up hand-offs are outside the window: 48, not 52
        assert xfer[ds]["requests"] == 48 and xfer[ds]["timed_completed"] == 48 and warm[ds]["pd"]["completed"] == 4


def test_agg_and_agg2_get_the_same_warm_up_phase_on_their_own_url(monkeypatch, tmp_path):
    a = bp.parse_args(["--model-path", "m", "--dataset", "random", "--out-dir", str(tmp_path), "--device", "cpu"])
    log = []
    _fake_servers(monkeypatch, log, {"requests": 0.0})
    results, warm = {"random": {}}, {"random": {}}
    bp.run_aggregated(a, str(tmp_path), ["agg", "agg2"], results, lambda: None, warm)
    runs = [(x[0], x[1], x[2]) for x in log if x[0] in ("warm_run", "bench")]
    assert runs == [("warm_run", "http://lb", "agg2"), ("bench", "http://lb", "agg2.jsonl"),
                    ("warm_run", "http://s0", "agg"), ("bench", "http://s0", "agg.jsonl")]
    assert set(warm["random"]) == {"agg", "agg2"} and set(results["random"]) == {"agg", "agg2"}


def test_report_states_the_warm_up_and_flags_a_leaky_counter_window(tmp_path):
    a = bp.parse_args(["--model-path", "m", "--dataset", "random", "--request-rate", "8", "--out-dir", str(tmp_path)])
    rec = {m: 1.0 for m in bp.METRICS}
    warm = {"random": {"pd": {"completed": 40, "warmup_seconds": 6.0, "mean_ttft_ms": 357.0, "p99_ttft_ms": 1600.0,
                              "flushed": True}}}
    xfer = {"random": bp.transfer_summary("pull", DELTA, {**PD, "completed": 4}, 1)}
    bp.write_report(a, {"random": {"pd": rec}}, xfer, {}, warm)
    md = next(tmp_path.glob("*.md")).read_text()
    assert "40 requests (5 s of arrivals at 8 req/s)" in md and "pd 40 requests in 6.0 s, mean / p99 TTFT 357.0" in md
    assert "counters saw" not in md  # 4 hand-offs, 4 timed requests
    assert json.loads(next(tmp_path.glob("*.json")).read_text())["warmup"]["pd"]["completed"] == 40
    leaky = bp.transfer_summary("pull", DELTA, {**PD, "completed": 3}, 1)
    assert "counters saw 4 hand-offs but the timed run completed 3" in bp.transfer_lines("pull", "nixl", leaky)[0]
    off = bp.parse_args(["--model-path", "m", "--warmup-seconds", "0"])
    assert pw.warmup_line(off, {}).startswith("warm-up phase: off")


def test_warm_up_sends_the_timed_runs_flags_but_its_count_and_seed(tmp_path):
    a = bp.parse_args(["--model-path", "m", "--request-rate", "8", "--max-concurrency", "0", "--input-len", "1024",
                       "--output-len", "128", "--num-prompts", "48"])
    for ds in ("random", "sharegpt"):
        timed = bp.bench_argv(a, "http://lb", "t.jsonl", ds)
        warm = bp.bench_argv(a, "http://lb", "t.jsonl", ds, 40, a.seed + pw.WARMUP_SEED_OFFSET)
        diff = {timed[i]: (timed[i + 1], warm[i + 1]) for i in range(len(timed) - 1) if timed[i + 1] != warm[i + 1]}
        assert len(timed) == len(warm) and diff == {"--num-prompts": ("48", "40"), "--seed": ("1", "1001")}
        assert "--request-rate" in timed and timed[timed.index("--warmup-requests") + 1] == "0"
    with pytest.raises(RuntimeError, match="--request-rate"):  # bench_serving's own error, named
        pw.bench_in_process(["--request-rate", "-1", "--model", "m", "--tokenizer", str(tmp_path)])


FAKE_ENV = {"git_commit": "0" * 40, "git_dirty": False, "date": "2026-12-07T12:00:00+00:00",
            "gpu": {"model": "NVIDIA H100 80GB HBM3", "count": 2, "driver": "x"}, "platform": "test",
            "versions": {"python": "3", "torch": None, "cuda": None, "nccl": None, "triton": None}}


def test_pd_record_compares_pd_with_the_agg2_baseline(tmp_path):
    from benchmark.common import records
    from benchmark.disaggregation.pd_serving_record import make_pd_record

    rec = {m: 1.0 for m in bp.METRICS}
    results = {"random": {"agg": {**rec, "output_throughput": 600.0, "mean_ttft_ms": 40.0},
                          "agg2": {**rec, "output_throughput": 1000.0, "mean_ttft_ms": 50.0},
                          "pd": {**rec, "output_throughput": 1200.0, "mean_ttft_ms": 100.0}}}
    a = bp.parse_args(["--model-path", "m", "--device", "cuda", "--dataset", "random", "--setups", "pd", "agg",
                       "agg2", "--transfer-backend", "nixl"])
    xfer = {"random": bp.transfer_summary("pull", DELTA, PD, 1)}
    js, _ = records.write_record(make_pd_record(a, results, xfer, {}, bp.METRICS, bp.SETUPS,
                                                env=FAKE_ENV), tmp_path)
    r = records.load_record(js)
    assert r["what"] == "pd_serving" and r["mode"] == "pd+agg+agg2-nixl-pull"
    assert r["baselines"] == ["base_output_throughput", "base_mean_ttft_ms"]
    assert [x["setup"] for x in r["rows"]] == ["agg", "agg2", "pd"] and {x["base"] for x in r["rows"]} == {"agg2"}
    pd = r["rows"][-1]
    assert pd["throughput_vs_base"] == 1.2 and pd["ttft_vs_base"] == 2.0 and pd["kv_share_of_ttft"] == 0.1
    h = r["headline"]
    assert [(x["value"], x["baseline"], x["ratio"]) for x in h[:2]] == [(1200.0, 1000.0, 1.2), (100.0, 50.0, 2.0)]
    assert "vs agg2" in h[0]["label"] and h[2]["value"] == 0.1
