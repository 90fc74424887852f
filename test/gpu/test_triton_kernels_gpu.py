"""GPU correctness of the Triton attention backend and fused-op kernels (compiled, bf16, larger shapes).

Attention vs the torch_native backend on random paged layouts (shuffled slots, cached prefixes, GQA 1/4/8,
head_dim 8/64/128/256, decode/extend/mixed), CUDA-graph replay of the decode path vs eager, and every fused op
vs its torch reference (the residual sum of add+RMSNorm must match bit for bit). Kernel modules are imported
inside the tests so that collecting this file never fixes Triton's interpreter mode for the CPU unit tests.
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

# The smoke selection (marker gpu) runs each kernel's path once: the first shape, the default launch (PDL where a
# kernel has it), bf16; the other shapes, launches and dtypes are gpu_extended.
DEV = "cuda"
TOL = {torch.float32: 5e-3, torch.float16: 4e-3, torch.bfloat16: 2e-2}  # fp32 dots run in TF32


def set_pdl(monkeypatch, pdl: str) -> None:
    """``pdl`` "default": SGLANG_DECODE_PDL unset (the GPU model's default: programmatic dependent launch on H100s,
    plain launches elsewhere); else the variable's value ("0": plain launches, "2": PDL)."""
    if pdl == "default":
        monkeypatch.delenv("SGLANG_DECODE_PDL", raising=False)
    else:
        monkeypatch.setenv("SGLANG_DECODE_PDL", pdl)


def close(a, b, dtype, scale=1.0):
    assert a.shape == b.shape and a.dtype == b.dtype
    err = (a.float() - b.float()).abs().max().item()
    tol = TOL[dtype] * max(b.float().abs().max().item(), 1.0) * scale
    assert err <= tol, f"max abs err {err} > {tol}"


def build_case(gen, prefix_lens, extend_lens, nh, nkv, hd, dtype, mode=None, layers=1):
    """Random paged batch on CUDA: (q, k, v, layer, make_batch(backend, layout="layer_major") -> ForwardBatch on a
    fresh pool copy of ``layers`` layers (layer 0 is used) stored in ``layout``)."""
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
    from sglang.srt.forward_batch_info import ForwardBatch, ForwardMode

    bs = len(prefix_lens)
    seq = [p + e for p, e in zip(prefix_lens, extend_lens)]
    total = sum(seq)
    nslots = total + 64
    perm = torch.randperm(nslots, generator=gen)[:total] + 1
    rows = torch.randperm(bs + 5, generator=gen)[:bs]
    max_ctx = max(seq) + 8
    r2t = torch.randint(0, nslots, (bs + 5, max_ctx), generator=gen, dtype=torch.int32)
    loc, off = [], 0
    for i in range(bs):
        r2t[rows[i], : seq[i]] = perm[off: off + seq[i]].to(torch.int32)
        loc.append(perm[off + prefix_lens[i]: off + seq[i]])
        off += seq[i]
    loc = torch.cat(loc).to(DEV)
    kinit = torch.randn(nslots + 1, nkv, hd, generator=gen).to(dtype).to(DEV)
    vinit = torch.randn(nslots + 1, nkv, hd, generator=gen).to(dtype).to(DEV)
    n = sum(extend_lens)
    q, k, v = (torch.randn(n, h * hd, generator=gen).to(dtype).to(DEV) for h in (nh, nkv, nkv))
    layer = RadixAttention(nh, hd, hd ** -0.5, nkv, 0)
    if mode is None:
        mode = ForwardMode.DECODE if all(e == 1 for e in extend_lens) else ForwardMode.MIXED \
            if any(e == 1 for e in extend_lens) else ForwardMode.EXTEND
    starts = [sum(extend_lens[:i]) for i in range(bs)]

    def t(x):
        return torch.tensor(x, dtype=torch.int64, device=DEV)

    def make_batch(backend, layout="layer_major"):
        pool = MHATokenToKVPool(nslots, 1, dtype, nkv, hd, layers, DEV, layout)
        pool.k_buffer[0].copy_(kinit)
        pool.v_buffer[0].copy_(vinit)
        rpool = ReqToTokenPool(bs + 5, max_ctx, DEV)
        rpool.req_to_token.copy_(r2t)
        fb = ForwardBatch(forward_mode=mode, batch_size=bs, input_ids=t([1] * n), positions=t([0] * n),
                          out_cache_loc=loc, req_pool_indices=rows.to(DEV), seq_lens=t(seq), prefix_lens=t(prefix_lens),
                          extend_lens=t(extend_lens), extend_start_loc=t(starts), seq_lens_cpu=seq,
                          prefix_lens_cpu=prefix_lens, extend_lens_cpu=extend_lens, req_to_token_pool=rpool,
                          token_to_kv_pool=pool, attn_backend=backend)
        backend.init_forward_metadata(fb)
        return fb

    return q, k, v, layer, make_batch


def run_both(q, k, v, layer, make_batch):
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend

    rfb = make_batch(TorchNativeAttnBackend())
    ref = rfb.attn_backend.forward(q, k, v, layer, rfb)
    fb = make_batch(TritonAttnBackend())
    out = fb.attn_backend.forward(q, k, v, layer, fb)
    assert torch.equal(fb.token_to_kv_pool.k_buffer[0], rfb.token_to_kv_pool.k_buffer[0])
    return out, ref


@pytest.mark.parametrize("nh,nkv,hd", gpu_tiered([(32, 8, 128), (8, 8, 64), (16, 4, 256), (8, 8, 8), (64, 8, 128)]))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decode_vs_torch_native(nh, nkv, hd, dtype):
    gen = torch.Generator().manual_seed(nh * hd)
    prefix = [int(x) for x in torch.randint(1, 2000, (24,), generator=gen)] + [1, 4095]
    out, ref = run_both(*build_case(gen, prefix, [1] * len(prefix), nh, nkv, hd, dtype))
    close(out, ref, dtype)


@pytest.mark.parametrize("nh,nkv,hd", gpu_tiered([(32, 8, 128), (8, 8, 64), (16, 4, 256), (8, 8, 8)]))
def test_extend_and_mixed_vs_torch_native(nh, nkv, hd):
    gen = torch.Generator().manual_seed(hd + 1)
    out, ref = run_both(*build_case(gen, [0, 300, 17, 1000], [700, 129, 1, 5], nh, nkv, hd, torch.bfloat16))
    close(out, ref, torch.bfloat16)
    out, ref = run_both(*build_case(gen, [0, 250], [1030, 64], nh, nkv, hd, torch.bfloat16))
    close(out, ref, torch.bfloat16)


@pytest.mark.parametrize("prefix,extend", gpu_tiered([([300, 17, 1000, 4095], [1, 1, 1, 1]),
                                                      ([0, 300, 17, 1000], [700, 129, 1, 5])], smoke=(1,),
                                                     ids=["decode", "mixed"]))
def test_token_major_pool_vs_layer_major(prefix, extend):
    """Compiled decode/extend kernels over a token-major pool (K/V buffers strided by 32 layers x 2 x
    8 heads x 128) equal the layer-major pool's output and the torch_native reference (Llama-3.1-8B heads, bf16)."""
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend

    gen = torch.Generator().manual_seed(sum(prefix) + len(extend))
    q, k, v, layer, make_batch = build_case(gen, prefix, extend, 32, 8, 128, torch.bfloat16, layers=32)
    outs = {}
    for layout in ("layer_major", "token_major"):
        fb = make_batch(TritonAttnBackend(), layout)
        assert fb.token_to_kv_pool.k_buffer[0].stride(0) == (8 * 128 if layout == "layer_major" else 32 * 2 * 8 * 128)
        outs[layout] = fb.attn_backend.forward(q, k, v, layer, fb)
    close(outs["token_major"], outs["layer_major"], torch.bfloat16, scale=0.1)
    _, ref = run_both(q, k, v, layer, make_batch)
    close(outs["token_major"], ref, torch.bfloat16)


@pytest.mark.parametrize("legacy", gpu_tiered([False, True]))
@pytest.mark.parametrize("bs", [1, 40, 128])
def test_decode_split_rules_vs_torch_native(bs, legacy):
    """The default decode kernel + 'wave' split rule (bs 128 on 132 SMs: one split, direct output, no
    reduce) and the legacy kernel + rule (SGLANG_TRITON_DECODE_LEGACY=1) both match torch_native at Llama-8B heads."""
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend

    gen = torch.Generator().manual_seed(bs + legacy)
    prefix = [int(x) for x in torch.randint(1, 1100, (bs,), generator=gen)]
    q, k, v, layer, make_batch = build_case(gen, prefix, [1] * bs, 32, 8, 128, torch.bfloat16)
    rfb = make_batch(TorchNativeAttnBackend())
    ref = rfb.attn_backend.forward(q, k, v, layer, rfb)
    backend = TritonAttnBackend(legacy_decode=legacy)
    fb = make_batch(backend)
    out = backend.forward(q, k, v, layer, fb)
    close(out, ref, torch.bfloat16)
    splits = fb.attn_metadata.num_kv_splits
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    if not legacy:
        assert splits == max(1, min(16, 2 * sms // (bs * 8)))  # 2 programs per SM (decode_attention.py)


@pytest.mark.parametrize("tile,pdl", gpu_tiered([("128/8/3", "0"), ("256/8/3", "0"), ("", "0"), ("", "default")],
                                                smoke=(3,)))
def test_decode_small_grid_tile_vs_torch_native(tile, pdl, monkeypatch):
    """SGLANG_DECODE_ATTN_SMALL_GRID_TILE at batch 32 (one split, 256 programs <= 2 per SM on an H100 or
    H200), and the default tile with programmatic dependent launch (the default) and without it
    (SGLANG_DECODE_PDL=0), match torch_native at Llama-8B heads."""
    set_pdl(monkeypatch, pdl)
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend
    from sgl_kernel.triton.decode_attention import small_grid_tile

    monkeypatch.setenv("SGLANG_DECODE_ATTN_SMALL_GRID_TILE", tile)
    bs = 32
    if tile and small_grid_tile(bs, 8, 1, torch.device(DEV)) is None:
        pytest.skip("fewer than 128 SMs: batch 32 is not a small grid here")
    gen = torch.Generator().manual_seed(27)
    prefix = [int(x) for x in torch.randint(1, 1100, (bs,), generator=gen)]
    q, k, v, layer, make_batch = build_case(gen, prefix, [1] * bs, 32, 8, 128, torch.bfloat16)
    rfb = make_batch(TorchNativeAttnBackend())
    ref = rfb.attn_backend.forward(q, k, v, layer, rfb)
    backend = TritonAttnBackend()
    fb = make_batch(backend)
    assert fb.attn_metadata.num_kv_splits == 1
    close(backend.forward(q, k, v, layer, fb), ref, torch.bfloat16)


@pytest.mark.parametrize("pdl", gpu_tiered(["0", "default"], smoke=(1,)))
def test_rope_and_store_kv_equals_rope_then_store_on_gpu(pdl, monkeypatch):
    """The fused RoPE + KV-store kernel writes the same pool bytes and q as apply_rope + indexed stores (bf16, fp32
    compute with a bf16 pool, Neox and GPT-J, partial rotary), leaves k/v alone, and the backend path through
    RadixAttention gives bit-identical attention with fused_rope on and off; with and without programmatic
    dependent launch. The kernel has no early-load variant (it wrote different k bytes on an H200)."""
    set_pdl(monkeypatch, pdl)
    from sglang.srt.layers.rotary_embedding import get_rope
    from sglang.srt.layers.triton_ops import rope, rope_kv_store

    gen = torch.Generator().manual_seed(19)
    n, nq, nkv, slots = 300, 32, 8, 4096
    for dtype, pool_dtype, hd, rot, neox in [(torch.bfloat16, torch.bfloat16, 128, 128, True),
                                             (torch.bfloat16, torch.bfloat16, 128, 128, False),
                                             (torch.float32, torch.bfloat16, 128, 64, True),
                                             (torch.float16, torch.float16, 64, 32, False)]:
        emb = get_rope(hd, rot, 8192, 500000.0, is_neox_style=neox).to(DEV)
        pos = torch.randint(0, 8192, (n,), generator=gen).to(DEV)
        qkv = torch.randn(n, (nq + 2 * nkv) * hd, generator=gen).to(dtype).to(DEV)
        q, kk, vv = qkv[:, : nq * hd], qkv[:, nq * hd: (nq + nkv) * hd], qkv[:, (nq + nkv) * hd:]
        loc = torch.randperm(slots, generator=gen)[:n].to(DEV)
        kb = torch.randn(slots, nkv, hd, generator=gen).to(pool_dtype).to(DEV)
        vb = torch.randn(slots, nkv, hd, generator=gen).to(pool_dtype).to(DEV)
        q2, k2, kb2, vb2 = q.clone(), kk.clone(), kb.clone(), vb.clone()
        rope.apply_rope(pos, q2, k2, emb.cos_sin_cache, hd, neox)
        kb2[loc] = k2.view(-1, nkv, hd).to(pool_dtype)
        vb2[loc] = vv.reshape(-1, nkv, hd).to(pool_dtype)
        kv_before = qkv[:, nq * hd:].clone()
        rope_kv_store.rope_and_store_kv(pos, q, kk, vv, emb.cos_sin_cache, hd, neox, kb, vb, loc)
        assert torch.equal(qkv[:, nq * hd:], kv_before)
        assert torch.equal(q, q2) and torch.equal(kb, kb2) and torch.equal(vb, vb2), (dtype, pool_dtype, hd, rot)
    _fused_backend_matches_unfused()


def _fused_backend_matches_unfused():
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend
    from sglang.srt.layers.rotary_embedding import get_rope

    gen = torch.Generator().manual_seed(7)
    prefix, extend = [300, 0, 17, 1000], [1, 129, 1, 1]
    q, k, v, layer, make_batch = build_case(gen, prefix, extend, 32, 8, 128, torch.bfloat16, layers=4)
    qkv = torch.cat([q, k, v], dim=1)
    emb = get_rope(128, 128, 4096, 500000.0).to(DEV)
    positions = torch.cat([torch.arange(p, p + e) for p, e in zip(prefix, extend)]).to(DEV)
    outs, pools = [], []
    for layout in ("layer_major", "token_major"):  # token-major: strided K/V buffers
        for fused in (True, False):
            fb = make_batch(TritonAttnBackend(fused_rope=fused), layout)
            x = qkv.clone()
            out = layer(x[:, : 32 * 128], x[:, 32 * 128: 40 * 128], x[:, 40 * 128:], fb, positions=positions,
                        rotary_emb=emb)
            outs.append(out)
            pools.append(fb.token_to_kv_pool)
    for out, pool in zip(outs[1:], pools[1:]):
        assert torch.equal(out, outs[0])
        assert torch.equal(pool.kv_layer_view, pools[0].kv_layer_view)


@pytest.mark.gpu
def test_sampling_columns_packed_copy_on_gpu():
    """columns_to_device on CUDA: one pinned copy, typed views with the values of separate tensors (odd sizes)."""
    from sglang.srt.utils.tensor_transfer import columns_to_device

    for bs in (1, 7, 128):
        cols = [(list(range(bs)), torch.float32), ([3 * i + 1 for i in range(bs)], torch.int64),
                ([i % 2 == 0 for i in range(bs)], torch.bool), ([0.5] * bs, torch.float32)]
        got = columns_to_device(cols, DEV)
        torch.cuda.synchronize()
        for t, (vals, dt) in zip(got, cols):
            assert t.is_cuda and t.dtype == dt and t.tolist() == torch.tensor(vals, dtype=dt).tolist()


@pytest.mark.parametrize("m,pdl", gpu_tiered([(1, "0"), (7, "0"), (16, "0"), (32, "0"), (1, "default"),
                                               (7, "default"), (32, "2")], smoke=(4,)))
def test_skinny_gemm_vs_cublas(m, pdl, monkeypatch):
    """The decode-batch weight-streaming GEMM equals F.linear within bf16 rounding at the Llama-3.1-8B qkv and
    down-projection shapes, with and without bias, one-pass and split-K; also launched with programmatic dependent
    launch and its L2 weight prefetch before the wait (SGLANG_DECODE_PDL=2; unset: the default, on for H100s,
    plain launches elsewhere) and with plain launches (=0)."""
    from sgl_kernel.triton.skinny_gemm import skinny_gemm

    set_pdl(monkeypatch, pdl)

    gen = torch.Generator().manual_seed(m)
    for n, k, bias in ((6144, 4096, False), (4096, 14336, True)):
        x = torch.randn(m, k, generator=gen).to(torch.bfloat16).to(DEV)
        w = (torch.randn(n, k, generator=gen) / k ** 0.5).to(torch.bfloat16).to(DEV)
        b = torch.randn(n, generator=gen).to(torch.bfloat16).to(DEV) if bias else None
        for split_k in (1, 4):
            close(skinny_gemm(x, w, b, split_k=split_k), torch.nn.functional.linear(x, w, b), torch.bfloat16)


@pytest.mark.parametrize("impl", gpu_tiered(["sdpa", "varlen"]))
def test_prefix_free_extend_rows_through_torch_attention_vs_torch_native(impl):
    """SGLANG_EXTEND_ATTENTION=sdpa / varlen: a chunked-prefill-like mixed batch (a continued row with a prefix, fresh
    rows of 1..1500 tokens, decode rows) at Llama-8B heads equals torch_native; the prefixed row stays on the Triton
    kernel."""
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend

    gen = torch.Generator().manual_seed(5 + (impl == "varlen"))
    prefix = [1200, 0, 0, 0, 700, 0]
    extend = [300, 1500, 2, 817, 1, 64]
    q, k, v, layer, make_batch = build_case(gen, prefix, extend, 32, 8, 128, torch.bfloat16)
    rfb = make_batch(TorchNativeAttnBackend())
    ref = rfb.attn_backend.forward(q, k, v, layer, rfb)
    backend = TritonAttnBackend(extend_impl=impl)
    fb = make_batch(backend)
    assert [n for _, n in fb.attn_metadata.dense_segments] == [1500, 2, 817, 64]
    close(backend.forward(q, k, v, layer, fb), ref, torch.bfloat16)


@pytest.mark.parametrize("policy,bs", gpu_tiered([("balanced", 160), ("balanced", 4), ("balanced", 24), ("wave", 4),
                                                  ("wave", 24), ("wave", 160)]))
def test_decode_variable_lengths_policies_in_graph_vs_torch_native(bs, policy):
    """Serving-like decode batches (contexts 1..6000 at Llama-8B heads) under the balanced split policy (rows longest
    first, length-aware splits) and the wave rule: a CUDA graph that captures the metadata (as the graph runner does)
    and is replayed with new lengths equals torch_native each time, and the balanced order follows the replayed
    lengths."""
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend

    gen = torch.Generator().manual_seed(bs * 3 + (policy == "wave"))
    prefix = [int(x) for x in torch.randint(1, 6000, (bs,), generator=gen)]
    q, k, v, layer, make_batch = build_case(gen, prefix, [1] * bs, 32, 8, 128, torch.bfloat16)
    backend = TritonAttnBackend(split_policy=policy)
    backend.init_cuda_graph_state(bs, 32, 128, 8, torch.device(DEV))
    fb = make_batch(backend)
    rfb = make_batch(TorchNativeAttnBackend())
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        backend.init_forward_metadata(fb)
        backend.forward(q, k, v, layer, fb)  # warm up (compile) outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        backend.init_forward_metadata(fb)
        out = backend.forward(q, k, v, layer, fb)
    for _ in range(2):
        new = torch.randint(1, max(fb.seq_lens_cpu) + 1, (bs,), generator=gen)
        fb.seq_lens.copy_(new.to(DEV))
        rfb.seq_lens.copy_(new.to(DEV))
        rfb.seq_lens_cpu[:] = new.tolist()
        q.copy_(torch.randn(q.shape, generator=gen).to(q.dtype))
        graph.replay()
        torch.cuda.synchronize()
        if policy == "balanced":
            got = fb.attn_metadata.decode_order.cpu()
            assert (new[got][:-1] >= new[got][1:]).all()
        ref = rfb.attn_backend.forward(q, k, v, layer, rfb)
        close(out, ref, torch.bfloat16)


@pytest.mark.parametrize("pdl", gpu_tiered(["0", "default", "2"], smoke=(1,)))
@pytest.mark.parametrize("bs", [16, 96])
def test_decode_cuda_graph_replay_equals_eager(bs, pdl, monkeypatch):
    """Graph replay equals eager at a multi-split size (16) and, on 132-SM parts, a one-split direct-output size
    (96); with the split kernel captured as a programmatic dependent launch (SGLANG_DECODE_PDL=2 on every GPU; the
    default on H100s), with the GPU model's default, and as a plain launch (=0)."""
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend

    set_pdl(monkeypatch, pdl)

    gen = torch.Generator().manual_seed(0)
    q, k, v, layer, make_batch = build_case(gen, [int(x) for x in torch.randint(1, 900, (bs,), generator=gen)],
                                            [1] * bs, 32, 8, 128, torch.bfloat16)
    backend = TritonAttnBackend()
    backend.init_cuda_graph_state(bs, 32, 128, 8, torch.device(DEV))
    fb = make_batch(backend)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        backend.forward(q, k, v, layer, fb)  # warm up (compile) outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.forward(q, k, v, layer, fb)
    for _ in range(2):  # new lengths and queries in the same static buffers
        fb.seq_lens.copy_(torch.randint(1, max(fb.seq_lens_cpu) + 1, (bs,), generator=gen).to(DEV))  # rows stay in bounds
        q.copy_(torch.randn(q.shape, generator=gen).to(q.dtype))
        graph.replay()
        eager = backend.forward(q, k, v, layer, fb)
        torch.cuda.synchronize()
        assert torch.equal(out, eager)


@pytest.mark.parametrize("pdl", ["0", "default"])
@pytest.mark.parametrize("dtype", gpu_tiered([torch.bfloat16, torch.float16, torch.float32]))
def test_fused_ops_vs_references(dtype, pdl, monkeypatch):
    set_pdl(monkeypatch, pdl)  # RMSNorm, SiLU-and-mul: plain or programmatic dependent launch
    from sglang.srt.layers import ops
    from sglang.srt.layers.activation import silu_and_mul_ref
    from sglang.srt.layers.layernorm import rmsnorm_ref
    from sglang.srt.layers.rotary_embedding import get_rope
    from sglang.srt.layers.triton_ops import activation, fused_add_rmsnorm, rope

    gen = torch.Generator().manual_seed(1)
    n, h = 257, 4096
    x = torch.randn(n, h, generator=gen).to(dtype).to(DEV)
    r = torch.randn(n, h, generator=gen).to(dtype).to(DEV)
    w = (torch.rand(h, generator=gen) + 0.5).to(dtype).to(DEV)
    y, s = rmsnorm_ref(x, w, 1e-5, r)
    xk, rk = x.clone(), r.clone()
    fused_add_rmsnorm.fused_add_rmsnorm(xk, rk, w, 1e-5)
    assert torch.equal(rk, s)
    close(xk, y, dtype, scale=0.5)
    close(ops.rmsnorm(x, w, 1e-5), rmsnorm_ref(x, w, 1e-5), dtype, scale=0.5)
    g = torch.randn(n, 2 * 1408, generator=gen).to(dtype).to(DEV)
    close(activation.silu_and_mul(g), silu_and_mul_ref(g), dtype, scale=0.5)
    for neox in (True, False):
        emb = get_rope(128, 128, 8192, 500000.0, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                       is_neox_style=neox).to(DEV)
        pos = torch.randint(0, 8192, (n,), generator=gen).to(DEV)
        qkv = torch.randn(n, 48 * 128, generator=gen).to(dtype).to(DEV)
        q, kk = qkv[:, : 32 * 128], qkv[:, 32 * 128: 40 * 128]
        wq, wk = emb(pos, q.clone(), kk.clone())
        rope.apply_rope(pos, q, kk, emb.cos_sin_cache, 128, neox)
        close(q, wq, dtype, scale=0.5)
        close(kk, wk, dtype, scale=0.5)


@pytest.mark.parametrize("n,e,k,renorm", gpu_tiered([(1, 8, 2, True), (37, 8, 2, True), (512, 60, 4, False),
                                                     (2048, 128, 8, True)], smoke=(1, 2)))
def test_moe_vs_references(n, e, k, renorm):
    from sglang.srt.layers import ops
    from sglang.srt.layers.moe.fused_moe import fused_moe_ref
    from sglang.srt.layers.moe.router import select_experts
    from sglang.srt.layers.triton_ops import moe

    gen = torch.Generator().manual_seed(n + e)
    h, i = 1024, 768
    logits = torch.randn(n, e, generator=gen).to(DEV)
    tw, tid = moe.fused_topk(logits, k, renorm)
    rw, rid = select_experts(logits, k, renorm)
    assert torch.equal(tid, rid)
    torch.testing.assert_close(tw, rw, rtol=1e-5, atol=1e-6)
    x = torch.randn(n, h, generator=gen).to(torch.bfloat16).to(DEV)
    w13 = (torch.randn(e, 2 * i, h, generator=gen) / h ** 0.5).to(torch.bfloat16).to(DEV)
    w2 = (torch.randn(e, h, i, generator=gen) / i ** 0.5).to(torch.bfloat16).to(DEV)
    want = fused_moe_ref(x, w13, w2, rw, rid)
    close(moe.fused_moe(x, w13, w2, tw, tid), want, torch.bfloat16, scale=2.0)
    close(ops.fused_moe(x, w13, w2, tw, tid), want, torch.bfloat16, scale=2.0)


def _pdl_chain(pdl: str, m: int, monkeypatch):
    """One decode MLP block as a chain of PDL-launched kernels in a CUDA graph (add + RMSNorm -> skinny gate_up ->
    SiLU-and-mul -> split-K skinny down, each reading the previous kernel's output): returns the outputs of two
    replays on fresh inputs written into the static buffers."""
    from sgl_kernel.triton.activation import silu_and_mul
    from sgl_kernel.triton.fused_add_rmsnorm import fused_add_rmsnorm
    from sgl_kernel.triton.skinny_gemm import skinny_gemm

    set_pdl(monkeypatch, pdl)
    gen = torch.Generator().manual_seed(272)
    h, i = 4096, 2048
    x, r = (torch.randn(m, h, generator=gen).to(torch.bfloat16).to(DEV) for _ in range(2))
    nw = (torch.rand(h, generator=gen) + 0.5).to(torch.bfloat16).to(DEV)
    w1 = (torch.randn(2 * i, h, generator=gen) / h ** 0.5).to(torch.bfloat16).to(DEV)
    w2 = (torch.randn(h, i, generator=gen) / i ** 0.5).to(torch.bfloat16).to(DEV)
    xs, rs = x.clone(), r.clone()

    def block():
        fused_add_rmsnorm(xs, rs, nw, 1e-5)
        return skinny_gemm(silu_and_mul(skinny_gemm(xs, w1, block_n=32, block_k=256)), w2, block_n=32,
                           block_k=256, split_k=4)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        block()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = block()
    outs = []
    for _ in range(2):
        xs.copy_(torch.randn(m, h, generator=gen).to(torch.bfloat16))
        rs.copy_(torch.randn(m, h, generator=gen).to(torch.bfloat16))
        graph.replay()
        outs.append((out.clone(), rs.clone()))
    torch.cuda.synchronize()
    return outs


@pytest.mark.parametrize("m", gpu_tiered([1, 32]))
def test_pdl_early_launch_chain_in_graph_equals_plain(m, monkeypatch):
    """Programmatic dependent launch (the default): with griddepcontrol.launch_dependents right after each
    kernel's wait and the skinny GEMM's L2 weight prefetch before it, a graph of dependent kernels gives
    bit-identical outputs to plain launches (SGLANG_DECODE_PDL=0; no kernel reads its input before the previous
    kernel finished writing it)."""
    plain = _pdl_chain("0", m, monkeypatch)
    early = _pdl_chain("default", m, monkeypatch)
    for (o0, r0), (o2, r2) in zip(plain, early):
        assert torch.equal(r0, r2) and torch.equal(o0, o2)
