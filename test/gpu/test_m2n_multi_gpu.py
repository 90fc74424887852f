"""M2N between GPUs: one rank per GPU (2 GPUs, or 4 when present; skipped with fewer).

* Every transport (CUDA IPC, inline ZMQ, NIXL) delivers exactly the bytes of a torch reference (what was sent, ids
  + 1) over random row counts incl. 0 and ``max_rows`` (rank 0 on cuda:0 exchanges with every peer on its own GPU;
  peers echo with ids + 1), so all deliver the same bytes.
* 10,000 back-to-back messages (up to ``slots`` unanswered per peer, round-robin over peers) arrive intact;
  the check accumulates on the device (no host sync per message).
* A killed peer fails closed: rank 0's receive raises within seconds and its close returns (no hang).

* ``cuda_push`` (device-driven; ``cuda_push_ll``: the same with the low-latency protocol) also passes the
  device-only phases of ``m2n_push_case.py``: random row counts incl.
  0 with the count read from the flag word, 10,000 back-to-back device-driven messages, and a killed peer whose
  device wait gives up within the budget (``check()`` raises TimeoutError); and a CUDA-graph phase (both ranks
  capture round trips with device row counts and replay them back to back; random rows incl. 0 vs the reference).

Each (transport, world) is its own test case with its own time bound (:data:`BOUNDS`), so a hang in one transport
cannot eat the others' time.
"""

from __future__ import annotations

import faulthandler
import hashlib
import os
import sys
import tempfile
import time
import traceback

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import m2n_push_case  # noqa: E402
from conftest import gpu_tiered  # noqa: E402


H, K, MAX_ROWS, SLOTS = 256, 4, 300, 4
OP_ECHO, OP_DIE = 0, 1
RECV_TIMEOUT_S = 15.0  # every receive is bounded: a lost message fails the phase, never hangs it
GROUP_TIMEOUT_S = 60.0  # peers' own receive timeout (they wait for rank 0's next message)
# per transport: (back-to-back messages of phase 2, seconds the whole group may take: spawn + attach + 3 phases)
BOUNDS = {"cuda_ipc": (10_000, 30.0), "inline": (200, 15.0), "nixl": (500, 25.0), "cuda_push": (10_000, 50.0),
          "cuda_push_ll": (10_000, 50.0)}
GRAPH_K, GRAPH_REPLAYS = 8, 20  # cuda_push phase G: round trips per captured graph, replays back to back
PUSH_BUDGET_S = 3.0  # rank 0's device-wait budget with cuda_push (the killed-peer phase waits this long)


def _progress(rank: int, transport: str, what: str, t0: float) -> None:
    """Per-phase progress on stdout (run pytest with -s), flushed so a killed run still shows where it was."""
    print(f"[m2n {transport} rank {rank} +{time.perf_counter() - t0:.1f}s] {what}", flush=True)


def _ngpu() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _layout():
    from sgl_kernel.m2n import RowLayout

    return RowLayout(((torch.bfloat16, H), (torch.int32, K), (torch.float32, K)))


def _endpoint(rank, addrs, transport, timeout_s):
    from sgl_kernel.m2n import M2NConfig, M2NEndpoint

    from sglang.srt.afd.protocol import create_afd_transport  # injects the NIXL agent factory for "nixl"

    torch.cuda.set_device(rank)
    if transport.startswith("cuda_push") and rank == 0:
        from sgl_kernel.m2n.cuda_push import CudaPushTransport

        tr = CudaPushTransport(wait_timeout_s=PUSH_BUDGET_S, protocol="ll" if transport == "cuda_push_ll" else "flag")
    else:
        tr = create_afd_transport(transport)
    return M2NEndpoint(M2NConfig(rank, addrs, MAX_ROWS, slots=SLOTS, device=f"cuda:{rank}", timeout_s=timeout_s),
                       _layout(), transport=tr)


def _peer(rank, addrs, transport, q) -> None:
    """Echo every message (ids + 1) to rank 0 until closed; OP_DIE: exit at once, as a crash would."""
    try:
        ep = _endpoint(rank, addrs, transport, GROUP_TIMEOUT_S)
        while True:
            msg = ep.recv()
            if msg.meta[0] == OP_DIE:
                os._exit(3)
            if msg.meta[0] == m2n_push_case.OP_DEVICE:
                m2n_push_case.peer_device_loop(ep, msg.meta[1], MAX_ROWS)
                continue
            if msg.meta[0] == m2n_push_case.OP_GRAPH:
                m2n_push_case.peer_graph_loop(ep, msg.meta[1], msg.meta[2])
                continue
            x, ids, w = msg.tensors
            ep.send(0, [x, ids + 1, w], msg.meta)
    except ConnectionError:
        q.put((rank, "closed"))
    except Exception as e:  # reported to the test
        q.put((rank, f"error {e!r}\n{traceback.format_exc()}"))


def _msg(g, n):
    x = torch.randn(n, H, device="cuda", generator=g).bfloat16()
    ids = torch.randint(0, 64, (n, K), device="cuda", dtype=torch.int32, generator=g)
    return x, ids, torch.rand(n, K, device="cuda", generator=g)


def _driver(addrs, transport, n_msgs, q) -> None:
    """Rank 0: phase 1 random sizes (digest of received bytes), phase 2 ``n_msgs`` back-to-back, phase 3 kill."""
    # a hang prints every thread's Python stack (stderr, kept by pytest -s) shortly before the case's bound
    faulthandler.dump_traceback_later(max(1.0, BOUNDS[transport][1] - 8.0), exit=False)
    try:
        world, t00 = len(addrs), time.perf_counter()
        ep = _endpoint(0, addrs, transport, RECV_TIMEOUT_S)
        _progress(0, transport, "endpoint up; phase 1 (random sizes)", t00)
        g = torch.Generator(device="cuda").manual_seed(7)
        sizes = [0, MAX_ROWS, 1] + [int(v) for v in np.random.default_rng(3).integers(0, MAX_ROWS + 1, 45)]
        digest, ref_digest, bad = hashlib.sha256(), hashlib.sha256(), 0
        for i, n in enumerate(sizes):
            peer = 1 + i % (world - 1)
            x, ids, w = _msg(g, n)
            ep.send(peer, [x, ids, w], (OP_ECHO, i))
            r = ep.recv()
            ok = r.src == peer and r.meta[1] == i and torch.equal(r.tensors[0], x) and \
                torch.equal(r.tensors[1], ids + 1) and torch.equal(r.tensors[2], w)
            bad += not ok
            for t, ref in zip(r.tensors, (x, ids + 1, w)):  # received bytes vs the torch reference (sent, ids + 1)
                digest.update(t.cpu().contiguous().view(torch.uint8).numpy().tobytes())
                ref_digest.update(ref.cpu().contiguous().view(torch.uint8).numpy().tobytes())
        _progress(0, transport, f"phase 1 done (bad={bad}); phase 2 ({n_msgs} back-to-back)", t00)
        # phase 2: back-to-back, SLOTS in flight per peer; mismatches summed on the device
        x, ids, w = _msg(g, 8)
        mism = torch.zeros((), dtype=torch.int64, device="cuda")
        sent = got = 0
        pending = [0] * world  # per peer at most SLOTS unanswered (the slot-reuse rule)
        t0 = time.perf_counter()
        while got < n_msgs:
            peer = 1 + sent % (world - 1)
            if sent < n_msgs and pending[peer] < SLOTS:
                ep.send(peer, [x * (sent % 7), ids, w], (OP_ECHO, sent))
                pending[peer] += 1
                sent += 1
                continue
            r = ep.recv()
            pending[r.src] -= 1
            j = r.meta[1]
            mism += (r.tensors[0] != x * (j % 7)).sum() + (r.tensors[1] != ids + 1).sum()
            got += 1
        torch.cuda.synchronize()
        rate = n_msgs / (time.perf_counter() - t0)
        _progress(0, transport, f"phase 2 done ({rate:.0f} msg/s); phase 3 (killed peer)", t00)
        dev = {}
        if transport.startswith("cuda_push"):
            dev = m2n_push_case.driver_device_phases(ep, lambda n: _msg(g, n), n_msgs, MAX_ROWS, SLOTS,
                                                     lambda s: _progress(0, transport, s, t00))
            dev.update(m2n_push_case.driver_graph_phase(ep, lambda n: _msg(g, n), GRAPH_K, GRAPH_REPLAYS, MAX_ROWS,
                                                        lambda s: _progress(0, transport, s, t00)))
            dev["dev_died"] = m2n_push_case.driver_device_kill(ep, lambda n: _msg(g, n), OP_DIE)
            _progress(0, transport, f"D3 device receive from the killed peer: {dev['dev_died']}", t00)
        # phase 3: peer 1 dies (cuda_push: it died in D3 already); the next receive must fail within the timeout
        if not transport.startswith("cuda_push"):
            ep.send(1, [x, ids, w], (OP_DIE, 0))
            ep.send(1, [x, ids, w], (OP_ECHO, -1))
        t0 = time.perf_counter()
        try:
            ep.recv(timeout_s=3.0)
            died = "no error"
        except (TimeoutError, ConnectionError) as e:
            died = f"{type(e).__name__} after {time.perf_counter() - t0:.1f} s"
        _progress(0, transport, f"phase 3 receive: {died}; closing", t00)
        t1 = time.perf_counter()
        ep.close(notify=list(range(2, world)))
        closed = time.perf_counter() - t1
        _progress(0, transport, f"phase 3 done ({died}; close {closed:.1f} s)", t00)
        q.put((0, {"bad": bad, "digest": digest.hexdigest(), "ref_digest": ref_digest.hexdigest(),
                   "mismatch": int(mism), "rate": rate, "died": died, "close_s": closed, **dev}))
        faulthandler.cancel_dump_traceback_later()
    except Exception as e:  # reported to the test
        q.put((0, f"error {e!r}\n{traceback.format_exc()}"))


def run_group(transport: str, world: int, n_msgs: int, bound_s: float) -> dict:
    """Spawn ``world`` ranks (rank r on cuda:r) and return rank 0's report; raises AssertionError when rank 0 has not
    reported within ``bound_s`` seconds (a hang), after killing every rank."""
    import torch.multiprocessing as mp

    d = tempfile.mkdtemp()
    addrs = tuple(f"ipc://{d}/m2n{r}" for r in range(world))
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_driver, args=(addrs, transport, n_msgs, q))]
    procs += [ctx.Process(target=_peer, args=(r, addrs, transport, q)) for r in range(1, world)]
    for p in procs:
        p.start()
    try:
        reports = {}
        deadline = time.monotonic() + bound_s
        while 0 not in reports and time.monotonic() < deadline:
            try:
                rank, rep = q.get(timeout=2)
            except Exception:
                if not procs[0].is_alive():
                    break
                continue
            reports[rank] = rep
            if isinstance(rep, str) and rep.startswith("error"):
                print(f"[m2n {transport}] rank {rank} reported: {rep}", flush=True)
                if rank != 0:  # a dead peer: rank 0 would only time out later
                    break
        assert 0 in reports, (f"rank 0 gave no report within {bound_s:.0f} s ({transport}, {world} GPUs): hang or "
                              f"crash; others: {reports}")
        return reports[0]
    finally:
        for p in procs:
            p.join(timeout=2 if 0 in reports else 0.1)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)


CASES = [("cuda_push", 2), ("cuda_push_ll", 2), ("cuda_ipc", 2), ("inline", 2), ("nixl", 2), ("cuda_push", 4),
         ("cuda_ipc", 4),
         ("inline", 4)]


@pytest.mark.parametrize("transport,world", gpu_tiered(CASES, smoke=(0, 2),
                                                         ids=[f"{t}-{w}gpu" for t, w in CASES]))
def test_m2n_one_rank_per_gpu(transport, world):
    if _ngpu() < world:
        pytest.skip(f"needs {world} GPUs, found {_ngpu()}")
    if transport == "nixl":
        from sglang.srt.disaggregation.transfer.base import nixl_available

        ok, why = nixl_available()
        if not ok:
            pytest.skip(f"nixl does not import ({why}); pip install 'sglang[pd]'")
    n_msgs, bound_s = BOUNDS[transport]
    rep = run_group(transport, world, n_msgs, bound_s)
    assert isinstance(rep, dict), rep
    assert rep["bad"] == 0 and rep["mismatch"] == 0, rep
    assert rep["digest"] == rep["ref_digest"], f"{transport} delivered other bytes than the torch reference"
    assert rep["died"].startswith(("TimeoutError", "ConnectionError")), rep["died"]
    assert rep["close_s"] < 5.0, f"close after the killed peer took {rep['close_s']:.1f} s"
    if transport.startswith("cuda_push"):
        assert rep["dev_bad"] == 0 and rep["dev_mismatch"] == 0, rep
        assert rep["graph_mismatch"] == 0 and rep["graph_msgs"] == GRAPH_K * GRAPH_REPLAYS, rep
        assert rep["dev_died"].startswith("TimeoutError"), rep["dev_died"]
