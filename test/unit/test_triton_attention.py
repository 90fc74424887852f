"""Triton attention backend vs the torch_native reference, on CPU under the Triton interpreter.

Random paged layouts: shuffled KV slots, cached prefixes, GQA ratios 1/4/8,
head_dim 8/64/128, decode, extend and mixed batches. On a CUDA host this module
skips (``test/gpu/test_triton_kernels_gpu.py`` runs the compiled kernels), because
``TRITON_INTERPRET`` must be set before any kernel module is imported.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("CUDA host: the compiled kernels are tested in test/gpu/test_triton_kernels_gpu.py",
                allow_module_level=True)
if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.fail("triton was imported (by an earlier-collected test module) before TRITON_INTERPRET=1 was set, so its "
                "library functions are compiled-mode; import triton lazily in that module", pytrace=False)
os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

from sglang.srt.layers.attention import create_attention_backend  # noqa: E402
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend  # noqa: E402
from sglang.srt.layers.attention.triton_backend import TritonAttnBackend  # noqa: E402
from sglang.srt.layers.radix_attention import RadixAttention  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool  # noqa: E402
from sglang.srt.forward_batch_info import ForwardBatch, ForwardMode  # noqa: E402

TOL = {torch.float32: 2e-4, torch.float16: 3e-3, torch.bfloat16: 2e-2}


def build_case(gen: torch.Generator, prefix_lens: list[int], extend_lens: list[int], nh: int, nkv: int, hd: int,
               dtype: torch.dtype, device: str = "cpu", layers: int = 2, layer_id: int = 1):
    """Random paged batch: returns (q, k, v, layer, make_batch) where make_batch(backend, layout="layer_major") gives
    a ForwardBatch over a fresh copy of the same random pool, stored in ``layout``."""
    bs = len(prefix_lens)
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    total = sum(seq_lens)
    slots_total = total + 7
    perm = torch.randperm(slots_total, generator=gen)[:total] + 1  # slot 0 is the dummy page
    rows = torch.randperm(bs + 3, generator=gen)[:bs]
    max_ctx = max(seq_lens) + 5
    r2t = torch.randint(0, slots_total, (bs + 3, max_ctx), generator=gen, dtype=torch.int32)
    out_loc, off = [], 0
    for i in range(bs):
        s = perm[off: off + seq_lens[i]]
        r2t[rows[i], : seq_lens[i]] = s.to(torch.int32)
        out_loc.append(s[prefix_lens[i]:])
        off += seq_lens[i]
    out_loc = torch.cat(out_loc)
    k_init = [torch.randn(slots_total + 1, nkv, hd, generator=gen).to(dtype) for _ in range(layers)]
    v_init = [torch.randn(slots_total + 1, nkv, hd, generator=gen).to(dtype) for _ in range(layers)]
    n = sum(extend_lens)
    q = torch.randn(n, nh * hd, generator=gen).to(dtype).to(device)
    k = torch.randn(n, nkv * hd, generator=gen).to(dtype).to(device)
    v = torch.randn(n, nkv * hd, generator=gen).to(dtype).to(device)
    layer = RadixAttention(nh, hd, hd ** -0.5, nkv, layer_id)
    if all(e == 1 for e in extend_lens):
        mode = ForwardMode.DECODE
    elif any(e == 1 for e in extend_lens):
        mode = ForwardMode.MIXED
    else:
        mode = ForwardMode.EXTEND
    starts = [sum(extend_lens[:i]) for i in range(bs)]

    def make_batch(backend, layout: str = "layer_major"):
        pool = MHATokenToKVPool(slots_total, 1, dtype, nkv, hd, layers, device, layout)
        for li in range(layers):
            pool.k_buffer[li].copy_(k_init[li])
            pool.v_buffer[li].copy_(v_init[li])
        rpool = ReqToTokenPool(bs + 3, max_ctx, device)
        rpool.req_to_token.copy_(r2t)

        def t(x):
            return torch.tensor(x, dtype=torch.int64, device=device)

        fb = ForwardBatch(
            forward_mode=mode, batch_size=bs, input_ids=t([1] * n), positions=t([0] * n),
            out_cache_loc=out_loc.to(device), req_pool_indices=rows.to(device), seq_lens=t(seq_lens),
            prefix_lens=t(prefix_lens), extend_lens=t(extend_lens), extend_start_loc=t(starts),
            seq_lens_cpu=seq_lens, prefix_lens_cpu=prefix_lens, extend_lens_cpu=extend_lens,
            req_to_token_pool=rpool, token_to_kv_pool=pool, attn_backend=backend)
        backend.init_forward_metadata(fb)
        return fb

    return q, k, v, layer, make_batch


def run_both(q, k, v, layer, make_batch):
    ref_fb = make_batch(TorchNativeAttnBackend())
    ref = ref_fb.attn_backend.forward(q, k, v, layer, ref_fb)
    fb = make_batch(TritonAttnBackend())
    out = fb.attn_backend.forward(q, k, v, layer, fb)
    for a, b in ((fb.token_to_kv_pool.k_buffer, ref_fb.token_to_kv_pool.k_buffer),
                 (fb.token_to_kv_pool.v_buffer, ref_fb.token_to_kv_pool.v_buffer)):
        assert all(torch.equal(x, y) for x, y in zip(a, b)), "pool contents differ after the K/V write"
    return out, ref


def assert_close(out, ref, dtype):
    assert out.dtype == ref.dtype and out.shape == ref.shape
    err = (out.float() - ref.float()).abs().max().item()
    assert err <= TOL[dtype] * max(1.0, ref.float().abs().max().item()), f"max abs err {err}"


@pytest.mark.parametrize("nh,nkv,hd", [(4, 4, 8), (8, 2, 64), (16, 2, 128)])
def test_decode_matches_torch_native(nh, nkv, hd):
    gen = torch.Generator().manual_seed(100 + hd + nh)
    prefix = [int(x) for x in torch.randint(1, 90, (3,), generator=gen)]
    case = build_case(gen, prefix, [1] * 3, nh, nkv, hd, torch.float32)
    out, ref = run_both(*case)
    assert_close(out, ref, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_decode_low_precision(dtype):
    gen = torch.Generator().manual_seed(7)
    case = build_case(gen, [70, 3, 129], [1, 1, 1], 8, 1, 64, dtype)
    out, ref = run_both(*case)
    assert_close(out, ref, dtype)


@pytest.mark.parametrize("nh,nkv,hd", [(4, 4, 8), (8, 2, 64), (8, 1, 128)])
def test_extend_with_cached_prefix(nh, nkv, hd):
    gen = torch.Generator().manual_seed(200 + hd + nkv)
    case = build_case(gen, [0, 37, 5], [45, 20, 3], nh, nkv, hd, torch.float32)
    out, ref = run_both(*case)
    assert_close(out, ref, torch.float32)


@pytest.mark.parametrize("dtype,nh,nkv,hd", [(torch.float16, 8, 2, 64), (torch.bfloat16, 8, 2, 64),
                                             (torch.float32, 16, 2, 128), (torch.float32, 2, 2, 8)])
def test_mixed_decode_and_extend(dtype, nh, nkv, hd):
    gen = torch.Generator().manual_seed(11 + hd)
    q, k, v, layer, make_batch = build_case(gen, [40, 0, 17, 3, 90], [1, 33, 1, 9, 1], nh, nkv, hd, dtype)
    out, ref = run_both(q, k, v, layer, make_batch)
    assert_close(out, ref, dtype)
    backend = TritonAttnBackend()
    meta = make_batch(backend).attn_metadata
    assert meta.num_decode == 3 and meta.decode_token_index.tolist() == [0, 34, 44]  # decode rows use the decode kernel
    assert meta.extend_lens.tolist() == [33, 9] and meta.max_extend_len == 33


def test_registry_and_missing_metadata():
    backend = create_attention_backend("triton")
    assert isinstance(backend, TritonAttnBackend)
    gen = torch.Generator().manual_seed(3)
    q, k, v, layer, make_batch = build_case(gen, [4], [1], 2, 1, 8, torch.float32)
    fb = make_batch(backend)
    fb.attn_metadata = None  # a batch whose metadata was never built on it (per-batch state)
    with pytest.raises(ValueError, match="init_forward_metadata"):
        backend.forward(q, k, v, layer, fb)


def test_two_live_batches_and_token_splits_on_one_backend():
    """Per-batch metadata: two batches whose metadata was built before either ran give the same outputs as
    run one by one; a mixed batch split at every token boundary (straddling requests as extends) equals the
    unsplit torch reference."""
    gen = torch.Generator().manual_seed(21)
    case_a = build_case(gen, [12, 0, 5], [1, 9, 4], 4, 2, 16, torch.float32)
    case_b = build_case(gen, [3, 7], [6, 1], 4, 2, 16, torch.float32)
    backend = TritonAttnBackend()
    fb_a, fb_b = case_a[4](backend), case_b[4](backend)  # both live on one backend
    out_b = backend.forward(*case_b[:4], fb_b)
    out_a = backend.forward(*case_a[:4], fb_a)
    for (q, k, v, layer, make), out in ((case_a, out_a), (case_b, out_b)):
        ref_fb = make(TorchNativeAttnBackend())
        assert_close(out, ref_fb.attn_backend.forward(q, k, v, layer, ref_fb), torch.float32)
    q, k, v, layer, make = case_a
    ref_fb = make(TorchNativeAttnBackend())
    ref = ref_fb.attn_backend.forward(q, k, v, layer, ref_fb)
    for cut in range(1, q.shape[0]):
        fb = make(backend)
        parts = fb.split_tokens(cut)
        for p in parts:
            backend.init_forward_metadata(p)
        outs = [backend.forward(q[a:b], k[a:b], v[a:b], layer, p)
                for p, (a, b) in zip(parts, (p.token_range for p in parts))]
        assert_close(torch.cat(outs), ref, torch.float32)


def test_decode_workspace_outlives_growth():
    """A workspace buffer handed out (e.g. to a captured CUDA graph) is never freed when a larger batch grows the
    workspace: on H100 a freed buffer was reused for KV slot indices while graph replays kept writing into it."""
    import gc
    import weakref

    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend

    be = TritonAttnBackend()
    small = be._get_workspace(4, 2, 8, torch.device("cpu"))
    ref = weakref.ref(small)
    del small
    big = be._get_workspace(400, 2, 8, torch.device("cpu"))
    assert big.numel() >= 400 * 2 * 9
    gc.collect()
    assert ref() is not None, "the smaller workspace was freed while a graph may still use it"
    assert be._get_workspace(10, 2, 8, torch.device("cpu")) is big  # no growth: the same buffer


def test_two_live_batches_on_the_triton_backend():
    """Engine seam (per-batch attention state) on the Triton backend: metadata for two batches built before either
    runs (a decode batch and a mixed extend batch over cached prefixes), then both run through a small Llama in
    reverse order: logits equal running them one after the other, and equal the torch_native backend's."""
    import sys as _sys

    transformers = pytest.importorskip("transformers")
    _sys.path.insert(0, os.path.dirname(__file__))
    from model_harness import ModelHarness, randomize_weights

    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_loader.loader import load_model

    import tempfile

    cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    hf = transformers.LlamaForCausalLM(cfg).float().eval()
    randomize_weights(hf, int.from_bytes(os.urandom(2), "little"))
    d = tempfile.mkdtemp(prefix="two-live-")
    hf.save_pretrained(d)
    config = ModelConfig.from_path(d)
    mdl = load_model(config, "auto", "cpu")
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(2), "little"))
    rand = lambda n: torch.randint(0, 97, (n,), generator=gen).tolist()  # noqa: E731
    first = [("a", rand(5)), ("b", rand(7)), ("c", rand(3))]
    decode = [("a", rand(1)), ("b", rand(1))]
    mixed = [("c", rand(1)), ("d", rand(6))]

    def fresh(backend):
        h = ModelHarness(mdl, config)
        h.backend = backend
        h.kv = MHATokenToKVPool(size=8 * 96, page_size=1, dtype=torch.float32, head_num=2, head_dim=16, layer_num=2,
                                device="cpu")  # the real pool (one region, as the engine uses)
        h.step(first)
        return h, h.prepare(decode), h.prepare(mixed)

    results = {}
    for name, make in (("triton", TritonAttnBackend), ("torch_native", TorchNativeAttnBackend)):
        h, fb1, fb2 = fresh(make())
        seq1, seq2 = h.run(fb1), h.run(fb2)
        h, fb1, fb2 = fresh(make())
        h.backend.init_forward_metadata(fb1)
        h.backend.init_forward_metadata(fb2)
        with torch.inference_mode():
            live2 = mdl(fb2.input_ids, fb2.positions, fb2).next_token_logits
            live1 = mdl(fb1.input_ids, fb1.positions, fb1).next_token_logits
        torch.testing.assert_close(live1, seq1, atol=2e-4, rtol=1e-4)
        torch.testing.assert_close(live2, seq2, atol=2e-4, rtol=1e-4)
        results[name] = (live1, live2)
    for a, b in zip(results["triton"], results["torch_native"]):
        torch.testing.assert_close(a, b, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("prefix,extend", [([40, 7, 90], [1, 1, 1]), ([0, 37, 5], [45, 20, 3]),
                                           ([40, 0, 17], [1, 12, 1])], ids=["decode", "extend", "mixed"])
@pytest.mark.parametrize("backend", ["triton", "torch_native"])
def test_token_major_pool_equals_layer_major(prefix, extend, backend):
    """The token-major pool (``[slot, layer, K/V, head, head_dim]``: K/V buffers are strided views with a slot
    stride of layers x 2 x heads x head_dim) gives the same attention output as the layer-major pool, bit for bit
    (same kernels, same values, only the strides differ), and the same KV after the write; both equal the
    torch_native reference on the layer-major pool."""
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(2), "little"))  # fresh random inputs
    nh, nkv, hd, layers = 8, 2, 32, 3
    q, k, v, layer, make_batch = build_case(gen, prefix, extend, nh, nkv, hd, torch.float32, layers=layers)
    make = {"triton": TritonAttnBackend, "torch_native": TorchNativeAttnBackend}[backend]
    outs, pools = {}, {}
    for layout, slot_stride in (("layer_major", nkv * hd), ("token_major", layers * 2 * nkv * hd)):
        fb = make_batch(make(), layout)
        pool = fb.token_to_kv_pool
        assert pool.k_buffer[1].stride() == pool.v_buffer[1].stride() == (slot_stride, hd, 1)
        assert pool.describe().strides[pool.describe().dims.index("slot")] == slot_stride
        outs[layout] = fb.attn_backend.forward(q.clone(), k.clone(), v.clone(), layer, fb)
        pools[layout] = pool
    assert torch.equal(outs["token_major"], outs["layer_major"])
    assert torch.equal(pools["token_major"].kv_layer_view, pools["layer_major"].kv_layer_view)
    ref_fb = make_batch(TorchNativeAttnBackend())
    assert_close(outs["token_major"], ref_fb.attn_backend.forward(q, k, v, layer, ref_fb), torch.float32)


@pytest.mark.parametrize("prefix,extend,dtype,layout", [([40, 7, 90], [1, 1, 1], torch.float32, "layer_major"),
                                                        ([40, 0, 17], [1, 12, 1], torch.float32, "layer_major"),
                                                        ([30, 65], [1, 1], torch.bfloat16, "layer_major"),
                                                        ([40, 0, 17], [1, 12, 1], torch.float32, "token_major")])
def test_fused_rope_kv_store_through_radix_attention(monkeypatch, prefix, extend, dtype, layout):
    """RadixAttention with rotary_emb: the Triton backend's fused RoPE + KV store (kernel forced on CPU tensors under
    the interpreter) equals RoPE-then-attention on torch_native and on the Triton backend with fused_rope=False:
    outputs within rounding, pools equal (fp32: bit for bit up to RoPE rounding), q/k/v inputs usable as strided
    views of one qkv tensor; also into a token-major pool (strided K/V buffers)."""
    from sglang.srt.layers import ops
    from sglang.srt.layers.rotary_embedding import get_rope

    gen = torch.Generator().manual_seed(sum(prefix) + len(extend))
    nh, nkv, hd = 8, 2, 64
    q, k, v, layer, make_batch = build_case(gen, prefix, extend, nh, nkv, hd, dtype)
    qkv = torch.cat([q, k, v], dim=1)  # strided views, as after the fused qkv GEMM
    rot = get_rope(hd, hd, 512, 10000.0)
    positions = torch.cat([torch.arange(p, p + e) for p, e in zip(prefix, extend)])

    def run(backend, force_kernel):
        with monkeypatch.context() as m:
            if force_kernel:
                m.setattr(ops, "_triton", lambda t, name: ops._kernels(name))
            fb = make_batch(backend, layout)
            x = qkv.clone()
            qv, kv_, vv = x[:, : nh * hd], x[:, nh * hd: (nh + nkv) * hd], x[:, (nh + nkv) * hd:]
            out = layer(qv, kv_, vv, fb, positions=positions, rotary_emb=rot)
            assert torch.equal(x[:, nh * hd:], qkv[:, nh * hd:]) or not force_kernel  # fused path leaves k, v as is
            return out, fb.token_to_kv_pool

    ref, ref_pool = run(TorchNativeAttnBackend(), False)
    fused, fused_pool = run(TritonAttnBackend(fused_rope=True), True)
    plain, plain_pool = run(TritonAttnBackend(fused_rope=False), False)
    assert_close(fused, ref, dtype)
    assert_close(plain, ref, dtype)
    for a, b in ((fused_pool.k_buffer[1], ref_pool.k_buffer[1]), (fused_pool.v_buffer[1], ref_pool.v_buffer[1]),
                 (plain_pool.k_buffer[1], ref_pool.k_buffer[1])):
        assert_close(a, b, dtype)
    assert torch.equal(fused_pool.v_buffer[1], ref_pool.v_buffer[1])
    assert torch.equal(fused_pool.k_buffer[0], ref_pool.k_buffer[0])  # other layers untouched


def test_legacy_and_new_decode_agree():
    """SGLANG_TRITON_DECODE_LEGACY's kernel variant and the default give the same decode output (within rounding)."""
    gen = torch.Generator().manual_seed(21)
    q, k, v, layer, make_batch = build_case(gen, [33, 120, 4], [1, 1, 1], 8, 2, 64, torch.float32)
    outs = []
    for legacy in (True, False):
        fb = make_batch(TritonAttnBackend(legacy_decode=legacy))
        outs.append(fb.attn_backend.forward(q, k, v, layer, fb))
    assert_close(outs[1], outs[0], torch.float32)


@pytest.mark.parametrize("splits", [1, 4])
def test_model_level_triton_fused_path_matches_torch_native(tmp_path, monkeypatch, splits):
    """A tiny Llama through ModelRunner (prefill of 3 requests of different lengths, then 3 decode steps): the Triton
    backend with every kernel forced on CPU tensors under the interpreter (fused RoPE + KV store, decode at 1 split =
    direct output or 4 splits + reduce) gives the torch_native runner's logits within fp32 rounding, step by step."""
    import json

    from sglang.bench_one_batch import StaticBatch
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.layers import ops
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.server_args import ServerArgs

    (tmp_path / "config.json").write_text(json.dumps(dict(
        architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=64, hidden_size=64, intermediate_size=96,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        rms_norm_eps=1e-6, torch_dtype="float32")))

    def build(backend):
        args = ServerArgs(model_path=str(tmp_path), load_format="dummy", device="cpu", max_total_tokens=512,
                          max_running_requests=5, attention_backend=backend)
        r = ModelRunner(ModelConfig.from_path(str(tmp_path), None, "auto", "cpu"), args, "cpu")
        with torch.no_grad():
            g = torch.Generator().manual_seed(0)
            for p in r.model.parameters():
                p.copy_(torch.randn(p.shape, generator=g) / (p.shape[-1] ** 0.5 if p.dim() > 1 else 4.0)
                        + (p.dim() == 1))
        logits = []
        real = r.forward

        def forward(batch):
            out = real(batch)
            logits.append(out[0].next_token_logits.clone())
            return out

        r.forward = forward
        return r, logits

    prompts = [[3, 9, 27, 1, 5], [7] * 11, [2, 4]]
    results = []
    for backend in ("torch_native", "triton"):
        with monkeypatch.context() as m:
            if backend == "triton":
                m.setattr(ops, "_triton", lambda t, name: ops._kernels(name))
            r, logits = build(backend)
            if backend == "triton":
                assert r.attn_backend.fuses_rope_kv_store and r.attn_backend.fused_rope
                m.setattr(r.attn_backend, "num_kv_splits", lambda *a: splits)
            b = StaticBatch(r, prompts, 8)
            ids = b.step(prompts)
            for _ in range(3):
                ids = b.step([[t] for t in ids])
            b.free()
            results.append(logits)
    for want, got in zip(*results):
        assert_close(got, want, torch.float32)


def test_kernels_reject_a_non_contiguous_head_dim():
    """The kernels take any slot/head strides (token-major pools) but index head_dim densely: a K/V buffer whose
    last dim is strided is refused with a ValueError, never read wrong."""
    from sgl_kernel.triton.decode_attention import decode_attention_fwd
    from sgl_kernel.triton.extend_attention import extend_attention_fwd

    q = torch.randn(1, 2, 8)
    kb = torch.randn(6, 8, 2).transpose(1, 2)  # [slots, heads, head_dim] with head_dim strided
    r2t = torch.zeros(1, 4, dtype=torch.int32)
    one = torch.ones(1, dtype=torch.int64)
    with pytest.raises(ValueError, match="contiguous"):
        decode_attention_fwd(q, kb, kb, torch.empty_like(q), r2t, one - 1, one, 0.3, 1, torch.empty(1, 2, 1, 8),
                             torch.empty(1, 2, 1))
    with pytest.raises(ValueError, match="contiguous"):
        extend_attention_fwd(q, torch.empty_like(q), kb, kb, r2t, one - 1, one - 1, one, one - 1, 1, 0.3)
