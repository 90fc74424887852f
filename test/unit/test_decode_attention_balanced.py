"""The split-KV decode kernel's ``balanced`` launch (rows longest first, length-aware split counts) against a dense
softmax reference, on fresh random variable-length batches, on CPU under the Triton interpreter; and the backend's
policy switch. Skips on CUDA hosts (``test/gpu/test_triton_kernels_gpu.py`` runs the compiled kernels).
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

from sgl_kernel.triton.decode_attention import (BALANCED_MIN_SPLIT_LEN, decode_attention_fwd,  # noqa: E402
                                                decode_attention_workspace, decode_row_order, default_num_kv_splits)

TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


def dense_reference(q, kb, vb, r2t, rows, seq, scale):
    """Decode attention of each row over its first ``seq[b]`` slots, computed densely in fp32: [bs, nh, hd]."""
    bs, nh, _ = q.shape
    group = nh // kb.shape[1]
    out = torch.empty(q.shape, dtype=torch.float32)
    for b in range(bs):
        s = r2t[rows[b], : seq[b]].long()
        kk = kb[s].float().repeat_interleave(group, 1)  # [seq, nh, hd]
        vv = vb[s].float().repeat_interleave(group, 1)
        p = torch.softmax(torch.einsum("hd,shd->hs", q[b].float(), kk) * scale, -1)
        out[b] = torch.einsum("hs,shd->hd", p, vv)
    return out


def random_case(seed: int, lens: list[int], nh: int = 8, nkv: int = 2, hd: int = 32, dtype=torch.float32):
    """Fresh random paged batch: shuffled slots, shuffled request rows, K/V/q of ``dtype``."""
    gen = torch.Generator().manual_seed(seed)
    bs, ctx = len(lens), max(lens)
    slots = sum(lens) + 5
    rows = torch.randperm(bs + 2, generator=gen)[:bs]
    r2t = torch.randint(0, slots, (bs + 2, ctx + 3), generator=gen, dtype=torch.int32)
    perm = torch.randperm(slots, generator=gen)
    off = 0
    for i, n in enumerate(lens):
        r2t[rows[i], :n] = perm[off: off + n].to(torch.int32)
        off += n
    kb = torch.randn(slots, nkv, hd, generator=gen).to(dtype)
    vb = torch.randn(slots, nkv, hd, generator=gen).to(dtype)
    q = torch.randn(bs, nh, hd, generator=gen).to(dtype)
    return q, kb, vb, r2t, rows, torch.tensor(lens)


def run_kernel(case, splits: int, order, min_split_len: int):
    q, kb, vb, r2t, rows, seq = case
    out = torch.full_like(q, float("nan"))
    mid_o, mid_lse = decode_attention_workspace(q.shape[0], q.shape[1], q.shape[2], splits, torch.device("cpu"))
    mid_o.fill_(float("nan"))  # every partial the reduce reads must have been written by this launch
    mid_lse.fill_(float("nan"))
    decode_attention_fwd(q, kb, vb, out, r2t, rows, seq, 0.3, splits, mid_o, mid_lse, order=order,
                         min_split_len=min_split_len)
    return out


def check(out, ref, dtype):
    assert not torch.isnan(out).any(), "a row was left unwritten"
    err = (out.float() - ref).abs().max().item()
    assert err <= TOL[dtype] * max(1.0, ref.abs().max().item()) * 10, f"max abs err {err}"


@pytest.mark.parametrize("splits,min_split_len,order_kind", [
    (1, 0, "longest_first"), (3, 0, "random"), (4, 16, "none"), (8, 40, "random"),
    (16, BALANCED_MIN_SPLIT_LEN, "longest_first"), (16, 0, "none")])
def test_variable_lengths_match_dense_reference(splits, min_split_len, order_kind):
    """Rows from 1 key to several hundred (multiples of the tiles and not), every split count / length rule / order:
    the output equals the dense softmax; rows with one split (direct output) and rows the reduce merges both."""
    seed = 1000 * splits + min_split_len + {"none": 0, "longest_first": 1, "random": 2}[order_kind]
    gen = torch.Generator().manual_seed(seed)
    lens = [1, 2, 63, 64, 65, 128, 300] + torch.randint(1, 400, (5,), generator=gen).tolist()
    case = random_case(seed, lens)
    bs = len(lens)
    order = {"none": None, "longest_first": decode_row_order(case[5]),
             "random": torch.randperm(bs, generator=gen)}[order_kind]
    out = run_kernel(case, splits, order, min_split_len)
    check(out, dense_reference(*case[:6], 0.3), torch.float32)


def test_bf16_long_and_short_rows_balanced():
    """bf16 K/V and q, the backend's balanced launch (longest first, BALANCED_MIN_SPLIT_LEN) at 8 splits: one row of
    700 keys beside rows of a few keys."""
    case = random_case(7, [700, 3, 129, 1, 256], nh=4, nkv=1, hd=64, dtype=torch.bfloat16)
    out = run_kernel(case, 8, decode_row_order(case[5]), BALANCED_MIN_SPLIT_LEN)
    check(out, dense_reference(*case[:6], 0.3), torch.bfloat16)


def test_row_order_is_longest_first_permutation():
    gen = torch.Generator().manual_seed(3)
    seq = torch.randint(1, 5000, (37,), generator=gen)
    order = decode_row_order(seq)
    assert sorted(order.tolist()) == list(range(37))
    assert (seq[order][:-1] >= seq[order][1:]).all()


def test_balanced_policy_count_equals_wave_and_bad_arguments_raise():
    cpu = torch.device("cpu")
    for bs in (1, 8, 16, 33, 160, 256):
        assert default_num_kv_splits(bs, 8, cpu, 16, "balanced", num_sms=132) == \
            default_num_kv_splits(bs, 8, cpu, 16, "wave", num_sms=132)
    case = random_case(5, [5, 9])
    q, kb, vb, r2t, rows, seq = case
    mid_o, mid_lse = decode_attention_workspace(2, 8, 32, 2, cpu)
    with pytest.raises(ValueError, match="order"):
        decode_attention_fwd(q, kb, vb, torch.empty_like(q), r2t, rows, seq, 0.3, 2, mid_o, mid_lse,
                             order=torch.arange(3))
    with pytest.raises(ValueError, match="min_split_len"):
        decode_attention_fwd(q, kb, vb, torch.empty_like(q), r2t, rows, seq, 0.3, 2, mid_o, mid_lse, min_split_len=-1)
    with pytest.raises(ValueError, match="legacy"):
        decode_attention_fwd(q, kb, vb, torch.empty_like(q), r2t, rows, seq, 0.3, 2, mid_o, mid_lse,
                             order=torch.arange(2), legacy=True)


@pytest.mark.parametrize("policy", ["balanced", "wave", "legacy"])
def test_backend_policies_match_torch_native_on_variable_lengths(policy):
    """TritonAttnBackend under each split policy (CPU: 4 splits, so the balanced launch splits the long rows and runs
    the short ones directly) equals the torch_native backend on a decode batch of 1..520-key rows; the balanced
    metadata carries the longest-first order and the length rule, the others neither."""
    sys.path.insert(0, os.path.dirname(__file__))
    from test_triton_attention import assert_close, build_case  # the shared random paged batch builder

    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend

    gen = torch.Generator().manual_seed(11)
    prefix = [519, 2, 140, 0, 260, 33]
    q, k, v, layer, make_batch = build_case(gen, prefix, [1] * len(prefix), 4, 2, 16, torch.float32)
    ref_fb = make_batch(TorchNativeAttnBackend())
    ref = ref_fb.attn_backend.forward(q, k, v, layer, ref_fb)
    fb = make_batch(TritonAttnBackend(split_policy=policy))
    meta = fb.attn_metadata
    if policy == "balanced":
        assert meta.decode_order.tolist() == sorted(range(6), key=lambda i: -(prefix[i] + 1))
        assert meta.num_kv_splits == 4 and meta.min_split_len > 0
    else:
        assert meta.decode_order is None and meta.min_split_len == 0
    assert_close(fb.attn_backend.forward(q, k, v, layer, fb), ref, torch.float32)


def test_backend_policy_from_environment(monkeypatch):
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend

    assert TritonAttnBackend().split_policy == "balanced"
    monkeypatch.setenv("SGLANG_DECODE_SPLIT_POLICY", "wave")
    assert TritonAttnBackend().split_policy == "wave"
    monkeypatch.setenv("SGLANG_TRITON_DECODE_LEGACY", "1")
    assert TritonAttnBackend().split_policy == "legacy"
    monkeypatch.delenv("SGLANG_TRITON_DECODE_LEGACY")
    monkeypatch.setenv("SGLANG_DECODE_SPLIT_POLICY", "fastest")
    with pytest.raises(ValueError, match="SGLANG_DECODE_SPLIT_POLICY.*balanced"):
        TritonAttnBackend()
