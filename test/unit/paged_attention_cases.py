"""Random paged attention batches for comparing an attention backend with torch_native (shared by
test/unit/test_flashinfer_backend.py and test/gpu/test_flashinfer_gpu.py; no environment side effects)."""

from __future__ import annotations

import torch

from sglang.srt.forward_batch_info import ForwardBatch, ForwardMode
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
from sglang.srt.layers.radix_attention import RadixAttention
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool


def paged_case(gen, prefix_lens, extend_lens, page_size, nh, nkv, hd, dtype, layout, shared_prefix=0, layers=2,
               device="cpu"):
    """A random batch in whole pages (``slot % page_size == position % page_size``, pages shuffled); requests 0 and 1
    share their first ``shared_prefix`` tokens' pages (a radix-cache hit). Returns (q, k, v, layer, make_batch):
    ``make_batch(backend)`` gives a ForwardBatch over a fresh copy of the same random pool on ``device``, its
    metadata built."""
    bs = len(prefix_lens)
    seq = [p + e for p, e in zip(prefix_lens, extend_lens)]
    n_pages = [(s + page_size - 1) // page_size for s in seq]
    free = (torch.randperm(sum(n_pages) + 6, generator=gen) + 1).tolist()  # page 0: the dummy page
    ctx = max(seq) + page_size
    r2t = torch.zeros(bs + 2, ctx, dtype=torch.int32)
    rows = torch.randperm(bs + 2, generator=gen)[:bs]
    out_loc = []
    for i in range(bs):
        pages = [free.pop() for _ in range(n_pages[i])]
        if i == 1 and shared_prefix:
            share = shared_prefix // page_size
            pages[:share] = [int(r2t[rows[0], j * page_size]) // page_size for j in range(share)]
        slots = torch.tensor([pages[t // page_size] * page_size + t % page_size for t in range(seq[i])])
        r2t[rows[i], : seq[i]] = slots.to(torch.int32)
        out_loc.append(slots[prefix_lens[i]:])
    out_loc = torch.cat(out_loc)
    slots_total = (max(max(r2t.max().item() // page_size + 1, 1), sum(n_pages) + 7) + 1) * page_size
    k_init = [torch.randn(slots_total + page_size, nkv, hd, generator=gen).to(dtype) for _ in range(layers)]
    v_init = [torch.randn(slots_total + page_size, nkv, hd, generator=gen).to(dtype) for _ in range(layers)]
    n = sum(extend_lens)
    q = torch.randn(n, nh * hd, generator=gen).to(dtype).to(device)
    k = torch.randn(n, nkv * hd, generator=gen).to(dtype).to(device)
    v = torch.randn(n, nkv * hd, generator=gen).to(dtype).to(device)
    layer = RadixAttention(nh, hd, hd ** -0.5, nkv, 1)
    mode = (ForwardMode.DECODE if all(e == 1 for e in extend_lens) else
            ForwardMode.MIXED if any(e == 1 for e in extend_lens) else ForwardMode.EXTEND)
    starts = [sum(extend_lens[:i]) for i in range(bs)]

    def make_batch(backend):
        pool = MHATokenToKVPool(slots_total, page_size, dtype, nkv, hd, layers, device, layout)
        for li in range(layers):
            pool.k_buffer[li].copy_(k_init[li])
            pool.v_buffer[li].copy_(v_init[li])
        rpool = ReqToTokenPool(bs + 2, ctx, device)
        rpool.req_to_token.copy_(r2t)

        def t(x):
            return torch.tensor(x, dtype=torch.int64, device=device)

        fb = ForwardBatch(
            forward_mode=mode, batch_size=bs, input_ids=t([1] * n), positions=t([0] * n),
            out_cache_loc=out_loc.to(device), req_pool_indices=rows.to(device), seq_lens=t(seq),
            prefix_lens=t(prefix_lens), extend_lens=t(extend_lens), extend_start_loc=t(starts), seq_lens_cpu=seq, prefix_lens_cpu=prefix_lens, extend_lens_cpu=extend_lens,
            req_to_token_pool=rpool, token_to_kv_pool=pool, attn_backend=backend)
        backend.init_forward_metadata(fb)
        return fb

    return q, k, v, layer, make_batch


def check_against_torch_native(case, backend, dtype):
    """Run ``case`` on ``backend`` and on torch_native: outputs within the dtype's rounding (fp32 1e-4, else 2e-2
    of the largest |output|), identical pools after the K/V store. Returns the backend's ForwardBatch."""
    q, k, v, layer, make_batch = case
    ref_fb = make_batch(TorchNativeAttnBackend())
    ref = ref_fb.attn_backend.forward(q, k, v, layer, ref_fb)
    fb = make_batch(backend)
    out = backend.forward(q, k, v, layer, fb)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    err = (out.float() - ref.float()).abs().max().item()
    assert err <= tol * max(1.0, ref.float().abs().max().item()), f"max abs err {err}"
    for a, b in ((fb.token_to_kv_pool.k_buffer, ref_fb.token_to_kv_pool.k_buffer),
                 (fb.token_to_kv_pool.v_buffer, ref_fb.token_to_kv_pool.v_buffer)):
        assert all(torch.equal(x, y) for x, y in zip(a, b)), "pool contents differ after the K/V store"
    return fb
