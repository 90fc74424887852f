"""Paged-KV page tables (CSR) from the token-slot table ``req_to_token``, on the device.

FlashInfer's paged attention (Ye et al. 2025, "FlashInfer: Efficient and Customizable Attention Engine for LLM
Inference Serving", sec. 3.1: the block-sparse / page-table KV format) reads a batch's KV through three arrays:
``kv_indptr [bs + 1]`` (offsets of each request's pages), ``kv_indices [kv_indptr[-1]]`` (page ids in position order)
and ``kv_last_page_len [bs]`` (tokens in each request's last page, 1 .. page_size). Our KV pool hands out whole pages
and keeps ``slot % page_size == position % page_size`` (``mem_cache/allocator.py``), so request ``r``'s page ``j``
is ``req_to_token[req_pool_indices[r], j * page_size] // page_size``. The index arrays are small, the gather is not:
one program per request copies its page ids without a host round trip, so a batch's table is built in stream order
(before a CUDA-graph replay, or once per eager forward) from the device's ``req_to_token``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sgl_kernel.triton.common import check_cuda_or_interpret

BLOCK = 128


@triton.jit
def _page_table_kernel(ReqToToken, ReqPoolIdx, Indptr, Out, stride_rt, page_size, BLOCK: tl.constexpr):
    r = tl.program_id(0)
    row = tl.load(ReqPoolIdx + r).to(tl.int64)
    start = tl.load(Indptr + r)
    n = tl.load(Indptr + r + 1) - start
    for j0 in range(0, n, BLOCK):
        j = j0 + tl.arange(0, BLOCK)
        m = j < n
        slot = tl.load(ReqToToken + row * stride_rt + j.to(tl.int64) * page_size, mask=m, other=0)
        tl.store(Out + start + j, (slot // page_size).to(tl.int32), mask=m)


def pages_per_request(seq_lens: torch.Tensor, page_size: int) -> torch.Tensor:
    """``ceil(seq_lens / page_size)`` (any integer dtype, same device)."""
    return (seq_lens + page_size - 1) // page_size


def build_page_table(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, kv_indptr: torch.Tensor,
                     page_size: int, out: torch.Tensor) -> torch.Tensor:
    """Fill ``out[:kv_indptr[-1]]`` with each request's page ids (one Triton program per request).

    Args:
        req_to_token: ``[rows, max_context]`` int32 slot table, on CUDA (or CPU under ``TRITON_INTERPRET=1``).
        req_pool_indices: ``[bs]`` int (any width) rows of ``req_to_token``, same device.
        kv_indptr: ``[bs + 1]`` int32 page offsets (``0`` then the cumulative sum of :func:`pages_per_request`).
        page_size: tokens per page, >= 1.
        out: int32 ``[>= kv_indptr[-1]]`` on the device (a fixed buffer under CUDA graphs).
    Returns:
        ``out`` (entries past ``kv_indptr[-1]`` untouched).
    Raises:
        ValueError: tensors on the CPU without the interpreter, ``page_size < 1``, mismatched batch sizes.
    """
    check_cuda_or_interpret(req_to_token, req_pool_indices, kv_indptr, out, what="build_page_table")
    if page_size < 1:
        raise ValueError(f"build_page_table: page_size={page_size} must be >= 1")
    bs = req_pool_indices.shape[0]
    if kv_indptr.shape[0] != bs + 1:
        raise ValueError(f"build_page_table: kv_indptr has {kv_indptr.shape[0]} entries for {bs} requests")
    if out.dtype != torch.int32 or req_to_token.stride(1) != 1:
        raise ValueError("build_page_table: out must be int32 and req_to_token rows contiguous")
    if bs:
        _page_table_kernel[(bs,)](req_to_token, req_pool_indices, kv_indptr, out, req_to_token.stride(0), page_size,
                                  BLOCK=BLOCK)
    return out


def build_page_table_ref(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                         page_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Torch reference: ``(kv_indptr [bs + 1] int32, kv_indices int32, kv_last_page_len [bs] int32)`` of requests
    with ``seq_lens`` tokens (>= 1) in rows ``req_pool_indices`` of ``req_to_token`` (any device)."""
    n_pages = pages_per_request(seq_lens.long(), page_size)
    indptr = torch.zeros(len(seq_lens) + 1, dtype=torch.int32, device=seq_lens.device)
    indptr[1:] = torch.cumsum(n_pages, 0).to(torch.int32)
    rows = [req_to_token[int(r), : int(n) * page_size: page_size] // page_size
            for r, n in zip(req_pool_indices.tolist(), n_pages.tolist())]
    indices = torch.cat(rows).to(torch.int32) if rows else torch.zeros(0, dtype=torch.int32)
    last = ((seq_lens.long() - 1) % page_size + 1).to(torch.int32)
    return indptr, indices, last
