"""Low-latency (LL) protocol of the ``cuda_push`` M2N transport (:mod:`sgl_kernel.m2n.ll_kernels`)
on CPU: the send and receive kernels under the Triton interpreter against the torch references (ring words ==
``ll_reference``, received bytes == ``relayout_reference``) over random row counts incl. 0 and ``max_rows``, host
and device row counts, fixed-offset and packed destinations, more messages than slots (tags of reused slots),
several programs with several blocks each; fail closed: a slot whose ack never came is not written, a message with
one word missing its tag (a partial arrival) and a never-sent message are not accepted (rows 0, nothing acked, the
error names the kernel); mutation checks (a send or receive counter that does not advance fails the case); the
kernels' sm_90a PTX (16-byte LL stores / loads, release ack, bounded wait, no multicast, no system fence on the
send path)."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

CASE = textwrap.dedent("""
    import sys
    import torch
    from sgl_kernel.m2n import RowLayout
    from sgl_kernel.m2n.ll_kernels import launch_ll_recv, launch_ll_send, ll_reference
    from sgl_kernel.m2n.push_kernels import relayout_reference
    from sgl_kernel.tdist.heap import simulate_group
    from sgl_kernel.tdist.layout import HeapConfig

    MODE = sys.argv[1] if len(sys.argv) > 1 else ""
    g = torch.Generator().manual_seed(5)
    lay = RowLayout(((torch.bfloat16, 6), (torch.int32, 3), (torch.float32, 1)))
    cb, max_rows, slots, G, BLOCK = [12, 12, 4], 9, 2, 3, 16
    cap = lay.nbytes(max_rows)
    W = cap // 4

    def group():
        # one heap plays both ranks: sender rank 0 writes hdr[0] / ring[0] of receiver rank 1, which acks into
        # acks[1, :], the words the sender waits on for peer 1
        heap = simulate_group(1, HeapConfig(data_bytes=16 * slots * cap, signal_slots=64, wait_timeout_s=1.0))[0]
        return (heap, heap.signals("hdr", 2 * slots * G), heap.signals("acks", 2 * G),
                heap.tensor("ring", (2, slots, W), torch.int64))

    heap, hdr, acks, ring = group()
    ctr_s, ctr_r = torch.zeros(4 * G, dtype=torch.int64), torch.zeros(4 * G, dtype=torch.int64)
    colb, rows_out = torch.tensor(cb), torch.zeros(1, dtype=torch.int64)

    def send(heap, ctr, send_buf, rows, dev_rows, src_rows):
        launch_ll_send(heap.meta, ctr[G:2 * G], 1, acks[G:], hdr, 0, ring, 0, send_buf.view(torch.int32), rows,
                       torch.tensor([rows]) if dev_rows else None, src_rows, max_rows if dev_rows else rows, colb, 2,
                       slots, W, G, BLOCK)

    def recv(heap, ctr, src, dst, cap_rows):
        launch_ll_recv(heap.meta, ctr[(2 + src) * G:(3 + src) * G], src, hdr, acks[G:], 0, ring, dst.view(torch.int32), rows_out, colb, cap_rows,
                       max_rows, 2, slots, W, G, BLOCK)

    sizes = [0, max_rows, 1] + torch.randint(0, max_rows + 1, (9,), generator=g).tolist()
    for seq, rows in enumerate(sizes):
        dev_rows = seq % 2 == 1  # odd messages: device row count, blocks at max_rows offsets in the send buffer
        ts = [torch.randn(max_rows, 6, generator=g).bfloat16(),
              torch.randint(-9, 9, (max_rows, 3), dtype=torch.int32, generator=g), torch.rand(max_rows, 1, generator=g)]
        buf = torch.randint(0, 256, (cap,), dtype=torch.uint8, generator=g)
        lay.pack(buf, ts if dev_rows else [t[:rows] for t in ts])
        src_rows = max_rows if dev_rows else -1
        send(heap, ctr_s, buf, rows, dev_rows, src_rows)
        if MODE == "--broken-send":
            ctr_s[G:2 * G] -= 1
        slot = seq % slots
        ref = ll_reference(buf, rows, cb, seq, src_rows)
        assert torch.equal(ring[0, slot, :ref.numel()], ref), (seq, rows)
        assert hdr[slot * G:(slot + 1) * G].tolist() == [(((seq + 1) << 32) | rows)] * G, (seq, hdr.tolist())
        packed = relayout_reference(buf, rows, cb, -1, src_rows)
        for cap_rows in (max_rows, -1):
            if cap_rows == -1:  # receive the same message again: rewind every program's receive counter
                ctr_r[2 * G:3 * G] -= 1
            dst = torch.zeros(cap, dtype=torch.uint8)
            recv(heap, ctr_r, 0, dst, cap_rows)
            want = relayout_reference(packed, rows, cb, cap_rows)
            assert torch.equal(dst[:want.numel()], want), (seq, rows, cap_rows)
            got = lay.unpack(dst, max_rows if cap_rows > 0 else rows)
            assert all(torch.equal(a[:rows], b[:rows]) for a, b in zip(got, ts)), (rows, cap_rows)
            assert int(rows_out) == rows and acks[G:].tolist() == [seq + 1] * G and acks[:G].tolist() == [0] * G
            heap.check()
        if MODE == "--broken-recv":
            ctr_r[2 * G:3 * G] -= 1
        assert ctr_s.tolist() == [0] * G + [seq + 1] * G + [0] * 2 * G, ctr_s.tolist()
        assert ctr_r.tolist() == [0] * 2 * G + [seq + 1] * G + [0] * G, ctr_r.tolist()
    print("MESSAGES-OK", flush=True)

    # fail closed 1: a never-sent message: rows 0, dst untouched, nothing acked or advanced, the error names the kernel
    dst = torch.full((cap,), 7, dtype=torch.uint8)
    recv(heap, ctr_r, 1, dst, max_rows)
    assert int(rows_out) == 0 and bool((dst == 7).all()) and ctr_r[3 * G:].tolist() == [0] * G
    err = heap.wait_error()
    assert err and "m2n_ll_recv_kernel" in err, err

    # fail closed 2: one payload word still carries the old tag (a partial arrival): not accepted, not acked
    heap, hdr, acks, ring = group()
    ctr_s, ctr_r = torch.zeros(4 * G, dtype=torch.int64), torch.zeros(4 * G, dtype=torch.int64)
    buf = torch.randint(0, 256, (cap,), dtype=torch.uint8, generator=g)
    send(heap, ctr_s, buf, max_rows, False, -1)
    ring[0, 0, W // 2] &= 0xFFFFFFFF  # tag 0: this word has not arrived yet
    recv(heap, ctr_r, 0, torch.zeros(cap, dtype=torch.uint8), max_rows)
    assert int(rows_out) == 0 and acks[G + (W // 2 // BLOCK) % G] == 0 and heap.wait_error()

    # fail closed 3: the sender may not overwrite a slot the receiver has not acked (slots + 1 sends, no receive)
    heap, hdr, acks, ring = group()
    ctr_s = torch.zeros(4 * G, dtype=torch.int64)
    for seq in range(slots + 1):
        before = ring.clone()
        send(heap, ctr_s, buf, max_rows, False, -1)
    assert torch.equal(ring, before) and ctr_s[G:2 * G].tolist() == [slots] * G
    err = heap.wait_error()
    assert err and "m2n_ll_recv_kernel / m2n_ll_send_kernel" in err, err
    print("OK")
""")


def _run(*args: str):
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "sgl-kernel" / "python"), str(REPO / "python"),
                                         env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-c", CASE, *args], env=env, capture_output=True, text=True, timeout=900)


@needs_triton
def test_ll_kernels_interpreter_match_torch_reference_and_fail_closed():
    r = _run()
    assert r.returncode == 0 and r.stdout.strip().endswith("OK"), r.stdout[-1000:] + r.stderr[-3000:]


@needs_triton
@pytest.mark.parametrize("mode", ["--broken-send", "--broken-recv"])
def test_ll_counter_that_does_not_advance_is_caught(mode):
    """Mutation checks: a counter that does not advance (sender: the tag repeats; receiver: it re-reads the old
    message) fails the message checks above, so they can fail."""
    r = _run(mode)
    assert r.returncode != 0 and "AssertionError" in r.stderr and "MESSAGES-OK" not in r.stdout, \
        r.stdout[-1000:] + r.stderr[-2000:]


def _ptx(fn, sig: dict, constexprs: dict) -> str:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from sgl_kernel.tdist import aot

    src = ASTSource(fn=fn, signature=dict(sig), constexprs=constexprs, attrs=aot.launch_attrs(fn, sig))
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]


@needs_triton
def test_ll_kernels_sm90a_ptx():
    """Send: 16-byte stores of LL words (``st.global.v2.b64``), the bounded ack wait, the relaxed header store and no
    system fence or arrival atomic (what the LL protocol removes). Receive: volatile 16-byte loads, bounded spin
    (timer + error record), release ack; no multicast in either."""
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        pytest.skip("AOT compilation needs the real Triton compiler")
    from sgl_kernel.m2n.ll_kernels import m2n_ll_recv_kernel, m2n_ll_send_kernel
    from sgl_kernel.tdist import aot

    common = {"meta": "*i64", "ctr": "*i64", "hdr": "*i64", "ring": "*i64", "col_bytes": "*i64",
              "max_rows": "i32", "cap_words": "i32", "WORLD": "constexpr", "SLOTS": "constexpr",
              "NCOL": "constexpr", "BLOCK": "constexpr"}
    send = _ptx(m2n_ll_send_kernel, {**common, "peer": "i32", "acks": "*i64", "hdr_delta": "i64",
                                     "ring_delta": "i64", "send": "*i32", "rows_ptr": "*i64", "rows_arg": "i32",
                                     "src_rows": "i32", "ROWS_DEV": "constexpr"},
                {"WORLD": 2, "SLOTS": 4, "NCOL": 1, "ROWS_DEV": True, "BLOCK": 1024})
    assert re.search(r"st\.global\.v2\.b64", send), "LL words not stored 16 bytes at a time"
    assert re.search(aot.ACQ, send) and all(re.search(p, send) for p in aot.BOUND)
    assert re.search(r"st\.relaxed\.sys\.global\.b64", send)
    assert not re.search(r"fence\.(sc|acq_rel)\.sys|membar\.sys", send) and not re.search(aot.ATOM, send)
    recv = _ptx(m2n_ll_recv_kernel, {**common, "src": "i32", "ack": "*i64", "ack_delta": "i64", "dst": "*i32",
                                     "rows_out": "*i64", "cap_rows": "i32"},
                {"WORLD": 2, "SLOTS": 4, "NCOL": 1, "BLOCK": 1024})
    assert re.search(r"ld\.volatile\.global\.v2\.b64", recv), "LL words not loaded 16 bytes at a time"
    assert re.search(aot.REL, recv) and all(re.search(p, recv) for p in aot.BOUND)
    assert "multimem" not in send + recv


def _sim(*args: str):
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "sgl-kernel" / "python"), str(REPO / "python"),
                                         env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, str(Path(__file__).resolve().parent / "m2n_push_sim_case.py"), *args],
                          env=env, capture_output=True, text=True, timeout=900)


@needs_triton
def test_ll_transport_host_logic_two_endpoints_interpreter():
    """m2n_push_sim_case.py --ll: two endpoints with ``protocol="ll"`` (host-header and device paths, device row
    counts, more messages than slots, per-program counters, identical launch arguments per message, fail-closed
    check()); and with a receive counter that does not advance the checks fail (BROKEN-DETECTED)."""
    r = _sim("--ll")
    assert r.returncode == 0 and r.stdout.strip().endswith("OK"), r.stdout[-1000:] + r.stderr[-3000:]
    r = _sim("--ll", "--broken-counter")
    assert r.returncode == 0 and "BROKEN-DETECTED" in r.stdout, r.stdout[-1000:] + r.stderr[-3000:]


def test_ll_protocol_bad_input():
    """An unknown protocol is refused naming the choices; a peer with the other protocol raises ValueError on first
    use (not a silent mix of ring layouts)."""
    from sgl_kernel.m2n import create_transport
    from sgl_kernel.m2n.cuda_push import CudaPushTransport

    with pytest.raises(ValueError, match="'flag' or 'll'"):
        CudaPushTransport(protocol="LL128")
    assert create_transport("cuda_push_ll").protocol == "ll" and create_transport("cuda_push").protocol == "flag"
    import contextlib
    import types

    import msgspec
    import numpy as np

    from sgl_kernel.m2n.base import HEADER_LEN
    from sgl_kernel.m2n.cuda_push import KIND_PUSH_HELLO

    plat = types.SimpleNamespace(context=lambda dev: contextlib.nullcontext(),
                                 driver=types.SimpleNamespace(ipc_open=lambda handle: 1 << 20))
    tr = CudaPushTransport(protocol="ll", platform=plat)
    tr.ep, tr.dev = types.SimpleNamespace(rank=0, config=types.SimpleNamespace(slots=2)), 0
    header = np.zeros(HEADER_LEN, dtype=np.int64)
    header[:2] = (KIND_PUSH_HELLO, 1)
    body = msgspec.msgpack.encode({"handle": b"h", "cap": 64, "flags": 0, "acks": 0, "ring": 0, "bytes": 0,
                                   "protocol": "flag", "grid": 0})  # rank 1's hello: the flag protocol
    tr.on_control([types.SimpleNamespace(buffer=header.tobytes()), types.SimpleNamespace(buffer=body)])
    with pytest.raises(ValueError, match="rank 1 uses protocol 'flag', this rank 'll'"):
        tr._peer(1)


FLOOR_CASE = textwrap.dedent("""
    import sys, tempfile
    import torch
    sys.path[:0] = [sys.argv[1], sys.argv[2]]
    from benchmark.afd.m2n_floor import RawLLFloor
    from m2n_push_sim_case import SimDriver, SimPlatform
    from sgl_kernel.m2n import M2NConfig, M2NEndpoint, RowLayout
    from sgl_kernel.m2n.cuda_push import CudaPushTransport
    from sgl_kernel.m2n.ll_kernels import ll_reference

    d, plat = tempfile.mkdtemp(), SimPlatform(SimDriver())
    eps = [M2NEndpoint(M2NConfig(r, (f"ipc://{d}/0", f"ipc://{d}/1"), 40, timeout_s=10),
                       RowLayout(((torch.float32, 256),)),
                       transport=CudaPushTransport(wait_timeout_s=1.0, platform=plat, protocol="ll")) for r in range(2)]
    x = torch.randn(40, 256)
    fl = [RawLLFloor(eps[r], 1 - r, x.numel() * 4, 3) for r in range(2)]
    for hop in range(3):  # ping-pong: 0 -> 1 -> 0 -> 1, tags advance per hop
        s, r = hop % 2, 1 - hop % 2
        y = x * (hop + 1)
        fl[s].put(y)
        assert torch.equal(fl[r].local[:y.numel()], ll_reference(y.view(torch.uint8).flatten(), 1, [y.numel() * 4],
                                                                  hop // 2)), hop
        fl[r].wait()
        eps[r].check()
    fl[0].wait()  # nothing was put: the bounded wait records the error, check() raises
    try:
        eps[0].check()
        raise AssertionError("no error")
    except TimeoutError as e:
        assert "m2n_ll_recv_kernel" in str(e), e
    print("OK")
""")


@needs_triton
def test_raw_ll_floor_kernels_interpreter():
    """benchmark/afd/m2n_floor.py (the latency table's floor): the put writes the LL words of the torch reference
    into the peer's slot with the hop's tag, the wait accepts them, and a wait for a put that never came fails
    closed."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "sgl-kernel" / "python"), str(REPO / "python"),
                                         env.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, "-c", FLOOR_CASE, str(REPO), str(Path(__file__).parent)],
                       env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0 and r.stdout.strip().endswith("OK"), r.stdout[-1000:] + r.stderr[-3000:]


def test_ll_max_grid_env(monkeypatch):
    """SGLANG_M2N_LL_MAX_GRID sets the receiver grid's cap (default 64); a value outside 1-1024 raises ValueError
    naming the variable."""
    from sgl_kernel.m2n.ll_kernels import LL_MAX_GRID, ll_grid, ll_max_grid

    monkeypatch.delenv("SGLANG_M2N_LL_MAX_GRID", raising=False)
    assert ll_max_grid() == LL_MAX_GRID == 64
    monkeypatch.setenv("SGLANG_M2N_LL_MAX_GRID", "128")
    assert ll_max_grid() == 128 and ll_grid(512 << 10, ll_max_grid()) == 128 and ll_grid(32 << 10, 128) == 8
    for bad in ("0", "2000", "x", "-4"):
        monkeypatch.setenv("SGLANG_M2N_LL_MAX_GRID", bad)
        with pytest.raises(ValueError, match="SGLANG_M2N_LL_MAX_GRID"):
            ll_max_grid()
