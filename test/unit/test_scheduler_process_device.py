"""A scheduler worker makes its explicit CUDA device current (a single-rank server on ``--base-gpu-id 1`` must
launch its Triton kernels on cuda:1, not on the default cuda:0); nothing is done for cpu or a bare ``cuda``."""

from __future__ import annotations

import pytest
import torch

from sglang.srt.managers.scheduler_process import make_device_current, torch_device_index


def test_torch_device_index():
    assert torch_device_index("cuda:3") == 3
    assert torch_device_index("cuda") is None and torch_device_index("cpu") is None


@pytest.mark.parametrize("device,want", [("cuda:1", [1]), ("cuda:0", [0]), ("cuda", []), ("cpu", [])])
def test_make_device_current_sets_only_explicit_cuda_devices(monkeypatch, device, want):
    calls: list = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: calls.append(i))
    make_device_current(device)
    assert calls == want


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_make_device_current_on_two_gpus():
    before = torch.cuda.current_device()
    try:
        make_device_current("cuda:1")
        assert torch.cuda.current_device() == 1
        x = torch.ones(4, device="cuda:1")
        assert torch.cuda.current_stream().device == x.device
    finally:
        torch.cuda.set_device(before)
