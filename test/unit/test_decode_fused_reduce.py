"""The fused split reduce of the decode kernel (``counters=`` / ``SGLANG_DECODE_FUSED_REDUCE=1``) vs the two-launch
path and a dense torch softmax reference, on CPU under the Triton interpreter: 1/3/16 splits, several batch sizes,
GQA 4, page sizes 1 and 16, fresh random inputs; the arrival counters are zero again after every call.

The interpreter runs the programs of a launch one after another, so these tests check the merge arithmetic and the
counter bookkeeping; the memory ordering on a GPU is checked in the PTX (test_triton_aot.py) and by
test/gpu/test_triton_kernels_gpu.py. Skips on CUDA hosts (TRITON_INTERPRET must be set before triton is imported).
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

from sglang.srt.layers.attention.triton_ops import (decode_attention_fwd, decode_attention_workspace,  # noqa: E402
                                                     decode_reduce_counters)

CPU = torch.device("cpu")


def paged_case(gen: torch.Generator, seq_lens: list[int], page_size: int, nh: int = 8, nkv: int = 2, hd: int = 32,
               dtype: torch.dtype = torch.float32):
    """Random paged decode batch: each request owns distinct random pages of ``page_size`` slots; returns
    (q [bs, nh, hd], k_buf, v_buf [slots, nkv, hd], req_to_token [bs + 2, max_ctx] int32, req_pool_indices [bs],
    seq_lens [bs] int64)."""
    bs = len(seq_lens)
    max_ctx = max(seq_lens) + page_size
    pages_per_req = [-(-s // page_size) for s in seq_lens]
    n_pages = sum(pages_per_req) + 3
    pages = torch.randperm(n_pages, generator=gen)
    rows = torch.randperm(bs + 2, generator=gen)[:bs]
    r2t = torch.randint(0, n_pages * page_size, (bs + 2, max_ctx), generator=gen, dtype=torch.int32)
    off = 0
    for i, s in enumerate(seq_lens):
        own = pages[off: off + pages_per_req[i]]
        off += pages_per_req[i]
        pos = torch.arange(s)
        r2t[rows[i], :s] = (own[pos // page_size] * page_size + pos % page_size).to(torch.int32)
    slots = n_pages * page_size
    kb = torch.randn(slots, nkv, hd, generator=gen).to(dtype)
    vb = torch.randn(slots, nkv, hd, generator=gen).to(dtype)
    q = torch.randn(bs, nh, hd, generator=gen).to(dtype)
    return q, kb, vb, r2t, rows, torch.tensor(seq_lens, dtype=torch.int64)


def dense_reference(q, kb, vb, r2t, rows, seq, scale):
    """Softmax attention per request over its gathered K/V (fp32), [bs, nh, hd]."""
    nh, nkv = q.shape[1], kb.shape[1]
    out = []
    for b in range(q.shape[0]):
        s = r2t[rows[b], : seq[b]].long()
        kk = kb[s].float().repeat_interleave(nh // nkv, 1)
        vv = vb[s].float().repeat_interleave(nh // nkv, 1)
        p = torch.softmax(torch.einsum("hd,shd->hs", q[b].float(), kk) * scale, -1)
        out.append(torch.einsum("hs,shd->hd", p, vv))
    return torch.stack(out)


def run(q, kb, vb, r2t, rows, seq, splits, counters):
    bs, nh, hd = q.shape
    out = torch.full_like(q, float("nan"))
    mid_o, mid_lse = decode_attention_workspace(bs, nh, hd, splits, CPU)
    mid_o.fill_(float("nan"))
    mid_lse.fill_(float("nan"))
    decode_attention_fwd(q, kb, vb, out, r2t, rows, seq, 0.2, splits, mid_o, mid_lse, counters=counters)
    return out


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("splits", [1, 3, 16])
@pytest.mark.parametrize("seq_lens", [[70], [1, 45, 130, 17, 64]])
def test_fused_reduce_matches_unfused_and_reference(seq_lens, splits, page_size):
    gen = torch.Generator().manual_seed(splits * 31 + page_size + len(seq_lens))
    case = paged_case(gen, seq_lens, page_size)
    counters = decode_reduce_counters(len(seq_lens), 2, CPU)
    fused = run(*case, splits, counters)
    unfused = run(*case, splits, None)
    ref = dense_reference(*case, 0.2)
    assert not fused.isnan().any()
    assert (fused - unfused).abs().max().item() <= 1e-5
    assert (fused - ref).abs().max().item() <= 1e-4 * max(1.0, ref.abs().max().item())
    assert torch.equal(counters, torch.zeros_like(counters)), counters


def test_counters_are_zero_after_each_call_and_reusable():
    """One counter buffer (larger than needed, as the backend keeps it) serves repeated calls of different batch sizes
    and split counts; it holds zeros after each, and the untouched tail is never written."""
    gen = torch.Generator().manual_seed(5)
    counters = decode_reduce_counters(8, 2, CPU)
    counters[12:] = 7  # beyond bs * num_kv_heads of every call below: must stay as it is
    for seq_lens, splits in (([33, 90, 5], 4), ([120], 16), ([9, 9, 64, 2, 100, 77], 3)):
        case = paged_case(gen, seq_lens, 16, dtype=torch.bfloat16)
        out = run(*case, splits, counters)
        ref = dense_reference(*case, 0.2)
        assert (out.float() - ref).abs().max().item() <= 2e-2 * max(1.0, ref.abs().max().item())
        assert torch.equal(counters[:12], torch.zeros(12, dtype=torch.int32)), counters
        assert torch.equal(counters[12:], torch.full((4,), 7, dtype=torch.int32))


def test_nonzero_counter_changes_who_merges():
    """The counter decides which program merges: a counter left at 1 makes split 1 of 3 merge before split 2 wrote
    its partial (so the fused path really reads the counter and the test above can fail)."""
    gen = torch.Generator().manual_seed(9)
    case = paged_case(gen, [150], 1)
    counters = decode_reduce_counters(1, 2, CPU)
    counters[0] = 1
    out = run(*case, 3, counters)
    assert out[0, :4].isnan().all() and not out[0, 4:].isnan().any()  # KV head 0's merge read the NaN partial
    assert counters.tolist() == [1, 0]


def test_bad_counters_raise():
    gen = torch.Generator().manual_seed(1)
    q, kb, vb, r2t, rows, seq = paged_case(gen, [10, 20], 1)
    mid_o, mid_lse = decode_attention_workspace(2, 8, 32, 2, CPU)
    for bad in (torch.zeros(3, dtype=torch.int32), torch.zeros(4, dtype=torch.int64)):
        with pytest.raises(ValueError, match="counters"):
            decode_attention_fwd(q, kb, vb, torch.empty_like(q), r2t, rows, seq, 0.2, 2, mid_o, mid_lse, counters=bad)
