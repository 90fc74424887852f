"""Back-to-back calls of the tdist kernels in random cross-rank interleavings, and the GPU group's stalling GEMM-RS
shapes, under TRITON_INTERPRET=1 with simulated ranks (CPU). Prints one JSON line {case: error-or-""}; run by
test_tdist_interpret.py in a subprocess (the interpreter flag is process-wide).

Regression cases for the 2026-11-25 GPU stall in case_gemm_rs (root cause: the test helper raised on the rank that
owns no rows, that rank abandoned the remaining GEMM-RS calls, its peers waited forever for its tiles):
* case_gemm_rs_gpu_shapes: the GPU case's shapes (K=320, N=448, default 128x128x64 tiles) and row sets, empty
  segments included, checked with reference.compare (which must accept the empty rank);
* case_rank_abandons_calls_fails_closed: the exact failure (rank 0 stops after 1 of 3 calls) is a reported deadlock
  naming rs_reduce_kernel, rank 1 and signal gemm_rs.arrive[0], instead of a hang;
* case_*_interleavings: every whole-launch interleaving the random schedules reach (ranks several calls apart)
  completes with the right results: the epoch / cumulative-target / buffer-release protocol has no reuse race.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

import torch  # noqa: E402

from sgl_kernel.tdist.ag_gemm import AgGemm  # noqa: E402
from sgl_kernel.tdist.all_to_all import AllToAll  # noqa: E402
from sgl_kernel.tdist.gemm_rs import GemmRs  # noqa: E402
from sgl_kernel.tdist.heap import simulate_group  # noqa: E402
from sgl_kernel.tdist.layout import HeapConfig  # noqa: E402
from sgl_kernel.tdist.reference import ag_gemm_ref, all_to_all_ref, compare, gemm_rs_ref  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tdist_schedule import Deadlock, run_schedule  # noqa: E402

CFG = HeapConfig(data_bytes=4 << 20, signal_slots=256)


def _gpu_row_sets(w):
    """test/gpu/tdist_gpu_case.py::_row_sets (uneven, a rank with 0 rows first and last)."""
    return [[64 * (r + 1) for r in range(w)], [1 + 37 * r for r in range(w)], [0] + [129] * (w - 1),
            [256] * w, [3] * (w - 1) + [0]]


def _expect(fails):
    assert not fails, "; ".join(fails)


def _rs_queues(ops, a, b, rows_per_call):
    """Per-rank FIFOs gemm/reduce/release of every call (plans prepared in call order, as the host would)."""
    queues, plans = [], []
    for r, op in enumerate(ops):
        q, ps = [], []
        for i, rows in enumerate(rows_per_call):
            p = op.prepare(a[i][r], b[i][r], rows)
            p["out"].fill_(float("nan"))
            ps.append(p)
            q += [(f"gemm_rs#{i}.gemm", lambda op=op, p=p: op.gemm(p)),
                  (f"gemm_rs#{i}.reduce", lambda op=op, p=p: op.reduce(p)),
                  (f"gemm_rs#{i}.release", lambda op=op, p=p: op.release(p))]
        queues.append(q)
        plans.append(ps)
    return queues, plans


def _rs_inputs(world, rows_per_call, k, n, seed):
    g = torch.Generator().manual_seed(seed)
    a = [[torch.randn(sum(rows), k, generator=g) for _ in range(world)] for rows in rows_per_call]
    b = [[torch.randn(n, k, generator=g).t() for _ in range(world)] for _ in rows_per_call]
    return a, b


def _check_rs(plans, a, b, rows_per_call, tag):
    for i, rows in enumerate(rows_per_call):
        ref = gemm_rs_ref(a[i], b[i], rows)
        for r in range(len(plans)):
            _expect(compare(plans[r][i]["out"], ref[r], f"{tag} call {i} rank {r} rows {rows}", rel=1e-4))


def case_gemm_rs_gpu_shapes():
    # world 2: every row set; world 4 (slow in the interpreter): the sets with a rank that owns no rows
    for world, sets in ((2, _gpu_row_sets(2)), (4, [_gpu_row_sets(4)[2], _gpu_row_sets(4)[4]])):
        hs = simulate_group(world, CFG)
        ops = [GemmRs(h, 256, 448, torch.float32) for h in hs]  # default tiles: 128 x 128 x 64, like the GPU case
        a, b = _rs_inputs(world, sets, 320, 448, seed=world)
        queues, plans = _rs_queues(ops, a, b, sets)
        # stream order per rank, ranks in lockstep per step (all gemms, then all reduces, then all releases)
        for i in range(len(sets)):
            for step in range(3):
                for r in range(world):
                    queues[r][3 * i + step][1]()
        for h in hs:
            h.check()
        _check_rs(plans, a, b, sets, f"world {world}")
        assert any(p["out"].shape == (0, 448) for ps in plans for p in ps)  # a rank without rows: compare() accepts it


def case_gemm_rs_interleavings():
    rows_per_call = [[7, 0, 9], [0, 0, 5], [16, 17, 1], [0, 12, 0], [5, 6, 7]]
    for seed in range(2):
        hs = simulate_group(3, CFG)
        ops = [GemmRs(h, 32, 24, torch.float32, bm=16, bn=16, bk=16) for h in hs]
        a, b = _rs_inputs(3, rows_per_call, 19, 24, seed=100 + seed)
        queues, plans = _rs_queues(ops, a, b, rows_per_call)
        run_schedule(hs, queues, seed)
        _check_rs(plans, a, b, rows_per_call, f"seed {seed}")


def case_gemm_rs_gpu_back_to_back_interleaved():
    """The GPU case's back-to-back part (rows 90 + 5r, K=320, N=448) for 3 calls in random interleavings."""
    world = 2
    rows_per_call = [[90 + 5 * r for r in range(world)]] * 3
    for seed in range(2):
        hs = simulate_group(world, CFG)
        ops = [GemmRs(h, 256, 448, torch.float32) for h in hs]
        a, b = _rs_inputs(world, rows_per_call, 320, 448, seed=7 + seed)
        queues, plans = _rs_queues(ops, a, b, rows_per_call)
        run_schedule(hs, queues, seed)
        _check_rs(plans, a, b, rows_per_call, f"seed {seed}")


def case_rank_abandons_calls_fails_closed():
    """Rank 0 leaves after the first of 3 calls (what the raising test helper made it do on the GPU): rank 1 is
    reported blocked in rs_reduce_kernel on gemm_rs.arrive[0] (device: a TdistWaitError after the budget)."""
    rows_per_call = [[0, 20]] * 3
    hs = simulate_group(2, CFG)
    ops = [GemmRs(h, 32, 24, torch.float32, bm=16, bn=16, bk=16) for h in hs]
    a, b = _rs_inputs(2, rows_per_call, 19, 24, seed=5)
    queues, _ = _rs_queues(ops, a, b, rows_per_call)
    queues[0] = queues[0][:3]
    try:
        run_schedule(hs, queues, 0)
    except Deadlock as e:
        msg = str(e)
        assert "rank 1 at gemm_rs#1.reduce" in msg and "rs_reduce_kernel" in msg, msg
        assert "gemm_rs.arrive[0]" in msg and "on rank 1 of 2" in msg, msg
    else:
        raise AssertionError("an abandoned GEMM-RS call was not detected")


def case_ag_gemm_interleavings():
    rows_per_call = [[5, 0, 17], [1, 2, 3], [0, 0, 9], [8, 8, 8], [3, 0, 0]]
    for producer_chunks, seed in ((2, 0), (1, 1)):
        hs = simulate_group(3, CFG)
        ops = [AgGemm(h, 64, 24, torch.float32, bm=16, bn=16, bk=16, chunks=producer_chunks) for h in hs]
        g = torch.Generator().manual_seed(seed)
        shards = [[torch.randn(rows[r], 24, generator=g) for r in range(3)] for rows in rows_per_call]
        bs = [torch.randn(20, 24, generator=g).t() for _ in rows_per_call]
        queues, plans = [], []
        for r, op in enumerate(ops):
            q, ps = [], []
            for i, rows in enumerate(rows_per_call):
                p = op.prepare(shards[i][r], bs[i], rows)
                p["out"].fill_(float("nan"))
                ps.append(p)
                q += [(f"ag#{i}.produce", lambda op=op, p=p: op.produce(p)),
                      (f"ag#{i}.consume", lambda op=op, p=p: op.consume(p)),
                      (f"ag#{i}.release", lambda op=op, p=p: op.release(p))]
            queues.append(q)
            plans.append(ps)
        run_schedule(hs, queues, seed)
        for i in range(len(rows_per_call)):
            ref = ag_gemm_ref(shards[i], bs[i])
            for r in range(3):
                _expect(compare(plans[r][i]["out"], ref, f"ag seed {seed} call {i} rank {r}", rel=1e-4))


def case_all_to_all_interleavings():
    world, h, cap = 3, 8, 6
    for seed in range(2):
        hs = simulate_group(world, CFG)
        ops = [AllToAll(x, cap, h, torch.float32, chunks=2) for x in hs]
        g = torch.Generator().manual_seed(seed)
        calls = []
        for _ in range(4):
            sc = torch.randint(0, cap + 1, (world, world), generator=g).tolist()
            calls.append((sc, [torch.randn(sum(c), h, generator=g) for c in sc]))
        queues, plans = [], []
        for r, op in enumerate(ops):
            q, ps = [], []
            for i, (sc, xs) in enumerate(calls):
                p = op.prepare(xs[r], torch.tensor(sc[r], dtype=torch.int32))
                ps.append(p)
                st = op.stages(p)  # announce, send, finish, bump; the output is read right after finish (it
                # must stay intact until this rank's next announce, however far the peers run ahead)
                q += [(f"a2a#{i}.{name}", fn) for name, fn in st[:3]]
                q += [(f"a2a#{i}.read", lambda p=p: p.__setitem__("got", p["out"].clone())),
                      (f"a2a#{i}.{st[3][0]}", st[3][1])]
            queues.append(q)
            plans.append(ps)
        run_schedule(hs, queues, seed)
        for i, (sc, xs) in enumerate(calls):
            ref, rc = all_to_all_ref(xs, sc)
            for d in range(world):
                p = plans[d][i]
                assert p["recv_counts"].tolist() == rc[d], (seed, i, d, p["recv_counts"], rc[d])
                assert torch.equal(p["got"][: ref[d].shape[0]], ref[d]), f"seed {seed} call {i} rank {d}"


if __name__ == "__main__":
    names = sys.argv[1:] or [n for n in dict(globals()) if n.startswith("case_")]
    res = {}
    for n in names:
        try:
            globals()[n]()
            res[n] = ""
        except Exception:
            res[n] = traceback.format_exc()[-3000:]
    print(json.dumps(res))
