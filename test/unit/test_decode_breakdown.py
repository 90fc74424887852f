"""benchmark/decode/breakdown.py on CPU: GEMM roles from kernel order (cuBLAS/nvjet names as profiled on the H200,
skinny split-K with its reduce kernel), minimum bytes of Llama-3.1-8B, and the time/bandwidth arithmetic."""

from __future__ import annotations

import os
import random
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

from benchmark.decode import breakdown as db  # noqa: E402

NVJET = "nvjet_sm90_tst_128x8_64x12_2x1_v_bz_TNT"
SPLITK = "nvjet_sm90_tst_64x8_64x16_2x1_v_bz_splitK_TNT"
ARGMAX = ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::ArgMaxOps<float>, "
          "unsigned int, long, 4> >(at::native::ReduceOp<float, at::native::ArgMaxOps<float>, unsigned int, long, 4>)")
CAST = "void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)>"


def llama_step(layers: int, split_attention: bool, skinny_down: bool) -> tuple[list[str], list[str]]:
    """Kernel names of one decode step as launched, and the class each must get."""
    names, want = ["void at::native::indexSelectLargeIndex<c10::BFloat16>"], ["embed_copy"]
    for _ in range(layers):
        layer = [("_rmsnorm_kernel", "norm"), (NVJET, "qkv"), ("_rope_kv_store_kernel", "rope_kv"),
                 ("_decode_split_kernel", "attention")]
        layer += [("_decode_reduce_kernel", "attention")] if split_attention else []
        layer += [(SPLITK, "o"), ("_rmsnorm_kernel", "norm"), (NVJET, "gate_up"), ("_silu_and_mul_kernel", "act")]
        layer += ([("_skinny_gemm_kernel", "down"), ("_splitk_reduce_kernel", "down")] if skinny_down
                  else [(SPLITK, "down")])
        names += [n for n, _ in layer]
        want += [c for _, c in layer]
    names += ["_rmsnorm_kernel", "nvjet_sm90_tst_256x8_64x6_2x1_v_bz_TNT", CAST, ARGMAX]
    want += ["norm", "lm_head", "embed_copy", "sampling"]
    return names, want


@pytest.mark.parametrize("layers", [1, 3, 32])
@pytest.mark.parametrize("split_attention", [False, True])
@pytest.mark.parametrize("skinny_down", [False, True])
def test_roles_follow_the_layer_structure(layers, split_attention, skinny_down):
    names, want = llama_step(layers, split_attention, skinny_down)
    assert db.assign_classes(names) == want


def test_fused_epilogue_kernels_get_their_classes():
    """Epilogue fusions: the split-K reduce inside add + RMSNorm counts as ``norm`` and the gate_up skinny GEMM with
    SiLU-and-mul as ``gate_up`` (no ``act`` kernel left); the roles of the other GEMMs are unchanged."""
    names = ["_rmsnorm_kernel", NVJET, "_rope_kv_store_kernel", "_decode_split_kernel", "_skinny_gemm_kernel",
             "_splitk_add_rmsnorm_kernel", "_skinny_silu_kernel", "_skinny_gemm_kernel", "_splitk_add_rmsnorm_kernel",
             NVJET, ARGMAX]
    assert db.assign_classes(names) == ["norm", "qkv", "rope_kv", "attention", "o", "norm", "gate_up", "down",
                                        "norm", "lm_head", "sampling"]


def test_extra_gemms_are_not_given_a_role():
    names = ["_rmsnorm_kernel", NVJET, NVJET, "_decode_split_kernel", NVJET, NVJET, NVJET, NVJET, NVJET, NVJET]
    assert db.assign_classes(names) == ["norm", "qkv", "gemm_other", "attention", "o", "gate_up", "down",
                                        "lm_head", "gemm_other", "gemm_other"]


LLAMA8B = dict(layers=32, hidden=4096, inter=14336, heads=32, kv_heads=8, head_dim=128, vocab=128256, itemsize=2)


def test_min_bytes_of_llama_8b():
    nb = db.min_bytes(LLAMA8B, bs=1, kv_tokens=1024)
    assert nb["qkv"] == 32 * (6144 * 4096 + 6144 + 4096) * 2
    assert nb["gate_up"] == 32 * (28672 * 4096 + 28672 + 4096) * 2
    assert nb["down"] == 32 * (4096 * 14336 + 4096 + 14336) * 2
    assert nb["lm_head"] == (128256 * 4096 + 128256 + 4096) * 2
    assert nb["attention"] == 32 * (1024 * 2 * 1024 + 2 * 4096) * 2  # 128 KiB of K+V per token over 32 layers
    weights = sum(nb[r] for r in ("qkv", "o", "gate_up", "down", "lm_head"))
    assert 14.9e9 < weights < 15.1e9  # the 7.5 B non-embedding parameters in bf16
    big = db.min_bytes(LLAMA8B, bs=128, kv_tokens=128 * 1040)
    assert all(big[k] >= nb[k] for k in nb) and big["attention"] == 128 * 1040 * 131072 + 32 * 2 * 128 * 4096 * 2


def test_role_breakdown_arithmetic_on_random_times():
    rng = random.Random(7)
    names, _ = llama_step(4, True, True)
    events = [(n, rng.uniform(1.0, 50.0)) for n in names]
    nbytes = db.min_bytes(dict(LLAMA8B, layers=4), bs=8, kv_tokens=8 * 500)
    bw = 3.0e12
    b = db.role_breakdown(events, nbytes, bw)
    assert b["total_ms"] == pytest.approx(sum(us for _, us in events) / 1e3)
    assert b["floor_ms"] == pytest.approx(sum(nbytes.values()) / bw * 1e3)
    assert sum(r["kernels"] for r in b["rows"]) == len(events)
    rows = {r["cls"]: r for r in b["rows"]}
    want_down = sum(us for (n, us), c in zip(events, db.assign_classes(names)) if c == "down") / 1e3
    assert rows["down"]["ms"] == pytest.approx(want_down) and rows["down"]["kernels"] == 8
    for r in b["rows"]:
        assert r["over_ms"] == pytest.approx(r["ms"] - r["bytes"] / bw * 1e3)
        if r["ms"]:
            assert r["of_copy"] == pytest.approx(r["bytes"] / (r["ms"] / 1e3) / bw)
    assert sum(r["over_ms"] for r in b["rows"]) == pytest.approx(b["total_ms"] - b["floor_ms"])
    lines = db.render_role_table("bs 8", b, bw)
    assert lines[0].startswith("### bs 8") and any(line.startswith("| down | 8 |") for line in lines)


def test_served_timeline_counts_steps_busy_and_idle():
    """Prefill kernels, then 4 decode steps of 3 graph kernels + 1 argmax, 10 us busy each, with a 5 us gap after
    each argmax and one extra 2 us copy per step outside the graph: the window starts after the first argmax."""
    trace, t = [("_extend_kernel", 0.0, 50.0), ("_rmsnorm_kernel", 50.0, 5.0)], 60.0
    for _ in range(4):
        for name in (NVJET, "_decode_split_kernel", NVJET):
            trace.append((name, t, 2.0))
            t += 2.0
        trace.append((ARGMAX, t, 4.0))
        t += 4.0
        trace.append(("Memcpy DtoH (Device -> Pinned)", t, 2.0))
        t += 2.0 + 5.0  # idle until the next step's graph
    got = db.served_timeline(trace, graph_kernels=4)
    assert got["steps"] == 3 and got["kernels_per_step"] == pytest.approx(5.0)
    assert got["extra_per_step"] == pytest.approx(1.0)
    assert got["busy_us"] == pytest.approx(12.0) and got["idle_us"] == pytest.approx(5.0)
    assert got["period_us"] == pytest.approx(17.0) and got["gaps"][0][0] == pytest.approx(5.0)
    assert "error" in db.served_timeline(trace[:8], graph_kernels=4)
