"""Device-driven M2N transport (``cuda_push``, MegaScale-Infer sec. 5) on CPU: its receive kernel under the Triton
interpreter against the torch reference (random row counts incl. 0, fixed-offset and packed destinations, the ack
store, the fail-closed bounded wait with 0 rows), the transport's host logic with two endpoints on a CPU stand-in
of the CUDA platform (m2n_push_sim_case.py), its sm_90a PTX (acquire/release at system scope, bounded-wait
instructions, 16-byte copies, no multicast), the flag word, and the endpoint's API checks."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
import torch

from sgl_kernel.m2n import M2NConfig, M2NEndpoint, RowLayout, create_transport

REPO = Path(__file__).resolve().parents[2]
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

INTERPRET_CASE = textwrap.dedent("""
    import torch
    from sgl_kernel.m2n import RowLayout
    from sgl_kernel.m2n.push_kernels import flag_value, launch_recv, relayout_reference
    from sgl_kernel.tdist.heap import simulate_group
    from sgl_kernel.tdist.layout import HeapConfig

    g = torch.Generator().manual_seed(11)
    lay = RowLayout(((torch.bfloat16, 6), (torch.int32, 3), (torch.float32, 1)))
    cb, max_rows = [12, 12, 4], 9
    heap = simulate_group(1, HeapConfig(data_bytes=4096, signal_slots=64, wait_timeout_s=1.0))[0]
    flags, acks = heap.signals("flags", 4), heap.signals("acks", 2)
    rows_out = torch.zeros(1, dtype=torch.int64)
    sizes = [0, max_rows, 1] + torch.randint(0, max_rows + 1, (5,), generator=g).tolist()
    for seq, rows in enumerate(sizes):
        ring = torch.randint(0, 256, (lay.nbytes(max_rows),), dtype=torch.uint8, generator=g)
        ts = [torch.randn(rows, 6, generator=g).bfloat16(), torch.randint(-9, 9, (rows, 3), dtype=torch.int32,
              generator=g), torch.rand(rows, 1, generator=g)]
        lay.pack(ring, ts)
        flags[1] = flag_value(seq, rows)
        for cap_rows in (max_rows, -1):
            dst = torch.zeros(lay.nbytes(max_rows), dtype=torch.uint8)
            launch_recv(heap.meta, flags[1:2], (seq + 1) << 32, acks[0:1], 1, seq + 1, ring.view(torch.int32),
                        dst.view(torch.int32), rows_out, torch.tensor(cb), cap_rows, max_rows, True, 3, 4)
            ref = relayout_reference(ring, rows, cb, cap_rows)
            assert torch.equal(dst[:ref.numel()], ref), (rows, cap_rows)
            got = lay.unpack(dst, max_rows if cap_rows > 0 else rows)
            assert all(torch.equal(a[:rows], b) for a, b in zip(got, ts)), (rows, cap_rows)
            assert int(rows_out) == rows and int(acks[1]) == seq + 1 and int(acks[0]) == 0  # stored at ack + delta
            heap.check()
    # never signalled: the bounded wait records the error and the kernel copies 0 rows
    dst = torch.full((lay.nbytes(max_rows),), 7, dtype=torch.uint8)
    launch_recv(heap.meta, flags[2:3], 1 << 32, acks[0:1], 0, 0, ring.view(torch.int32), dst.view(torch.int32),
                rows_out, torch.tensor(cb), max_rows, max_rows, True, 2, 4)
    assert int(rows_out) == 0 and bool((dst == 7).all())
    err = heap.wait_error()
    assert err and "m2n_recv_kernel" in err and "flags[2]" in err, err
    print("OK")
""")


def _interpret(argv: list) -> None:
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "sgl-kernel" / "python"), str(REPO / "python"),
                                         env.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, *argv], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and r.stdout.strip().endswith("OK"), r.stderr[-3000:]


@needs_triton
def test_recv_kernel_interpreter_matches_torch_reference():
    _interpret(["-c", INTERPRET_CASE])


@needs_triton
def test_transport_host_logic_two_endpoints_interpreter():
    """m2n_push_sim_case.py: both paths, acks, stash, fail-closed check (see its docstring)."""
    _interpret([str(Path(__file__).resolve().parent / "m2n_push_sim_case.py")])


@needs_triton
@pytest.mark.parametrize("copy,expect_ty,ack_ty", [(True, "i64", "i64"), (True, "i64", "i32"), (False, "i32", "i32")])
def test_recv_kernel_sm90a_ptx(copy, expect_ty, ack_ty):
    """The argument types the launcher really passes: ``expect`` i64 for data flags, i32 for the sender's ack wait;
    ``ack_delta`` / ``ack_value`` i32 when 0 (first receive, no ack), i64 for a peer's heap distance."""
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        pytest.skip("AOT compilation needs the real Triton compiler")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from sgl_kernel.m2n.push_kernels import m2n_recv_kernel
    from sgl_kernel.tdist import aot

    sig = {"meta": "*i64", "flag": "*i64", "expect": expect_ty, "ack": "*i64", "ack_delta": ack_ty, "ack_value": ack_ty,
           "src": "*i32",
           "dst": "*i32", "rows_out": "*i64", "col_bytes": "*i64", "cap_rows": "i32", "max_rows": "i32",
           "NCOL": "constexpr", "COPY": "constexpr", "BLOCK": "constexpr"}
    src = ASTSource(fn=m2n_recv_kernel, signature=dict(sig), constexprs={"NCOL": 3, "COPY": copy, "BLOCK": 1024},
                    attrs=aot.launch_attrs(m2n_recv_kernel, sig))
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]
    for pat in (aot.ACQ, aot.REL) + aot.BOUND:  # acquire spin, release ack, bounded wait (timer + error record)
        assert re.search(pat, ptx), pat
    assert "multimem" not in ptx
    if copy:  # the payload copy moves 16 bytes per access
        assert aot.vector_ops(ptx)["ld_v4"] > 0 and aot.vector_ops(ptx)["st_v4"] > 0


@needs_triton
def test_flag_kernel_sm90a_ptx():
    """The fallback flag writer: a system-scope fence then a release store (no multicast)."""
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        pytest.skip("AOT compilation needs the real Triton compiler")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from sgl_kernel.m2n.push_kernels import m2n_flag_kernel
    from sgl_kernel.tdist import aot

    sig = {"flag": "*i64", "delta": "i64", "value": "i64"}
    src = ASTSource(fn=m2n_flag_kernel, signature=sig, constexprs={}, attrs=aot.launch_attrs(m2n_flag_kernel, sig))
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 1}).asm["ptx"]
    assert re.search(r"fence\.sc\.sys", ptx) and re.search(aot.REL, ptx) and "multimem" not in ptx


def test_flag_word_carries_sequence_and_rows():
    from sgl_kernel.m2n.push_kernels import flag_value

    assert flag_value(0, 0) == 1 << 32 and flag_value(4, 300) == (5 << 32) | 300
    assert flag_value(3, 7) >= 4 << 32 > flag_value(2, 2**32 - 1)  # the receiver's >= wait orders by sequence
    with pytest.raises(ValueError, match="rows"):
        flag_value(0, 2**32)


def test_endpoint_device_api_refuses_host_transports():
    d = tempfile.mkdtemp(prefix="m2n-push-")
    ep = M2NEndpoint(M2NConfig(0, (f"ipc://{d}/0", f"ipc://{d}/1"), 4), RowLayout(((torch.float32, 8),)))
    try:
        with pytest.raises(ValueError, match="device-driven"):
            ep.send(1, [torch.zeros(2, 8)], host_header=False)
        with pytest.raises(ValueError, match="device-driven"):
            ep.recv_device(1)
        ep.check()  # a host transport: nothing to check
    finally:
        ep.close()


def test_cuda_push_refuses_cpu_and_bad_budget():
    from sgl_kernel.m2n.cuda_push import CudaPushTransport

    with pytest.raises(ValueError, match="wait_timeout_s"):
        CudaPushTransport(wait_timeout_s=0)
    d = tempfile.mkdtemp(prefix="m2n-push-")
    with pytest.raises(RuntimeError, match="CUDA"):
        M2NEndpoint(M2NConfig(0, (f"ipc://{d}/0", f"ipc://{d}/1"), 4), RowLayout(((torch.float32, 8),)),
                    transport=create_transport("cuda_push"))
