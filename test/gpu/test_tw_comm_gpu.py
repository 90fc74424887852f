"""GPU correctness of tw-comm's fused AllReduce + residual + RMSNorm (2/4/8 ranks, one process per GPU).

Each variant (one-shot, two-shot, pipelined two-shot, two-shot with sharded residual, copy-engine, plain AllReduce,
NCCL fallback) is compared with NCCL AllReduce in fp32 + fp32 RMSNorm on fresh random inputs, outputs poisoned with
NaN first;
token counts 1..16384 including ones not divisible by the world size; CUDA-graph capture + replay; thousands of
back-to-back calls (signal reuse, no hang); and the NVLS gate refuses (never launching a multimem kernel).
"""

import os
import sys
import time
from pathlib import Path

import pytest
import torch

# NVLink multicast is forbidden on our hosts: every process started here inherits these.
REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO / "python")]
from sglang.srt.utils.nvls_env import NVLS_OFF_ENV  # noqa: E402  (pure Python)

os.environ.update(NVLS_OFF_ENV)
PATHS = [str(REPO / "sgl-kernel" / "python"), str(REPO / "python")]
sys.path[:0] = PATHS
sys.path.insert(0, str(REPO / "test"))
from conftest import gpu_tiered  # noqa: E402


EPS = 1e-5
TOL = dict(rtol=2e-2, atol=2e-2)


def _inputs(seed, rank, tokens, hidden, dtype, device):
    g = torch.Generator(device="cpu").manual_seed(seed)
    residual = (torch.randn(tokens, hidden, generator=g) * 2).to(dtype)
    weight = (torch.rand(hidden, generator=g) + 0.5).to(dtype)
    g.manual_seed(seed * 131 + rank + 1)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    return x.to(device), residual.to(device), weight.to(device)


def _reference(x, residual, weight):
    import torch.distributed as dist
    from sgl_kernel.tw_comm.reference import add_rmsnorm_fp32

    total = x.float()
    dist.all_reduce(total)
    return add_rmsnorm_fp32(total, residual, weight, EPS), total


def _check_variant(ws, backend, tokens, hidden, dtype, seed, sms=None, sharded=False):
    from sgl_kernel.tw_comm.reference import owned_range
    from sglang.srt.distributed.tw_comm import allreduce_rmsnorm

    x, residual, weight = _inputs(seed, ws.rank, tokens, hidden, dtype, ws.device)
    if backend == type(backend).NCCL:  # the fallback sums in x's dtype inside NCCL: compare with exactly that
        import torch.distributed as dist
        from sgl_kernel.tw_comm.reference import add_rmsnorm_fp32

        total = x.clone()
        dist.all_reduce(total)
        res_ref, out_ref = add_rmsnorm_fp32(total.float(), residual, weight, EPS)
    else:
        (res_ref, out_ref), _ = _reference(x, residual, weight)
    r = residual.clone()
    out = torch.full_like(x, float("nan"))
    allreduce_rmsnorm(ws, x, r, weight, EPS, out=out, backend=backend, max_sms=sms, residual_sharded=sharded)
    torch.cuda.synchronize()
    tag = f"{backend.value} T={tokens} H={hidden} {dtype} sms={sms} sharded={sharded}"
    assert torch.isfinite(out).all(), f"{tag}: unwritten output rows"
    torch.testing.assert_close(out.float(), out_ref.float(), **TOL, msg=lambda m: f"{tag}: out {m}")
    if sharded:
        s, e = owned_range(tokens, ws.world, ws.rank)
        torch.testing.assert_close(r[s:e].float(), res_ref[s:e].float(), **TOL, msg=lambda m: f"{tag}: res {m}")
        assert torch.equal(r[:s], residual[:s]) and torch.equal(r[e:], residual[e:]), f"{tag}: foreign rows"
    else:
        torch.testing.assert_close(r.float(), res_ref.float(), **TOL, msg=lambda m: f"{tag}: residual {m}")
    return out


def _check_consistent(out):
    """Every rank must hold the bit-identical result."""
    import torch.distributed as dist

    ref = out.clone()
    dist.broadcast(ref, 0)
    assert torch.equal(ref, out), "ranks disagree on the AllReduce result"


def _check_graph(ws, rank, dev, T, H, calls, reps, tag):
    """Capture ``calls`` (``(backend, max_sms)`` pairs, run in order on one bf16 ``[T, H]`` input set) in a CUDA
    graph after a warm-up of the first on a side stream, then replay it ``reps`` times with fresh inputs; each replay
    vs the fp32 reference applied once per call (the residual accumulates call by call)."""
    from sglang.srt.distributed.tw_comm import allreduce_rmsnorm

    x, residual, w = _inputs(500, rank, T, H, torch.bfloat16, dev)
    r, out = residual.clone(), torch.empty_like(x)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        allreduce_rmsnorm(ws, x, r, w, EPS, out=out, backend=calls[0][0], max_sms=calls[0][1])
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for backend, sms in calls:
            allreduce_rmsnorm(ws, x, r, w, EPS, out=out, backend=backend, max_sms=sms)
    for rep in range(reps):
        nx, nres, _ = _inputs(600 + rep, rank, T, H, torch.bfloat16, dev)
        x.copy_(nx)
        r.copy_(nres)
        out.fill_(float("nan"))
        res_ref = nres
        for _ in calls:
            (res_ref, out_ref), _ = _reference(nx, res_ref, w)
        g.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out.float(), out_ref.float(), **TOL, msg=lambda m: f"{tag} graph: {m}")
        torch.testing.assert_close(r.float(), res_ref.float(), **TOL)
    del g


def _back_to_back(ws, rank, world, dev, tag, backend, others, seed, T, H, n_calls):
    """``n_calls`` back-to-back bf16 ``[T, H]`` calls of ``backend`` on 1-40 CTAs, residual sharded every other call,
    and every 5th call one of ``others`` (``others[it % 2]``: even / odd call index) on 8 CTAs in between (epochs and
    flags shared); prints the wall time on rank 0. A hang or a device fault here fails the run; the caller checks
    the next call's result."""
    from sglang.srt.distributed.tw_comm import allreduce_rmsnorm

    x1, r1, w1 = _inputs(seed, rank, T, H, torch.bfloat16, dev)
    o1 = torch.empty_like(x1)
    t0 = time.time()
    for it in range(n_calls):
        allreduce_rmsnorm(ws, x1, r1, w1, EPS, out=o1, backend=backend, max_sms=1 + it % 40,
                          residual_sharded=bool(it % 2))
        if it % 5 == 0:
            allreduce_rmsnorm(ws, x1, r1, w1, EPS, out=o1, backend=others[it % 2], max_sms=8)
    torch.cuda.synchronize()
    if rank == 0:
        print(f"[tw-comm gpu] {tag} world={world}: {n_calls + n_calls // 5} "
              f"back-to-back calls in {time.time() - t0:.2f}s")


def _nvls_refused(ws, rank, dev):
    """The NVLS gate refuses before any launch: the env gate, the library entry point and the Python API."""
    from sgl_kernel.tw_comm import ops as tw_comm_ops
    from sgl_kernel.tw_comm.lib import TW_ERR_NVLS_REFUSED, load_library
    from sglang.srt.distributed.tw_comm import TwBackend, allreduce_rmsnorm

    ok, why = tw_comm_ops.nvls_gate(rank)
    assert not ok and "NCCL_NVLS_ENABLE" in why, why
    lib = load_library()
    rc = lib.raw("tw_nvls_allreduce_rmsnorm", ws.handle, None, None, None, None, None, None, 8, 64, 0,
                 EPS, 4, None)
    assert rc == TW_ERR_NVLS_REFUSED, (rc, lib.last_error())
    with pytest.raises(ValueError, match="nvls"):
        x, r, w = _inputs(1, rank, 4, 64, torch.bfloat16, dev)
        allreduce_rmsnorm(ws, x, r, w, EPS, backend=TwBackend.NVLS)


def _plain_and_local(ws, rank, dev, seed):
    """Plain AllReduce (one-shot / two-shot) vs NCCL in fp32, and the local fused add + RMSNorm op (baseline path)
    vs the fp32 reference."""
    import torch.distributed as dist
    from sgl_kernel.tw_comm.reference import add_rmsnorm_fp32
    from sglang.srt.distributed.tw_comm import TwBackend as B
    from sglang.srt.distributed.tw_comm import allreduce

    for T, H, variant in [(1, 4096, B.ONESHOT), (33, 1024, B.ONESHOT), (1001, 2048, B.TWOSHOT), (5, 8, B.TWOSHOT)]:
        seed += 1
        x, _, _ = _inputs(seed, rank, T, H, torch.bfloat16, dev)
        total = x.float()
        dist.all_reduce(total)
        out = allreduce(ws, x, out=torch.full_like(x, float("nan")), backend=variant, max_sms=8)
        torch.testing.assert_close(out.float(), total, **TOL)
    x, r, w = _inputs(99, rank, 37, 8192, torch.bfloat16, dev)
    exp_r, exp_o = add_rmsnorm_fp32(x.float(), r, w, EPS)
    o = torch.empty_like(x)
    torch.ops.sgl_kernel.tw_fused_add_rmsnorm(x, r, w, o, EPS, 16)
    torch.testing.assert_close(o.float(), exp_o.float(), **TOL)
    torch.testing.assert_close(r.float(), exp_r.float(), **TOL)


def _main_suite(ws, rank, world, dev, quick):
    """NVLS refused; every barrier-based variant over the shape sweep; plain AllReduce and the local op; CUDA-graph
    replay per variant; thousands of back-to-back calls of mixed variants and grids, then a checked call."""
    from sglang.srt.distributed.tw_comm import TwBackend as B
    from sglang.srt.distributed.tw_comm import allreduce_rmsnorm

    bf, fp = torch.bfloat16, torch.float16
    _nvls_refused(ws, rank, dev)
    seed = 0
    cases = [(1, 8192), (2, 64), (3, 4096), (5, 16384), (7, 2048), (13, 8), (64, 2048), (127, 1024),
             (1000, 2048), (2049, 2048), (4097, 1024), (16384, 2048), (16383, 256), (777, 16384)]
    if quick:
        cases = cases[::2]
    for i, (T, H) in enumerate(cases):
        dtype = bf if i % 3 else fp
        variants = [(B.TWOSHOT, 32, False), (B.TWOSHOT, 3, True), (B.CE, 4, False), (B.CE, 8, True),
                    (B.NCCL, None, False)]
        if world * T * H * 2 <= ws.capacity_bytes:
            variants.append((B.ONESHOT, 16, False))
        for backend, sms, sharded in variants:
            seed += 1
            out = _check_variant(ws, backend, T, H, dtype, seed, sms, sharded)
            if i % 4 == 0:
                _check_consistent(out)
    _plain_and_local(ws, rank, dev, seed)
    for backend, T, H, sms in [(B.ONESHOT, 5, 4096, 8), (B.TWOSHOT, 301, 2048, 16), (B.CE, 1031, 1024, 4)]:
        _check_graph(ws, rank, dev, T, H, [(backend, sms)], 4, str(backend))
    x1, r1, w1 = _inputs(700, rank, 8, 4096, bf, dev)
    x2, r2, w2 = _inputs(701, rank, 77, 2048, bf, dev)
    o1, o2 = torch.empty_like(x1), torch.empty_like(x2)
    n_calls = 600 if quick else 3000
    t0 = time.time()
    for it in range(n_calls):
        allreduce_rmsnorm(ws, x1, r1, w1, EPS, out=o1, backend=B.ONESHOT, max_sms=8 if it % 2 else 3)
        allreduce_rmsnorm(ws, x2, r2, w2, EPS, out=o2, backend=B.TWOSHOT, max_sms=1 + it % 32)
        if it % 100 == 0:
            allreduce_rmsnorm(ws, x2, r2, w2, EPS, out=o2, backend=B.CE, max_sms=2)
    torch.cuda.synchronize()
    elapsed = time.time() - t0
    for backend in (B.ONESHOT, B.TWOSHOT, B.CE):
        _check_variant(ws, backend, 77, 2048, bf, 800, 8)
    if rank == 0:
        print(f"[tw-comm gpu] world={world}: {n_calls * 2 + n_calls // 100} back-to-back calls in {elapsed:.2f}s")


def _lamport_suite(ws, rank, world, dev, quick):
    """The Lamport one-shot (flag in the data): every shape vs the fp32 reference with NaN-poisoned outputs,
    bit-identical across ranks, negative zeros in x (the sentinel value must not stall or corrupt a call),
    interleaved with barrier-based variants (the epoch, hence the buffer, advances by other kernels too),
    CUDA-graph replay, and back-to-back calls reusing the three buffers, then a checked call."""
    from sglang.srt.distributed.tw_comm import TwBackend as B
    from sglang.srt.distributed.tw_comm import allreduce_rmsnorm

    seed = 1000
    for i, (T, H) in enumerate([(1, 8192), (2, 64), (3, 4096), (7, 2048), (13, 8), (32, 8192), (64, 2048),
                                (127, 1024), (128, 8192), (5, 16384)]):
        dtype = torch.bfloat16 if i % 3 else torch.float16
        for sms in (64, 3):
            seed += 1
            _check_consistent(_check_variant(ws, B.LAMPORT, T, H, dtype, seed, sms))
        _check_variant(ws, B.ONESHOT if i % 2 else B.TWOSHOT, T, H, dtype, seed + 500, 8)
    # negative zeros in the payload: canonicalized to +0 on the wire, the result is unchanged
    x, r, w = _inputs(77, rank, 16, 4096, torch.bfloat16, dev)
    x[:, ::3] = -0.0
    (res_ref, out_ref), _ = _reference(x, r, w)
    out = torch.full_like(x, float("nan"))
    allreduce_rmsnorm(ws, x, r, w, EPS, out=out, backend=B.LAMPORT, max_sms=16)
    torch.cuda.synchronize()
    torch.testing.assert_close(out.float(), out_ref.float(), **TOL)
    torch.testing.assert_close(r.float(), res_ref.float(), **TOL)
    _check_graph(ws, rank, dev, 9, 8192, [(B.LAMPORT, 8)], 5, "lamport")
    # back-to-back: Lamport calls of changing sizes and grids, some interleaved with the barrier one-shot
    x1, r1, w1 = _inputs(700, rank, 8, 4096, torch.bfloat16, dev)
    x2, r2, w2 = _inputs(701, rank, 100, 2048, torch.bfloat16, dev)
    o1, o2 = torch.empty_like(x1), torch.empty_like(x2)
    n_calls = 1000 if quick else 20000
    for it in range(n_calls):
        allreduce_rmsnorm(ws, x1, r1, w1, EPS, out=o1, backend=B.LAMPORT, max_sms=1 + it % 8)
        allreduce_rmsnorm(ws, x2, r2, w2, EPS, out=o2, backend=B.LAMPORT, max_sms=1 + it % 64)
        if it % 7 == 0:
            allreduce_rmsnorm(ws, x1, r1, w1, EPS, out=o1, backend=B.ONESHOT, max_sms=4)
    torch.cuda.synchronize()
    _check_consistent(_check_variant(ws, B.LAMPORT, 100, 2048, torch.bfloat16, 800, 16))
    if rank == 0:
        print(f"[tw-comm gpu] lamport world={world}: {n_calls * 2 + n_calls // 7} back-to-back calls passed")


def _pipe_suite(ws, rank, world, dev, quick):
    """The pipelined two-shot (per-chunk flags) vs the fp32 reference with NaN-poisoned outputs: shapes with T not
    divisible by the world, several chunks per block (small chunk_bytes) and one, full and sharded residual, fp16
    and bf16, grids from 1 to 128 blocks (block indices unused for many calls keep stale flags), interleaved with
    the other variants (epochs advance under it; the Lamport one-shot where it fits, on grids larger than T), CUDA-graph
    replay with fresh inputs, back-to-back calls, and bit-identical results on every rank."""
    import dataclasses

    from sglang.srt.distributed.tw_comm import TwBackend as B

    base_cfg = ws.config
    seed = 3000
    cases = [(1, 8192, 0), (3, 4096, 4096), (13, 8, 0), (77, 2048, 4096), (130, 8192, 16384), (257, 1024, 0),
             (1000, 2048, 8192), (2049, 8192, 0), (4097, 1024, 2048), (8192, 4096, 0), (5, 16384, 0)]
    if quick:
        cases = cases[::2] + [cases[3]]
    for i, (T, H, chunk) in enumerate(cases):
        ws.config = dataclasses.replace(base_cfg, pipe_chunk_bytes=chunk)
        dtype = torch.bfloat16 if i % 3 else torch.float16
        for sms, sharded in ((128, False), (16, True), (3, False), (1 + i * 7 % 40, True)):
            seed += 1
            out = _check_variant(ws, B.PIPE, T, H, dtype, seed, sms, sharded)
            if not sharded:
                _check_consistent(out)
        _check_variant(ws, B.TWOSHOT if i % 2 else B.ONESHOT, T, H, dtype, seed + 500, 8)
        if T * H * 2 <= 2 << 20:  # the Lamport one-shot between pipe calls; its grid may exceed T (push spread)
            for sms in (128, 2):
                _check_consistent(_check_variant(ws, B.LAMPORT, T, H, dtype, seed + 700 + sms, sms))
    ws.config = dataclasses.replace(base_cfg, pipe_chunk_bytes=4096)
    _check_graph(ws, rank, dev, 301, 2048, [(B.PIPE, 16), (B.PIPE, 5)], 4, "pipe")  # residual accumulates twice
    _back_to_back(ws, rank, world, dev, "pipe", B.PIPE, (B.TWOSHOT, B.TWOSHOT), 700, 77, 2048, 500 if quick else 5000)
    _check_consistent(_check_variant(ws, B.PIPE, 77, 2048, torch.bfloat16, 900, 32))


def _bulk_suite(ws, rank, world, dev, quick):
    """The bulk-copy two-shot (cp.async.bulk push / pull through a shared ring) vs the fp32 reference with
    NaN-poisoned outputs on fresh random inputs: hidden 8192 bf16 at T = 1, 128, 1024, 8192 on 8/16/24/32/132 CTAs,
    full and sharded residual; odd shapes (T not divisible by the world, rows of 16 bytes, rows larger than one
    16 KiB ring tile, fp16); interleaved with the two-shot and the pipelined two-shot (epochs and flags shared);
    CUDA-graph replay with fresh inputs; back-to-back calls; bit-identical results on every rank."""
    from sglang.srt.distributed.tw_comm import TwBackend as B

    seed = 5000
    for T in (1, 128, 1024, 8192):
        grids = ((8, True), (16, False), (24, True), (32, False), (132, True))
        for sms, sharded in grids if T < 8192 else grids[1::2]:
            seed += 1
            out = _check_variant(ws, B.BULK, T, 8192, torch.bfloat16, seed, sms, sharded)
            if not sharded:
                _check_consistent(out)
    for i, (T, H) in enumerate(((3, 8), (77, 2048), (257, 1024), (1000, 16384), (4097, 1024), (5, 16384))):
        dtype = torch.float16 if i % 2 else torch.bfloat16
        for sms, sharded in ((1, False), (16, True), (7 + i, False)):
            seed += 1
            out = _check_variant(ws, B.BULK, T, H, dtype, seed, sms, sharded)
            if not sharded:
                _check_consistent(out)
        _check_variant(ws, B.TWOSHOT if i % 2 else B.PIPE, T, H, dtype, seed + 500, 16)
    _check_graph(ws, rank, dev, 1030, 8192, [(B.BULK, 16), (B.BULK, 24)], 3, "bulk")  # residual accumulates twice
    _back_to_back(ws, rank, world, dev, "bulk", B.BULK, (B.TWOSHOT, B.PIPE), 950, 513, 4096, 300 if quick else 3000)
    _check_consistent(_check_variant(ws, B.BULK, 513, 4096, torch.bfloat16, 990, 16))


# suite -> (body, workspace config): the workspace covers the suite's largest call
SUITES = {
    "main": (_main_suite, dict(max_bytes=16384 * 2048 * 2)),
    "lamport": (_lamport_suite, dict(max_bytes=4096 * 2048 * 2)),
    "pipe": (_pipe_suite, dict(max_bytes=8192 * 4096 * 2, use_calibrated=False)),
    "bulk": (_bulk_suite, dict(max_bytes=8192 * 8192 * 2, use_calibrated=False)),
}


def _worker(rank, world, init_file, quick, suite):
    """One rank (one GPU) of ``SUITES[suite]``: NCCL process group through ``init_file``, a tw-comm workspace, the
    suite's body, then the workspace and the group closed whatever happened."""
    sys.path[:0] = PATHS
    import torch.distributed as dist
    from sglang.srt.distributed.tw_comm import TwCommConfig, TwCommWorkspace

    body, cfg = SUITES[suite]
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world, device_id=dev)
    ws = TwCommWorkspace(None, dev, TwCommConfig(**cfg))
    try:
        body(ws, rank, world, dev, quick)
    finally:
        ws.close()
        dist.destroy_process_group()


def _run(world, tmp_path, suite, timeout_s=150):
    """Spawn ``world`` ranks of ``_worker(suite)``; skip without enough GPUs; fail (killing the ranks) past
    ``timeout_s``."""
    import torch.multiprocessing as mp

    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs, found {torch.cuda.device_count()}")
    from sgl_kernel.tw_comm.build import build_library

    build_library()  # once, before the ranks start
    quick = os.environ.get("TW_COMM_QUICK") == "1"
    ctx = mp.spawn(_worker, args=(world, str(tmp_path / "store"), quick, suite), nprocs=world, join=False)
    deadline = time.time() + timeout_s
    while not ctx.join(timeout=5):
        if time.time() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            pytest.fail(f"tw-comm GPU test hung for {timeout_s}s at world={world}")


@pytest.mark.parametrize("world", gpu_tiered([2, 4, 8]))
def test_tw_comm_gpu(world, tmp_path):
    _run(world, tmp_path, "main")


@pytest.mark.parametrize("world", gpu_tiered([2, 4, 8]))
def test_tw_comm_lamport_gpu(world, tmp_path):
    """The Lamport one-shot alone (a hang here cannot hide the other variants' results)."""
    _run(world, tmp_path, "lamport", timeout_s=90)


@pytest.mark.parametrize("world", gpu_tiered([2, 4, 8]))
def test_tw_comm_pipe_gpu(world, tmp_path):
    """The pipelined two-shot alone (a hang here cannot hide the other variants' results)."""
    _run(world, tmp_path, "pipe", timeout_s=90)


@pytest.mark.parametrize("world", gpu_tiered([2, 4, 8]))
def test_tw_comm_bulk_gpu(world, tmp_path):
    """The bulk-copy two-shot alone (a hang here cannot hide the other variants' results)."""
    _run(world, tmp_path, "bulk", timeout_s=90)
