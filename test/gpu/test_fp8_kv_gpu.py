"""FP8 KV cache on a GPU (compiled Triton kernels, sm_89+ for E4M3): the decode and extend attention kernels over
E4M3 / E5M2 pools with random per-layer scales against the torch reference (gathered FP8 values dequantized, then
SDPA) on fresh random inputs (head dims 64 / 128 / 256, page sizes 1 and 16, GQA 4, decode / extend / mixed); the
fused RoPE + FP8 KV store byte-equal to RoPE followed by the pool's quantization (hardware round-to-nearest-even
with saturation); every decode split policy (balanced: rows longest first with length-aware split counts, its
metadata captured with the graph; wave; legacy) and the prefix-free prefill rows through FlashAttention-2 varlen / SDPA
read the FP8 cache with its scales; the decode kernel captured in a CUDA graph equals eager; a ModelRunner with
``--kv-cache-dtype fp8_e4m3`` replays decode graphs that equal its eager decode (the graph-vs-eager check of
``test_gpu_correctness.py``). Kernel modules are imported inside the tests (collecting this file must not fix Triton's
interpreter mode for the CPU tests).

Tiers (test/conftest.py): the smoke selection (``-m gpu``) runs each FP8 kernel path once -- the attention kernels
on a mixed batch (extend and balanced-policy decode kernels), the fused RoPE + FP8 store, the varlen prefix-free
rows, the decode graph replay; the FP8 KV ModelRunner graphs run in the smoke tier of ``test_fp8_gpu.py`` together
with FP8 weights. Everything else is ``gpu_extended``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "python"))
sys.path.insert(0, str(REPO / "test"))
from conftest import gpu_tiered  # noqa: E402

DEV = "cuda"
KINDS = {"decode": ([700, 3, 1290, 17, 64, 333], [1] * 6), "extend": ([0, 370, 5], [450, 200, 31]),
         "mixed": ([400, 0, 17, 900], [1, 330, 1, 95])}


@pytest.fixture(autouse=True)
def _compiled(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 E4M3 conversions need sm_89+")


def _fresh_seed() -> int:
    """A new seed per call (fresh random inputs each run), printed so a failure can be replayed."""
    seed = int(torch.randint(0, 2**31 - 1, (1,)).item())
    print(f"seed {seed}")
    return seed


ATTN_CASES = [("mixed", "e4m3", 128, 16, "balanced")] + [
    (kind, kv, hd, page, "balanced") for kind in sorted(KINDS) for kv in ("e4m3", "e5m2")
    for hd, page in ((64, 1), (128, 16), (128, 1), (256, 16)) if (kind, kv, hd, page) != ("mixed", "e4m3", 128, 16)
] + [(kind, "e4m3", 128, 16, policy) for kind in ("decode", "mixed") for policy in ("wave", "legacy")]


@pytest.mark.parametrize("kind,kv,hd,page,policy", gpu_tiered(ATTN_CASES))
def test_fp8_attention_kernels_vs_torch_reference(kind, kv, hd, page, policy):
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend
    from sglang.test.kv_cases import paged_case

    kv_dtype = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}[kv]
    prefix, extend = KINDS[kind]
    c = paged_case(_fresh_seed(), prefix, extend, 32, 8, hd, kv_dtype, torch.bfloat16, page, device=DEV)
    ref_fb = c.make_batch(TorchNativeAttnBackend())
    ref = ref_fb.attn_backend.forward(c.q, c.k, c.v, c.layer, ref_fb)
    legacy = policy == "legacy"  # the kernel variant of before: K tiles gathered transposed, a reduce at any split
    fb = c.make_batch(TritonAttnBackend(legacy_decode=True) if legacy else TritonAttnBackend(split_policy=policy))
    out = fb.attn_backend.forward(c.q, c.k, c.v, c.layer, fb)
    torch.cuda.synchronize()
    assert torch.equal(fb.token_to_kv_pool.kv_data, ref_fb.token_to_kv_pool.kv_data)  # same FP8 bytes written
    err = (out.float() - ref.float()).abs().max().item()
    assert err <= 2e-2 * max(1.0, ref.float().abs().max().item()), f"max abs err {err}"


@pytest.mark.parametrize("kv,neox,hd,rotary_dim", gpu_tiered(
    [(kv, neox, hd, rd) for kv in ("e4m3", "e5m2") for neox, hd, rd in ((True, 128, 128), (False, 64, 64),
                                                                          (True, 80, 64))]))
def test_fused_rope_fp8_store_equals_rope_then_quantize(kv, neox, hd, rotary_dim):
    from sgl_kernel.triton import rope, rope_kv_store
    from sglang.srt.layers.rotary_embedding import get_rope
    from sglang.srt.mem_cache.kv_quant import quantize_kv

    kv_dtype = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}[kv]
    gen = torch.Generator().manual_seed(_fresh_seed())
    nq, nkv, n, slots = 32, 8, 257, 4096
    emb = get_rope(hd, rotary_dim, 4096, 500000.0, is_neox_style=neox).to(DEV)
    pos = torch.randint(0, 4096, (n,), generator=gen).to(DEV)
    qkv = (torch.randn(n, (nq + 2 * nkv) * hd, generator=gen) * 30).to(torch.bfloat16).to(DEV)
    qkv[0, nq * hd] = 1e5  # saturates
    loc = torch.randperm(slots, generator=gen)[:n].to(DEV)
    kb = torch.zeros(slots, nkv, hd, dtype=torch.uint8, device=DEV).view(kv_dtype)
    vb = torch.zeros_like(kb)
    q, k, v = qkv[:, : nq * hd], qkv[:, nq * hd: (nq + nkv) * hd], qkv[:, (nq + nkv) * hd:]
    ks, vs = 0.173, 0.0219
    k2 = k.clone()
    rope.apply_rope(pos, q.clone(), k2, emb.cos_sin_cache, hd, neox)
    kb2, vb2 = kb.clone(), vb.clone()
    kb2[loc] = quantize_kv(k2.view(-1, nkv, hd), ks, kv_dtype)
    vb2[loc] = quantize_kv(v.reshape(-1, nkv, hd), vs, kv_dtype)
    rope_kv_store.rope_and_store_kv(pos, q, k, v, emb.cos_sin_cache, hd, neox, kb, vb, loc, ks, vs)
    torch.cuda.synchronize()
    assert torch.equal(kb.view(torch.uint8), kb2.view(torch.uint8))
    assert torch.equal(vb.view(torch.uint8), vb2.view(torch.uint8))
    assert kb.float().abs().max().item() == torch.finfo(kv_dtype).max  # saturated, not NaN


@pytest.mark.parametrize("bs", gpu_tiered([96, 16]))
def test_fp8_decode_cuda_graph_replay_equals_eager(bs):
    """The balanced policy's metadata (the longest-first row order, an on-device argsort) is built inside the capture,
    as the CUDA-graph runner does, so each replay re-sorts the new lengths; the replayed output equals an eager
    forward on freshly built metadata and the torch reference over the same FP8 pool."""
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend
    from sglang.test.kv_cases import paged_case

    seed = _fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    c = paged_case(seed, [int(x) for x in torch.randint(1, 900, (bs,), generator=gen)], [1] * bs, 32, 8, 128,
                   torch.float8_e4m3fn, torch.bfloat16, 16, device=DEV)
    backend = TritonAttnBackend(split_policy="balanced")
    backend.init_cuda_graph_state(bs, 32, 128, 8, torch.device(DEV))
    fb = c.make_batch(backend)
    ref_fb = c.make_batch(TorchNativeAttnBackend())
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        backend.forward(c.q, c.k, c.v, c.layer, fb)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        backend.init_forward_metadata(fb)
        out = backend.forward(c.q, c.k, c.v, c.layer, fb)
    for _ in range(2):  # new lengths, queries and new-token K/V in the same static buffers
        lens = torch.randint(1, max(fb.seq_lens_cpu) + 1, (bs,), generator=gen)
        fb.seq_lens.copy_(lens.to(DEV))
        for t in (c.q, c.k, c.v):
            t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))
        graph.replay()
        replayed = out.clone()
        backend.init_forward_metadata(fb)
        eager = backend.forward(c.q, c.k, c.v, c.layer, fb)
        ref_fb.seq_lens.copy_(lens.to(DEV))
        ref_fb.seq_lens_cpu = lens.tolist()
        ref = ref_fb.attn_backend.forward(c.q, c.k, c.v, c.layer, ref_fb)
        torch.cuda.synchronize()
        assert torch.equal(replayed, eager)
        err = (replayed.float() - ref.float()).abs().max().item()
        assert err <= 2e-2 * max(1.0, ref.float().abs().max().item()), f"max abs err {err}"


@pytest.mark.parametrize("impl", gpu_tiered(["varlen", "sdpa"]))
def test_prefix_free_rows_read_fp8_kv(impl):
    """SGLANG_EXTEND_ATTENTION=varlen / sdpa over an FP8 pool: the prefix-free prefill rows are gathered from the pool
    (uint8 view), widened, run with the K scale in the softmax scale and the V scale on the output, and equal the
    torch reference; the other rows stay on the FP8 Triton kernels."""
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend
    from sglang.test.kv_cases import paged_case

    c = paged_case(_fresh_seed(), [0, 370, 0, 17], [450, 200, 1, 95], 32, 8, 128, torch.float8_e4m3fn,
                   torch.bfloat16, 16, device=DEV)
    ref_fb = c.make_batch(TorchNativeAttnBackend())
    ref = ref_fb.attn_backend.forward(c.q, c.k, c.v, c.layer, ref_fb)
    fb = c.make_batch(TritonAttnBackend(extend_impl=impl))
    assert list(fb.attn_metadata.dense_segments) == [(0, 450)]
    out = fb.attn_backend.forward(c.q, c.k, c.v, c.layer, fb)
    torch.cuda.synchronize()
    err = (out.float() - ref.float()).abs().max().item()
    assert err <= 2e-2 * max(1.0, ref.float().abs().max().item()), f"max abs err {err}"


@pytest.mark.gpu_extended
def test_model_runner_fp8_kv_decode_graphs_equal_eager(tmp_path):
    """A ModelRunner (fp32 Llama-style config, dummy weights randomized) with ``--kv-cache-dtype fp8_e4m3``: decode
    batches of captured and padded sizes replay graphs whose logits equal eager decode on the same runner and on a
    second runner without graphs (``test_gpu_correctness.compare_graphs``)."""
    import test_gpu_correctness as tgc

    path = tgc.write_config(tmp_path, "llama", "float32")
    res = tgc.compare_graphs(path, kv_cache_dtype="fp8_e4m3")
    print("fp8 KV graphs:", res)
    assert res["eager_steps"] >= 1 and res["worst"] < tgc.GRAPH_TOL
