"""Transfer backends across two real processes (nixl when it imports, and fake): one-sided reads of random
non-contiguous ranges return the source bytes, writes land, notifications flow both ways, and a peer that
dies or freezes mid-transfer turns transfers into FAILED within the timeout, never a hang."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

from sglang.srt.disaggregation.transfer import (MemRegion, ReadOp, TransferConfig, TransferError, TransferState,
                                                make_transfer_backend)
from sglang.srt.disaggregation.transfer.base import nixl_available
from transfer_peer import Peer, peer_buffer

pytestmark = pytest.mark.timeout(300)  # a hang fails the test instead of CI
NBYTES = 1 << 20
_NIXL_OK, _NIXL_WHY = nixl_available()
BACKENDS = ["fake", pytest.param("nixl", marks=pytest.mark.skipif(not _NIXL_OK, reason=f"nixl: {_NIXL_WHY}"))]


def _random_ops(rng, remote_base, local_base, n, nbytes=NBYTES):
    """``n`` non-overlapping ranges at random offsets on both sides (random order, random sizes)."""
    cuts = np.sort(rng.choice(np.arange(1, nbytes // 64), 2 * n, replace=False)) * 64
    spans = [(int(a), int(b - a)) for a, b in zip(cuts[0::2], cuts[1::2])]
    ops, off = [], 0
    for i in rng.permutation(len(spans)):  # packed locally in a shuffled order, with 64-byte gaps
        a, s = spans[i]
        ops.append(ReadOp(remote_base + a, local_base + off, s))
        off += s + 64
    assert off <= nbytes
    return ops


def _pair(backend):
    peer = Peer(backend, "prefill0", seed=7, nbytes=NBYTES, timeout_s=2.0)
    me = make_transfer_backend(backend, "decode0", TransferConfig(transfer_timeout_s=2.0, connect_timeout_s=2.0))
    local = np.zeros(NBYTES, dtype=np.uint8)
    me.register([MemRegion(local.ctypes.data, NBYTES, "cpu")])
    me.connect("prefill0", peer.metadata)
    me.connect("prefill0", peer.metadata)  # idempotent
    peer.call("connect", "decode0", me.local_metadata())
    return backend, peer, me, local


@pytest.fixture(scope="module", params=BACKENDS)
def setup(request):
    """One live pair per backend, shared by the non-destructive tests (agent start-up is slow)."""
    pair = _pair(request.param)
    yield pair
    pair[2].close()
    pair[1].stop()


@pytest.fixture
def fresh(request):
    pair = _pair(request.param)
    yield pair
    pair[2].close()
    pair[1].stop()


def test_read_noncontiguous_equals_source(setup):
    backend, peer, me, local = setup
    src = peer_buffer(7, NBYTES)
    rng = np.random.default_rng(1)
    for rnd in range(3):
        local[:] = 0
        ops = _random_ops(rng, peer.src_addr, local.ctypes.data, n=50)
        h = me.read("prefill0", ops, notif=b"COMPLETE:%d" % rnd)
        assert me.wait(h, 10) is TransferState.DONE, h.error
        assert h.nbytes == sum(o.nbytes for o in ops) and h.num_ops == 50
        for o in ops:
            lo, ro = o.local_addr - local.ctypes.data, o.remote_addr - peer.src_addr
            assert np.array_equal(local[lo:lo + o.nbytes], src[ro:ro + o.nbytes])
        assert peer.call("notifs", 5.0, 1) == {"decode0": [b"COMPLETE:%d" % rnd]}  # notif after the data


def test_write_mode_and_notifs(setup):
    backend, peer, me, local = setup
    local[:] = np.random.default_rng(3).integers(0, 256, NBYTES, dtype=np.uint8)
    ops = _random_ops(np.random.default_rng(4), peer.scratch_addr, local.ctypes.data, n=20)
    h = me.write("prefill0", np.array([(o.remote_addr, o.local_addr, o.nbytes) for o in ops]), notif=b"W")
    assert me.wait(h, 10) is TransferState.DONE, h.error
    assert peer.call("notifs", 5.0, 1) == {"decode0": [b"W"]}
    for o in ops:
        lo = o.local_addr - local.ctypes.data
        assert peer.call("peek", o.remote_addr - peer.scratch_addr, o.nbytes) == local[lo:lo + o.nbytes].tobytes()
    me.send_notif("prefill0", b"C|1")
    me.send_notif("prefill0", b"C|2")
    assert peer.call("notifs", 5.0, 2) == {"decode0": [b"C|1", b"C|2"]}  # in order
    peer.call("send_notif", "decode0", b"A|1")
    got, end = {}, time.monotonic() + 5
    while not got and time.monotonic() < end:
        got = me.get_notifs()
        time.sleep(0.005)
    assert got == {"prefill0": [b"A|1"]}


def test_bad_requests_rejected(setup):
    backend, peer, me, local = setup
    with pytest.raises(ValueError, match="registered"):
        me.read("prefill0", [ReadOp(peer.src_addr, 12345, 8)])
    with pytest.raises(ValueError, match="empty"):
        me.read("prefill0", [])
    with pytest.raises(TransferError, match="unknown peer"):
        me.read("nobody", [ReadOp(peer.src_addr, local.ctypes.data, 8)])
    with pytest.raises(TransferError):
        me.connect("other", peer.metadata)  # metadata names prefill0
    if backend == "fake":  # the fake target checks remote ranges; nixl/UCX rejects them at post
        h = me.read("prefill0", [ReadOp(16, local.ctypes.data, 8)])
        assert me.wait(h, 10) is TransferState.FAILED and "registered" in h.error
    with pytest.raises(ValueError):
        make_transfer_backend("rdma", "x")


_NIXL_SKIP = pytest.mark.skipif(not _NIXL_OK, reason=f"nixl: {_NIXL_WHY}")


@pytest.mark.parametrize("fresh,sig", [("fake", signal.SIGKILL), ("fake", signal.SIGSTOP),
                                       pytest.param("nixl", signal.SIGKILL, marks=_NIXL_SKIP),
                                       pytest.param("nixl", signal.SIGSTOP, marks=_NIXL_SKIP)],
                         indirect=["fresh"])
def test_peer_dies_mid_transfer_fails_closed(fresh, sig):
    """Reads in flight when the peer is SIGKILLed/SIGSTOPped end DONE or FAILED within the timeout; later
    reads of a dead peer are FAILED. (A stopped peer can still be read one-sidedly by nixl: DONE is fine.)"""
    backend, peer, me, local = fresh
    ops = [ReadOp(peer.src_addr + i * 4096, local.ctypes.data + i * 4096, 2048) for i in range(NBYTES // 4096)]
    handles = [me.read("prefill0", ops) for _ in range(4)]
    os.kill(peer.proc.pid, sig)
    handles += [me.read("prefill0", ops) for _ in range(4)]
    t0 = time.monotonic()
    try:
        states = [me.wait(h, timeout_s=20) for h in handles]
        assert time.monotonic() - t0 < 10  # transfer_timeout_s=2 bounds every handle
        assert all(s in (TransferState.DONE, TransferState.FAILED) for s in states)
        if sig == signal.SIGKILL or backend == "fake":
            time.sleep(0.2)
            late = me.read("prefill0", ops)
            assert me.wait(late, timeout_s=20) is TransferState.FAILED and late.error
    finally:
        if sig == signal.SIGSTOP:
            os.kill(peer.proc.pid, signal.SIGCONT)


def test_ucx_env_defaults_only_where_unset(monkeypatch):
    """The nixl transport's UCX defaults fill only variables the user left unset, and nothing without a CUDA driver
    (UCX would warn that a cuda_ipc variable is unused)."""
    import ctypes.util

    from sglang.srt.disaggregation.transfer import nixl_backend as nb

    key, sgl = "UCX_CUDA_IPC_ENABLE_GET_ZCOPY", "NIXL_UCX_SGL_ENABLE"
    assert nb.UCX_ENV_DEFAULTS == {key: "on", sgl: "1"}
    monkeypatch.setattr(ctypes.util, "find_library", lambda name: "libcuda.so.1" if name == "cuda" else None)
    env = {"UCX_TLS": "cuda_ipc,cuda_copy,tcp,self"}
    assert nb.apply_ucx_env_defaults(env) == {key: "on", sgl: "1"}
    assert env == {"UCX_TLS": "cuda_ipc,cuda_copy,tcp,self", key: "on", sgl: "1"}
    user = {key: "auto", sgl: "0"}
    assert nb.apply_ucx_env_defaults(user) == {} and user == {key: "auto", sgl: "0"}
    half = {sgl: "0"}
    assert nb.apply_ucx_env_defaults(half) == {key: "on"} and half == {key: "on", sgl: "0"}
    monkeypatch.setattr(ctypes.util, "find_library", lambda name: None)
    empty: dict = {}
    assert nb.apply_ucx_env_defaults(empty) == {} and empty == {}


def test_nixl_threads_flag_reaches_the_transfer_config(monkeypatch):
    """--disaggregation-nixl-threads: negative values are refused naming the flag; N > 0 gives the agent's
    TransferConfig N UCX threads and a split batch, 0 leaves NIXL's defaults."""
    from sglang.srt.disaggregation import agent as ag
    from sglang.srt.disaggregation.transfer import base
    from sglang.srt.server_args import ServerArgs

    with pytest.raises(ValueError, match="disaggregation-nixl-threads"):
        ServerArgs(model_path="x", disaggregation_nixl_threads=-1)
    with pytest.raises(ValueError, match="nixl_num_threads"):
        TransferConfig(nixl_num_threads=-2)
    seen = []
    monkeypatch.setattr(base, "make_transfer_backend", lambda name, agent, cfg: seen.append(cfg) or 1 / 0)
    for threads in (4, 0):
        args = ServerArgs(model_path="x", disaggregation_mode="decode", disaggregation_nixl_threads=threads)
        kv = type("KV", (), {"describe": lambda self: None})()
        with pytest.raises(ZeroDivisionError):
            ag.DisaggAgent(args, kv, 0, 1, 8)
    assert [(c.nixl_num_threads, c.nixl_split_batch_size) for c in seen] == [(4, ag.NIXL_SPLIT_BATCH), (0, 0)]
