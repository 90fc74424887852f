"""Device-driven AFD steps (one STEP host message per step, the per-layer exchange device to device over
``cuda_push``: the path the attention worker's decode CUDA graph captures), on CPU: afd_device_sim_case.py runs the
real M2N kernels under the Triton interpreter over the CPU stand-in of the CUDA platform, attention worker and FFN
workers on threads, on the trained stories260K-moe checkpoint: greedy tokens and logits equal colocated for m = 1,
2, 3 and N_E = 1, 2; a placement mismatch and a dead FFN worker fail the step (RuntimeError / TimeoutError), never
return logits. The GPU run (graph capture, 2 GPUs): scripts/gpu/issue24_afd_graph_2gpu.sh."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from conftest import shared_path  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
CASE = Path(__file__).resolve().parent / "afd_device_sim_case.py"
pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


def _case(*args: str) -> None:
    env = dict(os.environ, TRITON_INTERPRET="1", AFD_SIM_MODEL=shared_path("models", "stories260K-moe"))
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "sgl-kernel" / "python"), str(REPO / "python"),
                                         env.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, str(CASE), *args], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout[-1000:] + r.stderr[-3000:]


@pytest.mark.parametrize("m", [1, 2, 3])
def test_device_driven_afd_equals_colocated(m):
    _case("equal", str(m))


def test_device_driven_afd_refused_pairs_fail_the_step():
    _case("stray")


def test_device_driven_afd_dead_ffn_fails_closed():
    _case("dead")
