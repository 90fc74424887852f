"""benchmark/afd/crossover.py: the plan search per GPU budget against a colocated per-GPU rate -- rows per budget,
the ratio consistent with the plan's own per-GPU throughput, the crossover line naming the first budget that meets
1.3x (or none), and clear errors for a missing baseline."""

from __future__ import annotations

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from conftest import shared_path  # noqa: E402


def _rows(lines):
    return [x for x in lines if x.startswith("| ") and not x.startswith("| GPUs")]


def test_crossover_rows_and_line():
    from benchmark.afd import crossover as afd_crossover

    cfg = shared_path("configs", "mistralai--Mixtral-8x7B-v0.1")
    low = afd_crossover.crossover_lines(cfg, "H100", 1.0, [4, 8], 100.0)  # a tiny baseline: AFD wins at once
    rows = _rows(low)
    assert len(rows) == 2 and all(r.endswith("| yes |") for r in rows)
    per_gpu = float(rows[0].split(" | ")[5].replace(",", ""))
    ratio = float(rows[0].split(" | ")[6].rstrip("x"))
    assert abs(ratio - per_gpu) <= 1e-3 * per_gpu  # baseline 1 tok/s per GPU: the ratio is the plan's per-GPU rate
    assert low[-1] == "Crossover: AFD reaches 1.3x colocated per GPU from 4 GPUs (model)."
    high = afd_crossover.crossover_lines(cfg, "H100", 1e9, [4, 8], 100.0)  # an unbeatable baseline
    assert all(r.endswith("| no |") for r in _rows(high)) and high[-1].startswith("Crossover: none up to 8 GPUs")


def test_crossover_cli_reads_colocated_json(tmp_path, capsys):
    from benchmark.afd import crossover as afd_crossover

    cfg = shared_path("configs", "mistralai--Mixtral-8x7B-v0.1")
    colo = tmp_path / "colo.json"
    colo.write_text(json.dumps({"colocated": {"rows": {"64": {"tps": 900.0, "step_s": 0.05},
                                                        "256": {"tps": 2000.0, "step_s": 0.128}}}}))
    assert afd_crossover.main(["--model-path", cfg, "--gpu", "H100", "--colocated-json", str(colo),
                               "--totals", "4"]) == 0
    out = capsys.readouterr().out
    assert "- colocated (measured): batch 256, 128.00 ms per step, 2,000.0 tok/s per GPU" in out
    assert afd_crossover.main(["--model-path", cfg, "--gpu", "H100"]) == 2
    assert "--colocated-json or --colocated-tps-per-gpu" in capsys.readouterr().err
    (tmp_path / "empty.json").write_text("{}")
    assert afd_crossover.main(["--model-path", cfg, "--gpu", "H100", "--colocated-json",
                               str(tmp_path / "empty.json")]) == 2


def test_crossover_record_rows_ratio_headline(tmp_path):
    """--record-dir: the rows of crossover_lines (rows_out) -- one per GPU budget with the plan's tok/s per GPU, the
    measured colocated baseline and their ratio, an infeasible budget with its reason -- as a valid record whose
    headline is the best budget's ratio and the crossover budget."""
    from benchmark.afd import crossover as afd_crossover
    from benchmark.common import records

    rows = [{"gpus": 4, "error": "infeasible: TPOT SLO", "colocated_tok_s_per_gpu": 1500.0},
            {"gpus": 8, "tp_a": 1, "n_a": 4, "tp_e": 1, "n_e": 4, "m": 3, "micro_batch": 128, "global_batch": 1536,
             "ta_ms": 0.21, "te_ms": 0.18, "tc_ms": 0.05, "m_min": 2.48, "tpot_ms": 40.2, "tok_s_per_gpu": 1800.0,
             "colocated_tok_s_per_gpu": 1500.0},
            {"gpus": 16, "tp_a": 1, "n_a": 8, "tp_e": 2, "n_e": 4, "m": 3, "micro_batch": 256, "global_batch": 6144,
             "ta_ms": 0.3, "te_ms": 0.25, "tc_ms": 0.06, "m_min": 2.4, "tpot_ms": 62.0, "tok_s_per_gpu": 2100.0,
             "colocated_tok_s_per_gpu": 1500.0}]
    env = {"git_commit": "abc", "git_dirty": False, "date": "2026-12-07T00:00:00+00:00",
           "gpu": {"model": "cpu", "count": 0, "driver": None}, "versions": {"python": "3"}}
    rec = afd_crossover.crossover_record(rows, "H100", {"totals": [4, 8, 16]}, notes=["colocated (measured): x"],
                                         env=env, command="python benchmark/afd/crossover.py")
    js, md = records.write_record(rec, tmp_path)
    rec = records.load_record(js)
    assert js.name == "2026-12-07_afd_crossover_h100_cpu.json" and rec["baselines"] == ["colocated_tok_s_per_gpu"]
    r4, r8, r16 = rec["rows"]
    assert r4["vs_colocated"] is None and r4["meets_target"] is False and r4["error"].startswith("infeasible")
    assert r8["vs_colocated"] == round(1800.0 / 1500.0, 3) and r8["meets_target"] is False  # 1.2 < 1.3
    assert r16["vs_colocated"] == round(2100.0 / 1500.0, 3) and r16["meets_target"] is True
    best, cross = rec["headline"]
    assert (best["value"], best["baseline"], best["ratio"]) == (2100.0, 1500.0, round(2100.0 / 1500.0, 3))
    assert cross["value"] == 16 and rec["params"]["target"] == afd_crossover.TARGET
    assert "| gpus |" in md.read_text() and "colocated (measured): x" in records.render_markdown(rec)


def test_crossover_cli_record_dir(tmp_path, capsys):
    """The CLI with --record-dir writes one record whose rows match the printed table's budgets and ratios."""
    from benchmark.afd import crossover as afd_crossover
    from benchmark.common import records

    cfg = shared_path("configs", "mistralai--Mixtral-8x7B-v0.1")
    assert afd_crossover.main(["--model-path", cfg, "--gpu", "H100", "--colocated-tps-per-gpu", "1.0",
                               "--totals", "4", "8", "--record-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    (js,) = (tmp_path / "afd").glob("*_afd_crossover_h100_*.json")
    rec = records.load_record(js)
    assert [r["gpus"] for r in rec["rows"]] == [4, 8] and f"record: {js}" in out
    for row, line in zip(rec["rows"], _rows(out.splitlines())):
        assert row["vs_colocated"] == round(row["tok_s_per_gpu"] / 1.0, 3) and row["meets_target"] is True
        assert f"{row['tok_s_per_gpu']:,.1f}" == line.split(" | ")[5]
    assert rec["headline"][1]["value"] == 4
