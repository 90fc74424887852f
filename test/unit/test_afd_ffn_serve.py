"""FFN worker ``serve_once`` with a transport control message waiting behind a DISPATCH: it answers the DISPATCH
and returns at once (before the fix it kept waiting up to the endpoint's whole timeout for a data message behind the
control one); ``M2NEndpoint.recv_nowait`` handles control messages and returns None without waiting or faulting."""

from __future__ import annotations

import os
import sys
import tempfile
import time

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from conftest import shared_path  # noqa: E402

from sgl_kernel.m2n import M2NConfig, M2NEndpoint, RowLayout  # noqa: E402
from sgl_kernel.m2n.base import HEADER_LEN  # noqa: E402

from sglang.srt.afd.experts import moe_layer_specs  # noqa: E402
from sglang.srt.afd.ffn_worker import FfnServer  # noqa: E402
from sglang.srt.afd.protocol import DISPATCH, RESULT, AfdTopology, dispatch_layout, result_layout  # noqa: E402
from sglang.srt.configs.model_config import ModelConfig  # noqa: E402

KIND_TRANSPORT = 7  # neither data nor close: a transport's own control message (ignored by the inline transport)


def _control_frames(src: int) -> list[bytes]:
    header = np.zeros(HEADER_LEN, dtype=np.int64)
    header[:2] = (KIND_TRANSPORT, src)
    return [header.tobytes(), b"handles"]


def test_recv_nowait_skips_control_and_never_waits():
    d = tempfile.mkdtemp(prefix="m2n-nowait-")
    addrs = (f"ipc://{d}/0", f"ipc://{d}/1")
    lay = RowLayout(((torch.float32, 4),))
    a = M2NEndpoint(M2NConfig(0, addrs, 4, timeout_s=30), lay)
    b = M2NEndpoint(M2NConfig(1, addrs, 4, timeout_s=30), lay)
    try:
        assert b.recv_nowait() is None
        a.send_control(1, _control_frames(0))
        x = torch.randn(3, 4)
        a.send(1, [x], (5,))
        a.send_control(1, _control_frames(0))
        deadline = time.monotonic() + 5
        while not b.poll(10) and time.monotonic() < deadline:
            pass
        t0 = time.monotonic()
        msg = None
        while msg is None and time.monotonic() < deadline:
            msg = b.recv_nowait()
        assert msg is not None and msg.meta[0] == 5 and torch.equal(msg.tensors[0], x)
        time.sleep(0.1)  # the trailing control message is in the inbox now
        assert b.recv_nowait() is None
        assert time.monotonic() - t0 < 2.0
    finally:
        a.close()
        b.close()


def test_serve_once_returns_with_only_a_control_message_waiting():
    mc = ModelConfig.from_path(shared_path("models", "stories260K-moe"))
    specs = moe_layer_specs(mc)
    s0 = specs[0]
    d = tempfile.mkdtemp(prefix="afd-serve-")
    topo = AfdTopology(1, 1, (f"ipc://{d}/0", f"ipc://{d}/1"), max_rows=16, timeout_s=30)
    server = FfnServer(mc, specs, list(range(s0.num_experts)), "auto", torch.device("cpu"), topo, 0)
    att = M2NEndpoint(M2NConfig(0, topo.addresses, 16, timeout_s=30), dispatch_layout(s0.hidden, s0.top_k, mc.dtype),
                      recv_layout=result_layout(s0.hidden, mc.dtype))
    try:
        n = 5
        x = torch.randn(n, s0.hidden, dtype=mc.dtype)
        ids = torch.randint(0, s0.num_experts, (n, s0.top_k), dtype=torch.int32)
        w = torch.rand(n, s0.top_k)
        att.send(1, [x, ids, w], (DISPATCH, s0.layer, 1, 0))
        att.send_control(1, _control_frames(0))
        time.sleep(0.2)  # both are in the FFN worker's inbox before it looks
        t0 = time.monotonic()
        assert server.serve_once(timeout_s=5.0)
        assert time.monotonic() - t0 < 3.0, "serve_once waited for data behind a control message"
        reply = att.recv(timeout_s=5)
        assert reply.meta[:3] == (RESULT, s0.layer, 1) and reply.tensors[0].shape == (n, s0.hidden)
        ref = server.shards[s0.layer].compute(x, ids, w)
        assert torch.allclose(reply.tensors[0], ref)
    finally:
        att.close()
        server.ep.close()


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q", "-x"]))
