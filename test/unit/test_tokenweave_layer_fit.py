"""The fixed per-forward cost fit of the TokenWeave layer benchmark: on synthetic timings with a
known line per variant, ``tokenweave_report`` recovers the intercept (fixed ms per forward) and the slope (ms per
layer), reports TokenWeave's fixed cost over NCCL against the 0.2 ms target, and refuses a single layer count."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from conftest import load_benchmark  # noqa: E402


def _report():
    return load_benchmark("tokenweave.layer_report")


# (fixed ms, ms per layer) per variant at T=1024, eager; graph mode: fixed costs 0.1 ms lower
LINES = {"nccl": (0.50, 2.00), "tokenweave": (0.85, 1.80), "nocomm": (0.40, 1.60)}


def _run(layers: int, tokens=(1024,), noise: float = 0.0) -> dict:
    res = {}
    for v, (a, b) in LINES.items():
        for t in tokens:
            res[f"{v}|{t}"] = a + b * layers + noise
            res[f"graph|{v}|{t}"] = a - 0.1 + b * layers
            res[f"host|{v}|{t}"] = 0.3 + 0.01 * layers
    res["notes"] = ["not a timing"]
    return {"model": "llama", "tp": 4, "results": res}


def _write(tmp_path, r, layers, **kw) -> Path:
    c = _run(layers, **kw)
    return r.write_cases_json(tmp_path / f"L{layers}.json", layers, [1024], list(LINES),
                              [(c["model"], c["tp"], c["results"])])


def test_fit_line_exact_and_least_squares():
    r = _report()
    assert r.fit_line([1, 4], [2.5, 8.5]) == pytest.approx((0.5, 2.0, 0.0))
    # three points: the line 0.5 + 2x plus residuals (0.1, -0.15, 0.05), orthogonal to 1 and x, so least squares
    # recovers the line exactly and the rms is the residuals'
    icpt, slope, rms = r.fit_line([1, 2, 4], [2.6, 4.35, 8.55])
    assert (icpt, slope) == (pytest.approx(0.5), pytest.approx(2.0))
    assert rms == pytest.approx((0.035 / 3) ** 0.5)
    with pytest.raises(ValueError, match="2 distinct layer counts"):
        r.fit_line([4, 4], [1.0, 1.1])


def test_layer_fit_table_recovers_fixed_and_per_layer_cost(tmp_path):
    r = _report()
    runs = [json.loads(_write(tmp_path, r, n).read_text()) for n in (1, 4)]
    assert all("notes" not in c["results"] for run in runs for c in run["cases"])  # floats only
    fits = r.layer_fits(runs)
    assert fits[("llama", 4, "eager", 1024, "tokenweave")][:3] == ([1, 4], pytest.approx(0.85), pytest.approx(1.8))
    assert fits[("llama", 4, "graph", 1024, "nccl")][1] == pytest.approx(0.40)
    rows = {tuple(c.strip() for c in line.strip("|").split("|")[2:5]): line for line in r.layer_fit_table(runs)[2:]}
    tw = [c.strip() for c in rows[("eager", "1024", "tokenweave")].strip("|").split("|")]
    assert tw[5:] == ["1,4", "0.850", "1.800", "0.000", "+0.350", "0.900", "no"]  # 0.35 ms over NCCL >= 0.2
    g = [c.strip() for c in rows[("graph", "1024", "tokenweave")].strip("|").split("|")]
    assert g[9] == "+0.350" and g[11] == "no"
    nccl = [c.strip() for c in rows[("eager", "1024", "nccl")].strip("|").split("|")]
    assert nccl[9:] == ["+0.000", "1.000", "-"]  # target checked only for TokenWeave variants
    assert ("host", "1024", "tokenweave") in rows


def test_target_met_when_fixed_cost_over_nccl_is_small(tmp_path, monkeypatch):
    r = _report()
    monkeypatch.setitem(LINES, "tokenweave", (0.60, 1.80))  # 0.10 ms over NCCL
    runs = [json.loads(_write(tmp_path, r, n).read_text()) for n in (1, 4)]
    line = [x for x in r.layer_fit_table(runs) if "| eager | 1024 | tokenweave |" in x][0]
    assert line.endswith("| +0.100 | 0.900 | yes |")


def test_cli_writes_section_and_refuses_one_layer_count(tmp_path, capsys):
    r = _report()
    f1, f4 = _write(tmp_path, r, 1), _write(tmp_path, r, 4)
    out = tmp_path / "fit.md"
    text = r.main(["--layer-fit", str(f1), str(f4), "--out", str(out)])
    assert out.read_text() == text
    assert text.startswith("## fixed per-forward cost (least squares over layer counts 1, 4")
    assert "| llama | 4 | eager | 1024 | tokenweave | 1,4 | 0.850 | 1.800 |" in text
    with pytest.raises(SystemExit):
        r.main(["--layer-fit", str(f4), str(f4)])
    assert "needs runs at >= 2 layer counts" in capsys.readouterr().err
