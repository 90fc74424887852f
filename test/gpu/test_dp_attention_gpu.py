"""DP attention on GPUs. With >= 2 CUDA GPUs (one DP rank per GPU, NCCL): a ``--tp 2 --dp-size 2 --ep-size 2
--enable-dp-attention`` server on ``stories260K-moe8`` in fp32 with decode CUDA graphs (the MoE all-gather and
reduce-scatter captured in them; every rank replays the size of the largest decode batch, idle ranks padding only)
gives TP1's greedy tokens for a batch, for one request with the other rank idle, and for requests joining
mid-decode; the same with the all-to-all dispatcher (``--moe-a2a-backend nccl``: each rank dispatches its own tokens,
the captured decode graphs in low-latency mode), and with it plus forced two-batch overlap (``--enable-two-batch-overlap
--tbo-min-tokens 2``: the graphs capture the two-micro-batch schedule on two streams). With one GPU: both DP ranks
share it (``--tp-ranks-share-gpu``: gloo device group, no CUDA graphs), the GPU kernels (Triton attention and fused MoE
on the gathered rows) give the same tokens.

Run: ``python -m pytest -q -m gpu test/gpu/test_dp_attention_gpu.py`` (the NVLink-multicast-off environment is set
by conftest.py and server_utils.ENV).
"""

from __future__ import annotations

import os
import sys
import threading

import pytest
import requests

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "unit"))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "integration"))
from conftest import shared_path  # noqa: E402
from server_utils import ServerProcess  # noqa: E402

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs at least 2 CUDA GPUs")
N_NEW = 32
PARAMS = {"temperature": 0, "max_new_tokens": N_NEW, "ignore_eos": True}


def _want(path, prompt, n=N_NEW):
    from test_tp_cpu import tokenize, tp1_greedy

    return tp1_greedy(path, tokenize(path, prompt), n)


def test_dp2_ranks_sharing_one_gpu_equal_tp1():
    from test_tp_cpu import PROMPTS

    path = shared_path("models", "stories260K-moe8")
    with ServerProcess(["--model-path", path, "--device", "cuda", "--dtype", "float32", "--tp", "2", "--dp-size", "2",
                        "--ep-size", "2", "--enable-dp-attention", "--tp-ranks-share-gpu", "--max-total-tokens",
                        "4096", "--chunked-prefill-size", "16"], timeout=400) as s:
        outs = requests.post(s.url + "/generate", json={"text": PROMPTS, "sampling_params": PARAMS}, timeout=120).json()
        for prompt, out in zip(PROMPTS, outs):
            assert out["output_ids"] == _want(path, prompt), prompt
        one = requests.post(s.url + "/generate", json={"text": PROMPTS[1], "sampling_params": PARAMS},
                            timeout=120).json()
        assert one["output_ids"] == _want(path, PROMPTS[1])


@two_gpus
@pytest.mark.parametrize("a2a", ["none", "nccl", "nccl-tbo"])
def test_dp2_server_with_cuda_graphs_equals_tp1(a2a):
    from test_tp_cpu import PROMPTS, tokenize, tp1_greedy

    backend, tbo = a2a.split("-")[0], a2a.endswith("-tbo")
    path = shared_path("models", "stories260K-moe8")
    args = ["--model-path", path, "--device", "cuda", "--dtype", "float32", "--tp", "2", "--dp-size", "2",
            "--ep-size", "2", "--enable-dp-attention", "--mem-fraction-static", "0.3", "--cuda-graph-max-bs", "16",
            "--chunked-prefill-size", "16"] + (["--moe-a2a-backend", backend] if backend != "none" else [])
    if tbo:
        args += ["--enable-two-batch-overlap", "--tbo-min-tokens", "2"]
    params = {"temperature": 0, "max_new_tokens": N_NEW, "ignore_eos": True}

    def want(prompt, n=N_NEW):
        return tp1_greedy(path, tokenize(path, prompt), n)

    with ServerProcess(args, timeout=400) as s:
        outs = requests.post(s.url + "/generate", json={"text": PROMPTS, "sampling_params": params}, timeout=120).json()
        for prompt, out in zip(PROMPTS, outs):
            assert out["output_ids"] == want(prompt), prompt
        one = requests.post(s.url + "/generate", json={"text": PROMPTS[1], "sampling_params": params},
                            timeout=120).json()
        assert one["output_ids"] == want(PROMPTS[1])  # the other rank replays the same graphs with padding only
        long_prompt = "Lily and Tom went to the park. They saw a big red ball and a little dog. The dog"
        res = {}
        t = threading.Thread(target=lambda: res.update(r=requests.post(s.url + "/generate", timeout=120, json={
            "text": long_prompt, "sampling_params": {**params, "max_new_tokens": 64}}).json()))
        t.start()
        late = requests.post(s.url + "/generate", json={"text": PROMPTS, "sampling_params": params}, timeout=120).json()
        t.join(120)
        assert res["r"]["output_ids"] == want(long_prompt, 64)
        for prompt, out in zip(PROMPTS, late):
            assert out["output_ids"] == want(prompt), prompt
        info = requests.get(s.url + "/get_server_info", timeout=30).json()
        st = info["internal_states"]
        assert [x["dp_rank"] for x in st] == [0, 1] and sum(x["dp_idle_forwards"] for x in st) > 0, st
        log = s.log_tail(2000)
        assert "captured CUDA graphs for decode batch sizes" in log and "CUDA graphs off" not in log
        if tbo:  # the startup choice (rank 0) and a split forward
            with open(s.log_path) as f:
                full = f.read()
            assert "capture the two-micro-batch schedule" in full and "two-batch overlap on:" in full
