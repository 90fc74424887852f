"""Prefix-free prefill rows through PyTorch's SDPA (``SGLANG_EXTEND_ATTENTION=sdpa``) inside the Triton backend: extend
and mixed batches (rows with and without cached prefixes, decode rows) equal the torch_native reference, on CPU under
the Triton interpreter for the rows that stay on the Triton kernels. The FlashAttention-2 varlen path is CUDA-only
(``test/gpu/test_triton_kernels_gpu.py``)."""

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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_triton_attention import assert_close, build_case  # noqa: E402

from sglang.srt.layers.attention.extend_dense import extend_impl_from_env, prefix_free_attention  # noqa: E402
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend  # noqa: E402
from sglang.srt.layers.attention.triton_backend import TritonAttnBackend  # noqa: E402


@pytest.mark.parametrize("prefix,extend,dtype", [
    ([0, 37, 0, 5, 0], [45, 20, 1, 3, 30], torch.float32),   # mixed: prefix-free, prefixed and decode rows
    ([0, 0, 0], [17, 64, 2], torch.bfloat16),                # extend: every row prefix-free (no Triton launch)
    ([12, 0, 40], [9, 33, 1], torch.float32)])               # mixed, one prefix-free row between prefixed ones
def test_sdpa_rows_match_torch_native(prefix, extend, dtype):
    gen = torch.Generator().manual_seed(sum(extend) + len(prefix))
    q, k, v, layer, make_batch = build_case(gen, prefix, extend, 8, 2, 16, dtype)
    ref_fb = make_batch(TorchNativeAttnBackend())
    ref = ref_fb.attn_backend.forward(q, k, v, layer, ref_fb)
    fb = make_batch(TritonAttnBackend(extend_impl="sdpa"))
    meta = fb.attn_metadata
    starts = [sum(extend[:i]) for i in range(len(extend))]
    assert list(meta.dense_segments) == [(starts[i], extend[i]) for i in range(len(extend))
                                         if prefix[i] == 0 and extend[i] > 1]
    if all(p == 0 for p in prefix) and all(e > 1 for e in extend):
        assert meta.req_pool_indices is None and meta.max_extend_len == 0  # nothing left for the extend kernel
    assert_close(fb.attn_backend.forward(q, k, v, layer, fb), ref, dtype)
    plain = make_batch(TritonAttnBackend(extend_impl="triton"))
    assert plain.attn_metadata.dense_segments == ()


def test_impl_choice_and_errors(monkeypatch):
    monkeypatch.delenv("SGLANG_EXTEND_ATTENTION", raising=False)
    assert extend_impl_from_env() == "triton" and TritonAttnBackend().extend_impl == "triton"
    monkeypatch.setenv("SGLANG_EXTEND_ATTENTION", "sdpa")
    assert TritonAttnBackend().extend_impl == "sdpa"
    monkeypatch.setenv("SGLANG_EXTEND_ATTENTION", "flash")
    with pytest.raises(ValueError, match="SGLANG_EXTEND_ATTENTION"):
        TritonAttnBackend()
    q = torch.zeros(4, 2, 8)
    kb = torch.zeros(9, 1, 8)
    with pytest.raises(ValueError, match="varlen"):
        prefix_free_attention(q, torch.empty_like(q), kb, kb, torch.arange(4), [(0, 4)], 0.3, "varlen")
    with pytest.raises(ValueError, match="impl"):
        prefix_free_attention(q, torch.empty_like(q), kb, kb, torch.arange(4), [(0, 4)], 0.3, "fast")
