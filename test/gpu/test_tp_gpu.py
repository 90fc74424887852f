"""GPU tensor parallelism (needs >= 2 GPUs): the communicators on NCCL / symmetric memory, and a TP=2 server
whose fp32 greedy tokens equal TP=1's on stories260K.

Run: ``python -m pytest -q -m gpu test/gpu/test_tp_gpu.py`` (the NVLink-multicast-off environment is set by
conftest.py and server_utils.ENV).
"""

from __future__ import annotations

import os
import sys

import pytest
import requests

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "unit"))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "integration"))
from conftest import shared_path  # noqa: E402
from server_utils import ServerProcess  # noqa: E402

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                                  reason="needs at least 2 CUDA GPUs")]


def _comm_check(ps, seed: int) -> dict:
    import torch

    from sglang.srt.distributed.communicator import TorchCommunicator, create_communicator

    dev = ps.torch_device()
    custom = create_communicator(ps, "auto")
    nccl = TorchCommunicator.create(ps)
    out = {"describe": custom.describe()}
    for numel in (8192, 1 << 18, 1 << 22, 3 << 22):  # one-shot, two-shot, NCCL fallback sizes
        g = torch.Generator(device=dev).manual_seed(seed + ps.tp_rank * 7 + numel)
        x = torch.randn(numel, generator=g, device=dev).to(torch.bfloat16)
        ref = nccl.all_reduce(x.float().clone())
        got = custom.all_reduce(x.clone())
        out[numel] = float((got.float() - ref).abs().max() / (ref.abs().max() + 1e-6))
    x = torch.randn(16, 64, device=dev)
    out["gather"] = custom.all_gather(x, dim=-1).shape
    return out


@pytest.mark.gpu
def test_custom_all_reduce_matches_nccl():
    from tp_worker import spawn_ranks

    seed = int.from_bytes(os.urandom(2), "little")
    results = spawn_ranks(_comm_check, 2, seed, device="cuda", timeout=300)
    for r in results:
        print(r["describe"])
        assert r["gather"] == (16, 128)
        for numel in (8192, 1 << 18, 1 << 22, 3 << 22):
            assert r[numel] < 2e-2, (numel, r)  # bf16 sums vs fp32 NCCL reference


@pytest.mark.gpu_extended
def test_tp2_server_fp32_greedy_equals_tp1():
    from test_tp_cpu import PROMPTS, tokenize, tp1_greedy

    path = shared_path("models", "stories260K")
    with ServerProcess(["--model-path", path, "--device", "cuda", "--dtype", "float32", "--tp", "2",
                        "--mem-fraction-static", "0.3"]) as s:
        params = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}
        outs = requests.post(s.url + "/generate", json={"text": PROMPTS, "sampling_params": params}, timeout=120).json()
        for prompt, out in zip(PROMPTS, outs):
            assert out["output_ids"] == tp1_greedy(path, tokenize(path, prompt)), prompt
        log = s.log_tail(400)
        assert "TP communicator (rank 0/2)" in log
