"""Decomposition AG-GEMM / GEMM-RS (sgl_kernel/tdist/decomp.py), their NCCL fallback (auto.py) and the SM kernels'
cached metadata on 2 GPUs, one rank per GPU (cases in tdist_decomp_case.py): results vs torch references on random
inputs, back-to-back reuse, CUDA-graph capture and replay. Skips without 2 CUDA GPUs. Multicast stays off.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

from sglang.srt.utils.nvls_env import apply_nvls_off_env

apply_nvls_off_env(os.environ)
HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
for p in (str(REPO / "sgl-kernel" / "python"), str(REPO / "python"), str(HERE)):
    if p not in sys.path:
        sys.path.insert(0, p)
os.environ["PYTHONPATH"] = os.pathsep.join([str(REPO / "sgl-kernel" / "python"), str(REPO / "python"), str(HERE),
                                            os.environ.get("PYTHONPATH", "")])

pytestmark = pytest.mark.gpu
if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)

CASES = ("decomp", "schedules", "a2a", "sm_cached", "auto", "bounded", "graph", "sm_graph", "deadpeer")  # riskiest last
_RESULTS = {}


def _run():
    if "r" not in _RESULTS:
        import torch

        if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
            pytest.skip("needs 2 CUDA GPUs (one rank per GPU)")
        os.environ.pop("TRITON_INTERPRET", None)
        import tdist_decomp_case as C
        from sgl_kernel.tdist.layout import HeapConfig
        from sgl_kernel.tdist.spawn import run_ranks

        from sglang.srt.utils.nvls_env import NVLS_OFF_ENV

        cfg = HeapConfig(data_bytes=64 << 20, signal_slots=1024, wait_timeout_s=20)
        got = {}  # case -> {rank: failures}, filled as each case ends on each rank
        progress = None
        if os.environ.get("TDIST_GPU_PROGRESS") == "1":  # live progress notes (use with -s)
            progress = lambda r, msg: print(f"[rank {r}] {msg}", flush=True)  # noqa: E731 (CLI-style test output)
        _, problems = run_ranks(2, C.run, (CASES,), env=NVLS_OFF_ENV, heap_config=cfg, with_nccl=True,
                                timeout=float(os.environ.get("TDIST_GPU_TIMEOUT", "240")), stall_timeout=90,
                                on_result=lambda r, case, fails: got.setdefault(case, {}).__setitem__(r, fails),
                                on_note=progress)
        _RESULTS["r"] = (got, problems)
    return _RESULTS["r"]


@pytest.mark.parametrize("case", CASES)
def test_decomp_case(case):
    got, problems = _run()
    outcome = got.get(case, {})
    missing = [r for r in range(2) if r not in outcome]
    assert not missing, f"{case}: ranks {missing} did not finish it; group problems: " + " | ".join(problems)
    msgs = [f"rank {r}: " + "; ".join(fails) for r, fails in sorted(outcome.items()) if fails]
    assert not msgs, "\n".join(msgs)
