"""Ahead-of-time compilation of the decode-path Triton kernels for Hopper (sm_90a) without a GPU.

``python -m sgl_kernel.triton.aot [arch]`` compiles every entry of :data:`KERNELS` with
``triton.compile(ASTSource(...), target=GPUTarget("cuda", arch, 32))`` down to PTX and cubin (ptxas from the CUDA
toolkit) and prints one JSON line ``{name: {"error", "cubin_bytes", "ptx_lines", "shared"}}``, so a CPU machine
proves that each kernel variant the decode step launches (the default and the legacy decode kernel, the one-split
direct-output variant, the reduce, fused RoPE + KV store; the skinny GEMM under evaluation) builds for the
H100/H200 at the Llama-3.1-8B shapes.
Must run with ``TRITON_INTERPRET`` unset.
"""

from __future__ import annotations

import re
from typing import Dict, Tuple

_I32 = "i32"


def _decode_split(k_rows: bool, direct: bool, splits: int) -> Tuple[str, str, Dict[str, str], Dict[str, object], int]:
    sig = {n: t for n, t in (
        ("Q", "*bf16"), ("K_buf", "*bf16"), ("V_buf", "*bf16"), ("Req_to_token", "*i32"), ("Req_pool_idx", "*i64"),
        ("Seq_lens", "*i64"), ("Mid_o", "*fp32"), ("Mid_lse", "*fp32"), ("Out", "*bf16"), ("Order", "*i64"),
        ("qk_scale", "fp32"), ("v_scale", "fp32"), ("min_split_len", _I32))}
    for n in ("stride_qb", "stride_qh", "stride_kt", "stride_kh", "stride_vt", "stride_vh", "stride_r2t",
              "stride_mob", "stride_moh", "stride_mos", "stride_mlb", "stride_mlh", "stride_ob", "stride_oh"):
        sig[n] = _I32
    const = dict(GROUP=4, HEAD_DIM=128, BLOCK_D=128, BLOCK_H=16, BLOCK_N=64, NUM_SPLITS=splits, DOT_F32=False,
                 K_ROWS=k_rows, DIRECT_OUT=direct, USE_GDC=False, HAS_ORDER=False, LEN_SPLITS=False)
    for n in const:
        sig[n] = "constexpr"
    return "decode_attention", "_decode_split_kernel", sig, const, 4


def _decode_reduce(len_splits: bool = False) -> Tuple[str, str, Dict[str, str], Dict[str, object], int]:
    sig = {"Mid_o": "*fp32", "Mid_lse": "*fp32", "Out": "*bf16", "Seq_lens": "*i64", "min_split_len": _I32}
    for n in ("stride_mob", "stride_moh", "stride_mos", "stride_mlb", "stride_mlh", "stride_ob", "stride_oh"):
        sig[n] = _I32
    const = dict(HEAD_DIM=128, BLOCK_D=128, NUM_SPLITS=2, BLOCK_S=2, LEN_SPLITS=len_splits, SPLIT_BLOCK_N=64)
    sig.update({n: "constexpr" for n in const})
    return "decode_attention", "_decode_reduce_kernel", sig, const, 4


def _rope_kv_store(neox: bool) -> Tuple[str, str, Dict[str, str], Dict[str, object], int]:
    sig = {"Pos": "*i64", "Q": "*bf16", "K": "*bf16", "V": "*bf16", "Cache": "*fp32", "K_buf": "*bf16",
           "V_buf": "*bf16", "Loc": "*i64"}
    for n in ("stride_q", "stride_k", "stride_v", "stride_c", "stride_kbt", "stride_kbh", "stride_vbt", "stride_vbh",
              "num_q_heads", "num_kv_heads"):
        sig[n] = _I32
    sig.update(k_scale_inv="fp32", v_scale_inv="fp32")
    const = dict(HEAD_DIM=128, HALF=64, BLOCK_HALF=64, BLOCK_D=128, NEOX=neox, BLOCK_HQ=32, BLOCK_HK=8,
                 PASS_THROUGH=False, USE_GDC=False, QUANT_MAX=0.0)
    sig.update({n: "constexpr" for n in const})
    return "rope_kv_store", "_rope_kv_store_kernel", sig, const, 4


def _rmsnorm() -> Tuple[str, str, Dict[str, str], Dict[str, object], int]:
    sig = {"X": "*bf16", "R": "*bf16", "W": "*bf16", "Y": "*bf16", "stride_x": _I32, "stride_r": _I32,
           "stride_y": _I32, "H": _I32, "eps": "fp32"}
    const = dict(HAS_RESIDUAL=True, BLOCK=4096, USE_GDC=False)
    sig.update({n: "constexpr" for n in const})
    return "fused_add_rmsnorm", "_rmsnorm_kernel", sig, const, 8


def _with(entry, **extra) -> Tuple[str, str, Dict[str, str], Dict[str, object], int]:
    """``entry`` (a :data:`KERNELS` value) with extra constexprs."""
    module, fn, sig, const, warps = entry
    return module, fn, dict(sig, **{n: "constexpr" for n in extra}), dict(const, **extra), warps


def _fp8_kv(entry, **extra) -> Tuple[str, str, Dict[str, str], Dict[str, object], int]:
    """``entry`` reading / writing an FP8 E4M3 KV cache (``--kv-cache-dtype fp8_e4m3``): ``K_buf`` / ``V_buf`` as
    ``*fp8e4nv``, plus extra constexprs."""
    module, fn, sig, const, warps = _with(entry, **extra)
    return module, fn, {n: ("*fp8e4nv" if n in ("K_buf", "V_buf") else t) for n, t in sig.items()}, const, warps


def _extend() -> Tuple[str, str, Dict[str, str], Dict[str, object], int]:
    sig = {"Q": "*bf16", "Out": "*bf16", "K_buf": "*bf16", "V_buf": "*bf16", "Req_to_token": "*i32",
           "Req_pool_idx": "*i64", "Prefix_lens": "*i64", "Extend_lens": "*i64", "Extend_start": "*i64",
           "qk_scale": "fp32", "v_scale": "fp32"}
    for n in ("stride_qt", "stride_qh", "stride_ot", "stride_oh", "stride_kt", "stride_kh", "stride_vt", "stride_vh",
              "stride_r2t"):
        sig[n] = _I32
    const = dict(GROUP=4, HEAD_DIM=128, BLOCK_D=128, BLOCK_M=128, BLOCK_N=128, DOT_F32=False)
    sig.update({n: "constexpr" for n in const})
    return "extend_attention", "_extend_kernel", sig, const, 8  # extend_config(128, (9, 0)): 8 warps, 3 stages


def _rope(neox: bool) -> Tuple[str, str, Dict[str, str], Dict[str, object], int]:
    sig = {"Pos": "*i64", "Q": "*bf16", "K": "*bf16", "Cache": "*fp32", "stride_q": _I32, "stride_k": _I32,
           "stride_c": _I32, "num_q_heads": _I32, "num_k_heads": _I32}
    const = dict(HEAD_DIM=128, HALF=64, BLOCK_HALF=64, NEOX=neox, BLOCK_HQ=32, BLOCK_HK=8)
    sig.update({n: "constexpr" for n in const})
    return "rope", "_rope_kernel", sig, const, 4


def _skinny_gemm() -> Tuple[str, str, Dict[str, str], Dict[str, object], int]:
    sig = {"X": "*bf16", "W": "*bf16", "B": "*bf16", "Y": "*bf16"}
    for n in ("M", "N", "K", "K_CHUNK", "stride_xm", "stride_wn", "stride_ym"):
        sig[n] = _I32
    const = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=256, HAS_BIAS=False, PARTIAL=False, DOT_F32=False, USE_GDC=False,
                 PF_LINES=1, PF_STEP=64)
    sig.update({n: "constexpr" for n in const})
    return "skinny_gemm", "_skinny_gemm_kernel", sig, const, 4


def _splitk_add_rmsnorm() -> Tuple[str, str, Dict[str, str], Dict[str, object], int]:
    sig = {"P": "*fp32", "B": "*bf16", "R": "*bf16", "W": "*bf16", "Y": "*bf16", "M": _I32, "H": _I32,
           "SPLIT": _I32, "stride_r": _I32, "stride_y": _I32, "eps": "fp32"}
    const = dict(HAS_BIAS=False, BLOCK=4096, USE_GDC=False)
    sig.update({n: "constexpr" for n in const})
    return "decode_fuse", "_splitk_add_rmsnorm_kernel", sig, const, 8


def _skinny_silu() -> Tuple[str, str, Dict[str, str], Dict[str, object], int]:
    sig = {"X": "*bf16", "W": "*bf16", "B": "*bf16", "Y": "*bf16"}
    for n in ("M", "I", "K", "stride_xm", "stride_wn", "stride_ym"):
        sig[n] = _I32
    const = dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=128, HAS_BIAS=False, DOT_F32=False, USE_GDC=False, PF_LINES=1,
                 PF_STEP=64)
    sig.update({n: "constexpr" for n in const})
    return "decode_fuse", "_skinny_silu_kernel", sig, const, 4


KERNELS = {
    "decode_split_rows_2": _decode_split(True, False, 2),
    "decode_split_rows_direct": _decode_split(True, True, 1),
    "decode_split_legacy_8": _decode_split(False, False, 8),
    "decode_reduce": _decode_reduce(),
    # the balanced split policy: rows longest first (one split, 128-key tiles, 3 stages as on sm_90), and at several
    # splits the length-aware rule with its reduce
    "decode_split_balanced_direct": _with(_decode_split(True, True, 1), HAS_ORDER=True, BLOCK_N=128),
    "decode_split_balanced_4": _with(_decode_split(True, False, 4), HAS_ORDER=True, LEN_SPLITS=True),
    "decode_reduce_balanced": _decode_reduce(True),
    "extend": _extend(),  # prefill / extend attention at the Llama-3.1-8B shapes (8K prefill)
    "rope_kv_store_neox": _rope_kv_store(True),
    "rope_kv_store_gptj": _rope_kv_store(False),
    "rmsnorm_add": _rmsnorm(),
    # programmatic dependent launch (the default on Hopper, SGLANG_DECODE_PDL=0 opts out):
    # griddepcontrol.wait first, then launch_dependents; the skinny GEMM prefetches weight lines into L2 before both
    "rmsnorm_add_pdl": _with(_rmsnorm(), USE_GDC=True),
    "rope_kv_store_neox_pdl": _with(_rope_kv_store(True), USE_GDC=True),
    "decode_split_rows_direct_pdl": _with(_decode_split(True, True, 1), USE_GDC=True),
    "skinny_gemm_pdl": _with(_skinny_gemm(), USE_GDC=True, PF_LINES=16),
    # FP8 KV cache (E4M3 tiles widened to bf16 in registers; the fused store quantizes with the layer's scale)
    "decode_split_rows_direct_fp8": _fp8_kv(_decode_split(True, True, 1)),
    "decode_split_rows_2_fp8": _fp8_kv(_decode_split(True, False, 2)),
    "extend_fp8": _fp8_kv(_extend()),
    "rope_kv_store_neox_fp8": _fp8_kv(_rope_kv_store(True), QUANT_MAX=448.0),
    # the balanced split policy (the default) over an FP8 cache: the same tiles as its BF16 variants above
    "decode_split_balanced_direct_fp8": _fp8_kv(_decode_split(True, True, 1), HAS_ORDER=True, BLOCK_N=128),
    "decode_split_balanced_4_fp8": _fp8_kv(_decode_split(True, False, 4), HAS_ORDER=True, LEN_SPLITS=True),
    "rope_neox": _rope(True),  # the unfused kernel, for comparison
    "skinny_gemm": _skinny_gemm(),
    # decode epilogue fusions (SGLANG_DECODE_FUSE_EPILOGUE=1): split-K reduce in add + RMSNorm, gate_up + SiLU
    "splitk_add_rmsnorm": _splitk_add_rmsnorm(),
    "splitk_add_rmsnorm_pdl": _with(_splitk_add_rmsnorm(), USE_GDC=True),
    "skinny_silu": _skinny_silu(),
    "skinny_silu_pdl": _with(_skinny_silu(), USE_GDC=True, PF_LINES=8),
}


# num_stages where the kernel's launcher does not use 2 (the extend kernel: extend_config on Hopper)
_STAGES = {"extend": 3, "extend_fp8": 3, "decode_split_balanced_direct": 3, "decode_split_balanced_direct_fp8": 3}

# integer arguments that are multiples of 16 at the Llama-3.1-8B shapes (Triton's JIT specialises such values, and
# 16-byte aligned pointers, as ``tt.divisibility = 16``; AOT must say so or it compiles scalar loads)
_DIV16_INTS = {"stride_qb", "stride_qh", "stride_kt", "stride_kh", "stride_vt", "stride_vh", "stride_mob",
               "stride_moh", "stride_mos", "stride_mlb", "stride_mlh", "stride_ob", "stride_oh", "stride_q", "stride_k",
               "stride_qt", "stride_ot", "stride_v", "stride_c", "stride_kbt", "stride_kbh", "stride_vbt", "stride_vbh",
               "num_q_heads",
               "stride_xm", "stride_wn", "stride_ym", "K", "N", "K_CHUNK", "I", "H", "stride_r"}


def runtime_attrs(fn, sig: Dict[str, str]) -> Dict[tuple, list]:
    """``tt.divisibility = 16`` for every pointer and every :data:`_DIV16_INTS` argument, as the runtime JIT gives."""
    return {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n, t in sig.items()
            if t.startswith("*") or n in _DIV16_INTS}


def compile_kernel(name: str, arch: int = 90):
    """Compile ``KERNELS[name]`` for ``sm_{arch}`` (90 -> sm_90a) with no GPU; returns Triton's CompiledKernel.
    Raises KeyError for an unknown name, Triton's CompilationError on failure."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    module, fn_name, sig, const, warps = KERNELS[name]
    fn = getattr(importlib.import_module(f"sgl_kernel.triton.{module}"), fn_name)
    src = ASTSource(fn=fn, signature=dict(sig), constexprs=dict(const), attrs=runtime_attrs(fn, sig))
    stages = _STAGES.get(name, 2)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": warps, "num_stages": stages})


def compile_extend(head_dim: int, dtype: str = "bf16", arch: int = 90):
    """Compile the extend kernel for ``sm_{arch}`` at ``head_dim`` and ``dtype`` ("bf16", "fp16", "fp32") with the
    config :func:`sgl_kernel.triton.extend_attention.extend_config` picks for that arch (table shared-memory limit);
    returns ``(config, CompiledKernel)``. Raises Triton's errors on failure."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from sgl_kernel.triton.common import next_pow2
    from sgl_kernel.triton.extend_attention import _extend_kernel, extend_config

    config = extend_config(head_dim, (arch // 10, arch % 10), 4 if dtype == "fp32" else 2)
    block_m, block_n, warps, stages = config
    _, _, sig, const, _ = _extend()
    sig = {n: (f"*{dtype}" if n in ("Q", "Out", "K_buf", "V_buf") else t) for n, t in sig.items()}
    const = dict(const, HEAD_DIM=head_dim, BLOCK_D=max(16, next_pow2(head_dim)), BLOCK_M=block_m, BLOCK_N=block_n)
    src = ASTSource(fn=_extend_kernel, signature=sig, constexprs=const, attrs=runtime_attrs(_extend_kernel, sig))
    return config, triton.compile(src, target=GPUTarget("cuda", arch, 32),
                                  options={"num_warps": warps, "num_stages": stages})


def _loads_after_first_store(ptx: str) -> int:
    """Number of ``ld.global`` instructions after the first ``st.global`` of ``ptx`` (0: every load first)."""
    first = ptx.find("st.global")
    return 0 if first < 0 else len(re.findall(r"\bld\.global", ptx[first:]))


def _before_wait(ptx: str) -> Dict[str, int]:
    """``l2_prefetch_before_wait`` (``prefetch.global.L2`` issued before the first ``griddepcontrol.wait``) and
    ``loads_before_wait`` (global loads or async copies before it: must be 0, they could read stale data); both 0
    without a wait."""
    head = ptx[:max(ptx.find("griddepcontrol.wait"), 0)]
    return dict(l2_prefetch_before_wait=head.count("prefetch.global.L2"),
                loads_before_wait=len(re.findall(r"\bld\.global|\bcp\.async\.\w+\.shared\.global", head)))


def report(arch: int = 90) -> Dict[str, dict]:
    """Compile every kernel; per name: {"error", "cubin_bytes", "ptx_lines", "shared" (shared memory bytes),
    "v4_loads" (16-byte global loads), "loads_after_first_store" (global loads the PTX issues after its first global
    store: each such group waits behind that store), "scalar_b16_loads", "cp_async16" (16-byte asynchronous copies
    to shared memory: loads pipelined over ``num_stages``), "atom_acq_rel_gpu" (acquire-release atomics at gpu
    scope; none of the kernels should have any), "bar_sync" (CTA barriers), "griddep_wait"
    (``griddepcontrol.wait``: programmatic dependent launch), "griddep_launch" (``launch_dependents``),
    "fp8_satfinite_cvt" (``cvt.rn.satfinite.e4m3x2.f32``: FP8 stores rounded to nearest even and saturated),
    "l2_prefetch_before_wait", "loads_before_wait" (:func:`_before_wait`)}."""
    out: Dict[str, dict] = {}
    for name in KERNELS:
        try:
            k = compile_kernel(name, arch)
            ptx = k.asm["ptx"]
            out[name] = dict(error="", cubin_bytes=len(k.asm.get("cubin", b"")), ptx_lines=ptx.count("\n"),
                             shared=int(getattr(k.metadata, "shared", 0) or 0),
                             v4_loads=len(re.findall(r"ld\.global(\.\w+)*\.v4\.", ptx)),
                             scalar_b16_loads=ptx.count("ld.global.b16"),
                             loads_after_first_store=_loads_after_first_store(ptx),
                             cp_async16=len(re.findall(r"cp\.async\.\w+\.shared\.global[^;]*, 0x10", ptx)),
                             atom_acq_rel_gpu=len(re.findall(r"atom(\.\w+)*\.acq_rel(\.\w+)*\.gpu\b|"
                                                             r"atom(\.\w+)*\.gpu(\.\w+)*\.acq_rel\b", ptx)),
                             bar_sync=len(re.findall(r"\b(bar\.sync|barrier\.sync)", ptx)),
                             griddep_wait=ptx.count("griddepcontrol.wait"),
                             griddep_launch=ptx.count("griddepcontrol.launch_dependents"),
                             fp8_satfinite_cvt=len(re.findall(r"cvt\.rn\.satfinite\.e4m3x2\.f32", ptx)),
                             **_before_wait(ptx))
        except Exception as e:  # reported per kernel, so one failure does not hide the others
            out[name] = dict(error=f"{type(e).__name__}: {e}"[:2000], cubin_bytes=0, ptx_lines=0, shared=0)
    return out


if __name__ == "__main__":
    import json
    import os
    import sys

    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        sys.exit("unset TRITON_INTERPRET: AOT compilation needs the real Triton compiler")
    if len(sys.argv) > 1 and sys.argv[1] == "extend":  # aot extend ARCH DTYPE HEAD_DIM...: chosen config's smem
        res = {}
        for hd in sys.argv[4:]:
            try:
                cfg, k = compile_extend(int(hd), sys.argv[3], int(sys.argv[2]))
                res[hd] = dict(config=list(cfg), shared=int(k.metadata.shared), error="")
            except Exception as e:  # reported per head dim
                res[hd] = dict(config=None, shared=0, error=f"{type(e).__name__}: {e}"[:2000])
        print(json.dumps(res))
    else:
        print(json.dumps(report(int(sys.argv[1]) if len(sys.argv) > 1 else 90)))
