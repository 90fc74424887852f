"""Triton-distributed kernels run under the Triton interpreter (CPU) with simulated ranks against torch references:
message passing with signal reuse, atomics/put/get/barrier, AG-GEMM and GEMM-RS with uneven (and empty) row
segments and world sizes 1 and 3, all-to-all dispatch + combine with random variable counts, and the fail-closed
capacity overflow. The cases live in tdist_interpret_case.py and run in one subprocess (TRITON_INTERPRET is
process-wide)."""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

if importlib.util.find_spec("triton") is None:  # not imported here: the interpreter tests need a fresh import
    pytest.skip("triton is not installed", allow_module_level=True)

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
CASE_FILE = HERE / "tdist_interpret_case.py"
CASES = sorted(n.name for n in ast.parse(CASE_FILE.read_text()).body
               if isinstance(n, ast.FunctionDef) and n.name.startswith("case_"))


@pytest.fixture(scope="module")
def results():
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "sgl-kernel" / "python"), str(REPO / "python"),
                                         env.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, str(CASE_FILE)], env=env, capture_output=True, text=True, timeout=900)
    if r.returncode != 0:
        pytest.fail(f"interpreter case process failed ({r.returncode}): {r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_cases_found():
    assert len(CASES) >= 8


@pytest.mark.parametrize("case", CASES)
def test_interpreted(results, case):
    assert case in results, f"{case} did not run"
    assert not results[case], results[case]
