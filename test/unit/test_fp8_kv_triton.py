"""FP8 KV cache through the Triton kernels on CPU under the Triton interpreter: decode, extend (cached prefix) and
mixed batches over E4M3 / E5M2 pools with random per-layer scales, page sizes 1 and 16, against the torch_native
reference (which dequantizes the gathered FP8 values); the fused RoPE + KV store quantizes as the torch reference;
stories260K's logits through the Triton backend equal the torch_native backend's over an FP8 cache.

On a CUDA host this module skips (``test/gpu/test_fp8_kv_gpu.py`` runs the compiled kernels), because
``TRITON_INTERPRET`` must be set before any kernel module is imported.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("CUDA host: the compiled kernels are tested in test/gpu/test_fp8_kv_gpu.py", allow_module_level=True)
if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.fail("triton was imported before TRITON_INTERPRET=1 was set; run this module in its own process",
                pytrace=False)
os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

from conftest import shared_path  # noqa: E402

from sgl_kernel.triton import rope, rope_kv_store  # noqa: E402
from sglang.srt.layers import ops  # noqa: E402
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend  # noqa: E402
from sglang.srt.layers.attention.triton_backend import TritonAttnBackend  # noqa: E402
from sglang.srt.layers.rotary_embedding import get_rope  # noqa: E402
from sglang.srt.mem_cache.kv_quant import KVScales, dequantize_kv, quantize_kv  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool  # noqa: E402
from sglang.test.kv_cases import paged_case  # noqa: E402

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
TOL = {torch.float32: 2e-4, torch.bfloat16: 2e-2}


def fp8_case(seed, prefix_lens, extend_lens, nh, nkv, hd, kv_dtype, q_dtype, page_size=1, layers=2):
    """(q, k, v, layer, make_batch) of :func:`sglang.test.kv_cases.paged_case` on the CPU (random per-layer scales,
    pages of ``page_size`` in a shuffled order)."""
    c = paged_case(seed, prefix_lens, extend_lens, nh, nkv, hd, kv_dtype, q_dtype, page_size, layers)
    return c.q, c.k, c.v, c.layer, c.make_batch


CASES = {  # (prefix_lens, extend_lens)
    "decode": ([70, 3, 129, 17], [1, 1, 1, 1]),
    "extend": ([0, 37, 5], [45, 20, 3]),
    "mixed": ([40, 0, 17, 90], [1, 33, 1, 9]),
}


@pytest.mark.parametrize("kind", sorted(CASES))
@pytest.mark.parametrize("kv_dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("q_dtype,nh,nkv,hd,page", [(torch.float32, 8, 2, 64, 1), (torch.bfloat16, 8, 1, 128, 16),
                                                    (torch.float32, 4, 4, 8, 16)])
def test_triton_reads_fp8_kv_like_the_reference(kind, kv_dtype, q_dtype, nh, nkv, hd, page):
    prefix, extend = CASES[kind]
    q, k, v, layer, make_batch = fp8_case(len(kind) + hd + page, prefix, extend, nh, nkv, hd, kv_dtype, q_dtype,
                                          page)
    ref_fb = make_batch(TorchNativeAttnBackend())
    ref = ref_fb.attn_backend.forward(q, k, v, layer, ref_fb)
    fb = make_batch(TritonAttnBackend())
    out = fb.attn_backend.forward(q, k, v, layer, fb)
    pool, ref_pool = fb.token_to_kv_pool, ref_fb.token_to_kv_pool
    assert torch.equal(pool.kv_data, ref_pool.kv_data)  # the same FP8 bytes were written
    assert pool.k_scale(layer.layer_id) != 1.0  # scales in play: ignoring one would fail the comparison below
    err = (out.float() - ref.float()).abs().max().item()
    assert err <= TOL[q_dtype] * max(1.0, ref.float().abs().max().item()), f"max abs err {err}"


POLICY_CASES = {  # decode rows long enough for several splits (the balanced rule's length-aware split counts)
    "decode": ([300, 3, 129, 17], [1, 1, 1, 1]),
    "mixed": ([300, 0, 17, 90], [1, 33, 1, 9]),
}


@pytest.mark.parametrize("policy", ["balanced", "wave", "legacy"])
@pytest.mark.parametrize("kind", sorted(POLICY_CASES))
@pytest.mark.parametrize("kv_dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_every_decode_split_policy_reads_fp8_kv(policy, kind, kv_dtype):
    """Each decode split policy (``SGLANG_DECODE_SPLIT_POLICY``: balanced = rows longest first with length-aware
    split counts, some rows written directly and some reduced; wave; legacy) dequantizes an FP8 cache: K scale folded
    into the softmax scale, V scale on every split's output, equal to the torch_native reference."""
    prefix, extend = POLICY_CASES[kind]
    q, k, v, layer, make_batch = fp8_case(len(policy) + len(kind), prefix, extend, 8, 2, 32, kv_dtype,
                                          torch.float32, 16)
    ref_fb = make_batch(TorchNativeAttnBackend())
    ref = ref_fb.attn_backend.forward(q, k, v, layer, ref_fb)
    # legacy: the kernel variant of before (K tiles gathered transposed, a reduce at every split count)
    legacy = policy == "legacy"
    fb = make_batch(TritonAttnBackend(legacy_decode=True) if legacy else TritonAttnBackend(split_policy=policy))
    meta = fb.attn_metadata
    assert meta.num_kv_splits > 1
    if policy == "balanced":
        assert meta.decode_order is not None and meta.min_split_len > 0
    out = fb.attn_backend.forward(q, k, v, layer, fb)
    assert fb.token_to_kv_pool.v_scale(layer.layer_id) != 1.0
    err = (out - ref).abs().max().item()
    assert err <= TOL[torch.float32] * max(1.0, ref.abs().max().item()), f"{policy} max abs err {err}"


@pytest.mark.parametrize("kv_dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_prefix_free_sdpa_rows_read_fp8_kv(kv_dtype):
    """``SGLANG_EXTEND_ATTENTION=sdpa``: prefix-free prefill rows gathered from an FP8 pool are widened and scaled
    (K scale in the softmax scale, V scale on the output) like the Triton rows, equal to torch_native."""
    q, k, v, layer, make_batch = fp8_case(13, [0, 37, 0, 5], [45, 20, 1, 30], 8, 2, 32, kv_dtype, torch.float32)
    ref_fb = make_batch(TorchNativeAttnBackend())
    ref = ref_fb.attn_backend.forward(q, k, v, layer, ref_fb)
    fb = make_batch(TritonAttnBackend(extend_impl="sdpa"))
    assert list(fb.attn_metadata.dense_segments) == [(0, 45)]
    out = fb.attn_backend.forward(q, k, v, layer, fb)
    err = (out - ref).abs().max().item()
    assert err <= TOL[torch.float32] * max(1.0, ref.abs().max().item()), f"max abs err {err}"


def test_fp8_attention_error_against_unquantized_kv_is_bounded():
    """The whole FP8 path against attention over the same K/V kept in fp32: the output error is what E4M3's 3
    mantissa bits allow (measured ~0.5% of the output range here; bound 3%), i.e. the scales are applied right."""
    q, k, v, layer, make_batch = fp8_case(5, [60, 17], [1, 1], 8, 2, 64, E4M3, torch.float32)
    fb = make_batch(TritonAttnBackend())
    out = fb.attn_backend.forward(q, k, v, layer, fb)
    pool = fb.token_to_kv_pool
    exact = MHATokenToKVPool(pool.size, 1, torch.float32, 2, 64, 2, "cpu")
    li = layer.layer_id
    for buf, src, s in ((exact.k_buffer[li], pool.get_key_buffer(li), pool.k_scale(li)),
                        (exact.v_buffer[li], pool.get_value_buffer(li), pool.v_scale(li))):
        buf.copy_(dequantize_kv(src, s, torch.float32))  # what FP8 holds, dequantized
    ref_fb = make_batch(TorchNativeAttnBackend())
    ref_fb.token_to_kv_pool = exact
    ref = TorchNativeAttnBackend().forward(q, k, v, layer, ref_fb)
    assert (out - ref).abs().max().item() <= 3e-2 * ref.abs().max().item() + 1e-3


@pytest.mark.parametrize("kv_dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("neox,hd,rotary_dim", [(True, 16, 16), (False, 12, 8)])
def test_fused_rope_store_quantizes_like_the_reference(kv_dtype, dtype, neox, hd, rotary_dim):
    """The fused RoPE + KV store into an FP8 pool quantizes as the pool does (round to k's dtype, scale, saturate,
    round to nearest even), compared with Triton's RoPE kernel followed by the pool's :func:`quantize_kv` and with
    the all-torch reference. The Triton 3.9 interpreter's fp32 -> fp8 cast has two known deviations from the GPU's
    ``cvt.rn.satfinite`` (the GPU test checks byte equality): exact ties round away from zero (one FP8 step), and a
    rounding that carries into the exponent loses the carry (7.96 -> 4.0 instead of 8.0: half the value). Every
    byte must match or show one of those two patterns, and most bytes must match."""
    gen = torch.Generator().manual_seed(hd + 3 * neox)
    nq, nkv, n, slots = 4, 2, 7, 40
    emb = get_rope(hd, rotary_dim, 64, 10000.0, is_neox_style=neox)
    pos = torch.randint(0, 64, (n,), generator=gen)
    qkv = (torch.randn(n, (nq + 2 * nkv) * hd, generator=gen) * 8).to(dtype)
    qkv[0, nq * hd] = 1e5  # saturates E4M3 and E5M2 at these scales
    loc = torch.randperm(slots, generator=gen)[:n]
    kb = torch.zeros(slots, nkv, hd, dtype=torch.uint8).view(kv_dtype)
    vb = torch.zeros_like(kb)
    q, k, v = qkv[:, : nq * hd], qkv[:, nq * hd: (nq + nkv) * hd], qkv[:, (nq + nkv) * hd:]
    q_ref, kb_ref, vb_ref = q.clone(), kb.clone(), vb.clone()
    ops.rope_and_store_kv_ref(pos, q_ref, k, v, emb.cos_sin_cache, hd, neox, kb_ref, vb_ref, loc, 0.75, 0.0625)
    kv_before = qkv[:, nq * hd:].clone()
    rope_kv_store.rope_and_store_kv(pos, q, k, v, emb.cos_sin_cache, hd, neox, kb, vb, loc, 0.75, 0.0625)
    assert torch.equal(qkv[:, nq * hd:], kv_before)
    assert not torch.isnan(kb.float()).any() and kb.float().abs().max().item() == torch.finfo(kv_dtype).max
    k2 = k.clone()  # the unfused chain: Triton RoPE (on a scratch q), then the pool's quantization
    rope.apply_rope(pos, torch.empty_like(q), k2, emb.cos_sin_cache, hd, neox)
    kb2, vb2 = kb_ref.clone(), vb_ref.clone()
    kb2[loc] = quantize_kv(k2.view(-1, nkv, hd), 0.75, kv_dtype)
    vb2[loc] = quantize_kv(v.reshape(-1, nkv, hd), 0.0625, kv_dtype)

    def interpreter_equal(a, b):
        a, b = a.float(), b.float()
        step = torch.finfo(kv_dtype).eps * b.abs().clamp_min(torch.finfo(kv_dtype).tiny)
        tie = (a - b).abs() <= step
        lost_carry = (b != 0) & (torch.log2(b.abs()) == torch.log2(b.abs()).round()) & (a == b / 2)
        return bool((tie | lost_carry).all()) and (a == b).float().mean().item() > 0.8

    for a, b, r in ((kb, kb2, kb_ref), (vb, vb2, vb_ref)):
        assert interpreter_equal(a, b) and interpreter_equal(a, r)
    with pytest.raises(ValueError, match="1.0 unless FP8"):
        rope_kv_store.rope_and_store_kv(pos, q, k, v, emb.cos_sin_cache, hd, neox, kb.float(), vb.float(), loc, 0.5)


def test_stories260k_triton_equals_torch_native_over_fp8_kv():
    """stories260K (fp32 compute) with an E4M3 cache and checkpoint-like scales: the Triton backend (fused RoPE +
    FP8 store, FP8 decode / extend kernels) gives the torch_native backend's logits through prefill and decode."""
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_loader.loader import load_model
    from sglang.test.model_harness import ModelHarness, greedy_logits

    path = shared_path("models", "stories260K")
    mc = ModelConfig.from_path(path, device="cpu")
    model = load_model(mc, "auto", "cpu")
    sc = KVScales((0.05, 0.08, 0.06, 0.07, 0.05), (0.004, 0.005, 0.006, 0.005, 0.006), "checkpoint")
    outs = {b: greedy_logits(ModelHarness(model, mc, max_reqs=4, max_len=24, attention_backend=b,
                                          kv_cache_dtype=E4M3, kv_scales=sc), steps=3)
            for b in ("torch_native", "triton")}
    for a, b in zip(outs["torch_native"], outs["triton"]):
        assert torch.equal(a.argmax(-1), b.argmax(-1))
        assert (a - b).abs().max().item() < 2e-2 * a.abs().max().item()
