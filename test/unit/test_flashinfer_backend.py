"""``--attention-backend flashinfer`` without a GPU: the refusal before any worker starts when FlashInfer is missing,
the lazy import, the page-table kernel (Triton interpreter) against its torch reference, and the backend's glue
(page tables, plan arguments, the paged view of either pool layout, CUDA-graph re-planning) against the torch_native
backend, with FlashInfer's wrappers replaced by a torch model of their documented contract (paged KV in page-table
form, causal mask aligned to the end of each request's keys). The compiled kernels: test/gpu/test_flashinfer_gpu.py.
"""

from __future__ import annotations

import os
import sys
import types

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("CUDA host: test/gpu/test_flashinfer_gpu.py runs the compiled kernels", allow_module_level=True)
if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.fail("triton was imported (by an earlier-collected test module) before TRITON_INTERPRET=1 was set, so its "
                "library functions are compiled-mode; import triton lazily in that module", pytrace=False)
os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

from sglang.srt.layers.attention import create_attention_backend  # noqa: E402
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend  # noqa: E402
from sglang.srt.server_args import ServerArgs  # noqa: E402
from sgl_kernel.triton.page_table import build_page_table, build_page_table_ref  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from paged_attention_cases import check_against_torch_native as _check, paged_case  # noqa: E402


# ------------------------------------------------------------------ refusal and lazy import
def test_flag_is_refused_before_any_worker_when_flashinfer_is_missing(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "flashinfer" else real(name, *a))
    with pytest.raises(ValueError, match=r"--attention-backend='flashinfer' is invalid: FlashInfer is not installed; "
                                         r'pip install "sglang\[flashinfer\]"'):
        ServerArgs(model_path="m", attention_backend="flashinfer")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "flashinfer" else real(name, *a))
    assert ServerArgs(model_path="m", attention_backend="flashinfer").resolved_attention_backend == "flashinfer"


def test_backend_creation_without_flashinfer_names_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # an import of it raises ImportError
    with pytest.raises(ImportError, match=r'pip install "sglang\[flashinfer\]"'):
        create_attention_backend("flashinfer")


def test_help_names_the_extra():
    from sglang.srt.server_args_help import SERVER_ARGS_HELP

    assert 'pip install "sglang[flashinfer]"' in SERVER_ARGS_HELP["attention_backend"]


# ------------------------------------------------------------------ page tables
@pytest.mark.parametrize("page_size", [1, 16])
def test_page_table_kernel_matches_reference(page_size):
    gen = torch.Generator().manual_seed(page_size)
    rows, ctx = 9, 300
    r2t = torch.randint(0, 5000, (rows, ctx), generator=gen, dtype=torch.int32)
    for _ in range(5):
        bs = int(torch.randint(1, rows, (1,), generator=gen))
        rpi = torch.randperm(rows, generator=gen)[:bs]
        seq = torch.randint(1, ctx + 1, (bs,), generator=gen)
        indptr, want, _ = build_page_table_ref(r2t, rpi, seq, page_size)
        out = torch.full((int(indptr[-1]) + 7,), -5, dtype=torch.int32)
        build_page_table(r2t, rpi, indptr, page_size, out)
        assert torch.equal(out[: int(indptr[-1])], want) and (out[int(indptr[-1]):] == -5).all()
    with pytest.raises(ValueError, match="kv_indptr has"):
        build_page_table(r2t, rpi, indptr[:-1], page_size, out)


# ------------------------------------------------------------------ a torch model of FlashInfer's wrappers
class _Wrapper:
    """FlashInfer's documented paged-attention contract in torch: request r's keys are its pages
    ``indices[indptr[r]:indptr[r+1]]`` in order, all full but the last (``last_page_len[r]`` tokens); query row i of
    ``qo_len`` new rows sees keys ``0 .. kv_len - qo_len + i`` when causal (decode: all keys). Records its plans."""

    plans: list = []

    def __init__(self, workspace, layout="NHD", use_cuda_graph=False, use_tensor_cores=False,
                 paged_kv_indptr_buffer=None, paged_kv_indices_buffer=None, paged_kv_last_page_len_buffer=None,
                 backend="auto", **kw):
        assert layout == "NHD" and backend == "fa2" and workspace.dtype == torch.uint8
        self.graph = use_cuda_graph
        self.fixed = (paged_kv_indptr_buffer, paged_kv_indices_buffer, paged_kv_last_page_len_buffer)
        if use_cuda_graph:
            assert all(isinstance(b, torch.Tensor) for b in self.fixed)
        self.decode = isinstance(self, _Decode)

    def reset_workspace_buffer(self, float_ws, int_ws):
        assert float_ws.dtype == int_ws.dtype == torch.uint8

    def _plan(self, qo_indptr, indptr, indices, last, nh, nkv, hd, ps, causal, q_data_type, kv_data_type, sm_scale):
        for t in (indptr, last) + (() if qo_indptr is None else (qo_indptr,)):
            assert t.device.type == "cpu" and t.dtype == torch.int32  # host arrays: the plan needs no device sync
        assert indices.dtype == torch.int32 and indices.shape[0] == int(indptr[-1])
        if self.graph:  # fixed buffers: the plan copies into them (the page ids may already be there)
            assert len(last) == len(self.fixed[2])
            self.fixed[2].copy_(last)
            assert indices.data_ptr() != self.fixed[1].data_ptr()  # never copied onto itself
            self.fixed[1][: indices.shape[0]].copy_(indices)
            indices = self.fixed[1][: indices.shape[0]]
        self.p = dict(qo=qo_indptr, indptr=indptr.tolist(), indices=indices, last=last.tolist(), nh=nh, nkv=nkv,
                      hd=hd, ps=ps, causal=causal, scale=sm_scale, q_dtype=q_data_type, kv_dtype=kv_data_type)
        _Wrapper.plans.append((type(self).__name__, self.graph, len(last)))

    def run(self, q, paged_kv_cache, out=None, k_scale=None, v_scale=None):
        """FP8 pages (``kv_data_type`` of the plan) are widened exactly; ``k_scale`` multiplies the softmax scale and
        ``v_scale`` the output, as FlashInfer's run() documents (None: 1.0)."""
        p = self.p
        k_pages, v_pages = paged_kv_cache
        assert k_pages.shape[1:] == (p["ps"], p["nkv"], p["hd"]) and q.dtype == p["q_dtype"]
        assert k_pages.dtype == v_pages.dtype == p["kv_dtype"]  # FlashInfer checks the planned KV dtype
        self.last_scales = (k_scale, v_scale)
        k_pages, v_pages = k_pages.float(), v_pages.float()
        bs = len(p["last"])
        qo = p["qo"].tolist() if p["qo"] is not None else list(range(bs + 1))
        group = p["nh"] // p["nkv"]
        for r in range(bs):
            pages = p["indices"][p["indptr"][r]: p["indptr"][r + 1]].long()
            kv_len = (len(pages) - 1) * p["ps"] + p["last"][r]
            k = k_pages[pages].reshape(-1, p["nkv"], p["hd"])[:kv_len].float().repeat_interleave(group, 1)
            v = v_pages[pages].reshape(-1, p["nkv"], p["hd"])[:kv_len].float().repeat_interleave(group, 1)
            qr = q[qo[r]: qo[r + 1]].float()
            s = torch.einsum("qhd,khd->hqk", qr, k) * (p["scale"] * (1.0 if k_scale is None else k_scale))
            n = qr.shape[0]
            if p["causal"]:
                allowed = torch.arange(kv_len)[None, :] <= (kv_len - n + torch.arange(n))[:, None]
                s = s.masked_fill(~allowed[None], float("-inf"))
            o = torch.einsum("hqk,khd->qhd", s.softmax(-1), v)
            out[qo[r]: qo[r + 1]] = (o * (1.0 if v_scale is None else v_scale)).to(out.dtype)
        return out


class _Decode(_Wrapper):
    def plan(self, indptr, indices, last, nh, nkv, hd, ps, q_data_type=None, kv_data_type=None, sm_scale=None):
        self._plan(None, indptr, indices, last, nh, nkv, hd, ps, False, q_data_type, kv_data_type, sm_scale)


class _Prefill(_Wrapper):
    def plan(self, qo_indptr, indptr, indices, last, nh, nkv, hd, ps, causal=False, q_data_type=None,
             kv_data_type=None, sm_scale=None):
        self._plan(qo_indptr, indptr, indices, last, nh, nkv, hd, ps, causal, q_data_type, kv_data_type, sm_scale)


@pytest.fixture
def fake_flashinfer(monkeypatch):
    mod = types.ModuleType("flashinfer")
    mod.BatchDecodeWithPagedKVCacheWrapper = _Decode
    mod.BatchPrefillWithPagedKVCacheWrapper = _Prefill
    monkeypatch.setitem(sys.modules, "flashinfer", mod)
    monkeypatch.setattr("sglang.srt.layers.attention.flashinfer_backend.WORKSPACE_BYTES", 1 << 10)
    _Wrapper.plans = []
    return mod


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("layout", ["layer_major", "token_major"])
def test_backend_equals_torch_native_on_paged_batches(fake_flashinfer, page_size, layout):
    gen = torch.Generator().manual_seed(page_size + len(layout))
    backend = create_attention_backend("flashinfer")
    cases = [([37, 0, 5], [1, 1, 1], 0),          # decode
             ([0, 21, 3], [40, 19, 3], 0),        # extend with cached prefixes
             ([48, 48, 0, 9], [1, 30, 17, 1], 32)]  # mixed, requests 0 and 1 sharing 32 prefix tokens' pages
    for prefix, extend, shared in cases:
        for dtype, nh, nkv in ((torch.float32, 8, 2), (torch.bfloat16, 4, 4)):
            case = paged_case(gen, prefix, extend, page_size, nh, nkv, 16, dtype, layout, shared_prefix=shared)
            fb = _check(case, backend, dtype)
            want = "_Decode" if all(e == 1 for e in extend) else "_Prefill"
            assert _Wrapper.plans[-1] == (want, False, len(prefix))
            assert fb.attn_metadata.wrapper.p["causal"] == (want == "_Prefill")
            assert fb.attn_metadata.wrapper.p["scale"] == case[3].scaling


def test_graph_replay_is_replanned_with_the_replayed_lengths(fake_flashinfer):
    """The graph path: a decode wrapper per captured size on fixed buffers, planned at the warm-up's first layer,
    then re-planned before each replay from the host sequence lengths and the staged request rows."""
    gen = torch.Generator().manual_seed(5)
    backend = create_attention_backend("flashinfer")
    backend.init_cuda_graph_state(4, 8, 16, 2, torch.device("cpu"))
    q, k, v, layer, make_batch = paged_case(gen, [3, 60, 17, 1], [1, 1, 1, 1], 16, 8, 2, 16, torch.float32,
                                            "layer_major")
    fb = make_batch(TorchNativeAttnBackend())
    fb.attn_backend = backend
    backend.init_graph_metadata(fb)  # what CudaGraphRunner calls at capture
    backend.forward(q, k, v, layer, fb)  # the warm-up plans it
    assert _Wrapper.plans[-1] == ("_Decode", True, 4)
    ref_fb = make_batch(TorchNativeAttnBackend())
    ref = ref_fb.attn_backend.forward(q, k, v, layer, ref_fb)
    assert torch.allclose(backend.forward(q, k, v, layer, fb), ref, atol=1e-4)  # the captured forward: no plan
    assert len(_Wrapper.plans) == 1
    # before a replay: other lengths for the same staged rows -> the graph's wrapper is re-planned with them
    lens = [20, 33, 1, 16]
    backend.plan_graph_replay(fb, lens)
    p = fb.attn_metadata.wrapper.p
    indptr, indices, last = build_page_table_ref(fb.req_to_token_pool.req_to_token, fb.req_pool_indices,
                                                 torch.tensor(lens), 16)
    assert _Wrapper.plans[-1] == ("_Decode", True, 4) and p["indptr"] == indptr.tolist()
    assert p["last"] == last.tolist() and torch.equal(p["indices"], indices)
    fb.batch_size = 3
    with pytest.raises(ValueError, match="no captured, planned graph"):
        backend.plan_graph_replay(fb, lens[:3])


# ------------------------------------------------------------------ FP8 KV cache
@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("page_size", [1, 16])
def test_fp8_pool_is_read_with_the_layer_scales(fake_flashinfer, kv_dtype, page_size):
    """``--kv-cache-dtype fp8_*`` with FlashInfer: the plan names the FP8 KV dtype, the run gets the layer's
    (non-unit, per-layer) K/V scales, and the outputs equal torch_native's dequantized reference on the same FP8
    bytes for decode, extend-with-prefix and mixed batches; the new K/V are stored by the same rule (identical
    pools). A BF16 pool passes no scales."""
    from sglang.test.kv_cases import paged_case as kv_case

    backend = create_attention_backend("flashinfer")
    for seed, (prefix, extend) in enumerate((([37, 0, 5], [1, 1, 1]), ([0, 21, 3], [40, 19, 3]),
                                             ([48, 9], [30, 1]))):
        case = kv_case(seed + page_size, prefix, extend, 8, 2, 16, kv_dtype, torch.bfloat16, page_size=page_size)
        fb = _check((case.q, case.k, case.v, case.layer, case.make_batch), backend, torch.bfloat16)
        w = fb.attn_metadata.wrapper
        li = case.layer.layer_id
        assert w.p["kv_dtype"] == kv_dtype and w.last_scales == (case.scales.k[li], case.scales.v[li])
        assert case.scales.k[li] != 1.0 and case.scales.v[li] != 1.0
    bf16 = kv_case(3, [5], [1], 8, 2, 16, torch.bfloat16, torch.bfloat16)
    fb = _check((bf16.q, bf16.k, bf16.v, bf16.layer, bf16.make_batch), backend, torch.bfloat16)
    assert fb.attn_metadata.wrapper.last_scales == (None, None)


def test_fp8_scales_are_not_ignored(fake_flashinfer, monkeypatch):
    """The check above can fail: a run() that drops the scales misses torch_native's output by far more than the
    tolerance."""
    from sglang.test.kv_cases import paged_case as kv_case

    case = kv_case(11, [40, 7], [1, 1], 8, 2, 16, torch.float8_e4m3fn, torch.bfloat16)
    args = (case.q, case.k, case.v, case.layer, case.make_batch)
    backend = create_attention_backend("flashinfer")
    _check(args, backend, torch.bfloat16)
    run = _Wrapper.run
    monkeypatch.setattr(_Wrapper, "run", lambda self, q, kv, out=None, **kw: run(self, q, kv, out=out))
    with pytest.raises(AssertionError, match="max abs err"):
        _check(args, create_attention_backend("flashinfer"), torch.bfloat16)


def test_fp8_fused_rope_store_quantizes_with_the_layer_scales(fake_flashinfer):
    """The model's path (RoPE handed to the backend): FlashInfer rotates and stores K/V in one call, an FP8 pool
    quantized with the layer's scales, giving the same pool bytes and outputs as RoPE first + torch_native."""
    from sglang.srt.layers.rotary_embedding import get_rope
    from sglang.test.kv_cases import paged_case as kv_case

    case = kv_case(21, [0, 13], [9, 4], 8, 2, 16, torch.float8_e4m3fn, torch.bfloat16, page_size=16)
    rot = get_rope(16, 16, 64, 10000.0)
    pos = torch.tensor(list(range(9)) + list(range(13, 17)))
    backend = create_attention_backend("flashinfer")
    fb = case.make_batch(backend)
    out = backend.forward(case.q.clone(), case.k, case.v, case.layer, fb, rope=(pos, rot))
    ref_fb = case.make_batch(TorchNativeAttnBackend())
    rq, rk = rot(pos, case.q.clone(), case.k.clone())
    ref = ref_fb.attn_backend.forward(rq, rk, case.v, case.layer, ref_fb)
    li = case.layer.layer_id
    for a, b in ((fb.token_to_kv_pool.get_key_buffer(li), ref_fb.token_to_kv_pool.get_key_buffer(li)),
                 (fb.token_to_kv_pool.get_value_buffer(li), ref_fb.token_to_kv_pool.get_value_buffer(li))):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    assert (out.float() - ref.float()).abs().max().item() <= 2e-2 * max(1.0, ref.float().abs().max().item())
