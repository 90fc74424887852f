"""bench_pd_serving.py without servers: several datasets per invocation (one report each), the transfer share of TTFT
as the part the transfer adds (pull: the pure READ time; push: the WRITE time after the prefill forward, since
layerwise WRITEs overlap it), and the report's wording of both."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmark"))

import bench_pd_serving as bp  # noqa: E402

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
            sys.argv = ["bench_pd_serving.py", "--transfer-mode", mode]  # the report's command names the mode
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
