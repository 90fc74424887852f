"""M2N over the NIXL transport (CPU host memory, UCX) in real processes: variable row counts (0 included) give
the same bytes as the inline transport and a torch reference; a dead sender fails the READ closed."""

from __future__ import annotations

import os
import tempfile
import time

import pytest
import torch

from sgl_kernel.m2n import M2NConfig, M2NEndpoint, RowLayout, create_transport

from sglang.srt.afd.protocol import create_afd_transport


def _nixl_reason() -> str:
    try:
        from sglang.srt.disaggregation.transfer.base import nixl_available
    except ImportError as e:
        return str(e)
    ok, why = nixl_available()
    return "" if ok else why


_WHY = _nixl_reason()
needs_nixl = pytest.mark.skipif(bool(_WHY), reason=f"nixl does not import ({_WHY}); pip install 'sglang[pd]'")

H, K = 24, 2
DISPATCH = RowLayout(((torch.float32, H), (torch.int32, K), (torch.float32, K)))
COMBINE = RowLayout(((torch.float32, H),))
ROUNDS, MAX_ROWS = 12, 48


def _addrs(n: int) -> tuple[str, ...]:
    d = tempfile.mkdtemp(prefix="m2n-nixl-")
    return tuple(f"ipc://{d}/{i}" for i in range(n))


def _expert_fn(x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, j: int) -> torch.Tensor:
    scale = (ids.float() + 1.0 + j) * w
    return x * scale.sum(1, keepdim=True) + torch.tanh(x) * j


def _rank(rank: int, addrs, transport: str, q) -> None:
    """Rank 0 dispatches random row counts to ranks 1..n and collects the combines; the others answer."""
    n = len(addrs) - 1
    ep = None
    try:
        ep = M2NEndpoint(M2NConfig(rank, addrs, max_rows=MAX_ROWS, timeout_s=20),
                         DISPATCH if rank == 0 else COMBINE, recv_layout=COMBINE if rank == 0 else DISPATCH,
                         transport=create_afd_transport(transport))
        if rank == 0:
            g = torch.Generator().manual_seed(7)
            got, sent = [], []
            for r in range(ROUNDS):
                for j in range(1, n + 1):
                    rows = 0 if (r + j) % 5 == 0 else int(torch.randint(1, MAX_ROWS + 1, (1,), generator=g))
                    x = torch.randn(rows, H, generator=g)
                    ids = torch.randint(0, 8, (rows, K), generator=g, dtype=torch.int32)
                    w = torch.rand(rows, K, generator=g)
                    sent.append((r, j, x.numpy().copy(), ids.numpy().copy(), w.numpy().copy()))
                    ep.send(j, [x, ids, w], meta=(r, j))
                for _ in range(n):
                    msg = ep.recv()
                    got.append((msg.meta[0], msg.src, msg.tensors[0].numpy().copy()))  # numpy: pickled by value
            q.put(("ok", sent, got))
        else:
            for _ in range(ROUNDS):
                msg = ep.recv()
                x, ids, w = msg.tensors
                ep.send(0, [_expert_fn(x, ids, w, rank)], meta=msg.meta)
            ep.recv(timeout_s=20)  # rank 0's close notice: keep the ring registered until it has read everything
    except ConnectionError as e:
        if rank == 0 or "closed" not in str(e):
            q.put(("err", rank, repr(e)))
    except BaseException as e:  # reported by the test
        q.put(("err", rank, repr(e)))
    finally:
        if ep is not None:
            ep.close(notify=range(1, n + 1) if rank == 0 else ())


def _run_group(transport: str, world: int = 3):
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    addrs = _addrs(world)
    ps = [ctx.Process(target=_rank, args=(r, addrs, transport, q)) for r in range(world)]
    for p in ps:
        p.start()
    try:
        res = q.get(timeout=120)
    finally:
        for p in ps:
            p.join(30)
            if p.is_alive():
                p.kill()
    assert res[0] == "ok", res
    sent = [(r, j, torch.from_numpy(x), torch.from_numpy(i), torch.from_numpy(w)) for r, j, x, i, w in res[1]]
    return sent, [(r, s, torch.from_numpy(y)) for r, s, y in res[2]]


@needs_nixl
def test_nixl_m2n_three_processes_equal_inline_and_reference():
    sent_n, got_n = _run_group("nixl")
    sent_i, got_i = _run_group("inline")
    assert any(x.shape[0] == 0 for _, _, x, _, _ in sent_n), "no 0-row message was exercised"
    assert len(got_n) == len(got_i) == 2 * ROUNDS
    key = lambda t: (t[0], t[1])  # noqa: E731  (round, source rank)
    for (rn, sn, yn), (ri, si, yi) in zip(sorted(got_n, key=key), sorted(got_i, key=key)):
        assert (rn, sn) == (ri, si)
        assert yn.dtype == yi.dtype and yn.shape == yi.shape
        assert yn.numpy().tobytes() == yi.numpy().tobytes(), f"round {rn} from rank {sn}: nixl != inline"
    ref = {(r, j): _expert_fn(x, ids, w, j) for r, j, x, ids, w in sent_n}
    for r, j, y in got_n:
        torch.testing.assert_close(y, ref[(r, j)], rtol=0, atol=0)


def _dying_sender(addrs, q, go) -> None:
    ep = M2NEndpoint(M2NConfig(1, addrs, max_rows=8, timeout_s=20), DISPATCH, recv_layout=COMBINE,
                     transport=create_afd_transport("nixl"))
    q.put("attached")
    go.wait(60)
    ep.send(0, [torch.randn(8, H), torch.zeros(8, K, dtype=torch.int32), torch.rand(8, K)], meta=(1,))
    q.put("sent")
    time.sleep(60)  # killed by the test before rank 0 reads


@needs_nixl
def test_nixl_read_from_dead_peer_fails_closed():
    import torch.multiprocessing as mp

    addrs = _addrs(2)
    ctx = mp.get_context("spawn")
    q, go = ctx.Queue(), ctx.Event()
    ep = M2NEndpoint(M2NConfig(0, addrs, max_rows=8, timeout_s=3), COMBINE, recv_layout=DISPATCH,
                     transport=create_afd_transport("nixl"))
    p = ctx.Process(target=_dying_sender, args=(addrs, q, go))
    p.start()
    try:
        assert q.get(timeout=60) == "attached"
        with pytest.raises(TimeoutError):
            ep.recv(timeout_s=1.0)  # loads the sender's hello (connects its agent); no data yet
        assert 1 in ep.transport._peers
        go.set()
        assert q.get(timeout=30) == "sent"
        assert ep.poll(10_000), "the data header never arrived"
        p.kill()
        p.join(10)
        t0 = time.monotonic()
        with pytest.raises(ConnectionError, match="from rank 1") as err:
            ep.recv(timeout_s=3)
        took = time.monotonic() - t0
        print(f"dead-peer READ failed after {took:.2f} s: {err.value}")
        assert took < 15, "a READ from a dead peer must fail within the timeout"
    finally:
        if p.is_alive():
            p.kill()
        ep.close()


def _late_sender(addrs, q) -> None:
    ep = M2NEndpoint(M2NConfig(1, addrs, max_rows=8, timeout_s=20), DISPATCH, transport=create_afd_transport("nixl"))
    q.put("attached")
    time.sleep(60)  # killed by the test
    ep.close()


@needs_nixl
def test_nixl_hello_from_dead_peer_fails_closed():
    """A peer that dies between its hello and the receiver loading it: ConnectionError naming the rank."""
    import torch.multiprocessing as mp

    addrs = _addrs(2)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    ep = M2NEndpoint(M2NConfig(0, addrs, max_rows=8, timeout_s=3), DISPATCH, transport=create_afd_transport("nixl"))
    p = ctx.Process(target=_late_sender, args=(addrs, q))
    p.start()
    try:
        assert q.get(timeout=60) == "attached"
        assert ep.poll(10_000)
        p.kill()
        p.join(10)
        with pytest.raises(ConnectionError, match="rank 1"):
            ep.recv(timeout_s=3)
    finally:
        if p.is_alive():
            p.kill()
        ep.close()


@needs_nixl
def test_nixl_data_before_hello_is_refused():
    from sgl_kernel.m2n.nixl_transport import NixlTransport

    from sglang.srt.disaggregation.transfer.nixl_backend import m2n_read_agent

    ep = M2NEndpoint(M2NConfig(0, _addrs(2), max_rows=4, timeout_s=2), COMBINE, transport=NixlTransport(m2n_read_agent))
    try:
        out = ep.recv_buf[:16]
        with pytest.raises(RuntimeError, match="before its hello"):
            ep.transport.complete_recv(1, 0, 16, None, out)
    finally:
        ep.close()


def test_nixl_missing_names_the_extra(monkeypatch):
    """Where nixl does not import, attaching the transport raises ImportError naming the pd extra."""
    import sglang.srt.disaggregation.transfer.nixl_backend as nb
    from sgl_kernel.m2n.nixl_transport import NixlTransport

    def missing():
        raise ImportError("No module named 'nixl'")

    monkeypatch.setattr(nb, "import_nixl", missing)
    with pytest.raises(ImportError, match=r"pip install 'sglang\[pd\]'"):
        M2NEndpoint(M2NConfig(0, _addrs(1), max_rows=4), COMBINE, transport=NixlTransport(nb.m2n_read_agent))


def test_nixl_transport_needs_an_injected_agent():
    """sgl_kernel never imports sglang: without the injected NIXL agent factory the transport refuses at once."""
    with pytest.raises(ValueError, match="nixl_agent_factory|agent_factory"):
        create_transport("nixl")


def test_plain_m2n_import_does_not_import_nixl():
    import subprocess
    import sys

    code = ("import sys; from sglang.srt.afd.protocol import create_afd_transport; create_afd_transport('nixl'); "
            "assert not any(k == 'nixl' or k.startswith(('nixl.', 'nixl_cu')) for k in sys.modules), 'nixl imported'")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=os.environ)
    assert r.returncode == 0, r.stderr[-2000:]


def test_afd_transport_flag_accepts_nixl_and_refuses_it_without_nixl(monkeypatch):
    import sglang.srt.disaggregation.transfer.base as tb
    from sglang.srt.server_args import ServerArgs, prepare_server_args

    if not _WHY:
        a = prepare_server_args(["--enable-afd", "--afd-transport", "nixl"])
        assert a.afd_transport == "nixl"
    monkeypatch.setattr(tb, "nixl_available", lambda: (False, "No module named 'nixl'"))
    with pytest.raises(ValueError, match=r"afd-transport.*pip install 'sglang\[pd\]'"):
        ServerArgs(enable_afd=True, afd_transport="nixl")
    ServerArgs(afd_transport="nixl")  # ignored without --enable-afd


@needs_nixl
@pytest.mark.parametrize("why", ["timeout", "liveness"])
def test_nixl_pending_read_fails_closed(why):
    """A READ that never completes: ConnectionError naming the peer after ``timeout_s`` (or at once when ``alive()``
    turns False), never a hang. The stuck READ is simulated by NIXL reporting it in progress forever."""
    addrs = _addrs(2)
    state = {"alive": True}
    a = M2NEndpoint(M2NConfig(0, addrs, max_rows=8, timeout_s=1.0), COMBINE, transport=create_afd_transport("nixl"),
                    alive=lambda: state["alive"])
    b = M2NEndpoint(M2NConfig(1, addrs, max_rows=8, timeout_s=5), COMBINE, transport=create_afd_transport("nixl"))
    try:
        agent = a.transport.agent._agent
        agent.transfer = lambda handle: "PROC"  # posted, never done
        agent.check_xfer_state = lambda handle: "PROC"
        b.send(0, [torch.randn(5, H)])
        if why == "liveness":
            state["alive"] = False
        t0 = time.monotonic()
        with pytest.raises(ConnectionError, match="from rank 1") as err:
            a.recv(timeout_s=10)
        took = time.monotonic() - t0
        assert ("liveness" in str(err.value)) == (why == "liveness"), err.value
        assert ("within" in str(err.value)) == (why == "timeout"), err.value
        assert took < (0.9 if why == "liveness" else 5), took
        assert not a.transport.agent._pending, "the stuck READ was not released"
    finally:
        a.close()
        b.close()


def _streaming_peer(addrs, q) -> None:
    """Echo rank 0's rows + 1 back-to-back (each side READs the other's ring) until the test SIGKILLs it."""
    ep = M2NEndpoint(M2NConfig(1, addrs, max_rows=8, slots=4, timeout_s=30), COMBINE,
                     transport=create_afd_transport("nixl"))
    q.put("attached")
    while True:
        msg = ep.recv()
        ep.send(0, [msg.tensors[0] + 1], meta=msg.meta)


@needs_nixl
def test_nixl_peer_sigkilled_mid_stream_fails_closed_and_close_returns():
    """The 2-GPU killed-peer phase on CPU: a peer SIGKILLed while messages stream both ways (2 in flight). Rank 0's
    next receives fail (TimeoutError or ConnectionError) within the receive timeout, and ``close`` returns within
    seconds instead of waiting on the dead peer in NIXL/UCX teardown (on 2 H100s it once never returned)."""
    import signal

    import torch.multiprocessing as mp

    addrs = _addrs(2)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    ep = M2NEndpoint(M2NConfig(0, addrs, max_rows=8, slots=4, timeout_s=3), COMBINE,
                     transport=create_afd_transport("nixl"))
    p = ctx.Process(target=_streaming_peer, args=(addrs, q))
    p.start()
    closed = False
    try:
        assert q.get(timeout=60) == "attached"
        g = torch.Generator().manual_seed(5)
        xs, got, sent, killed, err = {}, 0, 0, None, None
        while err is None:
            while sent - got < 2:
                xs[sent] = torch.randn(1 + sent % 8, H, generator=g)
                ep.send(1, [xs[sent]], meta=(sent,))
                sent += 1
            try:
                msg = ep.recv(timeout_s=3)
            except (TimeoutError, ConnectionError) as e:
                err = e
                break
            j = msg.meta[0]
            torch.testing.assert_close(msg.tensors[0], xs.pop(j) + 1, rtol=0, atol=0)
            got += 1
            if got == 200:
                os.kill(p.pid, signal.SIGKILL)  # mid-stream: a message is in flight each way
                killed = time.monotonic()
            assert got < 400, "messages still arrive long after the peer was killed"
        took = time.monotonic() - killed
        assert killed is not None and took < 10, (took, err)
        t0 = time.monotonic()
        ep.close()
        closed = True
        assert time.monotonic() - t0 < 5, f"close after the killed peer took {time.monotonic() - t0:.1f} s"
    finally:
        if p.is_alive():
            p.kill()
        p.join(10)
        if not closed:
            ep.close()


@needs_nixl
def test_nixl_close_after_fault_makes_no_teardown_call():
    """After a receive timeout (a peer may be dead) ``close`` abandons the agent: no NIXL call that could wait on a
    dead peer (remote-agent removal, transfer release, deregistration); a clean group still tears down fully."""
    addrs = _addrs(2)
    a = M2NEndpoint(M2NConfig(0, addrs, max_rows=8, timeout_s=2), COMBINE, transport=create_afd_transport("nixl"))
    b = M2NEndpoint(M2NConfig(1, addrs, max_rows=8, timeout_s=2), COMBINE, transport=create_afd_transport("nixl"))
    calls = []
    try:
        b.send(0, [torch.randn(3, H)])
        assert a.recv(timeout_s=5).tensors[0].shape == (3, H)  # a has loaded b's agent and READ from it
        with pytest.raises(TimeoutError):
            a.recv(timeout_s=0.3)
        backend = a.transport.agent
        for name in ("remove_remote_agent", "deregister_memory", "release_xfer_handle"):
            setattr(backend._agent, name, lambda *args, _n=name: calls.append(_n))
        t0 = time.monotonic()
        a.close()
        assert calls == [] and time.monotonic() - t0 < 1.0, calls
        assert backend._closed and a.transport.agent is None
    finally:
        a.close()
        b_backend = b.transport.agent
        b.close()  # no fault on b: the ordinary teardown (deregistration) ran
        assert b_backend._closed and not b_backend._reg_dlists
