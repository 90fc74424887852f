"""Every Triton-distributed kernel compiles ahead of time for sm_90a on this CPU machine (Triton + ptxas, no GPU),
every global access of its data arguments is 16 bytes wide (``ld/st.global.v4.b32`` / ``.v2.b64``, ``cp.async``
16-byte copies, with the launch's specialization: aot.launch_attrs, unit strides as constexprs; only the named
flag/signal/metadata arguments of aot.SCALAR_ARGS may be accessed narrower), deliberately scalar
variants (aot.SCALAR_PROBES) are rejected, and its PTX has the scoped instructions the memory-ordering argument
relies on (ld.acquire.sys, st.release.sys, red.release.sys, atom ... acq_rel.sys, fences) and never a
``multimem`` (NVLink multicast) instruction.

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

from sgl_kernel.tdist.aot import (FORBIDDEN, KERNELS, SCALAR_ARGS, SCALAR_PROBES, VECTOR_EXPECT,  # noqa: E402
                                  KernelSpec, check_ptx, check_widths, vector_ops)
from sgl_kernel.tdist.ptx_scan import scan_accesses  # noqa: E402


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


def _width_report(name, w) -> str:
    return (f"{name}: {len(w['data_scalar'])} data accesses narrower than 16 bytes, {len(w['unattributed'])} "
            f"unattributed (16-byte data accesses: {w['data16']}, metadata accesses: {w['meta']}):\n  "
            + "\n  ".join(w["data_scalar"] + w["unattributed"]))


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_every_data_access_is_16_bytes(aot_report, name):
    """All ld/st/cp.async of data arguments (everything but aot.SCALAR_ARGS / ALWAYS_SCALAR) are 16 bytes wide."""
    rep = aot_report[name]
    assert not rep["error"], f"{name}: {rep['error']}"
    w = rep["widths"]
    assert not w["data_scalar"] and not w["unattributed"], _width_report(name, w)
    assert rep["ok"], f"{name}: {rep}"


@pytest.mark.parametrize("name", sorted(SCALAR_PROBES))
def test_scalar_probe_is_rejected(aot_report, name):
    """The width check can fail: a strided-B GEMM and an unaligned put compile to 2/8-byte data accesses."""
    rep = aot_report[name]
    assert not rep["error"], f"{name}: {rep['error']}"
    assert rep["widths"]["data_scalar"] and not rep["ok"], f"{name} passed the 16-byte check: {rep['widths']}"


def test_scalar_allow_lists_name_real_pointer_arguments():
    for name, spec in list(KERNELS.items()) + list(SCALAR_PROBES.items()):
        ptrs = {a for a, t in spec.signature.items() if t.startswith("*")}
        assert SCALAR_ARGS[spec.fn] <= ptrs, f"{name}: SCALAR_ARGS names non-pointer {SCALAR_ARGS[spec.fn] - ptrs}"


_PTX = """
\tld.param.b64 \t%rd1, [k_param_0];
\tld.param.b64 \t%rd2, [k_param_1];
\tld.param.b32 \t%r1, [k_param_2];
\t.loc\t1 7 3                          // kern.py:7:3
\tld.global.b64 { %rd3 }, [ %rd1 + 8 ];
\tmul.wide.s32 \t%rd4, %r1, 2;
\tadd.s64 \t%rd5, %rd2, %rd4;
\t// begin inline asm
\tmov.b32 %r2, 0; // consume_token %rd3
\t// end inline asm
\tcvt.s64.s32 \t%rd6, %r2;
\tadd.s64 \t%rd7, %rd5, %rd6;
\tsub.s64 \t%rd8, %rd7, %rd3;
$L__BB0_1:
\t@%p1 ld.global.v4.b32 { %r3, %r4, %r5, %r6 }, [ %rd8 + 0 ];
\t@%p1 st.global.b16 [ %rd7 + 0 ], %rs1;
\tmov.u64 \t%rd8, %rd7;
\tcp.async.cg.shared.global [ %r9 + 0 ], [ %rd7 + 0 ], 0x10, %r10;
\tcp.async.ca.shared.global [ %r9 + 0 ], [ %rd5 + 0 ], 4, %r10;
\tst.global.v2.b64 [ %rd1 + 0 ], { %rd3, %rd3 };
\tld.volatile.global.b64 { %rd9 }, [ %rd3 + 0 ];
\tmov.u64 \t%rd10, 4096;
\tst.global.b32 [ %rd10 + 0 ], %r1;
"""


def test_scan_traces_addresses_to_arguments_and_widths():
    acc = scan_accesses(_PTX, ["meta", "x", "n"])
    got = [(a.op, a.nbytes, tuple(sorted(a.args))) for a in acc]
    assert got == [("ld", 8, ("meta",)), ("ld", 16, ("*meta", "n", "x")), ("st", 2, ("n", "x")),
                   ("cp.async", 16, ("n", "x")), ("cp.async", 4, ("n", "x")), ("st", 16, ("meta",)),
                   ("ld", 8, ("*meta",)), ("st", 4, ())]
    assert acc[0].src == "kern.py:7" and acc[0].line == 6


def test_check_widths_classifies_data_metadata_and_unattributed():
    spec = KernelSpec("litmus", "put_kernel", {"meta": "*i64", "x": "*bf16", "n": "i32"})
    w = check_widths(spec, _PTX)
    assert (w["data16"], w["meta"]) == (2, 3)
    assert [s.split(":")[0] for s in w["data_scalar"]] == ["17", "20"]
    assert "x" in w["data_scalar"][0] and "st.global.b16" in w["data_scalar"][0]
    assert len(w["unattributed"]) == 1 and "st.global.b32" in w["unattributed"][0]


def test_vector_op_counter():
    ptx = ("ld.global.v4.b32 { %r1, %r2, %r3, %r4 }, [ %rd1 + 0 ];\n@%p1 st.global.v4.b32 [ %rd2 + 0 ], "
           "{ %r1, %r2, %r3, %r4 };\ncp.async.cg.shared.global [ %r47 + 0 ], [ %rd23 + 0 ], 0x10, %r48;\n"
           "ld.global.b16 { %rs1 }, [ %rd60 + 0 ];")
    assert vector_ops(ptx) == {"ld_v4": 1, "st_v4": 1, "cp_async": 1}
    assert vector_ops("ld.global.b16 { %rs1 }, [ %rd60 + 0 ];") == {"ld_v4": 0, "st_v4": 0, "cp_async": 0}


_SPECIALIZER = """
import json
try:
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.nvidia.compiler import CUDABackend
    print(json.dumps({v: list(native_specialize_impl(CUDABackend, v, False, True, True)[:2]) for v in (1, 7168, 7)}))
except (ImportError, AttributeError, TypeError) as e:
    print(json.dumps({"skip": repr(e)}))
"""


def test_launcher_specializes_unit_strides_as_constexpr():
    """The GEMM specs compile B = weight.t() with stride_bk as constexpr 1 and stride_bn (= K) divisible by 16:
    what Triton's launcher does with these int arguments (checked where the launcher's specializer is reachable;
    in a subprocess, so this process does not import triton before the interpreter tests)."""
    r = subprocess.run([sys.executable, "-c", _SPECIALIZER], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    spec = json.loads(r.stdout.strip().splitlines()[-1])
    if "skip" in spec:
        pytest.skip(f"this Triton's launcher specializer is not reachable: {spec['skip']}")
    assert spec["1"] == ["constexpr", 1] and spec["7168"] == ["i32", "D"] and spec["7"] == ["i32", ""], spec
