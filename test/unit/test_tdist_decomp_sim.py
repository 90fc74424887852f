"""The decomposition ops' signal / credit protocol (sgl_kernel/tdist/decomp.py) on CPU, with real concurrency.

Two ranks run as host threads on simulate_group heaps (real host memory, so peer addresses are real addresses). Each
rank's current stream executes eagerly on its thread; every side stream is a worker thread running its queue in
order; events, ``cuStreamWaitValue64`` (a bounded spin), ``cuStreamWriteValue64`` and ``cuMemcpyAsync`` (memmove)
are emulated with the same ordering semantics. Back-to-back calls with fresh inputs must give the torch reference
and never deadlock (every wait is bounded: a protocol deadlock fails the test with the signal it waited on).
The real streams are tested on GPUs by test/gpu/test_tdist_decomp_gpu.py.
"""

from __future__ import annotations

import ctypes
import queue
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "sgl-kernel" / "python"))

from sgl_kernel.tdist import cuda_ipc, decomp  # noqa: E402
from sgl_kernel.tdist.heap import simulate_group  # noqa: E402
from sgl_kernel.tdist.layout import HeapConfig  # noqa: E402
from sgl_kernel.tdist.reference import ag_gemm_ref, gemm_rs_ref  # noqa: E402

WAIT_S = 20.0
_local = threading.local()


class _Main:
    """A rank's current stream: runs everything at once on the calling thread."""

    def __init__(self):
        self.cuda_stream = self

    def run(self, fn):
        fn()

    def wait_event(self, ev):
        if not ev.done.wait(WAIT_S):
            raise TimeoutError("main stream: event never completed (deadlock)")

    def wait_stream(self, s):
        done = threading.Event()
        s.run(done.set)
        if not done.wait(WAIT_S):
            raise TimeoutError("main stream: side stream never drained (deadlock)")


class _Side:
    """A side stream: a worker thread running its queue in order."""

    def __init__(self, *args, **kwargs):
        self.cuda_stream = self
        self.q: queue.Queue = queue.Queue()
        self.error = None
        threading.Thread(target=self._loop, daemon=True).start()

    def _loop(self):
        while True:
            fn = self.q.get()
            try:
                fn()
            except Exception as e:  # surfaced by the rank thread through _Event / wait_stream timeouts
                self.error = e

    def run(self, fn):
        self.q.put(fn)

    def wait_event(self, ev):
        done = ev.done
        self.run(lambda: done.wait(WAIT_S) or (_ for _ in ()).throw(TimeoutError("side stream: event")))

    def wait_stream(self, s):
        raise AssertionError("not used by decomp")


class _Event:
    def __init__(self, *args, **kwargs):
        self.done = threading.Event()
        self.done.set()

    def record(self, stream=None):
        stream = stream or _local.main
        done = threading.Event()
        self.done = done
        stream.run(done.set)


def _write(addr, value, stream):
    stream.run(lambda: setattr(ctypes.c_int64.from_address(addr), "value", value))


def _wait(addr, value, stream):
    def spin():
        t0 = time.time()
        while ctypes.c_int64.from_address(addr).value < value:
            if time.time() - t0 > WAIT_S:
                raise TimeoutError(f"stream wait for *{addr:#x} >= {value} never satisfied (deadlock)")
            time.sleep(0)
    stream.run(spin)


def _memcpy(dst, src, nbytes, stream):
    stream.run(lambda: ctypes.memmove(dst, src, nbytes))


@pytest.fixture
def fake_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Stream", _Side)
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a, **k: _local.main)
    monkeypatch.setattr(cuda_ipc, "stream_write_value64", _write)
    monkeypatch.setattr(cuda_ipc, "stream_wait_value64", _wait)
    monkeypatch.setattr(cuda_ipc, "memcpy_async", _memcpy)


def _ranks(body, world):
    errors = [None] * world

    def run(r):
        _local.main = _Main()
        try:
            body(r)
        except Exception as e:
            errors[r] = e
    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a rank never finished"
    for e in errors:
        if e is not None:
            raise e


def _cpu_ops(cls, heaps, *args, name, chunks=None):
    ops = [cls(h, *args, torch.float32, name=name, chunks=chunks) for h in heaps]
    for op in ops:
        op.hs.ready.fill_(1)  # what the constructor does on CUDA (before its host barrier)
        if hasattr(op, "_done"):
            op._done = _Event()
        if hasattr(op, "_events"):
            op._events = [_Event() for _ in range(len(heaps))]
    return ops


@pytest.mark.parametrize("chunks", [None, 3, "bulk"])
@pytest.mark.parametrize("rows", [[48, 48], [40, 0], [0, 24]])
def test_ag_gemm_protocol_back_to_back(fake_cuda, rows, chunks):
    bulk = chunks == "bulk"  # too few rows for a head: the ordinary path
    chunks = 1 if bulk else chunks
    heaps = simulate_group(2, HeapConfig(data_bytes=1 << 20, signal_slots=64))
    ops = _cpu_ops(decomp.DecompAgGemm, heaps, 128, 32, name="sim.ag", chunks=chunks)
    calls = 25
    shards = [[torch.randn(rows[r], 32) for r in range(2)] for _ in range(calls)]
    bs = [torch.randn(32, 24) for _ in range(calls)]
    got = [[None] * calls for _ in range(2)]

    def body(r):
        for i in range(calls):
            got[r][i] = ops[r](shards[i][r], bs[i], rows, bulk=bulk).clone()
            _local.main.wait_stream(ops[r].hs.stream(1))
    _ranks(body, 2)
    for i in range(calls):
        ref = ag_gemm_ref(shards[i], bs[i])
        for r in range(2):
            torch.testing.assert_close(got[r][i], ref, atol=1e-4, rtol=1e-4, msg=f"call {i} rank {r}")


@pytest.mark.parametrize("chunks", [None, 4])
@pytest.mark.parametrize("rows", [[32, 32], [40, 0], [50, 34]])
def test_gemm_rs_protocol_back_to_back(fake_cuda, rows, chunks):
    heaps = simulate_group(2, HeapConfig(data_bytes=1 << 20, signal_slots=64))
    ops = _cpu_ops(decomp.DecompGemmRs, heaps, 64, 24, name="sim.rs", chunks=chunks)
    calls = 25
    m = sum(rows)
    a = [[torch.randn(m, 16) for _ in range(2)] for _ in range(calls)]
    b = [[torch.randn(16, 24) for _ in range(2)] for _ in range(calls)]
    got = [[None] * calls for _ in range(2)]

    def body(r):
        for i in range(calls):
            got[r][i] = ops[r](a[i][r], b[i][r], rows).clone()
    _ranks(body, 2)
    for i in range(calls):
        ref = gemm_rs_ref(a[i], b[i], rows)
        for r in range(2):
            torch.testing.assert_close(got[r][i], ref[r], atol=1e-4, rtol=1e-4, msg=f"call {i} rank {r}")


@pytest.mark.parametrize("split_recv", [True, False])
@pytest.mark.parametrize("schedule", ["ring", "all"])
@pytest.mark.parametrize("chunks", [1, 2])
@pytest.mark.parametrize("rows", [[40, 32, 48, 40], [200, 264, 328, 0]])
def test_world4_schedules_back_to_back(fake_cuda, schedule, chunks, split_recv, rows):
    """World 4 (three per-peer step streams per rank), staggered ("ring") and concurrent ("all") schedules, 1 and 2
    pieces (piece-major consumption under "all"), even-ish and uneven rows with an empty segment, receive waits on
    their own streams (default) or on the push streams: AG-GEMM and GEMM-RS back to back with fresh inputs equal the
    torch references and never deadlock (the ring's step-after-step waits add no cycle)."""
    w, calls = 4, 8
    heaps = simulate_group(w, HeapConfig(data_bytes=2 << 20, signal_slots=256))
    ag = _cpu_ops(decomp.DecompAgGemm, heaps, sum(rows), 32, name="sim.ag4", chunks=chunks)
    rs = _cpu_ops(decomp.DecompGemmRs, heaps, max(rows), 24, name="sim.rs4", chunks=chunks)
    for op in ag + rs:
        op.hs.schedule, op.hs.split_recv = schedule, split_recv
    shards = [[torch.randn(rows[r], 32) for r in range(w)] for _ in range(calls)]
    bs = [torch.randn(32, 24) for _ in range(calls)]
    a = [[torch.randn(sum(rows), 16) for _ in range(w)] for _ in range(calls)]
    b = [[torch.randn(16, 24) for _ in range(w)] for _ in range(calls)]
    got = [[None] * calls for _ in range(w)]

    def body(r):
        for i in range(calls):
            g = ag[r](shards[i][r], bs[i], rows).clone()
            got[r][i] = (g, rs[r](a[i][r], b[i][r], rows).clone())
    _ranks(body, w)
    for i in range(calls):
        ref_ag, ref_rs = ag_gemm_ref(shards[i], bs[i]), gemm_rs_ref(a[i], b[i], rows)
        for r in range(w):
            torch.testing.assert_close(got[r][i][0], ref_ag, atol=1e-4, rtol=1e-4, msg=f"AG call {i} rank {r}")
            torch.testing.assert_close(got[r][i][1], ref_rs[r], atol=1e-4, rtol=1e-4, msg=f"RS call {i} rank {r}")


def test_schedule_defaults_and_bad_value():
    assert decomp.default_schedule(2) == "all" and decomp.default_schedule(4) == "ring"
    heaps = simulate_group(2, HeapConfig(data_bytes=1 << 20, signal_slots=64))
    with pytest.raises(ValueError, match="schedule='zigzag'"):
        decomp.DecompAgGemm(heaps[0], 64, 32, torch.float32, name="bad.sched", schedule="zigzag")


def test_plan_chunks_world4_keeps_pieces_large():
    """World 4, Llama-3.3-70B TP4 shapes at M 2048 / 8192 (512 / 2048 rows per rank): one piece per segment for
    AG-GEMM (qkv's N = 2560 needs >= 1638 rows per piece GEMM; (world - 1) * pieces <= 4), GEMM-RS keeps 2 where a
    piece has >= 512 rows."""
    for n in (2560, 14336):
        assert decomp.plan_chunks("ag", [2048] * 4, 8192, n) == 1
        assert decomp.plan_chunks("ag", [512] * 4, 8192, n) == 1
    assert decomp.plan_chunks("rs", [2048] * 4, 2048, 8192) == 2
    assert decomp.plan_chunks("rs", [2048] * 4, 7168, 8192) == 2
    assert decomp.plan_chunks("rs", [512] * 4, 2048, 8192) == 1


def test_plan_chunks_follows_gemm_to_transfer_ratio():
    """Llama-3.3-70B TP4 shapes: qkv (N=2560) and o_proj (K=2048) are transfer-bound -> 4 pieces; gate_up
    (N=14336) hides its transfer -> 1; down (K=7168) -> 2; GEMM-RS never 1; small segments cap the count."""
    big = [4096, 4096]
    assert decomp.plan_chunks("ag", big, 8192, 2560) == 4
    assert decomp.plan_chunks("ag", big, 8192, 14336) == 1
    assert decomp.plan_chunks("rs", big, 2048, 8192) == 4
    assert decomp.plan_chunks("rs", big, 7168, 8192) == 2
    assert decomp.plan_chunks("rs", big, 16384, 8192) == 2
    assert decomp.plan_chunks("ag", [300, 300], 8192, 2560) == 1
    assert decomp.plan_chunks("ag", [1100, 0], 8192, 2560) == 2
    pieces = decomp._pieces(50, 4)
    assert pieces[0][0] == 0 and pieces[-1][1] == 50 and all(a[1] == b[0] for a, b in zip(pieces, pieces[1:]))
    with pytest.raises(ValueError, match="chunks=5"):
        decomp._check_chunks(5)



def test_enable_tdist_overlap_ops_on_the_decomposition(fake_cuda):
    """--enable-tdist-overlap's TdistSequenceParallelOps (default producer "decomp", a table forcing the
    decomposition) on two simulated ranks: ag_linear (column-parallel) equals F.linear on the gathered input and
    linear_rs (row-parallel) the own rows of the summed partials, back-to-back, with two weight shapes sharing one
    op per buffer name (like qkv / gate_up sharing K, o_proj / down sharing N)."""
    from sgl_kernel.tdist.auto import CalibrationTable
    from sglang.srt.distributed.tdist_overlap import TdistSequenceParallelOps

    heaps = simulate_group(2, HeapConfig(data_bytes=4 << 20, signal_slots=256))
    table = CalibrationTable(default_min_m=1)
    ops = [TdistSequenceParallelOps(None, torch.device("cpu"), r, 2, max_tokens=128, heap=heaps[r], table=table)
           for r in range(2)]
    assert all(op.producer == "decomp" for op in ops)
    rows, h, kl = [40, 24], 32, 16
    off = [0, rows[0], sum(rows)]
    x = torch.randn(sum(rows), h)
    w_cols = [torch.randn(48, h), torch.randn(20, h)]  # column-parallel shards, same K = h
    ks = (kl, 2 * kl)  # two row-parallel shapes with N = h and different K_local; inputs and weights per rank
    x_rows = [[torch.randn(sum(rows), k) for _ in range(2)] for k in ks]
    w_rows = [[torch.randn(h, k) for _ in range(2)] for k in ks]
    for op in ops:  # build the ops eagerly (one per name) and give them their initial credits (CUDA does that)
        for wc in w_cols:
            op._op("ag", h, wc.shape[0], torch.float32)
        op._op("rs", kl, h, torch.float32)
        assert len(op._ops) == 2
        for auto in op._ops.values():
            auto.decomp.hs.ready.fill_(1)
    got = [[] for _ in range(2)]

    def body(r):
        for _ in range(3):
            for wc in w_cols:
                got[r].append(ops[r].ag_linear(x[off[r]: off[r + 1]].contiguous(), wc, None, rows).clone())
            for xr, wr in zip(x_rows, w_rows):
                got[r].append(ops[r].linear_rs(xr[r], wr[r], None, rows).clone())
    _ranks(body, 2)
    for r in range(2):
        want = []
        for wc in w_cols:
            want.append(x @ wc.t())
        for xr, wr in zip(x_rows, w_rows):
            want.append((xr[0] @ wr[0].t() + xr[1] @ wr[1].t())[off[r]: off[r + 1]])
        for i, g in enumerate(got[r]):
            torch.testing.assert_close(g, want[i % 4], atol=1e-4, rtol=1e-4, msg=f"rank {r} call {i}")
        assert all(op.last_path == "decomp" for op in ops[r]._ops.values())


@pytest.mark.parametrize("rows", [[300, 260], [200, 400]])
def test_ag_gemm_bulk_head_then_one_gemm(fake_cuda, monkeypatch, rows):
    """bulk=True at world 2 with a wide N (head of 128 or 256 rows < own rows): head GEMM, copy-engine copy of the
    own shard into the gather buffer, one GEMM over the rest; back-to-back calls equal the reference and the bulk
    path ran."""
    heaps = simulate_group(2, HeapConfig(data_bytes=4 << 20, signal_slots=64))
    ops = _cpu_ops(decomp.DecompAgGemm, heaps, 1024, 16, name="sim.bulk", chunks=1)
    ran = []
    orig = decomp.DecompAgGemm._bulk
    monkeypatch.setattr(decomp.DecompAgGemm, "_bulk", lambda self, *a: ran.append(a[4]) or orig(self, *a))
    calls, n = 4, 8192
    shards = [[torch.randn(rows[r], 16) for r in range(2)] for _ in range(calls)]
    bs = [torch.randn(16, n) for _ in range(calls)]
    got = [[None] * calls for _ in range(2)]

    def body(r):
        for i in range(calls):
            got[r][i] = ops[r](shards[i][r], bs[i], rows, bulk=True).clone()
            _local.main.wait_stream(ops[r].hs.stream(1))
    _ranks(body, 2)
    # [200, 400]: rank 0's head would cover all its rows, so only rank 1 takes the bulk path (the exchange is the
    # same one-piece exchange on both paths, so ranks may differ)
    assert len(ran) == (2 if rows[0] > 256 else 1) * calls and all(h % 128 == 0 for h in ran), ran
    for i in range(calls):
        ref = ag_gemm_ref(shards[i], bs[i])
        for r in range(2):
            torch.testing.assert_close(got[r][i], ref, atol=1e-4, rtol=1e-4, msg=f"call {i} rank {r}")


@pytest.mark.parametrize("kind", ["ag", "rs"])
def test_split_pushes_keep_the_protocol(fake_cuda, kind):
    """Pushes cut in 3 parts on helper streams (_Handshake.split, what benchmark/tdist/bench_kernels.py measures): same results."""
    heaps = simulate_group(2, HeapConfig(data_bytes=1 << 20, signal_slots=64))
    rows = [40, 24]
    if kind == "ag":
        ops = _cpu_ops(decomp.DecompAgGemm, heaps, 128, 32, name="sim.sag", chunks=2)
    else:
        ops = _cpu_ops(decomp.DecompGemmRs, heaps, 64, 24, name="sim.srs", chunks=2)
    for op in ops:
        op.hs.split, op.hs.split_min_bytes = 3, 0
    calls = 10
    a = [[torch.randn(rows[r] if kind == "ag" else 64, 32 if kind == "ag" else 16) for r in range(2)]
         for _ in range(calls)]
    b = [[torch.randn(32 if kind == "ag" else 16, 24) for _ in range(2)] for _ in range(calls)]
    got = [[None] * calls for _ in range(2)]

    def body(r):
        for i in range(calls):
            got[r][i] = ops[r](a[i][r], b[i][0] if kind == "ag" else b[i][r], rows).clone()
            _local.main.wait_stream(ops[r].hs.stream(1))
    _ranks(body, 2)
    for i in range(calls):
        ref = ag_gemm_ref(a[i], b[i][0]) if kind == "ag" else None
        for r in range(2):
            want = ref if kind == "ag" else gemm_rs_ref(a[i], b[i], rows)[r]
            torch.testing.assert_close(got[r][i], want, atol=1e-4, rtol=1e-4, msg=f"{kind} call {i} rank {r}")


def test_join_waits_only_for_this_calls_streams(fake_cuda, monkeypatch):
    """A call after a split-push call (which created helper copy streams) joins only the push streams it used
    (the consumer already waited on the receive streams' last events): waiting on a stream outside the call
    invalidates a CUDA-graph capture (the bench's graph variant failed that way when split pushes ran first,
    2026-11-27 on 4 x H200)."""
    heaps = simulate_group(2, HeapConfig(data_bytes=1 << 20, signal_slots=64))
    ops = _cpu_ops(decomp.DecompGemmRs, heaps, 64, 24, name="sim.join", chunks=2)
    rows = [32, 32]
    a = [torch.randn(64, 16) for _ in range(2)]
    b = [torch.randn(16, 24) for _ in range(2)]
    joined = [[] for _ in range(2)]

    def body(r):
        ops[r].hs.split, ops[r].hs.split_min_bytes = 3, 0
        ops[r](a[r], b[r], rows)
        ops[r].hs.split = 1
        orig = _local.main.wait_stream
        _local.main.wait_stream = lambda s: joined[r].append(s) or orig(s)
        got = ops[r](a[r], b[r], rows)
        torch.testing.assert_close(got, gemm_rs_ref(a, b, rows)[r], atol=1e-4, rtol=1e-4)
    _ranks(body, 2)
    for r in range(2):
        hs = ops[r].hs
        assert any(isinstance(k, tuple) and k[0] == "copy" for k in hs.streams), "split pushes made no helpers"
        assert joined[r] == [hs.streams[1]], joined[r]  # the receive stream's events were waited on instead
        assert hs._used == []
