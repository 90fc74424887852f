"""Overlap scheduling with device futures on CUDA: the worker queues batch i+1 behind batch i on its
stream, the CUDA-graph replay (and the eager path for mixed batches) resolves placeholder ids from the device ring,
and a completer thread hands the ids to the scheduler one step late. On the real stories260K checkpoint (fp32,
Triton backend, CUDA graphs), the overlap scheduler with device futures and with host futures gives the plain
loop's tokens for greedy and seeded-sampling requests, with requests joining mid-decode (mixed batches, padded
graph sizes); the KV pool is fully returned. The same test logic runs on CPU in
``test/unit/test_overlap_device_futures.py``."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
for _p in (REPO / "python", REPO / "test", REPO / "test" / "unit"):
    sys.path.insert(0, str(_p))

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_stories260k_overlap_device_futures_equal_plain_loop_on_cuda():
    from conftest import shared_path
    from test_overlap_device_futures import assert_three_ways_equal, serve_three_ways

    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.server_args import ServerArgs

    path = shared_path("models", "stories260K")
    args = ServerArgs(model_path=path, device="cuda", dtype="float32", max_total_tokens=4096, random_seed=3,
                      cuda_graph_max_bs=16)
    runner = ModelRunner(ModelConfig.from_path(path, None, "float32", "cuda"), args, "cuda:0")
    assert runner.cuda_graph_runner is not None, "CUDA graphs were not captured: the replay path is not tested"
    replays = []
    inner = runner.cuda_graph_runner.replay
    runner.cuda_graph_runner.replay = lambda batch, padded=None: (
        replays.append(batch.future_token_ids is not None), inner(batch, padded))[1]
    results = serve_three_ways(runner, args)
    assert_three_ways_equal(results)
    assert any(replays), "no graph replay resolved device futures"
