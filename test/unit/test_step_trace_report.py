"""benchmark/serving/step_trace_report.py on a synthetic trace whose breakdown is known by construction."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest

from conftest import REPO_ROOT

_PATH = os.path.join(REPO_ROOT, "benchmark", "serving", "step_trace_report.py")


@pytest.fixture(scope="module")
def rep():
    spec = importlib.util.spec_from_file_location("step_trace_report", _PATH)
    mod = importlib.util.module_from_spec(spec)
    import sys

    sys.modules["step_trace_report"] = mod
    spec.loader.exec_module(mod)
    return mod


def _trace():
    """4 extend steps of 100 ms, 1 mixed step of 50 ms, 10 graph decode steps at bs 100 (10 ms), 5 eager decode
    steps at bs 200 (20 ms) with the queue empty from the first of them; 1 ms device idle before every step."""
    recs, t, i = [], 0.0, 0

    def add(mode, bs, dec, pre, kv, graph, gpu, waiting, retract=0):
        nonlocal t, i
        i += 1
        recs.append({"i": i, "t_s": t / 1e3, "mode": mode, "bs": bs, "dec": dec, "pre_tok": pre, "kv_tok": kv,
                     "graph": graph, "running": bs, "waiting": waiting, "usage": 0.5, "retract": retract,
                     "build": 2.0, "wait": 1.0, "proc": 0.5, "gpu": gpu, "gpu_t": t + 1.0})
        t += gpu + 1.0

    for _ in range(4):
        add("extend", 2, 0, 8000, 0, False, 100.0, 50)
    add("mixed", 10, 8, 4000, 8 * 1000, False, 50.0, 40)
    for _ in range(10):
        add("decode", 100, 100, 0, 100 * 2000, True, 10.0, 30)
    for _ in range(5):
        add("decode", 200, 200, 0, 200 * 3000, False, 20.0, 0, retract=3)
    return recs


def test_breakdown_matches_construction(rep):
    recs = _trace()
    model = rep.Model(weight_bytes=16e9, kv_bytes_per_token=131072, bw=3e12, prefill_flops=700e12)
    a = rep.analyze(recs, model, graph_max_bs=160)
    # device clock: first start at 1 ms, last end = start of the 20th step + 20 ms
    busy_ms = 4 * 100 + 50 + 10 * 10 + 5 * 20
    assert a["busy_s"] == pytest.approx(busy_ms / 1e3)
    assert a["wall_s"] == pytest.approx((busy_ms + 19) / 1e3)  # 19 idle gaps between 20 steps
    assert a["idle_s"] == pytest.approx(0.019)
    assert a["prefill_share_of_wall"] == pytest.approx(450 / (busy_ms + 19))
    assert a["by_mode"]["decode"]["steps"] == 15 and a["by_mode"]["extend"]["pre_tok"] == 32000
    assert a["decode_tokens"] == 8 + 1000 + 1000 and a["prefill_tokens"] == 36000
    bins = {b["bin"]: b for b in a["decode_bins"]}
    assert set(bins) == {"97-128", "193-256"}
    assert bins["97-128"]["steps"] == 10 and bins["97-128"]["eager"] == 0
    floor = (16e9 + 200_000 * 131072) / 3e12 * 1e3
    assert bins["97-128"]["floor_ms"] == pytest.approx(floor)
    assert bins["97-128"]["ratio"] == pytest.approx(10.0 / floor)
    assert bins["193-256"]["eager"] == 5
    assert a["eager_decode_steps"] == 5 and a["above_graph_steps"] == 5 and a["above_graph_s"] == pytest.approx(0.1)
    assert a["max_decode_bs"] == 200 and a["retractions"] == 3
    assert a["drain"]["steps"] == 5 and a["drain"]["dec_tok"] == 1000
    assert a["drain"]["span_s"] == pytest.approx((4 * 21 + 20) / 1e3)
    assert a["host"]["decode"]["build"]["median_ms"] == 2.0
    assert a["host_bound_steps"] == 0  # build + proc = 2.5 ms < every step's device time
    ideal = (4 * 8000 * model.flop_per_token / 700e12 + 4000 * model.flop_per_token / 700e12
             + 8000 * 131072 / 3e12 + 10 * (16e9 + 200_000 * 131072) / 3e12 + 5 * (16e9 + 600_000 * 131072) / 3e12)
    assert a["ideal_s"] == pytest.approx(ideal)


def test_compare_over_common_horizon(rep):
    base = _trace()
    cut = [dict(r) for r in base[:12]]  # a variant cut after its 12th step, same pace
    c = rep.compare({"base": base, "cut": cut})
    assert c["horizon_s"] == pytest.approx(cut[-1]["t_s"])
    assert [r["tokens"] for r in c["rows"]] == [8 + 700, 8 + 700]
    assert c["rows"][1]["vs_first"] == pytest.approx(1.0)


def test_cli_writes_md_and_json_and_skips_a_torn_line(rep, tmp_path, capsys):
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in _trace()) + '\n{"i": 21, "mo')
    js, md = tmp_path / "a.json", tmp_path / "a.md"
    assert rep.main(["--trace", f"base={path}", "--trace", f"again={path}", "--json", str(js), "--md", str(md)]) == 0
    out = capsys.readouterr().out
    assert "| 193-256 | 5 | 200.0 |" in out and "base: wall" in out and "vs first" in out
    data = json.loads(js.read_text())
    assert data["traces"]["base"]["steps"] == 20 and data["compare"]["rows"][1]["vs_first"] == 1.0
    assert md.read_text().startswith("### base")


def test_empty_trace_is_refused(rep, tmp_path):
    p = tmp_path / "empty.jsonl"
    p.write_text("")
    with pytest.raises(ValueError, match="SGLANG_STEP_TRACE"):
        rep.load_trace(str(p))
