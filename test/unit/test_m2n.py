"""M2N library (MegaScale-Infer sec. 5): random variable-size dispatch/combine round trips equal a torch
reference; back-to-back calls never hang; timeouts and closes fail closed."""

from __future__ import annotations

import tempfile
import threading
import time

import pytest
import torch

from sgl_kernel.m2n import M2NConfig, M2NEndpoint, RowLayout, create_transport

H, K = 24, 2
DISPATCH = RowLayout(((torch.float32, H), (torch.int32, K), (torch.float32, K)))
COMBINE = RowLayout(((torch.float32, H),))


def _addrs(n: int) -> tuple[str, ...]:
    d = tempfile.mkdtemp(prefix="m2n-test-")
    return tuple(f"ipc://{d}/{i}" for i in range(n))


def _expert_fn(x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, j: int) -> torch.Tensor:
    """The receiver's computation (a stand-in expert, different per receiver): the torch reference too."""
    scale = (ids.float() + 1.0 + j) * w
    return x * scale.sum(1, keepdim=True) + torch.tanh(x) * j


def test_layout_pack_unpack_roundtrip():
    buf = torch.empty(DISPATCH.nbytes(7), dtype=torch.uint8)
    x, i, w = torch.randn(7, H), torch.randint(-5, 5, (7, K), dtype=torch.int32), torch.rand(7, K)
    DISPATCH.pack(buf, [x, i, w])
    a, b, c = DISPATCH.unpack(buf, 7)
    assert torch.equal(a, x) and torch.equal(b, i) and torch.equal(c, w)
    with pytest.raises(ValueError, match="max_rows"):
        DISPATCH.pack(buf, [torch.randn(8, H), i[:1].repeat(8, 1), w[:1].repeat(8, 1)])
    with pytest.raises(ValueError, match="does not match"):
        DISPATCH.pack(buf, [x.double(), i, w])


def test_m2n_random_dispatch_combine_equals_reference():
    m, n, rounds = 3, 2, 25
    addrs = _addrs(m + n)
    errors: list[BaseException] = []

    def receiver(j: int) -> None:
        ep = M2NEndpoint(M2NConfig(m + j, addrs, max_rows=64, timeout_s=20), COMBINE, recv_layout=DISPATCH)
        try:
            for _ in range(m * rounds):
                msg = ep.recv()
                x, ids, w = msg.tensors
                ep.send(msg.src, [_expert_fn(x, ids, w, j)], meta=msg.meta)
        except BaseException as e:  # reported by the main thread
            errors.append(e)
        finally:
            ep.close()

    def sender(i: int) -> None:
        ep = M2NEndpoint(M2NConfig(i, addrs, max_rows=64, timeout_s=20), DISPATCH, recv_layout=COMBINE)
        g = torch.Generator().manual_seed(100 + i)
        try:
            for r in range(rounds):
                sent = {}
                for j in range(n):
                    rows = int(torch.randint(0, 65, (1,), generator=g))  # variable, including 0
                    x = torch.randn(rows, H, generator=g)
                    ids = torch.randint(0, 8, (rows, K), generator=g, dtype=torch.int32)
                    w = torch.rand(rows, K, generator=g)
                    sent[j] = (x, ids, w)
                    ep.send(m + j, [x, ids, w], meta=(r, j))
                for _ in range(n):
                    msg = ep.recv()
                    j = msg.src - m
                    assert msg.meta[:2] == (r, j)
                    torch.testing.assert_close(msg.tensors[0], _expert_fn(*sent[j], j), rtol=0, atol=0)
        except BaseException as e:
            errors.append(e)
        finally:
            ep.close()

    threads = [threading.Thread(target=receiver, args=(j,)) for j in range(n)]
    threads += [threading.Thread(target=sender, args=(i,)) for i in range(m)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "an M2N endpoint hung"
    assert not errors, errors


def test_m2n_10000_back_to_back_calls_do_not_hang():
    addrs = _addrs(2)
    calls = 10_000
    done = threading.Event()

    def echo() -> None:
        ep = M2NEndpoint(M2NConfig(1, addrs, max_rows=8, timeout_s=30), DISPATCH)
        try:
            for _ in range(calls):
                msg = ep.recv()
                ep.send(0, [t.clone() for t in msg.tensors], meta=msg.meta)
        finally:
            ep.close()
            done.set()

    t = threading.Thread(target=echo)
    t.start()
    ep = M2NEndpoint(M2NConfig(0, addrs, max_rows=8, timeout_s=30), DISPATCH)
    g = torch.Generator().manual_seed(0)
    t0 = time.monotonic()
    for c in range(calls):
        rows = c % 9
        ts = [torch.randn(rows, H, generator=g), torch.full((rows, K), c, dtype=torch.int32), torch.rand(rows, K)]
        ep.send(1, ts, meta=(c,))
        msg = ep.recv()
        assert msg.meta[0] == c and torch.equal(msg.tensors[0], ts[0]) and torch.equal(msg.tensors[1], ts[1])
    ep.close()
    t.join(30)
    assert done.is_set()
    print(f"{calls} round trips in {time.monotonic() - t0:.2f} s")


def test_m2n_timeout_and_close_fail_closed():
    addrs = _addrs(2)
    a = M2NEndpoint(M2NConfig(0, addrs, max_rows=4, timeout_s=0.2), COMBINE)
    b = M2NEndpoint(M2NConfig(1, addrs, max_rows=4, timeout_s=5), COMBINE)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        a.recv()  # nobody sends: an error, not a hang
    assert time.monotonic() - t0 < 3
    b.close(notify=[0])
    with pytest.raises(ConnectionError, match="closed"):
        a.recv(timeout_s=5)
    dead = M2NEndpoint(M2NConfig(0, _addrs(1), max_rows=4, timeout_s=5), COMBINE, alive=lambda: False)
    with pytest.raises(ConnectionError, match="liveness"):
        dead.recv()
    dead.close()
    a.close()
    with pytest.raises(ValueError, match="unknown M2N transport"):
        create_transport("carrier-pigeon")


def test_cuda_ipc_transport_refuses_cpu_buffers():
    from sgl_kernel.m2n.cuda_ipc import CudaIpcTransport

    with pytest.raises(RuntimeError, match="CUDA"):
        M2NEndpoint(M2NConfig(0, _addrs(1), max_rows=4), COMBINE, transport=CudaIpcTransport())


def test_cuda_ipc_strategy_switch(monkeypatch):
    from sgl_kernel.m2n.cuda_ipc import CudaIpcTransport

    t = CudaIpcTransport()
    assert (t.mem, t.event) == ("own", "own")  # the receiver's device context (CUDA simpleIPC)
    monkeypatch.setenv("SGL_M2N_IPC_MEM", "peer")
    monkeypatch.setenv("SGL_M2N_IPC_EVENT", "sync")
    t = CudaIpcTransport()
    assert (t.mem, t.event) == ("peer", "sync")
    assert CudaIpcTransport(mem="own", event="peer").event == "peer"  # explicit arguments beat the environment
    monkeypatch.setenv("SGL_M2N_IPC_EVENT", "later")
    with pytest.raises(ValueError, match="SGL_M2N_IPC_EVENT='later'"):
        CudaIpcTransport()
    with pytest.raises(ValueError, match="SGL_M2N_IPC_MEM='gpu9'"):
        CudaIpcTransport(mem="gpu9")


def _p2p_rank(rank: int, addrs, init: str, q) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    ep = M2NEndpoint(M2NConfig(rank, addrs, max_rows=32, timeout_s=30), DISPATCH if rank == 0 else COMBINE,
                     recv_layout=COMBINE if rank == 0 else DISPATCH, transport=create_transport("nccl"))
    try:
        g = torch.Generator().manual_seed(3)
        for r in range(20):
            if rank == 0:
                n = int(torch.randint(0, 33, (1,), generator=g))
                x, ids, w = torch.randn(n, H, generator=g), torch.randint(0, 8, (n, K), dtype=torch.int32), torch.rand(n, K)
                ep.send(1, [x, ids, w], (r,))
                msg = ep.recv()
                assert msg.meta[0] == r and torch.equal(msg.tensors[0], _expert_fn(x, ids, w, 1))
            else:
                msg = ep.recv()
                ep.send(0, [_expert_fn(*msg.tensors, 1)], msg.meta)
        if rank == 0:
            q.put("ok")
    except BaseException as e:
        q.put(repr(e))
    finally:
        ep.transport.close()
        dist.barrier()
        dist.destroy_process_group()


def test_p2p_baseline_transport_round_trips_equal_reference():
    """The NCCL-baseline transport's code path (isend/irecv of exact byte counts, header over ZMQ) on a gloo group."""
    import torch.multiprocessing as mp

    from sglang.srt.utils.common import free_tcp_ports

    addrs = _addrs(2)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    init = f"tcp://127.0.0.1:{free_tcp_ports(1)[0]}"
    ps = [ctx.Process(target=_p2p_rank, args=(r, addrs, init, q)) for r in range(2)]
    for p in ps:
        p.start()
    res = q.get(timeout=120)
    for p in ps:
        p.join(30)
        if p.is_alive():
            p.kill()
    assert res == "ok", res
