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
