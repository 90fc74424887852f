"""The decode paths ``benchmark/afd/bench.py`` times, compiled on one GPU, on the trained stories260K-moe checkpoint:
the :class:`ModelHarness` on the Triton attention backend (real ``MHATokenToKVPool``) and the AFD attention worker
on it (m = 2, the FFN worker on a thread, inline M2N) give the torch_native harness's greedy tokens and logits; the
colocated ModelRunner (Triton attention, CUDA graphs) gives the same greedy tokens as the eager harness."""

from __future__ import annotations

import os
import sys
import tempfile
import threading

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
from conftest import shared_path  # noqa: E402


TOL = 3e-2  # fp32 model (logits up to ~15): Triton attention runs its dots in TF32 on the GPU, the torch reference
# in fp32; a bf16 model differs by a few bf16 ULPs (0.2 measured on an H200), which this bound would not accept


def _greedy(h, executor=None) -> list[torch.Tensor]:
    from sglang.test.model_harness import greedy_logits

    return greedy_logits(h, executor, steps=4)


def _check(out, ref, what: str) -> None:
    for i, (a, b) in enumerate(zip(out, ref)):
        assert torch.equal(a.argmax(-1).cpu(), b.argmax(-1).cpu()), f"{what}: step {i} greedy tokens differ"
        assert (a.float() - b.float()).abs().max().item() < TOL, f"{what}: step {i} logits differ"


@pytest.mark.gpu
def test_triton_harness_and_afd_equal_reference_on_gpu():
    from sglang.srt.afd.executor import AfdExecutor
    from sglang.srt.afd.experts import moe_layer_specs
    from sglang.srt.afd.ffn_worker import FfnServer
    from sglang.srt.afd.protocol import AfdTopology
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_executor.worker_builder import role_spec
    from sglang.srt.model_loader.loader import load_model
    from sglang.test.model_harness import ModelHarness

    dev = "cuda:0"
    torch.cuda.set_device(0)
    mc = ModelConfig.from_path(shared_path("models", "stories260K-moe"), None, "float32", "cuda")
    model = load_model(mc, "auto", dev)
    ref = _greedy(ModelHarness(model, mc, 4, 24, device=dev))
    _check(_greedy(ModelHarness(model, mc, 4, 24, device=dev, attention_backend="triton")), ref, "triton harness")
    d = tempfile.mkdtemp(prefix="afd-gpu-")
    topo = AfdTopology(1, 1, (f"ipc://{d}/0", f"ipc://{d}/1"), max_rows=256, timeout_s=30)
    specs = moe_layer_specs(mc)
    ffn = FfnServer(mc, specs, list(range(specs[0].num_experts)), "auto", torch.device(dev), topo, 0)
    stop, errors = threading.Event(), []

    def serve():
        try:
            while not stop.is_set():
                ffn.serve_once(timeout_s=0.2)
        except BaseException as e:  # noqa: BLE001 -- reported by the test
            errors.append(e)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    attn = load_model(mc, "auto", dev, weight_filter=role_spec("attention").weight_filter)
    ex = AfdExecutor(mc, topo, 0, 2, torch.device(dev))
    try:
        out = _greedy(ModelHarness(attn, mc, 4, 24, device=dev, attention_backend="triton"), ex)
        c = ex.pipeline_constraint()
    finally:
        ex.close()
        stop.set()
        t.join(10)
        ffn.ep.close()
    assert not errors, errors
    _check(out, ref, "AFD m=2 on the triton harness")
    assert c["ta_ms"] > 0 and c["tf_ms"] > 0


@pytest.mark.gpu_extended  # the graph runner's smoke test is test_overlap_device_futures_gpu.py
def test_colocated_model_runner_with_graphs_matches_harness_tokens():
    from sglang.bench_one_batch import StaticBatch
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.server_args import ServerArgs
    from sglang.test.model_harness import ModelHarness

    path = shared_path("models", "stories260K-moe")
    sa = ServerArgs(model_path=path, device="cuda", skip_tokenizer_init=True, context_length=32, max_running_requests=4,
                    max_total_tokens=256, cuda_graph_max_bs=4, disable_radix_cache=True)
    mc = ModelConfig.from_path(path, 32, "auto", "cuda")
    runner = ModelRunner(mc, sa, "cuda:0")
    assert runner.cuda_graph_runner is not None, "the colocated baseline must decode through CUDA graphs"
    ref = _greedy(ModelHarness(runner.model, mc, 4, 24, device="cuda:0"))
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (6, 3, 9, 4)]
    sb = StaticBatch(runner, prompts, 8)
    try:
        ids = sb.prefill(prompts, None)
        toks = [ids]
        for _ in range(4):
            ids = sb.step([[t] for t in ids])
            toks.append(ids)
    finally:
        sb.free()
    assert toks == [r.argmax(-1).tolist() for r in ref], "ModelRunner (graphs) greedy tokens differ from the harness"
