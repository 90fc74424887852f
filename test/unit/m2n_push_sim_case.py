"""Host logic of the ``cuda_push`` M2N transport in one process on CPU (run under TRITON_INTERPRET=1 by
test_m2n_push.py): a stand-in for the CUDA platform (driver calls become memmove / 64-bit stores on CPU memory,
IPC handles are addresses), two endpoints talking over ZMQ, the real receive kernel under the interpreter. Checks
bytes against the sent tensors over random row counts incl. 0 (host-header and device-driven paths, more messages
than slots so the ack waits run), data read while waiting for a peer's handles is kept in order, and a receive
that is never sent fails closed (``check()`` raises TimeoutError); a device row count (``send(rows=...)``) sends
only that many rows; the device sequence counters match the messages sent / received; one-column messages go
without the staging pack; consecutive device-path messages launch with identical arguments (what makes a captured
CUDA graph replayable). ``--broken-counter``: the
receiver's device counter is rewound after every receive (a kernel that forgot to advance it): the checks must then
fail (prints BROKEN-DETECTED). Prints OK."""

from __future__ import annotations

import contextlib
import ctypes
import sys
import tempfile

import numpy as np
import torch

from sgl_kernel.m2n import M2NConfig, M2NEndpoint, RowLayout, ll_kernels, push_kernels
from sgl_kernel.m2n.cuda_push import CudaPushTransport


class SimDriver:
    """sgl_kernel.tdist.cuda_ipc's calls on CPU memory of this process."""

    def __init__(self):
        self.bufs = {}

    def mem_alloc(self, n):
        t = torch.zeros(n + 512, dtype=torch.uint8)
        p = t.data_ptr() + (-t.data_ptr()) % 512
        self.bufs[p] = (t, p - t.data_ptr(), n)
        return p

    def memset_d8(self, p, v, n):
        ctypes.memset(p, v, n)

    def ipc_get_handle(self, p):
        return p.to_bytes(64, "little")

    def ipc_open(self, h):
        return int.from_bytes(h, "little")

    def ipc_close(self, p):
        pass

    def mem_free(self, p):
        self.bufs.pop(p)



class BrokenCounterTransport(CudaPushTransport):
    """A receive that does not advance its device sequence counter (the deliberate bug the checks must catch)."""

    def _recv_into(self, src, cap_rows, grid_bytes):
        ctr = self.ll_ctr[1, src] if self.protocol == "ll" else self.ctr[self.ep.world + src:self.ep.world + src + 1]
        before = ctr.clone()
        super()._recv_into(src, cap_rows, grid_bytes)
        ctr.copy_(before)


class SimPlatform:
    def __init__(self, driver):
        self.driver = driver

    def check(self, device):
        return 0

    def context(self, dev):
        return contextlib.nullcontext()

    def stream(self, dev):
        return 0

    def tensor(self, ptr, n, dev):
        t, skip, _ = self.driver.bufs[ptr]
        return t[skip:skip + n]


def _sent(tr, peer):
    """Messages ``tr`` sent to ``peer`` per its device counters (LL: every program's counter; -1 if they differ)."""
    if tr.protocol == "flag":
        return int(tr.ctr[peer])
    v = set(tr.ll_ctr[0, peer, :tr._peers[peer]["grid"]].tolist())
    return v.pop() if len(v) == 1 else -1


def _received(tr, src):
    """Messages ``tr`` received from ``src`` per its device counters (LL: every program's; -1 if they differ)."""
    if tr.protocol == "flag":
        return int(tr.ctr[tr.ep.world + src])
    v = set(tr.ll_ctr[1, src, :tr.grid].tolist())
    return v.pop() if len(v) == 1 else -1


def main(driver, transport_cls=CudaPushTransport, protocol="flag"):
    g = torch.Generator().manual_seed(5)
    lay = RowLayout(((torch.bfloat16, 10), (torch.int32, 3), (torch.float32, 2)))
    max_rows, slots = 12, 2
    d = tempfile.mkdtemp(prefix="m2n-push-sim-")
    addrs = (f"ipc://{d}/0", f"ipc://{d}/1")
    plat = SimPlatform(driver)
    eps = [M2NEndpoint(M2NConfig(r, addrs, max_rows, slots=slots, timeout_s=10), lay,
                       transport=transport_cls(wait_timeout_s=1.0, platform=plat, protocol=protocol)) if r == 1 else
           M2NEndpoint(M2NConfig(r, addrs, max_rows, slots=slots, timeout_s=10), lay,
                       transport=CudaPushTransport(wait_timeout_s=1.0, platform=plat, protocol=protocol))
           for r in range(2)]

    def msg(n):
        return [torch.randn(n, 10, generator=g).bfloat16(),
                torch.randint(-50, 50, (n, 3), dtype=torch.int32, generator=g), torch.rand(n, 2, generator=g)]

    # rank 1 sends first while rank 0's data is already in its inbox: the data is kept (stash) for recv()
    first = msg(3)
    eps[0].send(1, first, (9, 1))
    back = msg(2)
    eps[1].send(0, back, (9, 2))
    m = eps[1].recv()
    assert m.src == 0 and m.meta[:2] == (9, 1) and all(torch.equal(a, b) for a, b in zip(m.tensors, first))
    m = eps[0].recv()
    assert m.src == 1 and m.meta[:2] == (9, 2) and all(torch.equal(a, b) for a, b in zip(m.tensors, back))
    sizes = [0, max_rows, 1] + np.random.default_rng(1).integers(0, max_rows + 1, 9).tolist()
    for i, n in enumerate(sizes):  # ping-pong, both paths, more messages than slots (the ack waits run)
        src, dst = i % 2, 1 - i % 2
        t = msg(n)
        if i % 3 == 2:  # device-driven: no host message, rows from the flag word, fixed max_rows offsets
            eps[src].send(dst, t, host_header=False)
            dm = eps[dst].recv_device(src)
            assert int(dm.rows) == n, (int(dm.rows), n)
            assert all(torch.equal(a[:n], b) and a.shape[0] == max_rows for a, b in zip(dm.tensors, t))
        else:
            eps[src].send(dst, t, (i,))
            m = eps[dst].recv()
            assert m.src == src and m.meta[0] == i and all(torch.equal(a, b) for a, b in zip(m.tensors, t)), i
    for ep in eps:
        ep.check()
    # a device row count: only the first k of the n packed rows travel (clamped to [0, n])
    for n, k in ((7, 3), (5, 0), (4, 9)):
        t = msg(n)
        eps[0].send(1, t, host_header=False, rows=torch.tensor([k], dtype=torch.int64))
        dm = eps[1].recv_device(0)
        k = min(k, n)
        assert int(dm.rows) == k and all(torch.equal(a[:k], b[:k]) for a, b in zip(dm.tensors, t)), (n, k)
    w = eps[0].world
    sent = [sum(1 for i in range(len(sizes)) if i % 2 == s_) + 1 for s_ in range(2)]  # + first / back
    sent[0] += 3
    t0, t1 = eps[0].transport, eps[1].transport
    assert _sent(t0, 1) == sent[0] and _received(t1, 0) == sent[0], (sent, _sent(t0, 1), _received(t1, 0))
    assert _sent(t1, 0) == sent[1] and _received(t0, 1) == sent[1], sent
    if protocol == "flag":
        assert not t0.ctr[2 * w:].any() and not t1.ctr[2 * w:].any()  # arrivals reset
    # a message that never comes: the bounded device wait records it, check() raises
    eps[0].recv_device(1)
    try:
        eps[0].check()
        raise AssertionError("check() did not raise")
    except TimeoutError as e:
        assert ("m2n_ll_recv_kernel" if protocol == "ll" else "m2n_recv_kernel") in str(e), e
    for ep in eps:
        ep.close()


def one_column(driver, protocol="flag"):
    """A one-column layout: contiguous aligned messages go to the peer without the staging pack (the direct view),
    others (a strided tensor, 0 rows) through it; bytes, row counts and counters as on the packed path."""
    g = torch.Generator().manual_seed(6)
    lay = RowLayout(((torch.float32, 4),))
    d = tempfile.mkdtemp(prefix="m2n-push-sim1-")
    addrs = (f"ipc://{d}/0", f"ipc://{d}/1")
    eps = [M2NEndpoint(M2NConfig(r, addrs, 10, slots=2, timeout_s=10), lay,
                       transport=CudaPushTransport(wait_timeout_s=1.0, platform=SimPlatform(driver),
                                                   protocol=protocol)) for r in range(2)]
    cases = [(5, False, None), (0, False, None), (7, True, None), (10, False, 4), (3, False, 0), (6, False, None)]
    for i, (n, strided, k) in enumerate(cases):
        t = torch.randn(n, 8, generator=g)[:, ::2] if strided else torch.randn(n, 4, generator=g)
        assert (eps[0]._direct_view([t]) is not None) == (n > 0 and not strided), (n, strided)
        kk = n if k is None else min(k, n)
        eps[0].send(1, [t], host_header=False, rows=None if k is None else torch.tensor([k]))
        dm = eps[1].recv_device(0)
        assert int(dm.rows) == kk and torch.equal(dm.tensors[0][:kk], t[:kk]), (i, n, k)
        eps[1].send(0, [dm.tensors[0][:kk].clone()], (i,))  # host-header path back
        m = eps[0].recv()
        assert m.meta[0] == i and torch.equal(m.tensors[0], t[:kk]), i
    assert _sent(eps[0].transport, 1) == len(cases) == _received(eps[1].transport, 0)
    # graph capturability: consecutive device-path messages launch with identical arguments (a replay of a captured
    # launch is correct because the counters, not the arguments, carry the sequence)
    mod = ll_kernels if protocol == "ll" else push_kernels
    names = ("launch_ll_send", "launch_ll_recv") if protocol == "ll" else ("launch_send", "launch_recv")
    calls, real = [], {n: getattr(mod, n) for n in names}

    def recorder(name):
        def rec(*args, **kw):
            calls.append((name, tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args)))
            return real[name](*args, **kw)
        return rec

    for name in real:
        setattr(mod, name, recorder(name))
    t, k = torch.randn(6, 4, generator=g), torch.tensor([4])
    try:
        for _ in range(3):  # more messages than slots: the slot and the expected flag change, the arguments do not
            eps[0].send(1, [t], host_header=False, rows=k)
            dm = eps[1].recv_device(0)
            assert int(dm.rows) == 4 and torch.equal(dm.tensors[0][:4], t[:4])
    finally:
        for name, fn in real.items():
            setattr(mod, name, fn)
    sends = [c for c in calls if c[0] == names[0]]
    recvs = [c for c in calls if c[0] == names[1]]
    assert len(sends) == len(recvs) == 3 and len(set(sends)) == 1 and len(set(recvs)) == 1, calls
    for ep in eps:
        ep.check()
        ep.close()


if __name__ == "__main__":
    if "--broken-counter" in sys.argv:
        try:
            main(SimDriver(), BrokenCounterTransport, "ll" if "--ll" in sys.argv else "flag")
        except AssertionError as e:
            print(f"BROKEN-DETECTED {e!r}"[:300])
        sys.exit(0)
    proto = "ll" if "--ll" in sys.argv else "flag"
    main(SimDriver(), protocol=proto)
    one_column(SimDriver(), protocol=proto)
    print("OK")
