"""Every Triton-distributed kernel compiles ahead of time for sm_90a on this CPU machine (Triton + ptxas, no GPU),
its main data paths use 16-byte accesses (``ld/st.global.v4`` or
``cp.async`` 16-byte copies, with the launch's divisibility specialization: aot.launch_attrs), and its PTX has the
scoped instructions the memory-ordering argument relies on (ld.acquire.sys, st.release.sys,
red.release.sys, atom ... acq_rel.sys, fences) and never a ``multimem`` (NVLink multicast) instruction.

Compilation runs in one subprocess with TRITON_INTERPRET unset (other test modules set it process-wide).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

if importlib.util.find_spec("triton") is None:  # not imported here: the interpreter tests need a fresh import
    pytest.skip("triton is not installed", allow_module_level=True)

REPO = Path(__file__).resolve().parents[2]
KP = str(REPO / "sgl-kernel" / "python")
sys.path.insert(0, KP)

from sgl_kernel.tdist.aot import FORBIDDEN, KERNELS, VECTOR_EXPECT, check_ptx, vector_ops  # noqa: E402


@pytest.fixture(scope="module")
def aot_report():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([KP, str(REPO / "python"), env.get("PYTHONPATH", "")])
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    r = subprocess.run([sys.executable, "-m", "sgl_kernel.tdist.aot", "90"], env=env, capture_output=True, text=True,
                       timeout=600)
    if r.returncode != 0:
        pytest.fail(f"AOT compile process failed ({r.returncode}): {r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_kernel_compiles_for_sm90a_with_scoped_ptx(aot_report, name):
    rep = aot_report[name]
    assert not rep["error"], f"{name}: {rep['error']}"
    assert rep["cubin_bytes"] > 0, f"{name}: no cubin (ptxas did not run?)"
    assert not rep["missing"], f"{name}: PTX lacks {rep['missing']}"
    assert not rep["forbidden"], f"{name}: PTX contains forbidden {rep['forbidden']}"


def test_ptx_checker_detects_missing_and_forbidden():
    missing, found = check_ptx("release", "mov.b32 %r1, 0;\nmultimem.ld_reduce.global.add.f32 %f1, [%rd1];")
    assert missing and found == list(FORBIDDEN)
    assert check_ptx("release", "st.release.sys.global.b64 [%rd1], %rd2;") == ([], [])


@pytest.mark.parametrize("name", sorted(VECTOR_EXPECT))
def test_kernel_main_paths_use_16_byte_accesses(aot_report, name):
    rep = aot_report[name]
    assert not rep["error"], f"{name}: {rep['error']}"
    assert not rep["scalar"], f"{name}: no 16-byte {rep['scalar']} in the PTX (counts {rep['vector']})"


def test_vector_op_counter():
    ptx = ("ld.global.v4.b32 { %r1, %r2, %r3, %r4 }, [ %rd1 + 0 ];\n@%p1 st.global.v4.b32 [ %rd2 + 0 ], "
           "{ %r1, %r2, %r3, %r4 };\ncp.async.cg.shared.global [ %r47 + 0 ], [ %rd23 + 0 ], 0x10, %r48;\n"
           "ld.global.b16 { %rs1 }, [ %rd60 + 0 ];")
    assert vector_ops(ptx) == {"ld_v4": 1, "st_v4": 1, "cp_async": 1}
    assert vector_ops("ld.global.b16 { %rs1 }, [ %rd60 + 0 ];") == {"ld_v4": 0, "st_v4": 0, "cp_async": 0}
