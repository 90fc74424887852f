"""The decomposition AG-GEMM / GEMM-RS (sgl_kernel/tdist/decomp.py) at world 4, one rank per GPU (cases in
tdist_decomp_case.py): results vs torch references on fresh random inputs with even, uneven and empty segments,
back-to-back reuse, both per-peer stream schedules ("ring": staggered steps, the world >= 3 default; "all") eager
and captured in CUDA graphs, and the NCCL fallback of the Auto ops. Skips without 4 CUDA GPUs. Multicast stays off.

Run by ``scripts/gpu/four_gpu.sh tdist_w4_test``. Knobs for hang hunts: TDIST_GPU_TIMEOUT (group seconds),
TDIST_GPU_PROGRESS=1 (print every rank's progress notes as they arrive; use with -s), TDIST_DECOMP_SHARED_STREAMS=0
(per-op side streams, HeapConfig.shared_streams=False: the layout before 2026-11-27). CUDA_DEVICE_MAX_CONNECTIONS set in the
environment is kept (spawn.run_ranks sets 32 otherwise).
"""

from __future__ import annotations

import os
import sys
import time
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

pytestmark = pytest.mark.gpu_extended  # 4 GPUs
WORLD = 4
CASES = ("decomp", "schedules", "auto")
_RESULTS = {}


def _run():
    if "r" not in _RESULTS:
        import torch

        if not torch.cuda.is_available() or torch.cuda.device_count() < WORLD:
            pytest.skip(f"needs {WORLD} CUDA GPUs (one rank per GPU)")
        os.environ.pop("TRITON_INTERPRET", None)
        import tdist_decomp_case as C
        from sgl_kernel.tdist.layout import HeapConfig
        from sgl_kernel.tdist.spawn import run_ranks

        from sglang.srt.utils.nvls_env import NVLS_OFF_ENV

        shared = os.environ.get("TDIST_DECOMP_SHARED_STREAMS", "1") != "0"
        cfg = HeapConfig(data_bytes=64 << 20, signal_slots=1024, wait_timeout_s=20, shared_streams=shared)
        got = {}
        progress = None
        if os.environ.get("TDIST_GPU_PROGRESS") == "1":
            t0 = time.monotonic()
            progress = lambda r, msg: print(f"[rank {r}] +{time.monotonic() - t0:.1f}s {msg}",  # noqa: E731
                                            flush=True)  # CLI-style test output: when each rank reached each note
        _, problems = run_ranks(WORLD, C.run, (CASES,), env=NVLS_OFF_ENV, heap_config=cfg, with_nccl=True,
                                timeout=float(os.environ.get("TDIST_GPU_TIMEOUT", "240")), stall_timeout=90,
                                on_result=lambda r, case, fails: got.setdefault(case, {}).__setitem__(r, fails),
                                on_note=progress)
        _RESULTS["r"] = (got, problems)
    return _RESULTS["r"]


@pytest.mark.parametrize("case", CASES)
def test_decomp_world4_case(case):
    got, problems = _run()
    outcome = got.get(case, {})
    missing = [r for r in range(WORLD) if r not in outcome]
    assert not missing, f"{case}: ranks {missing} did not finish it; group problems: " + " | ".join(problems)
    msgs = [f"rank {r}: " + "; ".join(fails) for r, fails in sorted(outcome.items()) if fails]
    assert not msgs, "\n".join(msgs)
