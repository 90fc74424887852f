"""The decode-path Triton kernels (split-KV decode attention in its default and legacy variants, the reduce, fused
RoPE + KV-cache store) compile ahead of time for sm_90a on this CPU machine (Triton + ptxas, no GPU), and the decode
kernels' K/V tiles are moved by 16-byte pipelined copies (never 2-byte scalar loads) without atomics.

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
NAMES = ("decode_split_rows_2", "decode_split_rows_direct", "decode_split_legacy_8", "decode_reduce", "extend",
         "rope_kv_store_neox", "rope_kv_store_gptj", "rope_neox", "skinny_gemm",
         "rmsnorm_add", "rmsnorm_add_pdl", "rope_kv_store_neox_pdl", "decode_split_rows_direct_pdl", "skinny_gemm_pdl",
         "splitk_add_rmsnorm", "splitk_add_rmsnorm_pdl", "skinny_silu", "skinny_silu_pdl",
         "decode_split_balanced_direct", "decode_split_balanced_4", "decode_reduce_balanced",
         "decode_split_rows_direct_fp8", "decode_split_rows_2_fp8", "extend_fp8", "rope_kv_store_neox_fp8",
         "decode_split_balanced_direct_fp8", "decode_split_balanced_4_fp8")


@pytest.fixture(scope="module")
def aot_report():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([KP, str(REPO / "python"), env.get("PYTHONPATH", "")])
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    r = subprocess.run([sys.executable, "-m", "sgl_kernel.triton.aot", "90"], env=env, capture_output=True, text=True,
                       timeout=600)
    if r.returncode != 0:
        pytest.fail(f"AOT compile process failed ({r.returncode}): {r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", NAMES)
def test_kernel_compiles_for_sm90a(aot_report, name):
    rep = aot_report[name]
    assert not rep["error"], f"{name}: {rep['error']}"
    assert rep["cubin_bytes"] > 0, f"{name}: no cubin (ptxas did not run?)"


@pytest.mark.parametrize("name", ["decode_split_rows_2", "decode_split_rows_direct", "decode_split_legacy_8"])
def test_decode_kv_tiles_use_pipelined_16_byte_copies(aot_report, name):
    rep = aot_report[name]
    assert rep["cp_async16"] >= 16 and rep["scalar_b16_loads"] == 0, rep
    assert rep["shared"] <= 228 * 1024 // 5, rep  # 5 programs per SM: the premise of default_num_kv_splits
    assert rep["atom_acq_rel_gpu"] == 0, rep  # the fused split reduce (an arrival counter) was removed


@pytest.mark.parametrize("name", ["decode_split_balanced_direct", "decode_split_balanced_4"])
def test_balanced_decode_variants_keep_pipelined_16_byte_copies(aot_report, name):
    """The balanced split policy's variants (row order read from a device tensor; the length-aware split rule with
    early-exiting programs) still move K/V by 16-byte asynchronous copies, with no atomics; the one-split variant at
    the sm_90 tile (128 keys, 3 stages) fits three programs per SM."""
    rep = aot_report[name]
    assert rep["cp_async16"] >= 16 and rep["scalar_b16_loads"] == 0, rep
    assert rep["atom_acq_rel_gpu"] == 0, rep
    assert rep["shared"] <= 228 * 1024 // 3, rep


def test_extend_attention_streams_kv_with_pipelined_copies(aot_report):
    """The prefill/extend kernel (8K prefill) moves K/V tiles by 16-byte asynchronous copies, never 2-byte
    scalar loads, and its Hopper config (BLOCK_M 128, BLOCK_N 128, head_dim 128, 8 warps, 3 stages) fits the 227 KB
    of shared memory one program may use on sm_90."""
    rep = aot_report["extend"]
    assert rep["cp_async16"] >= 16 and rep["scalar_b16_loads"] == 0, rep
    assert rep["shared"] <= 227 * 1024, rep


def test_rope_kv_store_neox_is_vectorized(aot_report):
    rep = aot_report["rope_kv_store_neox"]
    assert rep["v4_loads"] > 0 and rep["scalar_b16_loads"] == 0, rep


def test_skinny_gemm_streams_weights_with_pipelined_copies(aot_report):
    rep = aot_report["skinny_gemm"]
    assert rep["cp_async16"] > 0 and rep["scalar_b16_loads"] == 0, rep


@pytest.mark.parametrize("name", ["rmsnorm_add", "rmsnorm_add_pdl"])
def test_rmsnorm_issues_every_load_before_a_store(aot_report, name):
    """Add + RMSNorm issues every global load (the weight first) before its first global store, so no load
    waits behind the residual store (the former SGLANG_DECODE_EARLY_LOADS=1 order, kept as the only one). RoPE + KV
    store keeps program order: a variant loading k and v before storing q wrote different k bytes on an H200."""
    assert aot_report[name]["loads_after_first_store"] == 0, aot_report[name]


@pytest.mark.parametrize("kernel", ["rmsnorm_add", "rope_kv_store_neox", "decode_split_rows_direct", "skinny_gemm"])
def test_pdl_variants_wait_then_launch_dependents(aot_report, kernel):
    """Programmatic dependent launch (the default on Hopper): the PDL variants execute griddepcontrol.wait
    before any global load or async copy (nothing can read the previous kernel's outputs early), trigger the next
    kernel's launch (griddepcontrol.launch_dependents), and only the skinny GEMM issues L2 prefetches of its
    read-only weight lines before the wait; the plain variants (SGLANG_DECODE_PDL=0) have neither instruction."""
    rep, base = aot_report[kernel + "_pdl"], aot_report[kernel]
    assert rep["griddep_wait"] >= 1 and rep["griddep_launch"] >= 1 and rep["loads_before_wait"] == 0, rep
    assert (rep["l2_prefetch_before_wait"] > 0) == (kernel == "skinny_gemm"), rep
    assert base["griddep_wait"] == 0 and base["griddep_launch"] == 0, base


@pytest.mark.parametrize("name", ["splitk_add_rmsnorm", "splitk_add_rmsnorm_pdl"])
def test_splitk_add_rmsnorm_loads_before_its_stores(aot_report, name):
    """Epilogue fusion: the split-K partials, residual and weight are all loaded (16-byte vectors) before the first
    store, as in the unfused add + RMSNorm; under PDL nothing is read before griddepcontrol.wait."""
    rep = aot_report[name]
    assert rep["loads_after_first_store"] == 0 and rep["v4_loads"] > 0 and rep["scalar_b16_loads"] == 0, rep
    assert rep["loads_before_wait"] == 0, rep


@pytest.mark.parametrize("name", ["skinny_silu", "skinny_silu_pdl"])
def test_skinny_silu_streams_both_strips_with_pipelined_copies(aot_report, name):
    """Epilogue fusion: gate_up + SiLU streams its gate and up weight strips by 16-byte pipelined copies; under PDL
    it prefetches lines of both strips into L2 before griddepcontrol.wait and loads nothing before it."""
    rep = aot_report[name]
    assert rep["cp_async16"] > 0 and rep["scalar_b16_loads"] == 0, rep
    if name.endswith("_pdl"):
        assert rep["l2_prefetch_before_wait"] >= 2 and rep["loads_before_wait"] == 0, rep


@pytest.mark.parametrize("name", ["decode_split_rows_direct_fp8", "decode_split_rows_2_fp8", "extend_fp8",
                                  "decode_split_balanced_direct_fp8", "decode_split_balanced_4_fp8"])
def test_fp8_kv_attention_streams_fp8_tiles_with_pipelined_copies(aot_report, name):
    """FP8 KV cache: the decode / extend kernels copy the one-byte K/V tiles to shared memory with 16-byte async
    copies (16 elements each) and need less shared memory than their BF16 twins (the tiles are half the bytes)."""
    rep, bf16 = aot_report[name], aot_report[name.replace("_fp8", "")]
    assert rep["cp_async16"] > 0 and rep["scalar_b16_loads"] == 0 and rep["atom_acq_rel_gpu"] == 0
    assert rep["shared"] < bf16["shared"]


def test_fp8_kv_store_rounds_to_nearest_even_and_saturates(aot_report):
    """The fused RoPE + FP8 KV store converts with ``cvt.rn.satfinite.e4m3x2.f32`` (the pool's rounding rule:
    nearest even, saturated to +-448), and the BF16 variant has no FP8 conversion."""
    assert aot_report["rope_kv_store_neox_fp8"]["fp8_satfinite_cvt"] > 0
    assert aot_report["rope_kv_store_neox"]["fp8_satfinite_cvt"] == 0
