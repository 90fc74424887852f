"""Host logic of the ``cuda_push`` M2N transport in one process on CPU (run under TRITON_INTERPRET=1 by
test_m2n_push.py): a stand-in for the CUDA platform (driver calls become memmove / 64-bit stores on CPU memory,
IPC handles are addresses), two endpoints talking over ZMQ, the real receive kernel under the interpreter. Checks
bytes against the sent tensors over random row counts incl. 0 (host-header and device-driven paths, more messages
than slots so the ack waits run), data read while waiting for a peer's handles is kept in order, and a receive
that is never sent fails closed (``check()`` raises TimeoutError); all again with a driver that refuses stream
memory operations (flags by the fallback kernel). Prints OK."""

from __future__ import annotations

import contextlib
import ctypes
import tempfile

import numpy as np
import torch

from sgl_kernel.m2n import M2NConfig, M2NEndpoint, RowLayout
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

    def memcpy_async(self, dst, src, n, stream):
        ctypes.memmove(dst, src, n)

    def stream_write_value64(self, addr, v, stream):
        ctypes.c_int64.from_address(addr).value = v


class NoStreamOpsDriver(SimDriver):
    """A driver that refuses stream memory operations: the transport must fall back to its flag kernel."""

    def stream_write_value64(self, addr, v, stream):
        raise RuntimeError("cuStreamWriteValue64 failed: CUresult 801 (operation not supported)")


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


def main(driver):
    g = torch.Generator().manual_seed(5)
    lay = RowLayout(((torch.bfloat16, 10), (torch.int32, 3), (torch.float32, 2)))
    max_rows, slots = 12, 2
    d = tempfile.mkdtemp(prefix="m2n-push-sim-")
    addrs = (f"ipc://{d}/0", f"ipc://{d}/1")
    plat = SimPlatform(driver)
    eps = [M2NEndpoint(M2NConfig(r, addrs, max_rows, slots=slots, timeout_s=10), lay,
                       transport=CudaPushTransport(wait_timeout_s=1.0, platform=plat)) for r in range(2)]

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
    # a message that never comes: the bounded device wait records it, check() raises
    eps[0].recv_device(1)
    try:
        eps[0].check()
        raise AssertionError("check() did not raise")
    except TimeoutError as e:
        assert "m2n_recv_kernel" in str(e), e
    assert all(ep.transport._flag_kernel == isinstance(driver, NoStreamOpsDriver) for ep in eps)
    for ep in eps:
        ep.close()


if __name__ == "__main__":
    main(SimDriver())
    main(NoStreamOpsDriver())  # flags written by the fallback kernel
    print("OK")
