"""TokenWeave on one GPU: the two-stream executor with splitting forced equals the unsplit path (bf16) on many
random batch shapes, and tw-comm's fused AllReduce + RMSNorm runs with 2 ranks as 2 processes on ONE GPU
(CUDA IPC within the device, handles exchanged over gloo: NCCL refuses two ranks per GPU), in both the
plain and the overlapped (few-SM) mode, against a torch reference."""

from __future__ import annotations

import os
import random
import sys
import time
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO / "sgl-kernel" / "python"), str(REPO / "python"), str(REPO / "test" / "unit"),
                str(REPO / "test")]
from conftest import gpu_tiered  # noqa: E402
from sglang.srt.utils.nvls_env import apply_nvls_off_env  # noqa: E402

apply_nvls_off_env()


def _tiny_llama(tmp_path, moe: bool):
    transformers = pytest.importorskip("transformers")
    from model_harness import randomize_weights

    common = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=8,
                  num_key_value_heads=2, max_position_embeddings=1024)
    if moe:
        cfg = transformers.MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2)
        hf = transformers.MixtralForCausalLM(cfg)
    else:
        cfg = transformers.LlamaConfig(**common)
        hf = transformers.LlamaForCausalLM(cfg)
    randomize_weights(hf.float(), 3)
    hf.to(torch.bfloat16).save_pretrained(str(tmp_path))
    return str(tmp_path)


@pytest.mark.parametrize("moe,shapes", gpu_tiered([(False, 200), (False, 1000), (True, 300)]))
def test_two_stream_executor_equals_unsplit(tmp_path, moe, shapes):
    from model_harness import ModelHarness

    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_loader.loader import load_model
    from sglang.srt.tokenweave import gemm_widths_of
    from sglang.srt.tokenweave.executor import TokenWeaveConfig, TokenWeaveExecutor

    class Forced(TokenWeaveExecutor):
        cut = 1

        def plan(self, fb):
            return list(fb.split_tokens(self.cut))

    path = _tiny_llama(tmp_path, moe)
    config = ModelConfig.from_path(path)
    model = load_model(config, "auto", "cuda")
    ex = Forced(TokenWeaveConfig(min_tokens=2, gemm_widths=gemm_widths_of(config, 1)), torch.device("cuda"))
    assert ex.comm_stream is not None
    rng = random.Random(0)
    for i in range(shapes):
        h = ModelHarness(model, config, max_reqs=6, max_len=160, seed=i, device="cuda")
        if rng.random() < 0.5:  # a cached prefix for some requests
            h.step([(f"p{j}", [rng.randrange(256) for _ in range(rng.randrange(1, 30))]) for j in range(2)])
        items = [(f"p{j}" if j < 2 and f"p{j}" in h.reqs else f"n{j}",
                  [rng.randrange(256) for _ in range(rng.randrange(1, 40))]) for j in range(rng.randrange(1, 5))]
        fb = h.prepare(items)
        if fb.num_tokens < 2:
            continue
        ref = h.run(fb).float()
        ex.cut = rng.randrange(1, fb.num_tokens)
        out = h.run(fb, ex).float()
        torch.cuda.synchronize()
        diff = (out - ref).abs().max().item()
        assert diff <= 0.05 * max(1.0, ref.abs().max().item()), f"shape {i}: cut {ex.cut}/{fb.num_tokens} diff {diff}"


def _one_gpu_rank(rank: int, world: int, store: str, out: dict) -> None:
    import torch.distributed as dist
    from sgl_kernel.tw_comm.reference import add_rmsnorm_fp32

    from sglang.srt.distributed.tw_comm import TwBackend, TwCommWorkspace, allreduce_rmsnorm

    torch.cuda.set_device(0)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        ws = TwCommWorkspace(dist.group.WORLD, torch.device("cuda", 0))
        errs = {}
        for tokens in (1, 7, 64, 333, 2048):
            for backend, overlap, sms in ((None, False, None), (None, True, 8), (TwBackend.TWOSHOT, False, 16)):
                g = torch.Generator().manual_seed(tokens)
                residual = torch.randn(tokens, 512, generator=g).to(torch.bfloat16)
                weight = (torch.rand(512, generator=g) + 0.5).to(torch.bfloat16)
                g.manual_seed(1000 * tokens + rank)
                x = torch.randn(tokens, 512, generator=g).to(torch.bfloat16)
                total = x.float().clone()
                dist.all_reduce(total)  # gloo on CPU: the reference sum
                res_ref, out_ref = add_rmsnorm_fp32(total, residual, weight, 1e-5)
                xr, rr = x.cuda(), residual.cuda()
                got = allreduce_rmsnorm(ws, xr, rr, weight.cuda(), 1e-5, overlap=overlap, backend=backend,
                                        max_sms=sms)
                torch.cuda.synchronize()
                errs[(tokens, str(backend), overlap)] = max((got.float().cpu() - out_ref.float()).abs().max().item(),
                                                            (rr.float().cpu() - res_ref.float()).abs().max().item())
        _graph_replays(ws, rank, errs)
        ws.close()
        out[rank] = errs
    finally:
        dist.destroy_process_group()


def _graph_replays(ws, rank: int, errs: dict) -> None:
    """The decode path's CUDA-graph property with 2 ranks on one GPU: capture tw-comm's fused call once (one-shot
    at decode sizes, two-shot, and the few-SM overlap variant), then replay it with fresh inputs copied into the
    captured buffers (output NaN-poisoned first); each replay must equal the torch reference."""
    import torch.distributed as dist
    from sgl_kernel.tw_comm.reference import add_rmsnorm_fp32

    from sglang.srt.distributed.tw_comm import TwBackend, allreduce_rmsnorm

    for tokens, backend, sms in ((4, TwBackend.ONESHOT, None), (96, TwBackend.TWOSHOT, None), (300, None, 8)):
        gen = torch.Generator().manual_seed(tokens)
        weight = (torch.rand(512, generator=gen) + 0.5).to(torch.bfloat16)
        w = weight.cuda()
        xs = torch.randn(tokens, 512, generator=gen).to(torch.bfloat16).cuda()
        rs, outs = xs.clone(), torch.empty_like(xs)
        kw = dict(out=outs, backend=backend, overlap=sms is not None, max_sms=sms)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up outside the capture (both ranks call it: a collective)
            allreduce_rmsnorm(ws, xs, rs, w, 1e-5, **kw)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            allreduce_rmsnorm(ws, xs, rs, w, 1e-5, **kw)
        for rep in range(3):
            gen.manual_seed(10_000 * (rep + 1) + 100 * tokens + rank)
            x = torch.randn(tokens, 512, generator=gen).to(torch.bfloat16)
            gen.manual_seed(50_000 * (rep + 1) + tokens)  # the residual is the same on every rank
            residual = torch.randn(tokens, 512, generator=gen).to(torch.bfloat16)
            total = x.float().clone()
            dist.all_reduce(total)
            res_ref, out_ref = add_rmsnorm_fp32(total, residual, weight, 1e-5)
            xs.copy_(x)
            rs.copy_(residual)
            outs.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            errs[("graph", tokens, str(backend), rep)] = max(
                (outs.float().cpu() - out_ref.float()).abs().max().item(),
                (rs.float().cpu() - res_ref.float()).abs().max().item())
        del graph


def _spawn_target(rank, world, store, q):
    d = {}
    _one_gpu_rank(rank, world, store, d)
    q.put((rank, d[rank]))


@pytest.mark.gpu
def test_tw_comm_two_ranks_on_one_gpu(tmp_path):
    """2 ranks as 2 processes on cuda:0: every variant (and its CUDA-graph replays) equals the torch reference."""
    if os.environ.get("SGLANG_SKIP_ONE_GPU_MULTIRANK") == "1":
        pytest.skip("disabled by SGLANG_SKIP_ONE_GPU_MULTIRANK")
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    store = str(tmp_path / "store")
    procs = [ctx.Process(target=_spawn_target, args=(r, 2, store, q)) for r in range(2)]
    for p in procs:
        p.start()
    got = {}
    deadline = time.time() + 300
    while len(got) < 2 and time.time() < deadline:
        try:
            r, d = q.get(timeout=5)
            got[r] = d
        except Exception:
            if any(p.exitcode not in (None, 0) for p in procs):
                break
    for p in procs:
        p.join(10)
        if p.is_alive():
            p.kill()
    assert len(got) == 2, f"ranks did not finish: exit codes {[p.exitcode for p in procs]}"
    for r, errs in got.items():
        bad = {k: v for k, v in errs.items() if not v < 0.1}
        assert not bad, f"rank {r}: {bad}"


# ---- several TP ranks as processes on ONE GPU (--tp-ranks-share-gpu), the real kernels and streams --------------
@pytest.fixture(scope="module")
def tiny_checkpoints(tmp_path_factory):
    """Random fp32 HF checkpoints (dense Llama, Mixtral) of the CPU TP tests' shapes, fresh seed per run."""
    transformers = pytest.importorskip("transformers")
    from model_harness import randomize_weights

    from test_tp_models import CASES, COMMON

    seed = int.from_bytes(os.urandom(2), "little")
    paths = {}
    for name in ("llama_bias_untied", "mixtral"):
        cfg_cls, model_cls, extra = CASES[name]
        hf = getattr(transformers, model_cls)(getattr(transformers, cfg_cls)(**COMMON, **extra)).float().eval()
        randomize_weights(hf, seed + len(name))
        path = str(tmp_path_factory.mktemp(name))
        hf.save_pretrained(path)
        paths[name] = path
    return paths


@pytest.mark.gpu_extended  # the executor's and tw-comm's smoke tests are the two above
@pytest.mark.parametrize("name,world", [("llama_bias_untied", 2), ("mixtral", 2), ("llama_bias_untied", 4)])
def test_tokenweave_tp_ranks_share_one_gpu(tiny_checkpoints, name, world):
    """``world`` TP ranks as processes on cuda:0 (gloo device group, tw-comm's fused AllReduce-RMSNorm over CUDA
    IPC within the device, TokenWeave's two streams; the default sharded residual, stale rows NaN-filled), cut at
    every token boundary of prefill / mixed / decode steps: bf16 logits equal the single-process fp32 CPU reference
    within bf16 tolerance."""
    from test_tp_models import _reference
    from tp_worker import spawn_ranks, tokenweave_logits

    ref = _reference(tiny_checkpoints[name])
    results = spawn_ranks(tokenweave_logits, world, tiny_checkpoints[name], "bfloat16", timeout=300, device="cuda",
                          share_gpu=True)
    for rank, per_rank in enumerate(results):
        for step, (cuts, want) in enumerate(zip(per_rank, ref)):
            for cut, got in enumerate(cuts, start=1):
                diff = (got - want).abs().max().item()
                assert diff <= 0.05 * max(1.0, want.abs().max().item()), \
                    f"{name} world {world} rank {rank} step {step} cut {cut}: max diff {diff}"


@pytest.mark.gpu_extended
@pytest.mark.parametrize("name", ["llama_bias_untied", "mixtral"])
def test_tokenweave_tp2_one_rank_per_gpu(tiny_checkpoints, name):
    """2 TP ranks on 2 GPUs (NCCL device group, tw-comm's fused AllReduce-RMSNorm over CUDA IPC between the
    GPUs, TokenWeave's two streams and its GEMM SM carveout; the full residual, ``--tokenweave-full-residual``),
    cut at every token boundary of prefill / mixed / decode steps: bf16 logits equal the single-process fp32 CPU
    reference within bf16 tolerance, on both ranks. Skips without 2 GPUs."""
    _tp2_one_rank_per_gpu(tiny_checkpoints[name], name, sharded=False)


@pytest.mark.parametrize("name", gpu_tiered(["llama_bias_untied", "mixtral"]))
def test_tokenweave_tp2_one_rank_per_gpu_sharded_residual(tiny_checkpoints, name):
    """As :func:`test_tokenweave_tp2_one_rank_per_gpu` with the sharded residual (the default; each rank reads and
    updates only its rows of each split's residual; TokenWeave sec. 3-4), every rank's non-owned residual rows
    NaN-filled after each sharded call (``tp_worker.stale_rows_poisoned``), so a consumer that reads a stale row
    fails. Skips without 2 GPUs."""
    _tp2_one_rank_per_gpu(tiny_checkpoints[name], name, sharded=True)


def _tp2_one_rank_per_gpu(path: str, name: str, sharded: bool) -> None:
    """Every cut's bf16 logits of 2 ranks on 2 GPUs vs the fp32 CPU reference (5% of the largest |logit|)."""
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    from test_tp_models import _reference
    from tp_worker import spawn_ranks, tokenweave_logits

    ref = _reference(path)
    results = spawn_ranks(tokenweave_logits, 2, path, "bfloat16", sharded, timeout=300, device="cuda")
    for rank, per_rank in enumerate(results):
        for step, (cuts, want) in enumerate(zip(per_rank, ref)):
            for cut, got in enumerate(cuts, start=1):
                diff = (got - want).abs().max().item()
                assert diff <= 0.05 * max(1.0, want.abs().max().item()), \
                    f"{name} sharded={sharded} rank {rank} step {step} cut {cut}: max diff {diff}"


@pytest.mark.gpu_extended
def test_server_tp2_shared_gpu_tokenweave_equals_tp1():
    """Through HTTP: ``--tp 2 --tp-ranks-share-gpu --enable-tokenweave --tokenweave-min-tokens 8`` on the real
    stories260K checkpoint (fp16 on the GPU, tw-comm's kernel over CUDA IPC) gives TP=1's greedy tokens."""
    from conftest import shared_path
    from server_utils import ServerProcess

    model = shared_path("models", "stories260K")
    prompts = ["Once upon a time, there was a little girl named Lily. She loved to play with her toys",
               "The cat sat on the mat and looked at the dog. The dog was big and brown and"]
    common = ["--model-path", model, "--device", "cuda", "--dtype", "float16", "--max-total-tokens", "4096",
              "--mem-fraction-static", "0.2"]
    outs = {}
    for name, extra in (("tp1", []), ("tw", ["--tp", "2", "--tp-ranks-share-gpu", "--enable-tokenweave",
                                              "--tokenweave-min-tokens", "8"])):
        with ServerProcess(common + extra) as srv:
            import requests

            r = requests.post(f"{srv.url}/generate", json={
                "text": prompts, "sampling_params": {"temperature": 0, "max_new_tokens": 24}}, timeout=120)
            assert r.status_code == 200, r.text
            outs[name] = [o["output_ids"] for o in r.json()]
    assert outs["tw"] == outs["tp1"]
