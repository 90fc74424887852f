"""The scheduler's step trace and log lines, ``--disable-mixed-chunk`` and ``--schedule-conservativeness``, on the
fake runner of ``test_scheduler.py`` (every test runs with overlap scheduling off and on)."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_scheduler import assert_kv_returned, expected, make, record, run_all, submit  # noqa: E402
from test_scheduler import overlap  # noqa: E402,F401 (the autouse fixture, used by name)

from sglang.srt.forward_batch_info import ForwardMode  # noqa: E402
from sglang.srt.metrics.step_trace import STEP_TRACE_ENV  # noqa: E402
from sglang.srt.server_args import ServerArgs  # noqa: E402


def _workload(s):
    """Request a decodes while b (a chunked 37-token prompt) and c arrive: prefill and decode steps overlap."""
    res: dict = {}
    submit(s, "a", [3, 4, 5], max_new_tokens=20)
    record(res, s.step())
    record(res, s.step())
    submit(s, "b", list(range(3, 40)), max_new_tokens=4)
    submit(s, "c", [7, 8, 9, 10], max_new_tokens=6)
    return run_all(s, results=res)


def _check_outputs(res):
    assert res["a"]["ids"] == expected([3, 4, 5], 20)
    assert res["b"]["ids"] == expected(list(range(3, 40)), 4)
    assert res["c"]["ids"] == expected([7, 8, 9, 10], 6)


@pytest.mark.parametrize("flag", [None, True, False], ids=["default", "enable", "disable"])
def test_mixed_chunk_flag(flag):
    s, runner = make(chunked_prefill_size=16, enable_mixed_chunk=flag)
    res = _workload(s)
    _check_outputs(res)
    modes = {b.forward_mode for b in runner.batches}
    if flag is False:  # SGLang's scheduling: prefill batches alone, never mixed
        assert ForwardMode.MIXED not in modes and ForwardMode.EXTEND in modes, modes
    else:
        assert ForwardMode.MIXED in modes, modes
    assert_kv_returned(s, runner)


def test_disable_mixed_chunk_prefill_takes_the_whole_chunk():
    # without mixing the running decode rows do not shrink the step's prefill budget
    s, runner = make(chunked_prefill_size=16, enable_mixed_chunk=False)
    _check_outputs(_workload(s))
    extends = [b for b in runner.batches if b.forward_mode == ForwardMode.EXTEND]
    assert max(sum(b.extend_lens) for b in extends) == 16
    assert all(all(e == 1 for e in b.extend_lens) for b in runner.batches if b.forward_mode == ForwardMode.DECODE)


def test_step_trace_records_every_forward(tmp_path, monkeypatch):
    path = tmp_path / "trace.jsonl"
    monkeypatch.setenv(STEP_TRACE_ENV, str(path))
    s, runner = make(chunked_prefill_size=16)
    _check_outputs(_workload(s))
    s.close()
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["i"] for r in recs] == list(range(1, len(runner.batches) + 1))
    for r, b in zip(recs, runner.batches):
        assert r["mode"] == b.forward_mode.name.lower()
        assert r["bs"] == len(b.extend_lens)
        assert r["dec"] + r["pre_tok"] <= sum(b.extend_lens) and r["pre_tok"] + r["dec"] == sum(b.extend_lens)
        dec_rows = [i for i, (e, p) in enumerate(zip(b.extend_lens, b.prefix_lens))
                    if b.forward_mode == ForwardMode.DECODE or (e == 1 and p > 0)]
        assert r["kv_tok"] == sum(b.seq_lens[i] for i in dec_rows)
        assert r["graph"] is False and r["gpu"] is None and r["gpu_t"] is None  # CPU: no graphs, no events
        assert r["build"] >= 0 and r["wait"] >= 0 and r["proc"] >= 0
    assert [r["t_s"] for r in recs] == sorted(r["t_s"] for r in recs)
    # every generated token is counted once: decode rows of decode/mixed steps + first tokens of finished prefills
    total_out = 20 + 4 + 6
    assert sum(r["dec"] for r in recs) == total_out - 3  # each request's first token comes from its prefill
    assert {r["mode"] for r in recs} >= {"extend", "decode", "mixed"}


def test_step_trace_off_by_default(tmp_path, monkeypatch):
    monkeypatch.delenv(STEP_TRACE_ENV, raising=False)
    s, runner = make(chunked_prefill_size=16)
    _check_outputs(_workload(s))
    assert not s.tracer.enabled
    assert all(getattr(b, "gpu_timing", None) is None for b in runner.batches)


def test_sglang_style_log_lines(caplog):
    caplog.set_level(logging.INFO, logger="sglang.srt.metrics.step_trace")
    s, runner = make(chunked_prefill_size=16, decode_log_interval=2)
    _check_outputs(_workload(s))
    prefill = [m for m in caplog.messages if m.startswith("Prefill batch. #new-seq: ")]
    decode = [m for m in caplog.messages if m.startswith("Decode batch. #running-req: ")]
    n_dec = sum(1 for b in runner.batches if b.forward_mode == ForwardMode.DECODE)
    assert len(prefill) == sum(1 for b in runner.batches if b.forward_mode != ForwardMode.DECODE)
    assert len(decode) == n_dec // 2
    assert all("gen throughput (token/s): " in m and "cuda graph: False" in m for m in decode)


def test_schedule_conservativeness_scales_the_reserve():
    s1, _ = make()
    s2, _ = make(schedule_conservativeness=2.0)
    assert s1.new_token_ratio == pytest.approx(0.7) and s1.min_new_token_ratio == pytest.approx(0.098)
    assert s2.new_token_ratio == pytest.approx(1.0) and s2.min_new_token_ratio == pytest.approx(0.14)
    assert s1.new_token_ratio_decay == pytest.approx((0.7 - 0.098) / 600)


@pytest.mark.parametrize("kw,flag", [({"decode_log_interval": 0}, "--decode-log-interval"),
                                     ({"schedule_conservativeness": 0.0}, "--schedule-conservativeness")])
def test_bad_values_name_the_flag(kw, flag):
    with pytest.raises(ValueError, match=flag):
        ServerArgs(**kw)


def test_cli_pair_for_mixed_chunk():
    from sglang.srt.server_args import prepare_server_args

    assert prepare_server_args([]).resolved_enable_mixed_chunk is True
    assert prepare_server_args(["--enable-mixed-chunk"]).enable_mixed_chunk is True
    off = prepare_server_args(["--disable-mixed-chunk", "--decode-log-interval", "10"])
    assert off.enable_mixed_chunk is False and not off.resolved_enable_mixed_chunk and off.decode_log_interval == 10
