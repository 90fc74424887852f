"""The CPU-runnable parts of ``test/gpu/tw_comm_stress_gpus.py``: the variant names it cycles --
every tw-comm backend TokenWeave's calls can pick, including the bulk-copy two-shot and the residual-sharded calls of
the split halves -- map to the right ``(backend, residual_sharded)`` call, argument errors name the bad value, and
the default (the 100,000-call run) is unchanged."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "gpu"))
import tw_comm_stress_gpus as stress  # noqa: E402


def test_variants_cover_bulk_and_sharded_calls():
    from sglang.srt.distributed.tw_comm import TwBackend

    calls = {v: stress.variant_call(v) for v in stress.VARIANTS}
    for name, (backend, sharded) in calls.items():
        TwBackend(backend)  # every variant is a real backend
        assert sharded is name.endswith("_sharded"), name
    assert calls["p2p_twoshot_bulk"] == ("p2p_twoshot_bulk", False)
    assert {b for b, sh in calls.values() if sh} == {"p2p_twoshot", "p2p_twoshot_pipe", "p2p_twoshot_bulk", "ce"}
    with pytest.raises(ValueError, match="p2p_oneshot_sharded"):  # one-shot reads every residual row: no such call
        stress.variant_call("p2p_oneshot_sharded")


def test_parse_args_new_variants_and_errors():
    a = stress.parse_args(["--world", "2", "--calls", "20", "--variants", "p2p_twoshot_bulk",
                           "p2p_twoshot_bulk_sharded", "ce_sharded"])
    assert a.variants == ["p2p_twoshot_bulk", "p2p_twoshot_bulk_sharded", "ce_sharded"] and a.calls == 20
    assert stress.parse_args([]).variants == ["p2p_lamport", "p2p_oneshot", "p2p_twoshot", "p2p_twoshot_pipe"]
    for bad in (["--variants", "p2p_lamport_sharded"], ["--calls", "0"], ["--sms", "0"], ["--hidden", "12"]):
        with pytest.raises(SystemExit):
            stress.parse_args(bad)
