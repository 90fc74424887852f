"""sglang.srt.afd.step_timing on CPU: stamp pairs -> per-step medians, the m >= 2(1 + Tc/Tf) check (MegaScale-Infer
sec. 4.1) and its table cells, bad input refused."""

from __future__ import annotations

import time

import pytest
import torch

from sglang.srt.afd.step_timing import StepTimer, format_check, pipeline_check


def test_timer_pairs_give_per_step_medians():
    t = StepTimer(torch.device("cpu"))
    for step, waits in enumerate(((0.002, 0.004, 0.006), (0.001, 0.001, 0.001))):
        t.begin()
        for w in waits:
            p = t.open("ta")
            time.sleep(w)
            t.close(p)
        t.open("rtt")  # never closed: ignored
        got = t.collect()
        assert set(got) == {"ta"}
        assert got["ta"] == pytest.approx(sorted(waits)[1] * 1e3, abs=3.0)
    assert len(t.samples["ta"]) == 2 and t.medians()["ta"] > 0
    t.reset_samples()
    assert t.medians() == {}


def test_pipeline_check_values_and_cells():
    c = pipeline_check(0.2, 0.4, 0.6, 3)
    assert c["tc_ms"] == pytest.approx(0.1) and c["m_min"] == pytest.approx(2.5) and c["hidden"]
    assert not pipeline_check(0.2, 0.4, 0.6, 2)["hidden"]
    assert pipeline_check(0.2, 0.4, 0.3, 1)["tc_ms"] == 0.0  # a round trip below Tf: Tc clamped at 0
    assert format_check(c) == "0.200 / 0.400 / 0.100 | m >= 2(1+Tc/Tf) = 2.50: yes"
    assert format_check(None) == "n/a | n/a"
    for bad in ((0.1, 0.0, 0.2, 1), (-1, 0.4, 0.6, 1), (0.1, 0.4, 0.6, 0)):
        with pytest.raises(ValueError, match="pipeline_check"):
            pipeline_check(*bad)
