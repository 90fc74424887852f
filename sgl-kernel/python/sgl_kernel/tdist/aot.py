"""Ahead-of-time compilation of every tdist kernel for Hopper (sm_90a) without a GPU, and PTX checks.

``compile_kernel(name)`` runs ``triton.compile(ASTSource(...), target=GPUTarget("cuda", 90, 32))`` (Triton 3.x API)
down to PTX and cubin (ptxas from the CUDA toolkit), so CI on a CPU machine proves the kernels build for the H100 /
H200 and that the scoped instructions the memory-ordering argument relies on are really emitted. ``KERNELS`` maps
each kernel to its signature (as the launcher specializes it), constexprs and the PTX fragments it must contain.
``check_widths`` (full-width memory access) traces every global access to the arguments its address derives from
(ptx_scan) and requires 16-byte accesses for all but the named flag/signal/metadata arguments (``SCALAR_ARGS``);
``SCALAR_PROBES`` are deliberately scalar variants it must reject.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Dict, FrozenSet, Tuple

from sgl_kernel.tdist.ptx_scan import scan_accesses

FORBIDDEN = ("multimem",)  # NVLink multicast instructions: never emitted by tdist


@dataclass(frozen=True)
class KernelSpec:
    """module: tdist submodule; fn: kernel name; signature: Triton type per argument ("*bf16", "i32",
    "constexpr"); constexprs: values of constexpr args; expect: regexes the PTX must match; unaligned: pointer
    arguments compiled without the 16-byte divisibility the launcher gives aligned buffers (for the probes)."""

    module: str
    fn: str
    signature: Dict[str, str]
    constexprs: Dict[str, object] = field(default_factory=dict)
    expect: Tuple[str, ...] = ()
    unaligned: Tuple[str, ...] = ()


ACQ = r"ld\.acquire\.sys\.global"
REL = r"st\.release\.sys\.global"
RED = r"red\.release\.sys\.global\.add"
ATOM = r"atom\.global\.(sys\.acq_rel|acq_rel\.sys)"
# bounded waits (fail closed): the wall-clock read and the error record's CAS must be in every kernel that waits
BOUND = (r"%globaltimer", r"atom\.relaxed\.sys\.global\.cas\.b64")

_GEMM_TILE = {"BM": 128, "BN": 128, "BK": 64}

KERNELS: Dict[str, KernelSpec] = {
    "release": KernelSpec("common", "release_kernel", {"meta": "*i64", "ready": "*i64", "state": "*i64", "inc": "i32"},
                          expect=(REL,)),
    "wait_reset": KernelSpec("common", "wait_reset_kernel", {"meta": "*i64", "slot": "*i64"},
                             expect=(ACQ,) + BOUND),
    "mp_producer": KernelSpec("litmus", "mp_producer_kernel",
                              {"meta": "*i64", "data": "*fp32", "src": "*fp32", "sig": "*i64", "n": "i32",
                               "epoch": "i64", "peer": "i32", "BLOCK": "constexpr"}, {"BLOCK": 1024}, (REL,)),
    "mp_consumer": KernelSpec("litmus", "mp_consumer_kernel",
                              {"meta": "*i64", "data": "*fp32", "out": "*fp32", "sig": "*i64", "n": "i32",
                               "epoch": "i64", "BLOCK": "constexpr"}, {"BLOCK": 1024}, (ACQ,) + BOUND),
    "pingpong": KernelSpec("litmus", "pingpong_kernel",
                           {"meta": "*i64", "sig": "*i64", "data": "*i64", "log": "*i64", "iters": "i32",
                            "base": "i64", "peer": "i32", "BLOCK": "constexpr"}, {"BLOCK": 128}, (ACQ, REL) + BOUND),
    # a small base is passed as i32 at run time (the GPU run's loop-carried type error of 2026-11-25)
    "pingpong_i32": KernelSpec("litmus", "pingpong_kernel",
                               {"meta": "*i64", "sig": "*i64", "data": "*i64", "log": "*i64", "iters": "i32",
                                "base": "i32", "peer": "i32", "BLOCK": "constexpr"}, {"BLOCK": 128},
                               (ACQ, REL) + BOUND),
    "pingpong_cta": KernelSpec("litmus", "pingpong_cta_kernel",
                               {"meta": "*i64", "sig": "*i64", "data": "*i64", "log": "*i64", "iters": "i32",
                                "BLOCK": "constexpr"},
                               {"BLOCK": 4096}, (ACQ, REL) + BOUND),
    "counter": KernelSpec("litmus", "counter_kernel",
                          {"meta": "*i64", "counter": "*i64", "old_out": "*i64", "cas_out": "*i64", "peer": "i32",
                           "compare": "i64", "value": "i64"}, {},
                          (ATOM, r"atom\.global.*cas", RED, r"fence\.acq_rel\.sys", r"fence\.sc\.sys")),
    # what the launcher really passes for small int arguments (i32): the GPU run's compile error of 2026-11-25
    "counter_i32": KernelSpec("litmus", "counter_kernel",
                              {"meta": "*i64", "counter": "*i64", "old_out": "*i64", "cas_out": "*i64",
                               "peer": "i32", "compare": "i32", "value": "i32"}, {},
                              (ATOM, r"atom\.global.*cas", RED)),
    "put": KernelSpec("litmus", "put_kernel", {"meta": "*i64", "dst": "*i64", "src": "*i64", "n": "i32",
                                               "peer": "i32", "BLOCK": "constexpr"}, {"BLOCK": 1024},
                      (r"fence\.sc\.sys",)),
    "get": KernelSpec("litmus", "get_kernel", {"meta": "*i64", "dst": "*i64", "src": "*i64", "n": "i32",
                                               "peer": "i32", "BLOCK": "constexpr"}, {"BLOCK": 1024},
                      (r"fence\.sc\.sys",)),
    "barrier": KernelSpec("litmus", "barrier_kernel", {"meta": "*i64", "sig": "*i64", "epoch": "i64", "out": "*i64"},
                          {}, (ACQ, REL) + BOUND),
    "ag_producer": KernelSpec("ag_gemm", "ag_producer_kernel",
                              {"meta": "*i64", "a_local": "*bf16", "gather": "*bf16", "seg_sig": "*i64",
                               "ready": "*i64", "n_elems": "i64", "dst_off": "i64", "state": "*i64",
                               "CHUNKS": "constexpr", "BLOCK": "constexpr"}, {"CHUNKS": 4, "BLOCK": 2048},
                              (ACQ, RED) + BOUND),
    "ag_gemm_consumer": KernelSpec("ag_gemm", "ag_gemm_consumer_kernel",
                                   {"meta": "*i64", "a_local": "*bf16", "gather": "*bf16", "b": "*bf16",
                                    "c": "*bf16", "seg_sig": "*i64", "row_off": "*i32", "tiles": "*i32",
                                    "state": "*i64", "tsel": "i32", "tinc": "i32", "N": "i32", "K": "i32",
                                    "stride_bk": "constexpr",
                                    "stride_bn": "i32", "stride_cm": "i32", "BM": "constexpr", "BN": "constexpr",
                                    "BK": "constexpr", "IEEE": "constexpr"}, dict(_GEMM_TILE, IEEE=False, stride_bk=1),
                                   (ACQ, r"consume_token") + BOUND),
    "gemm_rs": KernelSpec("gemm_rs", "gemm_rs_kernel",
                          {"meta": "*i64", "a": "*bf16", "b": "*bf16", "partial": "*bf16", "arrive": "*i64",
                           "ready": "*i64", "row_off": "*i32", "tiles": "*i32", "state": "*i64", "N": "i32",
                           "K": "i32", "max_rows": "i32", "stride_am": "i32", "stride_bk": "constexpr",
                           "stride_bn": "i32", "BM": "constexpr", "BN": "constexpr", "BK": "constexpr",
                           "IEEE": "constexpr"}, dict(_GEMM_TILE, IEEE=False, stride_bk=1), (ACQ, RED) + BOUND),
    "rs_reduce": KernelSpec("gemm_rs", "rs_reduce_kernel",
                            {"meta": "*i64", "partial": "*bf16", "arrive": "*i64", "out": "*bf16", "state": "*i64",
                             "inc": "i32",
                             "M": "i32", "N": "i32", "max_rows": "i32", "stride_om": "i32", "BM": "constexpr",
                             "BN": "constexpr"}, {"BM": 64, "BN": 128}, (ACQ, r"consume_token") + BOUND),
    "a2a": KernelSpec("all_to_all", "a2a_kernel",
                      {"meta": "*i64", "x": "*bf16", "send_counts": "*i32", "recv": "*bf16", "cmat": "*i64",
                       "cflag": "*i64", "arrive": "*i64", "recv_counts": "*i32", "epochs": "*i64", "H": "i32",
                       "capacity": "i32", "CHUNKS": "constexpr", "BLOCK": "constexpr", "WPAD": "constexpr",
                       "ANNOUNCE": "constexpr", "SEND": "constexpr", "FINISH": "constexpr", "BUMP": "constexpr"},
                      {"CHUNKS": 32, "BLOCK": 4096, "WPAD": 2, "ANNOUNCE": True, "SEND": True, "FINISH": True,
                       "BUMP": True}, (ACQ, REL, RED) + BOUND),
}

# The GEMMs' B is ``weight.t()`` in every caller (tdist_overlap, benchmarks): stride_bk == 1, which Triton's launcher
# specializes as a constexpr (ints equal to 1 always are), and stride_bn == K (a multiple of 16). "_kn": a contiguous
# [K, N] B (stride_bn == 1). "_f32": fp32 models under --enable-tdist-overlap (IEEE products).
for _name in ("ag_gemm_consumer", "gemm_rs"):
    _k = KERNELS[_name]
    KERNELS[_name + "_kn"] = KernelSpec(_k.module, _k.fn, dict(_k.signature, stride_bk="i32", stride_bn="constexpr"),
                                        {**{c: v for c, v in _k.constexprs.items() if c != "stride_bk"},
                                         "stride_bn": 1}, _k.expect)
    KERNELS[_name + "_f32"] = KernelSpec(_k.module, _k.fn,
                                         {a: t.replace("bf16", "fp32") for a, t in _k.signature.items()},
                                         dict(_k.constexprs, IEEE=True, BK=32), _k.expect)


# int arguments that are multiples of 16 in the real launches (Llama / DeepSeek shapes, heap offsets); the launcher
# specializes them as such (``tt.divisibility = 16``), so the AOT compile does too. Epochs and targets are not
# specialized (``do_not_specialize``) and are never listed here.
DIV16_INTS = frozenset({"N", "K", "H", "n", "n_elems", "dst_off", "max_rows", "stride_am", "stride_bk", "stride_bn",
                        "stride_cm", "stride_om", "capacity"})


def launch_attrs(fn, signature: Dict[str, str], unaligned: Tuple[str, ...] = ()) -> dict:
    """``tt.divisibility = 16`` for every pointer argument (torch and heap buffers are >= 16-byte aligned) and for
    the :data:`DIV16_INTS` int arguments: what Triton's launcher specializes at run time for these shapes; none for
    the ``unaligned`` arguments."""
    attrs = {}
    for name, ty in signature.items():
        if name in unaligned:
            continue
        if ty.startswith("*") or (ty in ("i32", "i64") and name in DIV16_INTS):
            attrs[(fn.arg_names.index(name),)] = [["tt.divisibility", 16]]
    return attrs


def vector_ops(ptx: str) -> Dict[str, int]:
    """Counts of 16-byte global accesses in ``ptx``: ``ld.global...v4`` / ``st.global...v4`` (b32 x 4) and
    ``cp.async...16`` (async copies to shared memory, which Triton uses for pipelined GEMM operands)."""
    return {"ld_v4": len(re.findall(r"ld\.global(\.[a-z0-9_]+)*\.v4\.", ptx)),
            "st_v4": len(re.findall(r"st\.global(\.[a-z0-9_]+)*\.v4\.", ptx)),
            "cp_async": len(re.findall(r"cp\.async\.c[ag]\.shared\.global \[[^]]+\], \[[^]]+\], (16|0x10)", ptx))}


def compile_kernel(name: str, arch: int = 90, num_warps: int = 4):
    """Compile ``KERNELS[name]`` (or ``SCALAR_PROBES[name]``) for ``sm_{arch}`` (90 -> sm_90a) with no GPU; returns
    Triton's CompiledKernel (``.asm["ptx"]``, ``.asm["cubin"]``). Raises KeyError for an unknown name, Triton's
    CompilationError on failure."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    spec = KERNELS[name] if name in KERNELS else SCALAR_PROBES[name]
    fn = getattr(importlib.import_module(f"sgl_kernel.tdist.{spec.module}"), spec.fn)
    src = ASTSource(fn=fn, signature=dict(spec.signature), constexprs=dict(spec.constexprs),
                    attrs=launch_attrs(fn, spec.signature, spec.unaligned))
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps})


# 16-byte accesses each kernel's main data path must use (vector_ops keys): GEMM operands through cp.async into
# shared memory and v4 epilogue stores; copy and reduce loops through ld/st.global.v4
VECTOR_EXPECT: Dict[str, Tuple[str, ...]] = {
    "ag_producer": ("ld_v4", "st_v4"), "ag_gemm_consumer": ("cp_async", "st_v4"), "gemm_rs": ("cp_async", "st_v4"),
    "rs_reduce": ("ld_v4", "st_v4"), "a2a": ("ld_v4", "st_v4"),
    "ag_gemm_consumer_f32": ("cp_async", "st_v4"), "gemm_rs_f32": ("cp_async", "st_v4"),
    "ag_gemm_consumer_kn": ("cp_async", "st_v4"), "gemm_rs_kn": ("cp_async", "st_v4"),
}

# Pointer arguments whose accesses are flags, signals, counters or launch metadata (scalar by nature), per kernel
# function. Every other pointer argument is data: each global access whose address derives from one must be 16 bytes
# wide (ld/st.global.v4.b32 / .v2.b64, cp.async 16). ALWAYS_SCALAR: rank / peer bases / wait budget / error record
# (meta) and device epochs (state), in every kernel.
ALWAYS_SCALAR = frozenset({"meta", "state"})
SCALAR_ARGS: Dict[str, FrozenSet[str]] = {k: frozenset(v) for k, v in {
    "release_kernel": {"ready"}, "wait_reset_kernel": {"slot"}, "barrier_kernel": {"sig", "out"},
    "mp_producer_kernel": {"sig"}, "mp_consumer_kernel": {"sig"}, "put_kernel": (), "get_kernel": (),
    # signal-reuse litmus: one int64 per thread (BLOCK = 128 = the CTA's threads), not a data path
    "pingpong_kernel": {"sig", "log", "data"}, "pingpong_cta_kernel": {"sig", "log"},
    "counter_kernel": {"counter", "old_out", "cas_out"},
    "ag_producer_kernel": {"ready", "seg_sig"}, "ag_gemm_consumer_kernel": {"seg_sig", "row_off", "tiles"},
    "gemm_rs_kernel": {"arrive", "ready", "row_off", "tiles"}, "rs_reduce_kernel": {"arrive"},
    "a2a_kernel": {"send_counts", "cmat", "cflag", "arrive", "recv_counts", "epochs"},
}.items()}

# Deliberately scalar variants that check_widths must reject (the check can fail): a GEMM whose B has no unit
# stride (a strided slice: column loads of 2 bytes), and a put whose heap bases are not known to be 16-byte aligned.
SCALAR_PROBES: Dict[str, KernelSpec] = {
    "probe_gemm_strided_b": KernelSpec("ag_gemm", "ag_gemm_consumer_kernel",
                                       dict(KERNELS["ag_gemm_consumer"].signature, stride_bk="i32"),
                                       {c: v for c, v in KERNELS["ag_gemm_consumer"].constexprs.items()
                                        if c != "stride_bk"}),
    "probe_put_unaligned": dataclasses.replace(KERNELS["put"], unaligned=("dst", "src")),
}


def check_widths(spec: KernelSpec, ptx: str) -> Dict[str, object]:
    """Classify every global access of ``ptx`` (kernel ``spec``) by the pointer arguments its address derives from
    (ptx_scan.scan_accesses). Returns {"data16": count of 16-byte data accesses, "data_scalar": narrower data
    accesses, "meta": count of accesses of SCALAR_ARGS / ALWAYS_SCALAR arguments, "unattributed": accesses that
    reach no pointer argument}; the lists hold ``"<ptx line>: <instruction>  [<source>] <- <args>"``. Raises
    KeyError for a kernel function missing from SCALAR_ARGS."""
    names = [a for a, t in spec.signature.items() if t != "constexpr"]
    ptrs = {a for a, t in spec.signature.items() if t.startswith("*")}
    allowed = SCALAR_ARGS[spec.fn] | ALWAYS_SCALAR
    out: Dict[str, object] = dict(data16=0, data_scalar=[], meta=0, unattributed=[])
    for acc in scan_accesses(ptx, names):
        bases = {a.lstrip("*") for a in acc.args} & ptrs
        line = f"{acc.line}: {acc.text}  [{acc.src}] <- {','.join(sorted(acc.args))}"
        if not bases:
            out["unattributed"].append(line)
        elif bases <= allowed:
            out["meta"] += 1
        elif acc.nbytes >= 16:
            out["data16"] += 1
        else:
            out["data_scalar"].append(line)
    return out


def check_ptx(name: str, ptx: str) -> Tuple[list, list]:
    """(missing expected patterns, forbidden instructions found) for kernel ``name``'s PTX."""
    missing = [p for p in KERNELS[name].expect if not re.search(p, ptx)]
    found = [f for f in FORBIDDEN if f in ptx]
    return missing, found


def _one(name: str, arch: int) -> dict:
    spec = KERNELS[name] if name in KERNELS else SCALAR_PROBES[name]
    k = compile_kernel(name, arch)
    ptx = k.asm["ptx"]
    missing, found = check_ptx(name, ptx) if name in KERNELS else ([], [])
    vec = vector_ops(ptx)
    scalar = [v for v in VECTOR_EXPECT.get(name, ()) if vec[v] == 0]
    widths = check_widths(spec, ptx)
    if name in VECTOR_EXPECT and widths["data16"] == 0:
        scalar.append("data16")
    ok = not (missing or found or scalar or widths["data_scalar"] or widths["unattributed"])
    return dict(ok=ok, error="", missing=missing, forbidden=found, scalar=scalar, vector=vec, widths=widths,
                cubin_bytes=len(k.asm.get("cubin", b"")), ptx_lines=ptx.count("\n"))


def report(arch: int = 90) -> Dict[str, dict]:
    """Compile every kernel and every scalar probe; per name: {"ok", "error", "missing", "forbidden", "scalar"
    (VECTOR_EXPECT kinds, or "data16", with no 16-byte access in the PTX), "vector" (vector_ops counts), "widths"
    (check_widths), "cubin_bytes", "ptx_lines"}. Probes are expected to have ok False (scalar data accesses)."""
    out: Dict[str, dict] = {}
    for name in list(KERNELS) + list(SCALAR_PROBES):
        try:
            out[name] = _one(name, arch)
        except Exception as e:  # reported per kernel, so one failure does not hide the others
            out[name] = dict(ok=False, error=f"{type(e).__name__}: {e}"[:2000], missing=[], forbidden=[],
                             scalar=[], vector={}, widths={}, cubin_bytes=0, ptx_lines=0)
    return out


if __name__ == "__main__":
    import json
    import os
    import sys

    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        sys.exit("unset TRITON_INTERPRET: AOT compilation needs the real Triton compiler")
    print(json.dumps(report(int(sys.argv[1]) if len(sys.argv) > 1 else 90)))
