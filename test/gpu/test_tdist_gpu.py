"""Triton-distributed on GPUs: 2 and 4 ranks as processes (sharing one GPU when there is one; one GPU each
otherwise), the symmetric heap mapped through CUDA IPC. Every primitive (message-passing litmus with
acquire/release, 10,000 signal reuses in one launch, atomics, put/get, barrier_all) and every kernel (AG-GEMM with
the SM and the copy-engine producer, GEMM-RS, all-to-all dispatch + combine) against torch references on random
inputs with uneven and empty segments, plus 100 back-to-back calls (buffer reuse without host barriers).

The ranks run all cases in one group per world size (cases in tdist_gpu_case.py); a hang is reported with each
rank's last progress note. Multicast stays off (the environment below, inherited by the ranks).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

os.environ.update({"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"})
os.environ.pop("TRITON_INTERPRET", None)
HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
for p in (str(REPO / "sgl-kernel" / "python"), str(REPO / "python"), str(HERE)):
    if p not in sys.path:
        sys.path.insert(0, p)
os.environ["PYTHONPATH"] = os.pathsep.join([str(REPO / "sgl-kernel" / "python"), str(REPO / "python"), str(HERE),
                                            os.environ.get("PYTHONPATH", "")])

pytestmark = pytest.mark.gpu
pytest.importorskip("triton")

import tdist_gpu_case as C  # noqa: E402

_RESULTS = {}


def _group(world):
    if world not in _RESULTS:
        from sgl_kernel.tdist.layout import HeapConfig
        from sgl_kernel.tdist.spawn import run_ranks

        timeout = float(os.environ.get("TDIST_GPU_TIMEOUT", "900"))
        results, problems = run_ranks(world, C.run_all, (C.CASES,), timeout=timeout,
                                      heap_config=HeapConfig(data_bytes=192 << 20, signal_slots=4096))
        for r, res in enumerate(results):
            if res:
                print(f"world {world} rank {r} case seconds: {res['_time']}")
        _RESULTS[world] = (results, problems)
    return _RESULTS[world]


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("case", C.CASES)
def test_tdist_case(world, case):
    results, problems = _group(world)
    msgs = []
    for r, res in enumerate(results):
        if res is None:
            continue
        if case not in res:
            msgs.append(f"rank {r}: {case} did not run")
        elif res[case]:
            msgs.append(f"rank {r}: " + "; ".join(res[case]))
    if any(res is None for res in results) and problems:
        msgs.append("group problems: " + " | ".join(problems))
    assert not msgs, f"world {world} {case}: " + "\n".join(msgs)
