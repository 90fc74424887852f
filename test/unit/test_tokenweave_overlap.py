"""The overlap check of bench_tokenweave (communication kernel time overlapped by compute kernels, from
profiler kernel events) and TokenWeave's GEMM SM carveout (argument checks, CPU no-op, restored state)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def _k(name, ts, dur, stream):
    return {"name": name, "ts": ts, "dur": dur, "args": {"stream": stream}}


def test_overlap_stats_counts_only_concurrent_time():
    from benchmark.tokenweave.layer_profile import overlap_stats

    kernels = [dict(_k("nvjet_tst_gemm", 0, 100, 7), args={"stream": 7, "grid": [116, 1, 1]}), _k("flash_fwd", 100, 50, 7), _k("nvjet_tst_gemm", 200, 100, 7),
               _k("twoshot_kernel<bf16>", 80, 40, 20),   # 80..120: fully under compute (0..150)
               _k("twoshot_kernel<bf16>", 160, 60, 20)]  # 160..220: compute idle 150..200, then GEMM 200..220
    s = overlap_stats(kernels)
    assert s["comm_us"] == pytest.approx(100)
    assert s["overlap_us"] == pytest.approx(40 + 20)
    assert s["overlap_frac"] == pytest.approx(0.6)
    assert s["compute_us"] == pytest.approx(250) and s["gemm_us"] == pytest.approx(200)
    assert s["span_us"] == pytest.approx(300) and s["comm_kernels"] == 2
    assert s["comm_streams"] == [20] and s["compute_streams"] == [7] and s["gemm_max_ctas"] == 116


def test_overlap_stats_serialized_and_empty():
    from benchmark.tokenweave.layer_profile import overlap_stats, overlap_table

    serial = overlap_stats([_k("gemm", 0, 100, 7), _k("ncclDevKernel_AllReduce", 100, 30, 7)])
    assert serial["overlap_us"] == 0 and serial["overlap_frac"] == 0 and serial["comm_us"] == pytest.approx(30)
    none = overlap_stats([_k("gemm", 0, 10, 7)])
    assert none["comm_us"] == 0 and none["overlap_frac"] == 0
    rows = overlap_table([("nccl", 4096, serial)])
    assert rows[-1].startswith("| nccl | 4096 | 130 | 30 | 0 | 0.00 | 100 | 100 | 0 | 1 |")


def test_gemm_carveout_checks_and_cpu_noop():
    from sglang.srt.tokenweave.carveout import GemmCarveout

    with pytest.raises(ValueError, match="carveout=132"):
        GemmCarveout(132, 132, torch.device("cpu"))
    with pytest.raises(ValueError, match="carveout=-1"):
        GemmCarveout(-1, 132, torch.device("cpu"))
    before = torch._C._get_sm_carveout_experimental()
    with GemmCarveout(16, 132, torch.device("cpu")) as c:  # no CUDA: nothing changes
        assert not c.active and torch._C._get_sm_carveout_experimental() == before


def test_tokenweave_config_carveout_default_is_comm_budget():
    from sglang.srt.tokenweave.executor import TokenWeaveConfig

    assert TokenWeaveConfig(gemm_widths=(8,)).carveout_sms() == 16  # tw-comm's overlap CTA default
    assert TokenWeaveConfig(gemm_widths=(8,), comm_sms=8).carveout_sms() == 8
    assert TokenWeaveConfig(gemm_widths=(8,), comm_sms=8, gemm_carveout=0).carveout_sms() == 0
    with pytest.raises(ValueError, match="gemm_carveout=-2"):
        TokenWeaveConfig(gemm_widths=(8,), gemm_carveout=-2)


def test_gemm_carveout_sets_and_restores_both_caps(monkeypatch):
    """The CUDA path with the cuBLAS library and handle faked: inside the block torch's cuBLASLt carveout is 16
    and the handle targets 116 SMs; after it (also after an error) both are back to their defaults."""
    import contextlib

    from sglang.srt.tokenweave import carveout as mod

    calls = []

    class FakeLib:
        def cublasSetSmCountTarget(self, handle, n):
            calls.append((handle.value, n))
            return 0

    monkeypatch.setattr(mod, "_cublas", lambda: FakeLib())
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_blas_handle", lambda: 1234)
    before = torch._C._get_sm_carveout_experimental()
    c = mod.GemmCarveout(16, 132, torch.device("cuda", 0))
    with pytest.raises(RuntimeError, match="boom"):
        with c:
            assert torch._C._get_sm_carveout_experimental() == 16 and calls == [(1234, 116)]
            raise RuntimeError("boom")
    assert torch._C._get_sm_carveout_experimental() == before and calls[-1] == (1234, 0)
    with c:  # reusable across forwards
        pass
    assert calls == [(1234, 116), (1234, 0), (1234, 116), (1234, 0)]
