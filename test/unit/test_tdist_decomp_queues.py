"""Side streams of the decomposition ops (sgl_kernel/tdist/decomp.py) at world 4, on CPU (the threaded stream
emulation of test_tdist_decomp_sim.py): the per-heap shared streams keep the stream count bounded however many ops
exist, and the protocol survives streams merged onto few hardware queues.

CUDA maps every stream of a context onto ``CUDA_DEVICE_MAX_CONNECTIONS`` hardware queues (default 8); the streams of
one queue run in the order the host submitted their work, so a blocked ``cuStreamWaitValue64`` holds back the other
streams of its queue (false dependencies; with 1 queue the GPU runs everything in submission order). The question is
whether that can deadlock the ranks once a process has many streams. Here every side stream of a rank is put on one
of ``queues`` shared in-order workers (a wait blocks the whole worker): with 1 queue (everything in submission order)
and 2, every schedule and layout must still give the torch results without a deadlock (a deadlock times out).
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import test_tdist_decomp_sim as S  # noqa: E402
from test_tdist_decomp_sim import fake_cuda  # noqa: E402,F401,F811 (the fixture, used by name)

from sgl_kernel.tdist import decomp  # noqa: E402
from sgl_kernel.tdist.heap import simulate_group  # noqa: E402
from sgl_kernel.tdist.layout import HeapConfig  # noqa: E402
from sgl_kernel.tdist.reference import ag_gemm_ref, gemm_rs_ref  # noqa: E402

W = 4
_hw = threading.local()  # per rank thread: its hardware queues and how many streams it created


class _QueuedStream:
    """A stream on one of its rank's ``_hw.pool`` in-order workers (round-robin, like the driver's mapping):
    its work, waits included, runs in submission order with every other stream of that worker."""

    def __init__(self, *args, **kwargs):
        self.hw = _hw.pool[_hw.n % len(_hw.pool)]
        _hw.n += 1
        self.cuda_stream = self

    def run(self, fn):
        self.hw.run(fn)

    def wait_event(self, ev):
        done = ev.done
        self.run(lambda: done.wait(S.WAIT_S) or (_ for _ in ()).throw(TimeoutError("queued stream: event")))


def _ops(heaps, rows, cfg_chunks, split=1):
    ag = S._cpu_ops(decomp.DecompAgGemm, heaps, sum(rows), 32, name=f"q.ag{cfg_chunks}", chunks=cfg_chunks)
    rs = S._cpu_ops(decomp.DecompGemmRs, heaps, max(rows), 24, name=f"q.rs{cfg_chunks}", chunks=cfg_chunks)
    for op in ag + rs:
        op.hs.split, op.hs.split_min_bytes = split, 0
    return ag, rs


def _inputs(seed, rows):
    g = torch.Generator().manual_seed(seed)
    shards = [torch.randn(r, 32, generator=g) for r in rows]
    b = torch.randn(32, 24, generator=g)
    a = [torch.randn(sum(rows), 16, generator=g) for _ in rows]
    bs = [torch.randn(16, 24, generator=g) for _ in rows]
    return shards, b, a, bs


def _run_calls(op_pairs, rows, calls, queues=None):
    """Every rank calls each (AG, RS) pair ``calls`` times; returns the failures (wrong result or deadlock)."""
    inputs = [_inputs(i, rows) for i in range(calls)]
    fails = []

    def body(r):
        if queues is not None:
            _hw.pool, _hw.n = [S._Side() for _ in range(queues)], r  # ranks start on different queues
        for ag, rs in op_pairs:
            for i, (shards, b, a, bs) in enumerate(inputs):
                torch.testing.assert_close(ag[r](shards[r], b, rows), ag_gemm_ref(shards, b), atol=1e-4, rtol=1e-4)
                got = rs[r](a[r], bs[r], rows)
                torch.testing.assert_close(got, gemm_rs_ref(a, bs, rows)[r], atol=1e-4, rtol=1e-4)
    try:
        S._ranks(body, W)
    except Exception as e:  # noqa: BLE001 (reported with the configuration)
        fails.append(f"{type(e).__name__}: {str(e)[:300]}")
    return fails


@pytest.mark.parametrize("shared", [True, False])
def test_shared_streams_are_bounded_per_heap(fake_cuda, shared):
    """Three AG/RS pairs (1 and 3 pieces, split pushes on one) on one heap per rank: with HeapConfig.shared_streams
    every op uses the heap's streams, 2 * (world - 1) step streams + (world - 1) split helpers = 9 in all; without,
    each op has its own (6 per op, 9 with split helpers: 42 here; the count grows with the ops, and torch's pool
    of 32 streams per priority wraps around, so real per-op streams alias)."""
    rows = [40, 32, 48, 40]
    heaps = simulate_group(W, HeapConfig(data_bytes=4 << 20, signal_slots=512, shared_streams=shared))
    pairs = [_ops(heaps, rows, 1), _ops(heaps, rows, 3, split=2), _ops(heaps, rows, 2)]
    assert _run_calls(pairs, rows, 2) == []
    for r in range(W):
        used = [s for ag, rs in pairs for op in (ag[r], rs[r]) for s in op.hs.streams.values()]
        if shared:
            assert {id(s) for s in used} == {id(s) for s in heaps[r]._streams.values()}
            assert len(heaps[r]._streams) == 2 * (W - 1) + (W - 1)
        else:
            assert heaps[r]._streams == {}
            assert len({id(s) for s in used}) == len(used) == 2 * 6 + 2 * 9 + 2 * 6


@pytest.mark.parametrize("queues", [1, 2])
@pytest.mark.parametrize("schedule", ["ring", "all"])
@pytest.mark.parametrize("split_recv", [True, False])
@pytest.mark.parametrize("chunks, split", [(1, 1), (3, 2)])
def test_streams_merged_onto_few_queues_do_not_deadlock(fake_cuda, monkeypatch, queues, schedule, split_recv,
                                                        chunks, split):
    """Per-op streams (the layout of the world-4 hang, HeapConfig.shared_streams=False) merged onto 1 or 2
    in-order queues per rank, uneven rows with an empty segment, 3 back-to-back calls of AG-GEMM and GEMM-RS:
    torch results, no deadlock. Every wait of a call is for work its peers submitted before their own waits of
    the same or a later step, so running a rank's submissions in order cannot form a cycle."""
    monkeypatch.setattr(torch.cuda, "Stream", _QueuedStream)
    monkeypatch.setattr(S, "WAIT_S", 6.0)
    rows = [200, 264, 328, 0]
    heaps = simulate_group(W, HeapConfig(data_bytes=8 << 20, signal_slots=512, shared_streams=False))
    ag, rs = _ops(heaps, rows, chunks, split)
    for op in ag + rs:
        op.hs.schedule, op.hs.split_recv = schedule, split_recv
    assert _run_calls([(ag, rs)], rows, 3, queues) == []
