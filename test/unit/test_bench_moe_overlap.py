"""``benchmark/moe/bench_moe_overlap.py`` cannot rot: its smoke mode runs on CPU (one rank, and two gloo ranks) and
writes a well-formed record; the hidden-fraction arithmetic and the auto-off candidates are checked on fixed rows."""

from __future__ import annotations

import importlib.util
import json
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
from conftest import REPO_ROOT, shared_path  # noqa: E402

BENCH = os.path.join(REPO_ROOT, "benchmark", "moe")


def _bench():
    if BENCH not in sys.path:
        sys.path.insert(0, BENCH)
    spec = importlib.util.spec_from_file_location("bench_moe_overlap", os.path.join(BENCH, "bench_moe_overlap.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_moe_overlap"] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("nproc", [1, 2])
def test_smoke_mode_writes_a_record(tmp_path, nproc):
    shared_path("models", "stories260K-moe8")
    bench = _bench()
    path = bench.main(["--smoke", "--device", "cpu", "--nproc", str(nproc), "--out", str(tmp_path)])
    rec = json.loads(path.read_text())
    assert rec["schema"] == 1 and rec["subject"] == "moe" and rec["gpu"]["model"] == "cpu"
    assert rec["git_commit"] and rec["command"] and rec["versions"]["torch"] and path.name.endswith("_cpu.json")
    columns = {k for r in rec["rows"] for k in r}
    assert set(rec["baselines"]) <= columns and rec["units"]["seq_ms"] == "ms"
    assert {r["tokens"] for r in rec["rows"]} == {8, 300} and {r["level"] for r in rec["rows"]} == {"layer", "model"}
    assert {r["mode"] for r in rec["rows"]} == {"decode", "prefill"}
    ep = [r for r in rec["rows"] if r["layout"] == "ep"]
    assert all(r["seq_ms"] > 0 and r["tbo_ms"] > 0 and r["expert_ms"] > 0 and r["tbo_split"] for r in ep)
    assert any("straddles" in r["tbo_split"] for r in ep)  # the prefill is cut inside its request
    md = path.with_suffix(".md").read_text()
    if nproc == 1:
        assert [v["auto_choice"] for v in rec["verdicts"]] == ["off (EP 1)"] * 4
        assert "Single-rank split overhead" in md
    else:
        layouts = {r["layout"] for r in rec["rows"]}
        # every layout runs or is skipped with a reason (tdist needs the Triton interpreter on CPU)
        assert {"tp", "ep", "a2a_nccl"} <= layouts <= {"tp", "ep", "a2a_nccl", "a2a_tdist"}
        assert layouts | {s["layout"] for s in rec["skipped"]} == {"tp", "ep", "a2a_nccl", "a2a_tdist"}
        assert all(r["comm_ms"] is not None and r["seq_nocomm_ms"] is not None for r in rec["rows"])
        assert all((r["a2a_ms"] is not None) == r["layout"].startswith("a2a") for r in rec["rows"])
        assert all(r["tbo_nocomm_ms"] is not None for r in rec["rows"] if r["layout"] != "tp")
        assert len(rec["candidates"]) == 2 * (len(layouts) - 1) and "Candidate auto-off thresholds" in md


def test_hidden_fraction_and_candidates():
    bench = _bench()

    class Split:
        def describe(self):
            return "1 + 1 tokens, by requests"

    tbo = type("T", (), {"last_split": Split()})()
    # unsplit 10 ms of which 4 ms exposed communication (6 ms without); TBO 8 ms, 7 ms of it without communication
    res = {"ep|seq": 10.0, "ep|seq_nocomm": 6.0, "ep|tbo": 8.0, "ep|tbo_nocomm": 7.0}
    row = bench._row("m", "model", 1024, "prefill", "ep", 4, res, tbo, 2.0, 3.0)
    assert row["exposed_comm_ms"] == pytest.approx(4.0) and row["hidden_frac"] == pytest.approx(0.75)
    assert row["tbo_vs_seq"] == pytest.approx(0.8) and row["split_overhead"] == pytest.approx(7 / 6)
    rows = [{"model": "m", "level": "model", "layout": "ep", "ep_size": 4, "tokens": t, "seq_ms": 1.0, "tbo_ms": x}
            for t, x in ((16, 1.3), (256, 0.9), (1024, 1.1), (4096, 0.95), (8192, 0.9))]
    (c,) = bench.candidates(rows, "H100")
    assert c["min_tokens"] == 4096  # won at 256 too, but lost again at 1024
    rows[-1]["tbo_ms"] = 1.2
    assert bench.candidates(rows, "H100")[0]["min_tokens"] is None  # lost at the largest size: stays off
