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
