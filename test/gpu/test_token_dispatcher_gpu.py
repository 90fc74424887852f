"""Token dispatcher on a GPU (expert parallelism by all-to-all): dispatch -> Triton fused-MoE on the received rows ->
combine equals the torch reference (``fused_moe_ref`` over all experts) on fresh random bf16 inputs, both backends,
both modes, the all-to-alls issued on a side stream, and the low-latency path captured in a CUDA graph and replayed
on new inputs. One GPU: world 1 (NCCL and tdist: every packing, grouping and unpacking step, the device counts and
the graph capture still run) and tdist at world 2 with both ranks sharing the GPU (CUDA IPC between the two
processes: the kernel's cross-rank protocol). More GPUs: world 2 with one GPU each, both backends."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "unit"))

from sglang.srt.utils.nvls_env import apply_nvls_off_env  # noqa: E402

apply_nvls_off_env(os.environ)
pytestmark = pytest.mark.gpu
if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)

SEED = int.from_bytes(os.urandom(3), "little")  # fresh inputs every run (printed on failure)
BF16_REL = 0.03


def _gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _check(results, what):
    assert results, what
    for rank, per_rank in enumerate(results):
        assert per_rank, (what, rank)
        for r in per_rank:
            assert r["err"] <= BF16_REL * max(r["scale"], 1e-3) + 1e-3, (what, rank, r, f"seed {SEED}")


def test_world1_both_backends_both_modes_and_graph():
    from tp_worker import spawn_ranks
    from ep_a2a_gpu_worker import gpu_dispatcher_checks

    res = spawn_ranks(gpu_dispatcher_checks, 1, ["nccl", "tdist"], SEED, device="cuda", timeout=300)
    names = {r["name"] for r in res[0]}
    assert {"nccl/low_latency/graph", "tdist/low_latency/graph"} <= names, names
    _check(res, "world 1")


def test_world2_tdist_ranks_share_one_gpu():
    from tp_worker import spawn_ranks
    from ep_a2a_gpu_worker import gpu_dispatcher_checks

    if _gpus() < 1:
        pytest.skip("needs a CUDA GPU")
    res = spawn_ranks(gpu_dispatcher_checks, 2, ["tdist"], SEED, False, ep_size=2, device="cuda", share_gpu=True,
                      timeout=300)
    _check(res, "world 2 sharing one GPU")


def test_world2_one_gpu_each():
    from tp_worker import spawn_ranks
    from ep_a2a_gpu_worker import gpu_dispatcher_checks

    if _gpus() < 2:
        pytest.skip("needs 2 GPUs (one rank per GPU)")
    res = spawn_ranks(gpu_dispatcher_checks, 2, ["nccl", "tdist"], SEED, ep_size=2, device="cuda", timeout=300)
    _check(res, "world 2, one GPU each")


def test_ep2_share_gpu_server_greedy_equals_tp1():
    """Two EP ranks sharing the GPU (``--tp-ranks-share-gpu``: gloo device group, so the nccl backend stages
    through host memory and tdist maps its heap over CUDA IPC) give the one-GPU TP1 server's greedy tokens (same
    kernels, fp32 checkpoint) on stories260K-moe8, for each backend."""
    import requests

    sys.path.insert(0, os.path.dirname(HERE))
    from conftest import shared_path
    from server_utils import ServerProcess

    if _gpus() < 1:
        pytest.skip("needs a CUDA GPU")
    model = shared_path("models", "stories260K-moe8")
    if not os.path.isdir(model):
        pytest.skip(f"{model} is not present (shared test data)")
    payload = {"text": ["Once upon a time", "The little dog", "Lily and Tom went to the park. They",
                        "One day, a bird"], "sampling_params": {"temperature": 0, "max_new_tokens": 32,
                                                               "ignore_eos": True}}

    def tokens(extra):
        with ServerProcess(["--model-path", model, "--device", "cuda", "--chunked-prefill-size", "16", *extra],
                           timeout=300) as s:
            r = requests.post(s.url + "/generate", json=payload, timeout=300)
            assert r.status_code == 200, r.text
            return [o["output_ids"] for o in r.json()], open(s.log_path).read()

    want, _ = tokens([])
    for backend in ("nccl", "tdist"):
        got, log = tokens(["--tp", "2", "--ep-size", "2", "--tp-ranks-share-gpu", "--moe-a2a-backend", backend])
        assert f"MoE all-to-all ({backend}) on 5 MoE layers" in log
        assert got == want, backend
