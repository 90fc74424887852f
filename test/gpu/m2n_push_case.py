"""Device-driven phases of the one-rank-per-GPU M2N test for ``cuda_push`` (``send(host_header=False)`` /
``recv_device``): nothing goes through the host per message, the row count travels in the flag word.

* D1: random row counts incl. 0 and ``max_rows``: the peer masks what it received to the row count it read on the
  device and echoes all ``max_rows`` rows (ids + 1); rank 0 compares with the torch reference (sent rows, zero past n).
* D2: ``n`` back-to-back messages, ``slots`` in flight per peer, mismatches summed on the device.
* G: CUDA graphs: both ranks capture ``k`` round trips (rank 0: send with a device row count, receive, copy out;
  the peer: receive, echo ids + 1 with the row count it read on the device) and replay them ``replays`` times
  back to back (the device sequence counters continue from the eager phases); every replay has fresh random rows
  (counts incl. 0 and ``max_rows``) and rank 0 compares the first ``n`` rows and the row counts with the torch
  reference on the device.
* D3: a killed peer: rank 0's device wait gives up within the transport's budget and ``check()`` raises.
"""

from __future__ import annotations

import os
import time

import numpy as np
import torch

OP_DEVICE = 2  # host message telling a peer to take ``meta[1]`` device-driven messages
OP_GRAPH = 3  # host message: capture ``meta[1]`` device echoes in a CUDA graph, replay it ``meta[2]`` times


def peer_device_loop(ep, count: int, max_rows: int) -> None:
    """Peer side: ``count`` times receive from rank 0 on the device, echo (masked to the device row count)."""
    keep_idx = torch.arange(max_rows, device=ep.device).unsqueeze(1)
    for _ in range(count):
        m = ep.recv_device(0)
        keep = keep_idx < m.rows
        x, ids, w = m.tensors
        ep.send(0, [torch.where(keep, x, 0), torch.where(keep, ids + 1, 0), torch.where(keep, w, 0)],
                host_header=False)


def _echo_rows(ep) -> None:
    """One device echo with the received row count (``send(rows=...)``)."""
    m = ep.recv_device(0)
    x, ids, w = m.tensors
    ep.send(0, [x, ids + 1, w], host_header=False, rows=m.rows)


def peer_graph_loop(ep, k: int, replays: int) -> None:
    """Peer side of G: one eager echo (compiles the kernels), then ``k`` echoes captured once, replayed."""
    _echo_rows(ep)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, capture_error_mode="thread_local"):
        for _ in range(k):
            _echo_rows(ep)
    for _ in range(replays):
        g.replay()
    torch.cuda.synchronize()
    ep.check()


def driver_graph_phase(ep, msg, k: int, replays: int, max_rows: int, progress) -> dict:
    """Rank 0's side of G with peer 1 (see the module docstring); returns mismatching elements and row counts."""
    peer = 1
    ep.send(peer, [t[:0] for t in msg(0)], (OP_GRAPH, k, replays))
    xs = [list(msg(max_rows)) for _ in range(k + 1)]
    # row counts 16 bytes apart: every launch has the pointer alignment of the warm-up's (no compile in capture)
    nrows_buf = torch.zeros(k + 1, 2, dtype=torch.int64, device=ep.device)
    nrows = [nrows_buf[i, :1] for i in range(k + 1)]
    outs = [[torch.zeros_like(t) for t in x] for x in xs]
    got_rows = torch.zeros(k + 1, 1, dtype=torch.int64, device=ep.device)

    def one(i):
        ep.send(peer, xs[i], host_header=False, rows=nrows[i])
        m = ep.recv_device(peer)
        for o, t in zip(outs[i], m.tensors):
            o.copy_(t)
        got_rows[i].copy_(m.rows)

    keep_idx = torch.arange(max_rows, device=ep.device).unsqueeze(1)
    mism = torch.zeros((), dtype=torch.int64, device=ep.device)

    def compare(i):
        nonlocal mism
        keep = keep_idx < nrows[i]
        for got, ref in zip(outs[i], (xs[i][0], xs[i][1] + 1, xs[i][2])):
            mism += ((got != ref) & keep).sum()
        mism += (got_rows[i] != nrows[i]).sum()

    nrows[k].fill_(max_rows // 2)
    one(k)  # eager warm-up (compiles the device-row kernels before capture)
    compare(k)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, capture_error_mode="thread_local"):
        for i in range(k):
            one(i)
    sizes = [0, max_rows, 1] + [int(v) for v in np.random.default_rng(9).integers(0, max_rows + 1, k * replays)]
    t0 = time.perf_counter()
    for j in range(replays):  # back to back: fresh inputs enqueued, no host sync between replays
        for i in range(k):
            for t, f in zip(xs[i], msg(max_rows)):
                t.copy_(f)
            nrows[i].fill_(sizes[j * k + i])
        g.replay()
        for i in range(k):
            compare(i)
    torch.cuda.synchronize()
    ep.check()
    progress(f"G graph replays done ({replays} x {k} round trips in {time.perf_counter() - t0:.2f} s, "
             f"mismatches {int(mism)})")
    return {"graph_mismatch": int(mism), "graph_msgs": k * replays}


def _expect(x, ids, w, max_rows):
    n = x.shape[0]
    pad = [torch.zeros(max_rows - n, t.shape[1], dtype=t.dtype, device=t.device) for t in (x, ids, w)]
    return [torch.cat([x, pad[0]]), torch.cat([ids + 1, pad[1]]), torch.cat([w, pad[2]])]


def driver_device_phases(ep, msg, n_msgs: int, max_rows: int, slots: int, progress) -> dict:
    """Rank 0: D1 and D2 (see the module docstring); ``msg(n)`` makes random (x, ids, w) of n rows."""
    world = ep.world
    sizes = [0, max_rows, 1] + [int(v) for v in np.random.default_rng(5).integers(0, max_rows + 1, 29)]
    per_peer = [sum(1 for i in range(len(sizes)) if 1 + i % (world - 1) == p) for p in range(world)]
    for p in range(1, world):
        ep.send(p, [t[:0] for t in msg(0)], (OP_DEVICE, per_peer[p]))
    bad = torch.zeros((), dtype=torch.int64, device=ep.device)
    for i, n in enumerate(sizes):
        peer = 1 + i % (world - 1)
        x, ids, w = msg(n)
        ep.send(peer, [x, ids, w], host_header=False)
        r = ep.recv_device(peer)
        for got, ref in zip(r.tensors, _expect(x, ids, w, max_rows)):
            bad += (got != ref).sum()
        bad += (r.rows != max_rows).sum()
    bad_d1 = int(bad)
    progress(f"D1 device-driven random sizes done (bad elements={bad_d1}); D2 ({n_msgs} back-to-back)")
    x, ids, w = msg(8)
    per_peer = [sum(1 for i in range(n_msgs) if 1 + i % (world - 1) == p) for p in range(world)]
    for p in range(1, world):
        ep.send(p, [t[:0] for t in msg(0)], (OP_DEVICE, per_peer[p]))
    mism = torch.zeros((), dtype=torch.int64, device=ep.device)
    inflight: dict[int, list] = {p: [] for p in range(1, world)}
    t0 = time.perf_counter()
    for i in range(n_msgs + slots * world):
        peer = 1 + i % (world - 1)
        if len(inflight[peer]) == slots or i >= n_msgs:
            if not inflight[peer]:
                continue
            j = inflight[peer].pop(0)
            r = ep.recv_device(peer)
            mism += (r.tensors[0][:8] != x * (j % 7)).sum() + (r.tensors[1][:8] != ids + 1).sum()
            mism += (r.tensors[0][8:] != 0).sum() + (r.rows != max_rows).sum()
        if i < n_msgs:
            ep.send(peer, [x * (i % 7), ids, w], host_header=False)
            inflight[peer].append(i)
    torch.cuda.synchronize()
    rate = n_msgs / (time.perf_counter() - t0)
    ep.check()
    progress(f"D2 done ({rate:.0f} msg/s, mismatches {int(mism)})")
    return {"dev_bad": bad_d1, "dev_mismatch": int(mism), "dev_rate": rate}


def driver_device_kill(ep, msg, op_die: int) -> str:
    """D3: peer 1 dies; rank 0's device receive must give up within its budget: ``check()`` raises TimeoutError."""
    x, ids, w = msg(4)
    ep.send(1, [x, ids, w], (op_die, 0))
    time.sleep(0.5)
    t0 = time.perf_counter()
    ep.recv_device(1)
    torch.cuda.synchronize()
    try:
        ep.check()
        return "no error"
    except TimeoutError as e:
        return f"TimeoutError after {time.perf_counter() - t0:.1f} s ({str(e)[:160]})"


def die() -> None:
    """Exit at once, as a crash would."""
    os._exit(3)
