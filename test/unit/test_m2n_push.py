"""Device-driven M2N transport (``cuda_push``, MegaScale-Infer sec. 5) on CPU: its receive kernel under the Triton
interpreter against the torch reference (send and receive kernels with their device sequence counters, random row
counts incl. 0, host and device row counts, fixed-offset and packed destinations, the ack store, the fail-closed
bounded wait with 0 rows), the transport's host logic with two endpoints on a CPU stand-in of the CUDA platform
(m2n_push_sim_case.py), mutation checks (a counter that does not advance fails both), the kernels' sm_90a PTX
(acquire/release at system scope, bounded-wait instructions, 16-byte copies, no multicast), the flag word, and the
endpoint's API checks."""

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
    import sys
    import torch
    from sgl_kernel.m2n import RowLayout
    from sgl_kernel.m2n.push_kernels import launch_recv, launch_send, relayout_reference
    from sgl_kernel.tdist.heap import simulate_group
    from sgl_kernel.tdist.layout import HeapConfig

    BROKEN = "--broken-counter" in sys.argv  # the send kernel's counter rewound: the checks must fail
    g = torch.Generator().manual_seed(11)
    lay = RowLayout(((torch.bfloat16, 6), (torch.int32, 3), (torch.float32, 1)))
    cb, max_rows, slots = [12, 12, 4], 9, 2
    cap = lay.nbytes(max_rows)
    # one heap plays both ranks: the sender (rank 0) writes flags[0, :] / ring[0] of the receiver (rank 1), which
    # acks into acks[1], the word the sender waits on for peer 1
    heap = simulate_group(1, HeapConfig(data_bytes=4 * slots * cap, signal_slots=64, wait_timeout_s=1.0))[0]
    flags, acks = heap.signals("flags", 2 * slots), heap.signals("acks", 2)
    ring = heap.tensor("ring", (2, slots, cap), torch.uint8)
    ctr_s, ctr_r = torch.zeros(8, dtype=torch.int64), torch.zeros(8, dtype=torch.int64)
    colb = torch.tensor(cb)
    rows_out = torch.zeros(1, dtype=torch.int64)
    sizes = [0, max_rows, 1] + torch.randint(0, max_rows + 1, (7,), generator=g).tolist()
    for seq, rows in enumerate(sizes):
        dev_rows = seq % 2 == 1  # odd messages: row count on the device, blocks at max_rows offsets in the send slot
        ts = [torch.randn(max_rows, 6, generator=g).bfloat16(), torch.randint(-9, 9, (max_rows, 3), dtype=torch.int32,
              generator=g), torch.rand(max_rows, 1, generator=g)]
        send = torch.randint(0, 256, (cap,), dtype=torch.uint8, generator=g)
        lay.pack(send, ts if dev_rows else [t[:rows] for t in ts])
        src_rows = max_rows if dev_rows else -1
        launch_send(heap.meta, ctr_s, 1, acks, flags, 0, ring.view(torch.int32), 0, send.view(torch.int32), rows,
                    torch.tensor([rows]) if dev_rows else None, src_rows, max_rows if dev_rows else rows, colb, 2,
                    slots, cap // 4, 3, 4)
        if BROKEN:
            ctr_s[1] -= 1
        slot = seq % slots
        ref = relayout_reference(send, rows, cb, -1, src_rows)
        assert torch.equal(ring[0, slot, :ref.numel()], ref), (seq, rows)
        assert int(flags[slot]) == ((seq + 1) << 32) | rows, (seq, int(flags[slot]))
        for cap_rows in (max_rows, -1):
            if cap_rows == -1:  # receive the same message again: rewind the receiver's counter
                ctr_r[2 + 0] -= 1
            dst = torch.zeros(cap, dtype=torch.uint8)
            launch_recv(heap.meta, ctr_r, 0, flags, acks[1:2], 0, ring.view(torch.int32), dst.view(torch.int32),
                        rows_out, colb, cap_rows, max_rows, 2, slots, cap // 4, True, 3, 4)
            ref = relayout_reference(ring[0, slot], rows, cb, cap_rows)
            assert torch.equal(dst[:ref.numel()], ref), (rows, cap_rows)
            got = lay.unpack(dst, max_rows if cap_rows > 0 else rows)
            assert all(torch.equal(a[:rows], b[:rows]) for a, b in zip(got, ts)), (rows, cap_rows)
            assert int(rows_out) == rows and int(acks[1]) == seq + 1 and int(acks[0]) == 0  # acked at ack + delta
            heap.check()
        assert ctr_s.tolist() == [0, seq + 1] + [0] * 6 and ctr_r.tolist() == [0, 0, seq + 1, 0] + [0] * 4
    # never signalled: the bounded wait records the error, the kernel copies 0 rows and advances nothing
    dst = torch.full((cap,), 7, dtype=torch.uint8)
    launch_recv(heap.meta, ctr_r, 1, flags, acks[0:1], 0, ring.view(torch.int32), dst.view(torch.int32),
                rows_out, colb, max_rows, max_rows, 2, slots, cap // 4, True, 2, 4)
    assert int(rows_out) == 0 and bool((dst == 7).all()) and int(ctr_r[3]) == 0 and int(ctr_r[7]) == 0
    err = heap.wait_error()
    assert err and "m2n_recv_kernel" in err and "flags[2]" in err, err
    print("OK")
""")


ARRIVE_CASE = textwrap.dedent("""
    import torch
    import triton
    import triton.language as tl
    from sgl_kernel.m2n import push_kernels as K

    @triton.jit
    def probe(done, bad, out):
        pid = tl.program_id(0)
        last, all_ok = K._arrive_last(done, pid != bad)
        tl.store(out + 2 * pid, last.to(tl.int64))
        tl.store(out + 2 * pid + 1, all_ok.to(tl.int64))

    for bad in (-1, 0, 1, 2):  # -1: every program's wait succeeded; else program ``bad`` gave up
        done = torch.zeros(1, dtype=torch.int64)
        out = torch.full((6,), -1, dtype=torch.int64)
        probe[(3,)](done, bad, out)
        lasts, oks = out[0::2].tolist(), out[1::2].tolist()
        assert lasts.count(1) == 1 and int(done) == 0, (bad, lasts, int(done))  # one last program; counter reset
        assert oks[lasts.index(1)] == (bad == -1), (bad, oks)  # the last one publishes only if nobody gave up
    print("OK")
""")


def _interpret(argv: list, expect: str = "OK") -> str:
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "sgl-kernel" / "python"), str(REPO / "python"),
                                         env.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, *argv], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and expect in r.stdout, r.stdout[-1000:] + r.stderr[-3000:]
    return r.stdout


@needs_triton
def test_send_recv_kernels_interpreter_match_torch_reference():
    _interpret(["-c", INTERPRET_CASE])


@needs_triton
def test_arrival_counts_failed_programs_interpreter():
    """The kernels' arrival: exactly one program is last, it resets the counter, and it learns whether any other
    program's wait gave up (then neither kernel publishes a flag / ack for a partly copied message)."""
    _interpret(["-c", ARRIVE_CASE])


@needs_triton
def test_transport_host_logic_two_endpoints_interpreter():
    """m2n_push_sim_case.py: both paths, acks, stash, device row counts, device counters, fail-closed check."""
    _interpret([str(Path(__file__).resolve().parent / "m2n_push_sim_case.py")])


@needs_triton
def test_broken_device_counter_is_caught():
    """Mutation checks: a send kernel whose counter does not advance fails the kernel case, and a receive whose
    counter does not advance fails the two-endpoint case (stale slot read) -- so the checks above can fail."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "sgl-kernel" / "python"), str(REPO / "python"),
                                         env.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, "-c", INTERPRET_CASE, "--broken-counter"], env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode != 0 and "AssertionError" in r.stderr and "OK" not in r.stdout, r.stdout + r.stderr[-2000:]
    out = _interpret([str(Path(__file__).resolve().parent / "m2n_push_sim_case.py"), "--broken-counter"],
                     expect="BROKEN-DETECTED")
    assert not out.strip().endswith("OK")


def _ptx(fn, sig: dict, constexprs: dict) -> str:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from sgl_kernel.tdist import aot

    src = ASTSource(fn=fn, signature=dict(sig), constexprs=constexprs, attrs=aot.launch_attrs(fn, sig))
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]


def _check_ptx(ptx: str) -> None:
    """Acquire spin, release flag / ack, bounded wait (timer + error record), the arrival atomic at system scope,
    16-byte copies, no multicast."""
    from sgl_kernel.tdist import aot

    for pat in (aot.ACQ, aot.REL, aot.ATOM) + aot.BOUND:
        assert re.search(pat, ptx), pat
    assert "multimem" not in ptx
    assert aot.vector_ops(ptx)["ld_v4"] > 0 and aot.vector_ops(ptx)["st_v4"] > 0


@needs_triton
@pytest.mark.parametrize("delta_ty", ["i32", "i64"])
def test_recv_kernel_sm90a_ptx(delta_ty):
    """The argument types the launcher really passes: ``ack_delta`` i32 or i64 (a peer's heap distance)."""
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        pytest.skip("AOT compilation needs the real Triton compiler")
    from sgl_kernel.m2n.push_kernels import m2n_recv_kernel

    sig = {"meta": "*i64", "ctr": "*i64", "src": "i32", "flags": "*i64", "ack": "*i64", "ack_delta": delta_ty,
           "ring": "*i32", "dst": "*i32", "rows_out": "*i64", "col_bytes": "*i64", "cap_rows": "i32",
           "max_rows": "i32", "cap32": "i32", "WORLD": "constexpr", "SLOTS": "constexpr", "NCOL": "constexpr",
           "COPY": "constexpr", "BLOCK": "constexpr"}
    _check_ptx(_ptx(m2n_recv_kernel, sig, {"WORLD": 2, "SLOTS": 4, "NCOL": 3, "COPY": True, "BLOCK": 1024}))


@needs_triton
@pytest.mark.parametrize("rows_dev,delta_ty", [(False, "i64"), (True, "i64"), (False, "i32")])
def test_send_kernel_sm90a_ptx(rows_dev, delta_ty):
    """The send kernel for both row sources; the flag is written after a system-scope fence."""
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        pytest.skip("AOT compilation needs the real Triton compiler")
    from sgl_kernel.m2n.push_kernels import m2n_send_kernel

    sig = {"meta": "*i64", "ctr": "*i64", "peer": "i32", "acks": "*i64", "flags": "*i64", "flag_delta": delta_ty,
           "ring": "*i32", "ring_delta": delta_ty, "send": "*i32", "rows_ptr": "*i64", "rows_arg": "i32",
           "src_rows": "i32", "max_rows": "i32", "col_bytes": "*i64", "cap32": "i32", "WORLD": "constexpr",
           "SLOTS": "constexpr", "NCOL": "constexpr", "ROWS_DEV": "constexpr", "BLOCK": "constexpr"}
    ptx = _ptx(m2n_send_kernel, sig, {"WORLD": 2, "SLOTS": 4, "NCOL": 3, "ROWS_DEV": rows_dev, "BLOCK": 1024})
    _check_ptx(ptx)
    assert re.search(r"fence\.sc\.sys", ptx)


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


def test_send_device_rows_bad_input_names_the_fix():
    """``send(rows=...)``: a host header or a tensor that is not int64 [1] is refused before anything is sent."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from m2n_push_sim_case import SimDriver, SimPlatform

    from sgl_kernel.m2n.cuda_push import CudaPushTransport

    d = tempfile.mkdtemp(prefix="m2n-push-")
    ep = M2NEndpoint(M2NConfig(0, (f"ipc://{d}/0", f"ipc://{d}/1"), 4), RowLayout(((torch.float32, 8),)),
                     transport=CudaPushTransport(wait_timeout_s=1.0, platform=SimPlatform(SimDriver())))
    try:
        x = torch.zeros(2, 8)
        for kw in ({"rows": torch.tensor([1])}, {"rows": torch.tensor([1.0]), "host_header": False},
                   {"rows": torch.tensor([1, 2]), "host_header": False}):
            with pytest.raises(ValueError, match="int64 \\[1\\]"):
                ep.send(1, [x], **kw)
        assert int(ep.transport.ctr.abs().sum()) == 0  # nothing launched
    finally:
        ep.close()
