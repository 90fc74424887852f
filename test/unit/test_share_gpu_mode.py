"""``--tp-ranks-share-gpu`` (the correctness-only mode where TP ranks share one GPU): its config plumbing on CPU.
The mode itself runs in test/gpu/test_tokenweave_gpu.py."""

from __future__ import annotations

import pytest

from sglang.srt.distributed.parallel_state import DistConfig
from sglang.srt.server_args import ServerArgs


def test_share_gpu_turns_off_graphs_and_custom_all_reduce():
    a = ServerArgs(tp_size=2, tp_ranks_share_gpu=True)
    assert a.disable_cuda_graph and a.disable_custom_all_reduce
    b = ServerArgs(tp_size=2)
    assert not b.disable_cuda_graph and not b.disable_custom_all_reduce


def test_share_gpu_cli_flag_parses():
    import argparse

    p = argparse.ArgumentParser()
    ServerArgs.add_cli_args(p)
    ns = p.parse_args(["--tp", "2", "--tp-ranks-share-gpu"])
    assert ServerArgs.from_cli_args(ns).tp_ranks_share_gpu


@pytest.mark.parametrize("kw,needle", [(dict(device_backend="mpi"), "device_backend"),
                                        (dict(device_backend="nccl", device="cpu"), "needs device='cuda'")])
def test_dist_config_rejects_bad_device_backend(kw, needle):
    with pytest.raises(ValueError, match=needle):
        DistConfig(tp_rank=0, tp_size=2, init_method="tcp://127.0.0.1:1", **kw)


def test_dist_config_accepts_gloo_on_cuda():
    c = DistConfig(tp_rank=1, tp_size=2, init_method="tcp://127.0.0.1:1", device="cuda", device_index=0,
                   device_backend="gloo")
    assert c.gpu_index == 0
