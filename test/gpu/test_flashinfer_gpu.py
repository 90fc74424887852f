"""``--attention-backend flashinfer`` on a GPU (skips without FlashInfer; ``scripts/gpu/flashinfer_attention.sh``
installs the carried wheels and runs this file and the benchmark).

* the page-table kernel against its torch reference (no FlashInfer needed);
* the backend against torch_native on random paged batches at the Llama-3.1-8B per-rank head shape (bf16, 32 query
  / 8 KV heads of 128): decode, extend over cached prefixes, mixed batches with two requests sharing prefix pages
  (the radix cache's reuse), page sizes 1 and 16, both pool layouts;
* the same over an FP8 KV cache (E4M3 / E5M2, random per-layer scales: FlashInfer's run() gets the layer's k_scale
  and v_scale);
* a model runner on FlashInfer against torch_native with the reference ops (random 2-layer Llama, bf16), and its
  CUDA-graph decode replays (re-planned per replay) against eager decode on the same runner;
* (extended) the Llama-3.1-8B config with dummy weights served with ``--attention-backend flashinfer``.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), os.path.join(os.path.dirname(HERE), "unit"), HERE]
from conftest import gpu_tiered, shared_path  # noqa: E402

GRAPH_BF16_TOL = 2e-2  # graph vs eager on one runner, bf16: only the split-KV schedule differs


def _flashinfer():
    return pytest.importorskip("flashinfer", reason='FlashInfer is not installed (pip install "sglang[flashinfer]")')


@pytest.fixture(autouse=True)
def _compiled_triton(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [1, 16])
def test_page_table_kernel_matches_reference_on_gpu(page_size):
    from sgl_kernel.triton.page_table import build_page_table, build_page_table_ref

    gen = torch.Generator().manual_seed(page_size)
    r2t = torch.randint(0, 1 << 20, (64, 4096), generator=gen, dtype=torch.int32)
    rpi = torch.randperm(64, generator=gen)[:40]
    seq = torch.randint(1, 4097, (40,), generator=gen)
    indptr, want, _ = build_page_table_ref(r2t, rpi, seq, page_size)
    out = torch.full((int(indptr[-1]) + 5,), -1, dtype=torch.int32, device="cuda")
    build_page_table(r2t.cuda(), rpi.cuda(), indptr.cuda(), page_size, out)
    assert torch.equal(out[: int(indptr[-1])].cpu(), want) and (out[int(indptr[-1]):] == -1).all()


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("layout", ["layer_major", "token_major"])
def test_flashinfer_backend_equals_torch_native(page_size, layout):
    _flashinfer()
    from paged_attention_cases import check_against_torch_native, paged_case

    from sglang.srt.layers.attention import create_attention_backend

    backend = create_attention_backend("flashinfer")
    gen = torch.Generator().manual_seed(page_size * 7 + len(layout))
    cases = [([300, 17, 1024, 1], [1, 1, 1, 1], 0),            # decode
             ([0, 515, 64], [600, 200, 33], 0),                 # extend over cached prefixes
             ([256, 256, 0, 900, 31], [1, 180, 77, 1, 1], 240)]  # mixed; requests 0 and 1 share 240 prefix tokens
    for prefix, extend, shared in cases:
        case = paged_case(gen, prefix, extend, page_size, 32, 8, 128, torch.bfloat16, layout, shared_prefix=shared,
                          device="cuda")
        fb = check_against_torch_native(case, backend, torch.bfloat16)
        assert fb.attn_metadata.planned and fb.attn_metadata.decode == all(e == 1 for e in extend)


@pytest.mark.parametrize("kv", gpu_tiered(["e4m3", "e5m2"]))
def test_flashinfer_backend_reads_fp8_kv(kv):
    """``--kv-cache-dtype fp8_*`` on FlashInfer at the Llama-3.1-8B per-rank head shape: decode, extend over cached
    prefixes and mixed batches over an FP8 pool with random per-layer scales equal the torch_native reference (which
    dequantizes the gathered FP8 values) on fresh random inputs, and the new K/V are stored as the same FP8 bytes."""
    _flashinfer()
    from paged_attention_cases import check_against_torch_native

    from sglang.srt.layers.attention import create_attention_backend
    from sglang.test.kv_cases import paged_case

    kv_dtype = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}[kv]
    backend = create_attention_backend("flashinfer")
    seed = int(torch.randint(0, 2**31 - 1, (1,)).item())
    print(f"seed {seed}")
    for i, (prefix, extend) in enumerate((([300, 17, 1024, 1], [1, 1, 1, 1]), ([0, 515, 64], [600, 200, 33]),
                                          ([256, 0, 900, 31], [1, 77, 1, 1]))):
        c = paged_case(seed + i, prefix, extend, 32, 8, 128, kv_dtype, torch.bfloat16, 16, device="cuda")
        fb = check_against_torch_native((c.q, c.k, c.v, c.layer, c.make_batch), backend, torch.bfloat16)
        assert fb.attn_metadata.planned and fb.token_to_kv_pool.dtype == kv_dtype


@pytest.mark.gpu
def test_model_runner_on_flashinfer_with_graphs(tmp_path):
    _flashinfer()
    from test_gpu_correctness import VOCAB, Driver, compare_backends, make_runner, write_config

    path = write_config(tmp_path, "llama", "bfloat16")
    res = compare_backends(path, "cuda", test_backend="flashinfer", dtype="bfloat16")
    assert res["backend_class"] == "FlashInferAttnBackend" and res["rows"] > 0
    runner = make_runner(path, "flashinfer", "bfloat16", "cuda", graphs=True, max_bs=16)
    gr = runner.cuda_graph_runner
    assert gr is not None and gr.replan is not None, "CUDA graphs were not captured on FlashInfer (see the log)"
    drv = Driver(runner)
    gen = torch.Generator().manual_seed(4)
    rids = [f"r{i}" for i in range(20)]
    drv.step([(rid, torch.randint(3, VOCAB, (int(torch.randint(5, 60, (1,), generator=gen)),),
                                  generator=gen).tolist()) for rid in rids])
    for size in (1, 3, 8, 13, 16, 20, 5):
        items = [(rid, torch.randint(3, VOCAB, (1,), generator=gen).tolist()) for rid in rids[:size]]
        batch = drv.batch(items)
        graph_logits = drv.run(batch)
        eager_logits = drv.run(batch, use_graphs=False)
        scale = max(1.0, eager_logits.abs().max().item())
        err = (graph_logits.float() - eager_logits.float()).abs().max().item()
        assert err <= GRAPH_BF16_TOL * scale, f"decode batch {size}: graph vs eager max err {err} (scale {scale})"


@pytest.mark.gpu_extended
def test_dummy_llama8b_serves_on_flashinfer():
    _flashinfer()
    import requests
    from server_utils import ServerProcess

    cfg = shared_path("configs", "meta-llama--Meta-Llama-3.1-8B")
    tok = shared_path("tokenizers", "llama3")
    with ServerProcess(["--model-path", cfg, "--load-format", "dummy", "--tokenizer-path", tok, "--device", "cuda",
                        "--dtype", "bfloat16", "--context-length", "8192", "--attention-backend", "flashinfer",
                        "--page-size", "16"], timeout=900) as s:
        payload = {"text": "The capital of France is", "sampling_params": {"max_new_tokens": 32, "ignore_eos": True,
                                                                          "temperature": 0}}
        outs = [requests.post(s.url + "/generate", json=payload, timeout=300).json() for _ in range(3)]
        assert all(o["meta_info"]["completion_tokens"] == 32 for o in outs)
        assert outs[1]["meta_info"]["cached_tokens"] > 0  # the radix cache's prefix reuse on FlashInfer's pages
        assert outs[1]["output_ids"] == outs[2]["output_ids"]
        log = open(s.log_path).read()
        assert "captured CUDA graphs for decode batch sizes" in log, s.log_tail()
