"""Random paged attention batches over a KV pool of any format (BF16, FP8 with per-layer scales), shared by the FP8 KV
tests (CPU interpreter, GPU) and ``benchmark/attention/bench_fp8_kv_decode.py``.

:func:`paged_case` hands out pages of ``page_size`` slots in a shuffled order (so requests are non-contiguous, as
after the radix cache and the allocator have churned), fills every slot of every layer through the pool's own
``set_kv_buffer`` (FP8 pools quantize with their scales) and returns a factory for ForwardBatches over fresh copies
of that pool, so two backends can be run on identical bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from sglang.srt.forward_batch_info import ForwardBatch, ForwardMode
from sglang.srt.layers.radix_attention import RadixAttention
from sglang.srt.mem_cache.kv_quant import KVScales, is_fp8
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool


@dataclass
class PagedCase:
    """One batch: ``q`` ``[N, nh * hd]``, ``k`` / ``v`` ``[N, nkv * hd]`` (the new tokens, in ``q``'s dtype and
    device), the ``layer`` (last layer of the pool), and ``make_batch(backend) -> ForwardBatch`` over a fresh pool
    copy (metadata initialised by ``backend``)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    layer: RadixAttention
    make_batch: Callable
    scales: Optional[KVScales]


def random_scales(gen: torch.Generator, layers: int) -> KVScales:
    """Per-layer scales like a calibrated checkpoint's: K in [0.02, 0.22], V in [0.005, 0.055]."""
    return KVScales(tuple(float(x) for x in torch.rand(layers, generator=gen) * 0.2 + 0.02),
                    tuple(float(x) for x in torch.rand(layers, generator=gen) * 0.05 + 0.005), "checkpoint")


def paged_case(seed: int, prefix_lens: Sequence[int], extend_lens: Sequence[int], nh: int, nkv: int, hd: int,
               kv_dtype: torch.dtype, q_dtype: torch.dtype, page_size: int = 1, layers: int = 2,
               device: str = "cpu", scales: Optional[KVScales] = None, k_std: float = 3.0) -> PagedCase:
    """A random paged batch (module doc). Request i has ``prefix_lens[i]`` cached tokens and ``extend_lens[i]`` new
    ones (all 1: a DECODE batch; some 1: MIXED; none: EXTEND). FP8 ``kv_dtype`` gets ``scales`` (default
    :func:`random_scales`); K values are N(0, ``k_std``^2), V values N(0, 1). Everything is drawn from a CPU
    generator seeded with ``seed`` and moved to ``device``.

    Raises:
        ValueError: the lists differ in length, or scales for a non-FP8 ``kv_dtype``.
    """
    if len(prefix_lens) != len(extend_lens):
        raise ValueError(f"paged_case: {len(prefix_lens)} prefix lengths for {len(extend_lens)} extend lengths")
    gen = torch.Generator().manual_seed(seed)
    bs = len(prefix_lens)
    seq = [p + e for p, e in zip(prefix_lens, extend_lens)]
    pages = [-(-s // page_size) for s in seq]
    n_pages = sum(pages) + 3
    order = (torch.randperm(n_pages, generator=gen) + 1).tolist()  # page 0 is the pool's dummy page
    slots_total = (n_pages + 1) * page_size
    max_ctx = max(seq) + 5
    r2t = torch.zeros(bs + 2, max_ctx, dtype=torch.int32)
    rows = torch.randperm(bs + 2, generator=gen)[:bs]
    out_loc = []
    for i in range(bs):
        mine = [order.pop() for _ in range(pages[i])]
        s = torch.tensor([p * page_size + j for p in mine for j in range(page_size)][: seq[i]])
        r2t[rows[i], : seq[i]] = s.to(torch.int32)
        out_loc.append(s[prefix_lens[i]:])
    out_loc = torch.cat(out_loc).to(device)
    if is_fp8(kv_dtype):
        scales = scales or random_scales(gen, layers)
    elif scales is not None:
        raise ValueError(f"paged_case: scales given for the unscaled KV dtype {kv_dtype}")
    k_all = [torch.randn(slots_total - page_size, nkv, hd, generator=gen) * k_std for _ in range(layers)]
    v_all = [torch.randn(slots_total - page_size, nkv, hd, generator=gen) for _ in range(layers)]
    n = sum(extend_lens)
    q = torch.randn(n, nh * hd, generator=gen).to(q_dtype).to(device)
    k = (torch.randn(n, nkv * hd, generator=gen) * k_std).to(q_dtype).to(device)
    v = torch.randn(n, nkv * hd, generator=gen).to(q_dtype).to(device)
    layer = RadixAttention(nh, hd, hd ** -0.5, nkv, layers - 1)
    mode = ForwardMode.DECODE if all(e == 1 for e in extend_lens) else (
        ForwardMode.MIXED if any(e == 1 for e in extend_lens) else ForwardMode.EXTEND)

    def make_batch(backend) -> ForwardBatch:
        pool = MHATokenToKVPool(slots_total - page_size, page_size, kv_dtype, nkv, hd, layers, device,
                                scales=scales)
        every = torch.arange(page_size, slots_total, device=device)
        for li in range(layers):
            pool.set_kv_buffer(li, every, k_all[li].to(device), v_all[li].to(device))
        rpool = ReqToTokenPool(bs + 2, max_ctx, device)
        rpool.req_to_token.copy_(r2t.to(device))

        def t(x):
            return torch.tensor(x, dtype=torch.int64, device=device)

        fb = ForwardBatch(
            forward_mode=mode, batch_size=bs, input_ids=t([1] * n), positions=t([0] * n), out_cache_loc=out_loc,
            req_pool_indices=rows.to(device=device, dtype=torch.int64), seq_lens=t(seq), prefix_lens=t(prefix_lens),
            extend_lens=t(extend_lens), extend_start_loc=t([sum(extend_lens[:i]) for i in range(bs)]),
            seq_lens_cpu=list(seq), prefix_lens_cpu=list(prefix_lens), extend_lens_cpu=list(extend_lens),
            req_to_token_pool=rpool, token_to_kv_pool=pool, attn_backend=backend)
        backend.init_forward_metadata(fb)
        return fb

    return PagedCase(q, k, v, layer, make_batch, scales)
