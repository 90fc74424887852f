"""AFD on ONE GPU: the M2N CUDA-IPC transport between two processes on the same GPU (and the NIXL
transport, VRAM READs over UCX, where nixl imports) equals a torch reference on random variable-size
dispatch/combine round trips (stream-ordered: no host sync on the data), the NCCL-baseline transport too where
NCCL allows it, and an AFD server whose attention and FFN workers are separate processes on the one GPU gives the
colocated engine's greedy tokens on stories260K-moe."""

from __future__ import annotations

import os
import sys
import tempfile

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "unit"))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "integration"))
from conftest import gpu_tiered  # noqa: E402


H, K = 512, 4


def _expert(x, ids, w, j):
    return x * ((ids.float() + 1 + j) * w).sum(1, keepdim=True).to(x.dtype) + torch.tanh(x) * j


def _rank(rank: int, addrs, transport: str, rounds: int, q) -> None:
    from sgl_kernel.m2n import M2NConfig, M2NEndpoint, RowLayout

    from sglang.srt.afd.protocol import create_afd_transport

    torch.cuda.set_device(0)
    disp = RowLayout(((torch.bfloat16, H), (torch.int32, K), (torch.float32, K)))
    comb = RowLayout(((torch.bfloat16, H),))
    try:
        if rank == 0:
            ep = M2NEndpoint(M2NConfig(0, addrs, 512, device="cuda:0", timeout_s=60), disp, comb,
                             transport=create_afd_transport(transport))
            g = torch.Generator(device="cuda").manual_seed(1)
            worst = 0.0
            for r in range(rounds):
                n = int(torch.randint(0, 513, (1,)))
                x = torch.randn(n, H, device="cuda", generator=g).bfloat16()
                ids = torch.randint(0, 8, (n, K), device="cuda", dtype=torch.int32, generator=g)
                w = torch.rand(n, K, device="cuda", generator=g)
                ep.send(1, [x, ids, w], (r,))
                msg = ep.recv()
                assert msg.meta[0] == r
                worst = max(worst, (msg.tensors[0].float() - _expert(x, ids, w, 1).float()).abs().max().item()
                            if n else 0.0)
            q.put(("ok", worst))
            ep.close(notify=[1])
        else:
            ep = M2NEndpoint(M2NConfig(1, addrs, 512, device="cuda:0", timeout_s=60), comb, disp,
                             transport=create_afd_transport(transport))
            try:
                while True:
                    msg = ep.recv()
                    x, ids, w = msg.tensors
                    ep.send(0, [_expert(x, ids, w, 1)], msg.meta)
            except ConnectionError:
                pass
            ep.close()
    except Exception as e:  # reported to the test
        q.put(("error", repr(e)))


@pytest.mark.parametrize("transport", gpu_tiered(["cuda_ipc", "inline", "nixl"]))
def test_m2n_gpu_round_trips_equal_reference(transport):
    import torch.multiprocessing as mp

    if transport == "nixl":  # NIXL READ VRAM -> VRAM (UCX cuda_ipc / cuda_copy); the pd extra provides it
        from sglang.srt.disaggregation.transfer.base import nixl_available

        ok, why = nixl_available()
        if not ok:
            pytest.skip(f"nixl does not import ({why}); pip install 'sglang[pd]'")

    d = tempfile.mkdtemp()
    addrs = (f"ipc://{d}/0", f"ipc://{d}/1")
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    ps = [ctx.Process(target=_rank, args=(r, addrs, transport, 200, q)) for r in range(2)]
    for p in ps:
        p.start()
    status, val = q.get(timeout=300)
    for p in ps:
        p.join(60)
        if p.is_alive():
            p.kill()
    assert status == "ok", val
    assert val == 0.0, f"{transport}: max diff {val}"


@pytest.mark.gpu_extended
def test_afd_server_one_gpu_greedy_equals_colocated():
    from conftest import shared_path
    from server_utils import ServerProcess
    from test_afd_server import PROMPTS, N_NEW, generate
    from test_tp_cpu import tokenize, tp1_greedy

    path = shared_path("models", "stories260K-moe")
    with ServerProcess(["--model-path", path, "--device", "cuda", "--enable-afd", "--afd-ffn-workers", "2",
                        "--afd-micro-batches", "2", "--tp-ranks-share-gpu", "--dtype", "float32",
                        "--attention-backend", "torch_native"]) as s:
        out = generate(s, {"text": PROMPTS, "sampling_params": {"temperature": 0, "max_new_tokens": N_NEW,
                                                                "ignore_eos": True}})
        for p, o in zip(PROMPTS, out):
            assert o["output_ids"] == tp1_greedy(path, tokenize(path, p), N_NEW), p
        assert "M2N transport cuda_ipc" in s.log_tail(400)
