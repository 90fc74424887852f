"""FP8 KV cache (``--kv-cache-dtype``) on CPU: the flag's values and refusals, the quantization rule (scaled,
saturated, round-to-nearest-even), the pool (FP8 storage, per-layer scales, twice the tokens for the same bytes from
the real ModelRunner budget path), checkpoint scales (every published name style; malformed ones refused; the model
loader skips them), and the KV region descriptor (dtype, element size and scales travel; mismatches refused; transfer
byte counts at one byte per element)."""

from __future__ import annotations

import json
import os
import shutil

import msgspec
import pytest
import torch

from conftest import shared_path

from sglang.srt.mem_cache import kv_quant
from sglang.srt.mem_cache.kv_cache import KVCache
from sglang.srt.mem_cache.kv_descriptor import KVRegionDescriptor, check_peer_ranks, check_same_format
from sglang.srt.mem_cache.kv_quant import KVScales, dequantize_kv, quantize_kv
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.srt.model_loader import kv_scales as ks
from sglang.srt.server_args import ServerArgs, prepare_server_args

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
GiB = 1 << 30


# ---- the flag ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["auto", "bf16", "bfloat16", "fp8_e4m3", "fp8_e5m2"])
def test_supported_values_parse(name):
    assert prepare_server_args(["--kv-cache-dtype", name]).kv_cache_dtype == name
    assert ServerArgs().kv_cache_dtype == "auto"  # SGLang's default


@pytest.mark.parametrize("name,why", [("nvfp4", "is not supported here"), ("mxfp8", "is not supported here"),
                                      ("fp4_e2m1", "is not supported here"), ("int8", "is unknown"),
                                      ("fp8", "is unknown")])
def test_other_values_are_refused_naming_the_supported_ones(name, why):
    with pytest.raises(ValueError, match=why) as e:
        ServerArgs(kv_cache_dtype=name)
    msg = str(e.value)
    assert f"--kv-cache-dtype={name!r}" in msg and "auto, bf16, bfloat16, fp8_e4m3, fp8_e5m2" in msg


def test_fp8_is_accepted_with_every_attention_backend(monkeypatch):
    """Every registered attention backend reads an FP8 cache with its scales (torch_native and triton here and in
    test_fp8_kv_triton.py, flashinfer in test_flashinfer_backend.py), so none is refused; a new backend must join
    those tests before this set is widened."""
    import importlib.util

    from sglang.srt.layers.attention import _REGISTRY

    assert set(_REGISTRY) == {"torch_native", "triton", "flashinfer"}
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "flashinfer" else real(name, *a))
    for backend in sorted(_REGISTRY):
        for name in ("fp8_e4m3", "fp8_e5m2"):
            assert ServerArgs(kv_cache_dtype=name, attention_backend=backend).kv_cache_dtype == name


def test_resolve_follows_sglang_meaning():
    assert kv_quant.resolve_kv_cache_dtype("auto", torch.float32) == torch.float32  # the model's dtype
    assert kv_quant.resolve_kv_cache_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert kv_quant.resolve_kv_cache_dtype("bf16", torch.float32) == torch.bfloat16
    assert kv_quant.resolve_kv_cache_dtype("bfloat16", torch.float16) == torch.bfloat16
    assert kv_quant.resolve_kv_cache_dtype("fp8_e4m3", torch.bfloat16) == E4M3
    assert kv_quant.resolve_kv_cache_dtype("fp8_e5m2", torch.bfloat16) == E5M2


# ---- quantization rule ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_quantize_saturates_instead_of_nan(dtype):
    big = torch.tensor([1e6, -1e6, 1000.0, -70000.0])
    q = quantize_kv(big, 1.0, dtype)
    m = torch.finfo(dtype).max
    assert not torch.isnan(q.float()).any()
    assert q.float().abs().max().item() == m
    assert torch.equal(q.float().sign(), big.sign())


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("scale", [1.0, 0.0375, 3.5])
def test_quantize_is_scaled_round_to_nearest_even(dtype, scale):
    gen = torch.Generator().manual_seed(int(scale * 100))
    x = (torch.randn(4096, generator=gen) * 40 * scale).to(torch.bfloat16)
    q = quantize_kv(x, scale, dtype)
    # in range: the same as torch's RNE cast of fp32(x) * fp32(1 / scale)
    ref = (x.float() * (1.0 / scale)).clamp(-torch.finfo(dtype).max, torch.finfo(dtype).max).to(dtype)
    assert torch.equal(q.view(torch.uint8), ref.view(torch.uint8))
    # dequantized: within half an FP8 step of x for normal values (2^-4 relative for E4M3, 2^-3 for E5M2)
    d = dequantize_kv(q, scale, torch.float32)
    rel = torch.finfo(dtype).eps / 2
    normal = (x.float().abs() / scale >= torch.finfo(dtype).tiny) & (x.float().abs() / scale <= torch.finfo(dtype).max)
    err = (d - x.float()).abs()[normal] / x.float().abs()[normal]
    assert err.max().item() <= rel * (1 + 1e-6)


def test_quantize_rejects_bad_scales():
    with pytest.raises(ValueError, match="scale"):
        quantize_kv(torch.ones(2), 0.0, E4M3)
    with pytest.raises(ValueError, match="unscaled"):
        quantize_kv(torch.ones(2), 2.0, torch.bfloat16)
    with pytest.raises(ValueError, match="finite and > 0"):
        KVScales((1.0, float("inf")), (1.0, 1.0))
    with pytest.raises(ValueError, match="V scales"):
        KVScales((1.0,), (1.0, 1.0))


# ---- the pool ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["layer_major", "token_major"])
@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_pool_stores_scaled_fp8(layout, dtype):
    scales = KVScales((0.5, 0.125), (2.0, 0.25), "checkpoint")
    pool = MHATokenToKVPool(16, 1, dtype, 2, 8, 2, "cpu", layout, scales)
    assert pool.kv_data.dtype == torch.uint8 and pool.kv_data.element_size() == 1
    gen = torch.Generator().manual_seed(5)
    loc = torch.tensor([3, 9, 4])
    k, v = torch.randn(3, 2, 8, generator=gen) * 20, torch.randn(3, 2, 8, generator=gen)
    pool.set_kv_buffer(1, loc, k, v)
    kb, vb = pool.get_kv_buffer(1)
    assert kb.dtype == dtype and vb.dtype == dtype
    assert torch.equal(kb[loc].view(torch.uint8), quantize_kv(k, 0.125, dtype).view(torch.uint8))
    assert torch.equal(vb[loc].view(torch.uint8), quantize_kv(v, 0.25, dtype).view(torch.uint8))
    assert (pool.k_scale(1), pool.v_scale(1), pool.k_scale(0), pool.v_scale(0)) == (0.125, 0.25, 0.5, 2.0)
    assert pool.get_key_buffer(0).view(torch.uint8).count_nonzero() == 0  # other layer untouched


def test_pool_scales_default_and_refusals():
    pool = MHATokenToKVPool(8, 1, E4M3, 1, 4, 3, "cpu")
    assert pool.scales.is_unit and pool.scales.num_layers == 3
    assert MHATokenToKVPool(8, 1, torch.bfloat16, 1, 4, 3, "cpu").scales is None
    assert MHATokenToKVPool(8, 1, torch.bfloat16, 1, 4, 3, "cpu").k_scale(2) == 1.0
    with pytest.raises(ValueError, match="only for FP8"):
        MHATokenToKVPool(8, 1, torch.bfloat16, 1, 4, 3, "cpu", scales=KVScales.unit(3))
    with pytest.raises(ValueError, match="3 layers"):
        MHATokenToKVPool(8, 1, E4M3, 1, 4, 3, "cpu", scales=KVScales.unit(2))


def test_fp8_pool_is_half_the_bytes_of_bf16():
    per16 = MHATokenToKVPool.bytes_per_token(8, 128, 32, torch.bfloat16)
    assert per16 == 128 << 10  # Llama-3.1-8B
    assert MHATokenToKVPool.bytes_per_token(8, 128, 32, E4M3) * 2 == per16
    a = MHATokenToKVPool(1024, 16, torch.bfloat16, 2, 8, 2, "cpu")  # + a 16-slot dummy page each
    b = MHATokenToKVPool(2048, 16, E4M3, 2, 8, 2, "cpu")
    assert a.kv_size_bytes() == (1024 + 16) * (2 * 2 * 8 * 2) * 2 and b.kv_size_bytes() == (2048 + 16) * (2 * 2 * 8 * 2)


def test_capacity_doubles_from_the_memory_budget(monkeypatch):
    """The real ModelRunner sizing path (stories260K) with a fake 80 GiB device: an FP8 KV cache gets twice the
    tokens of a BF16 one, in the same bytes."""
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_executor import model_runner as mr
    from sglang.srt.model_executor import worker_builder

    path = shared_path("models", "stories260K")
    real = worker_builder.kv_budget_tokens
    seen = {}

    def budget_on_a_fake_gpu(args, device, bytes_per_token, page_size, reserve_bytes=0, fixed_bytes=0):
        seen[args.kv_cache_dtype] = bytes_per_token
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (60 << 20, 80 << 20))  # MiB-sized fake GPU
        return real(args, torch.device("cuda", 0), bytes_per_token, page_size, reserve_bytes, fixed_bytes)

    monkeypatch.setattr(mr, "kv_budget_tokens", budget_on_a_fake_gpu)
    runners = {}
    for name in ("bf16", "fp8_e4m3"):
        args = ServerArgs(model_path=path, device="cpu", kv_cache_dtype=name, page_size=16, mem_fraction_static=0.9,
                          max_running_requests=4)
        runners[name] = mr.ModelRunner(ModelConfig.from_path(path), args, "cpu")
    bf16, fp8 = runners["bf16"], runners["fp8_e4m3"]
    assert seen["bf16"] == 2 * seen["fp8_e4m3"] == 2 * 2 * 4 * 8 * 5  # 4 KV heads x 8 dims x 5 layers, K and V
    assert bf16.token_to_kv_pool.dtype == torch.bfloat16 and fp8.token_to_kv_pool.dtype == E4M3
    assert abs(fp8.max_total_tokens - 2 * bf16.max_total_tokens) <= 16  # whole pages
    assert fp8.max_total_tokens > 10000
    assert abs(fp8.token_to_kv_pool.kv_size_bytes() - bf16.token_to_kv_pool.kv_size_bytes()) <= 2 * 16 * seen["bf16"]


# ---- checkpoint scales ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name,want", [
    ("model.layers.3.self_attn.k_scale", (3, "k")), ("model.layers.0.self_attn.v_scale", (0, "v")),
    ("model.layers.12.self_attn.attn.k_scale", (12, "k")), ("model.layers.1.self_attn.k_proj.k_scale", (1, "k")),
    ("model.layers.1.self_attn.v_proj.v_scale", (1, "v")), ("model.layers.2.self_attn.k_proj.output_scale", (2, "k")),
    ("model.layers.2.self_attn.v_proj.output_scale", (2, "v")), ("model.layers.7.self_attn.kv_scale", (7, "kv")),
    ("layers.4.self_attn.k_scale", (4, "k")),
    ("model.layers.1.self_attn.k_proj.weight_scale", None), ("model.layers.1.self_attn.k_proj.input_scale", None),
    ("model.layers.1.self_attn.q_proj.output_scale", None), ("model.layers.1.mlp.down_proj.weight_scale_inv", None),
    ("model.layers.1.self_attn.k_proj.weight", None)])
def test_scale_names(name, want):
    assert ks.parse_kv_scale_name(name) == want
    assert ks.is_kv_scale_name(name) == (want is not None)


def _save(path, tensors):
    from safetensors.torch import save_file

    save_file(tensors, path)
    return path


def test_read_scales_in_every_published_style(tmp_path):
    t = torch.tensor
    f1 = _save(str(tmp_path / "a.safetensors"), {
        "model.layers.0.self_attn.k_scale": t(0.5), "model.layers.0.self_attn.v_scale": t([0.25]),
        "model.layers.1.self_attn.k_proj.k_scale": t(2.0), "model.layers.1.self_attn.v_proj.v_scale": t(4.0),
        "model.layers.0.self_attn.k_proj.weight": torch.zeros(2, 2)})
    f2 = _save(str(tmp_path / "b.safetensors"), {
        "model.layers.2.self_attn.kv_scale": t(0.75),
        "model.layers.3.self_attn.k_proj.output_scale": t(1.5, dtype=torch.bfloat16),
        "model.layers.3.self_attn.v_proj.output_scale": t(3.0)})
    got = ks.read_kv_scales([f1, f2], 5)
    assert got.source == "checkpoint"
    assert got.k == (0.5, 2.0, 0.75, 1.5, 1.0) and got.v == (0.25, 4.0, 0.75, 3.0, 1.0)  # layer 4: none -> 1.0
    assert ks.read_kv_scales([_save(str(tmp_path / "c.safetensors"), {"x.weight": torch.zeros(1)})], 5) is None
    k_only = _save(str(tmp_path / "d.safetensors"), {"model.layers.0.self_attn.k_scale": t(0.5)})
    assert ks.read_kv_scales([k_only], 1).v == (0.5,)  # V takes K's scale (as vLLM does for kv_scale)


@pytest.mark.parametrize("tensors,match", [
    ({"model.layers.9.self_attn.k_scale": torch.tensor(1.0)}, "names layer 9"),
    ({"model.layers.0.self_attn.k_scale": torch.ones(4)}, "per-tensor"),
    ({"model.layers.0.self_attn.v_scale": torch.tensor(0.0)}, "finite and > 0"),
    ({"model.layers.0.self_attn.v_scale": torch.tensor(float("nan"))}, "finite and > 0")])
def test_malformed_scales_are_refused(tmp_path, tensors, match):
    f = _save(str(tmp_path / "m.safetensors"), tensors)
    with pytest.raises(ValueError, match=match) as e:
        ks.read_kv_scales([f], 2)
    assert "m.safetensors" in str(e.value)


def test_checkpoint_with_scales_loads_and_serves_its_scales(tmp_path):
    """stories260K plus k_scale / v_scale tensors (llm-compressor names): the model loads (the loader skips the
    scales), an FP8 KV cache takes them, an ``auto`` cache ignores them."""
    from safetensors.torch import load_file, save_file

    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_executor.model_runner import ModelRunner

    src = shared_path("models", "stories260K")
    dst = tmp_path / "stories260K-kvscales"
    shutil.copytree(src, dst)
    w = load_file(str(dst / "model.safetensors"))
    for i in range(5):
        w[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(0.05 * (i + 1))
        w[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(0.01 * (i + 1))
    save_file(w, str(dst / "model.safetensors"))
    mc = ModelConfig.from_path(str(dst))
    fp8 = ModelRunner(mc, ServerArgs(model_path=str(dst), device="cpu", kv_cache_dtype="fp8_e4m3",
                                     max_total_tokens=256, max_running_requests=2), "cpu")
    pool = fp8.token_to_kv_pool
    assert pool.scales.source == "checkpoint"
    assert pool.scales.k == pytest.approx([0.05, 0.1, 0.15, 0.2, 0.25])
    assert pool.scales.v == pytest.approx([0.01, 0.02, 0.03, 0.04, 0.05])
    d = pool.describe()
    assert d.k_scales == pool.scales.k and d.dtype == "float8_e4m3fn" and d.itemsize == 1
    auto = ModelRunner(mc, ServerArgs(model_path=str(dst), device="cpu", max_total_tokens=256,
                                      max_running_requests=2), "cpu")
    assert auto.token_to_kv_pool.scales is None and auto.token_to_kv_pool.dtype == torch.float32


# ---- the KV region descriptor --------------------------------------------------------------------------------------
def _kv(dtype, scales=None, layers=2, heads=2, hd=8, page=4):
    return KVCache.create(max_total_tokens=32, page_size=page, dtype=dtype, head_num=heads, head_dim=hd,
                          layer_num=layers, req_rows=2, max_context_len=16, device="cpu", scales=scales)


def test_descriptor_carries_dtype_element_size_and_scales_over_the_wire():
    sc = KVScales((0.1, 0.2), (0.3, 0.123456789), "checkpoint")
    d = _kv(E4M3, sc).describe()
    assert (d.dtype, d.itemsize, d.k_scales, d.v_scales) == ("float8_e4m3fn", 1, sc.k, sc.v)
    wire = msgspec.json.decode(msgspec.json.encode(d.to_dict()))  # as the bootstrap server publishes it
    back = KVRegionDescriptor.from_dict(json.loads(json.dumps(wire)))
    assert back == d
    check_same_format(back, d)
    plain = _kv(torch.bfloat16).describe()
    assert (plain.dtype, plain.itemsize, plain.k_scales) == ("bfloat16", 2, ())
    assert KVRegionDescriptor.from_dict({k: v for k, v in plain.to_dict().items() if "scales" not in k}) == plain
    with pytest.raises(ValueError, match="3 K and 3 V scales for 2 layers"):
        KVRegionDescriptor.from_dict({**d.to_dict(), "k_scales": [1, 1, 1], "v_scales": [1, 1, 1]})


@pytest.mark.parametrize("a,b,match", [
    ((E4M3, None), (E5M2, None), "float8_e4m3fn .* float8_e5m2"),
    ((E4M3, None), (torch.bfloat16, None), "float8_e4m3fn .*bfloat16"),
    ((torch.float16, None), (torch.bfloat16, None), "float16 .*bfloat16"),
    ((E4M3, KVScales((1.0, 0.5), (1.0, 1.0))), (E4M3, KVScales((1.0, 0.25), (1.0, 1.0))), "layer 1 K scale"),
    ((E4M3, KVScales((1.0, 1.0), (1.0, 1.0))), (E4M3, KVScales((1.0, 1.0), (2.0, 1.0))), "layer 0 V scale")])
def test_format_mismatch_is_refused_naming_both_sides(a, b, match):
    da, db = _kv(*a).describe(), _kv(*b).describe()
    with pytest.raises(ValueError, match=match) as e:
        check_same_format(da, db, "prefill", "decode")
    assert "--kv-cache-dtype" in str(e.value) and "prefill" in str(e.value)
    with pytest.raises(ValueError, match="formats differ"):
        check_peer_ranks(db, [{"kv": da.to_dict()}], "decode", "prefill")
    check_peer_ranks(da, [{"kv": da.to_dict()}] * 2, "decode", "prefill")  # same format: accepted


def test_transfer_plans_move_one_byte_per_fp8_element():
    """The PD planners compute byte ranges from the descriptors' element size: an FP8 request moves half the bytes
    of the same request in BF16, both in pull (plan_kv_reads) and push (plan_slot_copies) form."""
    from sglang.srt.disaggregation.slot_plan import plan_slot_copies
    from sglang.srt.disaggregation.transfer.kv_plan import plan_kv_reads

    sc = KVScales((0.5, 0.5), (1.0, 1.0))
    for planner in ("pull", "push"):
        moved = {}
        for dtype, scales in ((torch.bfloat16, None), (E4M3, sc)):
            src, dst = _kv(dtype, scales).describe(), _kv(dtype, scales).describe()
            if planner == "pull":
                rows = plan_kv_reads(src, dst, [1, 2, 3], [4, 5, 6], num_tokens=10)
            else:
                rows = plan_slot_copies(src, (0, 2), list(range(4, 14)), dst, (0, 2), list(range(16, 26)))
            moved[dtype] = sum(r.nbytes for r in rows) if planner == "pull" else int(rows[:, 2].sum())
        assert moved[torch.bfloat16] == 2 * moved[E4M3] == 2 * (10 * 2 * 2 * 2 * 8), planner


# ---- numerics on the real checkpoint -------------------------------------------------------------------------------
STORY_PROMPTS = ["Once upon a time", "The little dog", "Lily and Tom went to the park. They",
                 "One day, a girl named Sue", "The sun was shining and", "Tim had a big red ball.", "Mom said to Ben,",
                 "There was a cat who liked to", "In the forest, a small bird", "The boy was sad because"]


@pytest.fixture(scope="module")
def stories():
    from tokenizers import Tokenizer

    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_loader.loader import load_model

    path = shared_path("models", "stories260K")
    tok = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
    mc = ModelConfig.from_path(path, device="cpu")
    prompts = [[1] + tok.encode(p, add_special_tokens=False).ids for p in STORY_PROMPTS]
    return load_model(mc, "auto", "cpu"), mc, prompts


def _run(stories, kv_dtype, steps, forced=None):
    """Prefill every prompt, then ``steps`` decode steps (greedy, or ``forced[i][s]`` as request i's input at step
    s); returns ``(logits [steps + 1, reqs, vocab], tokens [reqs, steps + 1])`` (torch_native over a real pool)."""
    from sglang.test.model_harness import ModelHarness

    model, mc, prompts = stories
    h = ModelHarness(model, mc, max_reqs=len(prompts), max_len=64, kv_cache_dtype=kv_dtype)
    logits = [h.step([(i, p) for i, p in enumerate(prompts)], poison=False)]
    toks = [logits[-1].argmax(-1).tolist()]
    for s in range(steps):
        nxt = toks[-1] if forced is None else [f[s] for f in forced]
        logits.append(h.step([(i, [t]) for i, t in enumerate(nxt)], poison=False))
        toks.append(logits[-1].argmax(-1).tolist())
    return torch.stack(logits), [list(t) for t in zip(*toks)]


@pytest.mark.parametrize("name,max_err,median_err,min_same", [("fp8_e4m3", 4.0, 1.2, 7), ("fp8_e5m2", 7.0, 2.5, 0)])
def test_stories260k_fp8_kv_stays_close_to_bf16_kv(stories, name, max_err, median_err, min_same):
    """stories260K (fp32 compute) over ten TinyStories prompts, a BF16 KV cache against an FP8 one (scale 1.0, the
    checkpoint has none). Stated tolerances, teacher-forced on BF16's greedy tokens for 16 steps: the largest
    per-row max |logit difference| <= ``max_err`` and its median <= ``median_err`` (logits span about +-20; measured
    2.27 / 0.84 for E4M3 and 4.94 / 1.74 for E5M2: this 260K model's 8-wide heads feel E4M3's 3 mantissa bits, and
    E5M2's 2 twice as much). Greedy: E4M3's first 8 tokens equal BF16's on at least ``min_same`` of the 10 prompts
    (measured 9; E5M2: 5, not asserted), and wherever a greedy continuation first leaves BF16's, BF16 itself was
    near a tie there (its logit gap between the two tokens <= 2 x ``max_err``)."""
    steps = 16
    ref_logits, ref_toks = _run(stories, torch.bfloat16, steps)
    kv_dtype = kv_quant.resolve_kv_cache_dtype(name, torch.float32)
    forced_logits, _ = _run(stories, kv_dtype, steps, forced=ref_toks)
    err = (forced_logits - ref_logits).abs().amax(-1)  # [steps + 1, reqs]
    assert err.max().item() <= max_err and err.median().item() <= median_err, (err.max().item(), err.median().item())
    assert err.max().item() > 0  # the FP8 cache is in play
    _, toks = _run(stories, kv_dtype, 7)
    assert sum(a[:8] == b[:8] for a, b in zip(ref_toks, toks)) >= min_same
    for i, (a, b) in enumerate(zip(ref_toks, toks)):
        first = next((j for j in range(8) if a[j] != b[j]), None)
        if first is not None:
            gap = (ref_logits[first, i, a[first]] - ref_logits[first, i, b[first]]).item()
            assert 0 <= gap <= 2 * max_err, (STORY_PROMPTS[i], first, gap)


def test_preflight_refuses_bad_scales_and_old_gpus(tmp_path, monkeypatch):
    """Before any worker starts: a checkpoint whose KV scale is per-channel is refused naming the tensor; E4M3 with the
    Triton or FlashInfer backend on an sm_80 GPU is refused naming the alternatives (E5M2, torch_native and sm_90
    pass)."""
    from safetensors.torch import load_file, save_file

    from sglang.srt.entrypoints import preflight

    src = shared_path("models", "stories260K")
    dst = tmp_path / "bad-scales"
    shutil.copytree(src, dst)
    w = load_file(str(dst / "model.safetensors"))
    w["model.layers.2.self_attn.v_scale"] = torch.ones(4)
    save_file(w, str(dst / "model.safetensors"))
    with pytest.raises(ValueError, match="model.layers.2.self_attn.v_scale.*per-tensor"):
        preflight.check_kv_cache(ServerArgs(model_path=str(dst), device="cpu", kv_cache_dtype="fp8_e4m3"))
    preflight.check_kv_cache(ServerArgs(model_path=str(dst), device="cpu"))  # auto: scales not read
    preflight.check_kv_cache(ServerArgs(model_path=src, device="cpu", kv_cache_dtype="fp8_e4m3"))
    pytest.importorskip("triton")
    cap = {"v": (8, 0)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cap["v"])
    gpu = dict(model_path=src, device="cuda", attention_backend="triton")
    with pytest.raises(ValueError, match="compute capability >= 8.9.*sm_80: use fp8_e5m2 or auto"):
        preflight.check_kv_cache(ServerArgs(kv_cache_dtype="fp8_e4m3", **gpu))
    preflight.check_kv_cache(ServerArgs(kv_cache_dtype="fp8_e5m2", **gpu))
    # FlashInfer stores K/V through the same Triton kernel (refused alike); torch_native converts in torch (passes)
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "flashinfer" else real(name, *a))
    with pytest.raises(ValueError, match="compute capability >= 8.9.*sm_80: use fp8_e5m2 or auto"):
        preflight.check_kv_cache(ServerArgs(kv_cache_dtype="fp8_e4m3", **dict(gpu, attention_backend="flashinfer")))
    preflight.check_kv_cache(ServerArgs(kv_cache_dtype="fp8_e4m3", **dict(gpu, attention_backend="torch_native")))
    cap["v"] = (9, 0)
    preflight.check_kv_cache(ServerArgs(kv_cache_dtype="fp8_e4m3", **gpu))
