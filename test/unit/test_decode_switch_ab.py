"""benchmark/decode/switch_ab.py on CPU: the set spec of ``bench_decode_ab.py --switch-ab`` parses into
(name, variables) pairs, rejects malformed or unknown entries with the offending set named, and the per-set
environment is exactly the set's variables while it runs and restored afterwards."""

from __future__ import annotations

import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

from benchmark.decode import switch_ab as sw  # noqa: E402

TILE, PDL, FUSE = sw.SWITCHES


def test_parse_sets():
    got = sw.parse_sets(f"default:; nopdl:{PDL}=0 ;all:{PDL}=2,{TILE}=128/8/3")
    assert got == [("default", {}), ("nopdl", {PDL: "0"}), ("all", {PDL: "2", TILE: "128/8/3"})]


@pytest.mark.parametrize("spec", ["old:", "old:;old:", f"a:;b:{PDL}", "a:;b:FOO=1", f"a:;:{PDL}=0",
                                  "a:;b:SGLANG_DECODE_EARLY_LOADS=1", ""])
def test_parse_sets_rejects(spec):
    with pytest.raises(ValueError, match="--switch-ab"):
        sw.parse_sets(spec)


def test_switched_sets_exactly_the_set_and_restores(monkeypatch):
    monkeypatch.setenv(TILE, "64/4/3")
    monkeypatch.delenv(PDL, raising=False)
    with sw.switched({PDL: "0"}):
        assert os.environ[PDL] == "0" and TILE not in os.environ
    assert os.environ[TILE] == "64/4/3" and PDL not in os.environ
    with pytest.raises(RuntimeError):
        with sw.switched({}):
            raise RuntimeError("restored even on errors")
    assert os.environ[TILE] == "64/4/3"


def test_render_switch_reports_difference_to_first_set():
    row = dict(batch=32, env={}, floor_ms=6.4, replay_floor_ms=6.4, steps=24)
    res = {"sets": [["old", {}], ["nopdl", {PDL: "0"}]], "breakdown": [],
           "rows": [dict(row, set="old", step_ms=7.75, ratio=1.211, replay_ms=7.8, replay_ratio=1.219,
                         host_replay_ms=0.021, nodes={"total": 330, "kernel": 325}),
                    dict(row, set="nopdl", step_ms=7.60, ratio=1.188, replay_ms=7.7, replay_ratio=1.203,
                         host_replay_ms=0.019, nodes=None)]}
    text = "\n".join(sw.render_switch(res, 3.0e12))
    assert f"`nopdl` = {PDL}=0" in text
    assert "| 32 | old | 7.750 | 6.400 | 1.211 | +0.000 | 7.800 | 1.219 | +0.000 | 0.021 | 330 (325 kernels) | 24 |" \
        in text
    assert "| 32 | nopdl | 7.600 | 6.400 | 1.188 | -0.150 | 7.700 | 1.203 | -0.100 | 0.019 | n/a | 24 |" in text


def test_capture_sets_tunes_once_per_pdl_mode(monkeypatch):
    """The decode-GEMM autotune runs at the first capture of each SGLANG_DECODE_PDL value, unset counting as the
    GPU model's default (2 here, as on an H100; the skinny kernel's launch mode changes its timings); later sets of that value reuse its table; the
    real tuner is restored afterwards."""
    from sglang.srt.layers import decode_gemm

    tuned = []

    def fake_tune(*a, **k):
        tuned.append(os.environ.get(PDL, "unset"))
        return f"table{len(tuned)}"

    class Graphs:
        def __init__(self, table):
            self.decode_gemm_table = table

    monkeypatch.setattr(decode_gemm, "maybe_autotune", fake_tune)
    monkeypatch.setattr(sw, "_unset_pdl_mode", lambda: "2")  # a GPU model where unset means on (H100)
    sets = sw.parse_sets(f"default:;tile:{TILE}=128/8/3;pdl2:{PDL}=2;nopdl:{PDL}=0;nopdl_tile:{PDL}=0,{TILE}=128/8/3")
    graphs = sw.capture_sets(None, [1, 32], lambda runner, sizes: Graphs(decode_gemm.maybe_autotune()), sets)
    assert tuned == ["unset", "0"]  # default, tile and pdl2 share the table of mode 2
    assert {n: g.decode_gemm_table for n, g in graphs.items()} == {
        "default": "table1", "tile": "table1", "pdl2": "table1", "nopdl": "table2", "nopdl_tile": "table2"}
    assert decode_gemm.maybe_autotune is fake_tune


def test_capture_sets_tunes_once_per_pdl_and_fuse_value(monkeypatch):
    """SGLANG_DECODE_FUSE_EPILOGUE changes the GEMM table (fused forms are timed), so each (PDL, fuse) pair
    tunes its own table, with the set's fuse value in the environment while it tunes; unset fuse counts as 0."""
    from sglang.srt.layers import decode_gemm

    tuned = []

    def fake_tune(*a, **k):
        tuned.append((os.environ.get(PDL, "unset"), os.environ.get(FUSE, "unset")))
        return f"table{len(tuned)}"

    class Graphs:
        def __init__(self, table):
            self.decode_gemm_table = table

    monkeypatch.setattr(decode_gemm, "maybe_autotune", fake_tune)
    monkeypatch.setattr(sw, "_unset_pdl_mode", lambda: "0")  # a GPU model where unset means off (H200)
    sets = sw.parse_sets(f"default:;fuse:{FUSE}=1;off:{FUSE}=0;pdl_fuse:{PDL}=2,{FUSE}=1")
    graphs = sw.capture_sets(None, [1, 32], lambda runner, sizes: Graphs(decode_gemm.maybe_autotune()), sets)
    assert tuned == [("unset", "unset"), ("unset", "1"), ("2", "1")]
    assert {n: g.decode_gemm_table for n, g in graphs.items()} == {
        "default": "table1", "fuse": "table2", "off": "table1", "pdl_fuse": "table3"}
