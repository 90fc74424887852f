"""FP8 weights on the GPU: the compiled kernels vs their torch references on fresh random inputs, the decode-GEMM
autotune over FP8 layers, CUDA-graph decode with FP8 weights vs eager, and the KV pool growing with FP8 weights.

References: :mod:`sglang.srt.layers.quantization.fp8_ref`. Activation quantization must match bit for bit (IEEE
division and round-to-nearest-even on both sides); GEMMs within fp32 accumulation-order differences plus one bf16
rounding of the output (``GEMM_TOL`` of the output's max magnitude). Speed lives in
``benchmark/quantization/bench_fp8.py``.
"""

from __future__ import annotations

import gc
import json
import sys
import zlib
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "python"))
sys.path.insert(0, str(REPO / "test"))
sys.path.insert(0, str(REPO / "test" / "gpu"))
from conftest import gpu_tiered  # noqa: E402

# Tiers (test/conftest.py): one case per kernel path in the smoke selection (-m gpu) -- activation quantization,
# per-channel GEMM (layer path, _scaled_mm and the Triton W8A8 GEMM), block GEMM, fused MoE per-channel and block, one
# graph-vs-eager model, the pool growth; the other shapes, the skinny-GEMM candidates, the static MoE scheme, the
# autotune and the other architectures are gpu_extended.
DEV = "cuda"
GEMM_TOL = 1.6e-2  # two bf16 roundings (2^-8 each) of the output scale, plus fp32 reassociation
GRAPH_TOL = 2e-2  # graph vs eager on one runner (same kernels; the GEMM row count may differ by padding)


@pytest.fixture(autouse=True)
def _no_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


def _g(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _rand(*shape, seed: int, scale: float = 1.0, dtype=torch.bfloat16) -> torch.Tensor:
    return (torch.randn(*shape, generator=_g(seed)) * scale).to(dtype).to(DEV)


def _close(a: torch.Tensor, b: torch.Tensor, tol: float = GEMM_TOL) -> None:
    err = (a.float() - b.float()).abs().max().item()
    bound = tol * max(b.float().abs().max().item(), 1e-6)
    assert a.shape == b.shape and err <= bound, f"max abs err {err:.4g} > {bound:.4g}"


# ---- kernels -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("m,k", gpu_tiered([(77, 1000), (1, 4096), (300, 14336)]))
def test_activation_quantization_bitwise(m, k):
    from sgl_kernel.triton import fp8

    from sglang.srt.layers.quantization import fp8_ref

    x = _rand(m, k, seed=m + k) * torch.logspace(-3, 2, m, device=DEV).to(torch.bfloat16).unsqueeze(1)
    x[m // 2] = 0
    for q, s, rq, rs in ((*fp8.per_token_quant_fp8(x), *fp8_ref.quant_per_token_ref(x)),
                         (*fp8.per_token_group_quant_fp8(x, 128), *fp8_ref.quant_per_token_group_ref(x, 128)),
                         (*fp8.per_token_quant_fp8(x, torch.tensor([0.01], device=DEV)),
                          *fp8_ref.quant_per_token_ref(x, torch.tensor([0.01], device=DEV)))):
        assert torch.equal(s, rs)
        assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8))


@pytest.mark.parametrize("m,n,k", gpu_tiered([(33, 6144, 4096), (1, 6144, 4096), (512, 6144, 4096), (1, 344, 172),
                                               (33, 344, 172), (512, 344, 172)]))
def test_per_channel_linear_paths(m, n, k):
    """The layer's per-channel path (``torch._scaled_mm`` row-wise where the shape allows, else the Triton W8A8
    GEMM), dynamic and static activations, with bias, vs the emulating reference; and the Triton GEMM directly."""
    from sgl_kernel.triton import fp8

    from sglang.srt.layers.quantization import fp8_ops, fp8_ref

    x = _rand(m, k, seed=m)
    wq, ws = fp8_ref.quant_weight_per_channel(_rand(n, k, seed=n, scale=k ** -0.5).float())
    bias = _rand(n, seed=3)
    for static in (None, torch.tensor([float(x.abs().max()) / 448], device=DEV)):
        got = fp8_ops.linear_per_channel(x, wq, ws, bias, static)
        _close(got, fp8_ref.fp8_linear_ref(x, wq, ws, bias, None, None, static))
    xq, xs = fp8_ref.quant_per_token_ref(x)
    _close(fp8.w8a8_scaled_gemm(xq, xs, wq, ws, bias), fp8_ref.w8a8_scaled_gemm_ref(xq, xs, wq, ws, bias))
    if fp8_ops.scaled_mm_shape_ok(n, k):
        _close(fp8_ops.scaled_mm_rowwise(xq, xs, wq, ws, bias, torch.bfloat16),
               fp8_ref.w8a8_scaled_gemm_ref(xq, xs, wq, ws, bias))


@pytest.mark.parametrize("m,rows_per_scale", gpu_tiered([(64, 128), (1, 128), (513, 128), (1, 1), (64, 1),
                                                         (513, 1)]))
def test_block_linear(m, rows_per_scale):
    """128 x 128 block scales (compact, and expanded per row) through the Triton GEMM vs the reference."""
    from sglang.srt.layers.quantization import fp8_ops, fp8_ref

    n, k = 2304, 2048
    x = _rand(m, k, seed=m)
    wq, ws = fp8_ref.quant_weight_block(_rand(n, k, seed=7, scale=k ** -0.5).float(), 128, 128)
    if rows_per_scale == 1:
        ws = ws.repeat_interleave(128, 0)[:n]
    got = fp8_ops.linear_block(x, wq, ws, (128, 128), rows_per_scale)
    _close(got, fp8_ref.fp8_linear_ref(x, wq, ws, None, (128, 128), rows_per_scale))


@pytest.mark.gpu_extended
@pytest.mark.parametrize("m", [1, 7, 32, 128])
def test_skinny_fp8_gemm_every_candidate(m):
    """Every config the decode-GEMM tuner may time for FP8 (split-K or not) equals the weight-only reference."""
    from sgl_kernel.triton.fp8 import skinny_fp8_gemm

    from sglang.srt.layers.decode_gemm import candidates
    from sglang.srt.layers.quantization import fp8_ref

    n, k = 6144, 4096
    x = _rand(m, k, seed=m)
    wq, ws = fp8_ref.quant_weight_per_channel(_rand(n, k, seed=11, scale=k ** -0.5).float())
    bias = _rand(n, seed=12)
    want = fp8_ref.skinny_fp8_gemm_ref(x, wq, ws, bias)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for cfg in candidates(m, n, k, sms):
        _close(skinny_fp8_gemm(x, wq, ws, bias, **cfg.kwargs()), want)


@pytest.mark.parametrize("mode,tokens", gpu_tiered(
    [("per-channel", 64), ("block", 64)] + [(m, t) for m in ("per-channel", "static", "block") for t in (1, 64, 700)
                                             if (m, t) not in (("per-channel", 64), ("block", 64))], smoke=2))
def test_fused_moe_fp8(mode, tokens):
    from sgl_kernel.triton.moe import fused_moe_fp8

    from sglang.srt.layers.quantization import fp8_ref
    from sglang.srt.ops_ref import select_experts

    e, h, i, top_k = 8, 1024, 512, 2
    x = _rand(tokens, h, seed=tokens)
    w13 = _rand(e, 2 * i, h, seed=21, scale=h ** -0.5).float()
    w2 = _rand(e, h, i, seed=22, scale=i ** -0.5).float()
    tw, ti = select_experts(_rand(tokens, e, seed=23).float(), top_k, True)
    kw = {}
    if mode == "block":
        q13, s13 = zip(*(fp8_ref.quant_weight_block(w, 128, 128) for w in w13))
        q2, s2 = zip(*(fp8_ref.quant_weight_block(w, 128, 128) for w in w2))
        kw = dict(block_size=(128, 128), w13_rows_per_scale=128, w2_rows_per_scale=128)
    else:
        q13, s13 = zip(*(fp8_ref.quant_weight_per_channel(w) for w in w13))
        q2, s2 = zip(*(fp8_ref.quant_weight_per_channel(w) for w in w2))
        if mode == "static":
            kw = dict(a13_scale=(x.float().abs().max() / 448).reshape(1), a2_scale=torch.tensor([4.0 / 448],
                                                                                                device=DEV))
    args = (x, torch.stack(q13), torch.stack(s13), torch.stack(q2), torch.stack(s2), tw, ti)
    got, want = fused_moe_fp8(*args, **kw), fp8_ref.fused_moe_fp8_ref(*args, **kw)
    if mode != "block":
        _close(got, want)
        return
    # Block-wise: the intermediate (silu(gate) * up in bf16) is re-quantized per 128-column group, so a one-ulp
    # difference of the fp8 MMA's accumulation in one group's largest element moves that whole group's scale and
    # re-rounds its e4m3 codes; kernel and reference then differ by a share of the quantization error itself (2.6%
    # of the output's max on an H100). So: close to the reference at twice the GEMM tolerance, and no further from
    # the unquantized experts than the reference is (a wrong scale index or expert costs many times that).
    from sglang.srt.layers.moe.fused_moe import fused_moe_ref

    _close(got, want, 2 * GEMM_TOL)
    exact = fused_moe_ref(x.float(), w13, w2, tw, ti)
    err_got, err_want = (got.float() - exact).abs(), (want.float() - exact).abs()
    assert err_got.max() <= 1.25 * err_want.max() and err_got.mean() <= 1.2 * err_want.mean(), (
        f"kernel vs unquantized: max {err_got.max():.4g} mean {err_got.mean():.4g}; reference: max "
        f"{err_want.max():.4g} mean {err_want.mean():.4g}")


# ---- layers and the decode-GEMM autotune ---------------------------------------------------------------------
def load_random(model: torch.nn.Module, seed: int) -> None:
    """Give ``model`` meaningful random weights through its own loaders: every quantized layer gets HF-shaped full
    tensors (randn / sqrt(K)) quantized as its scheme stores them (per tensor + static input scales, 128 x 128 blocks,
    or fed in bf16 to an online layer, which quantizes in its loader); other parameters as
    test_gpu_correctness.randomize (norms ~1, matrices with O(1) outputs)."""
    from sglang.srt.layers.linear import LinearBase
    from sglang.srt.layers.moe.fused_moe import FusedMoE
    from sglang.srt.layers.quantization import fp8_ref

    def feed(mod, shards, spec_of, call, name):
        m = mod.quant_method
        for sid in shards:
            spec = spec_of(sid)
            gen = _g(seed + zlib.crc32(f"{name}.{sid}".encode()))
            w = torch.randn(spec.full_rows, spec.full_cols, generator=gen) / spec.full_cols ** 0.5
            block = getattr(m, "block", None)
            if not m.config.checkpoint_fp8:
                call("weight", w.to(torch.bfloat16), sid)
            elif block is not None:
                q, s = fp8_ref.quant_weight_block(w, *block)
                call("weight", q, sid)
                call("weight_scale_inv", s, sid)
            else:
                q, s = fp8_ref.quant_weight_per_tensor(w)
                call("weight", q, sid)
                call("weight_scale", s, sid)
                if m.static:
                    call("input_scale", torch.tensor(4.0 / 448), sid)

    for name, mod in model.named_modules():
        if getattr(mod, "quant_method", None) is None:
            continue
        if isinstance(mod, LinearBase):
            def call(kind, t, sid, mod=mod):
                p = getattr(mod, kind)
                p.weight_loader(p, t, sid)
            feed(mod, mod.weight.expected_shards, mod.shard_spec, call, name)
        elif isinstance(mod, FusedMoE):
            for kind, shards in (("w13", ("w1", "w3")), ("w2", ("w2",))):
                for e in range(mod.num_experts):
                    def call(suffix, t, sid, mod=mod, kind=kind, e=e):
                        p = getattr(mod, f"{kind}_{suffix}")
                        p.weight_loader(p, t, sid, e)
                    feed(mod, shards, lambda sid, mod=mod, e=e: mod.expert_spec(sid, e)[1], call, f"{name}.{e}")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dtype == torch.float8_e4m3fn or "scale" in name:  # loaded above
                continue
            x = torch.randn(p.shape, generator=_g(seed + zlib.crc32(name.encode())))
            if p.dim() == 1:
                x = 1.0 + 0.2 * x if "norm" in name else 0.2 * x
            elif "embed" not in name:
                x = x / p.shape[-1] ** 0.5
            p.copy_(x.to(p.dtype))


@pytest.mark.gpu_extended
def test_decode_gemm_autotune_covers_fp8_layers():
    """autotune() times FP8 shapes (W8A8 path vs the weight-only streaming kernel), install() hands the table over,
    and each layer then returns exactly what its entry names, within tolerance of the emulating reference."""
    from sgl_kernel.triton.fp8 import skinny_fp8_gemm

    from sglang.srt.layers import decode_gemm
    from sglang.srt.layers.linear import RowParallelLinear
    from sglang.srt.layers.quantization import apply_quantization, fp8_ref
    from sglang.srt.layers.quantization.fp8_config import Fp8Config

    with torch.device(DEV):
        layers = torch.nn.ModuleList(RowParallelLinear(k, n, params_dtype=torch.bfloat16)
                                     for n, k in ((6144, 4096), (4096, 4096), (4096, 4096)))
        assert apply_quantization(layers, Fp8Config.online()) == 3
    for i, mod in enumerate(layers):
        mod.weight.weight_loader(mod.weight, _rand(*mod.weight.shape, seed=40 + i, scale=0.02))
    weights = decode_gemm.model_linear_weights(layers)
    assert set(weights) == {(6144, 4096, "float8_e4m3fn"), (4096, 4096, "float8_e4m3fn")}
    table = decode_gemm.autotune(weights, [1, 8, 32, 128], DEV)
    print("\n".join(table.describe()))
    assert all(c.config is None or c.skinny_us < c.cublas_us for _, cs in table.entries for c in cs)
    decode_gemm.install(layers, table)
    try:
        for m in (1, 5, 32, 100, 300):
            x = _rand(m, 4096, seed=m)
            for mod in layers:
                cfg = table.lookup(mod.weight.shape[0], 4096, mod.weight.dtype, m)
                got = mod(x)
                if cfg is not None:
                    assert torch.equal(got, skinny_fp8_gemm(x, mod.weight, mod.weight_scale, None, **cfg.kwargs()))
                    _close(got, fp8_ref.skinny_fp8_gemm_ref(x, mod.weight, mod.weight_scale))
                else:
                    _close(got, fp8_ref.fp8_linear_ref(x, mod.weight, mod.weight_scale))
    finally:
        decode_gemm.install(layers, None)


# ---- model runner: CUDA graphs, KV pool ----------------------------------------------------------------------
def _fp8_config_dir(tmp: Path, arch: str, qc) -> str:
    from test_gpu_correctness import ARCHS, BASE

    d = tmp / f"{arch}-fp8"
    d.mkdir(parents=True, exist_ok=True)
    cfg = {**BASE, **ARCHS[arch], "torch_dtype": "bfloat16", "hidden_size": 512, "intermediate_size": 1024}
    if qc is not None:
        cfg["quantization_config"] = qc
    (d / "config.json").write_text(json.dumps(cfg))
    return str(d)


BLOCK_QC = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
STATIC_QC = {"quant_method": "fp8", "activation_scheme": "static"}


@pytest.mark.parametrize("arch,qc,kv_cache_dtype", gpu_tiered([
    ("llama", None, "fp8_e4m3"), ("llama", None, "auto"), ("mixtral", None, "auto"), ("qwen3_moe", BLOCK_QC, "auto"),
    ("qwen2", STATIC_QC, "auto")]))
def test_cuda_graph_decode_with_fp8_weights_matches_eager(arch, qc, kv_cache_dtype, tmp_path):
    """A bf16 runner with FP8 weights (--quantization fp8, or the checkpoint's scheme), CUDA graphs and the
    decode-GEMM table: decode batches replayed from graphs equal the same runner's eager forward (same kernels), and
    the greedy tokens agree. The smoke case also stores the KV cache in FP8 (``--kv-cache-dtype fp8_e4m3``: both FP8
    features in one runner, the FP8 attention kernels captured in the graphs)."""
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.server_args import ServerArgs
    from test_gpu_correctness import VOCAB, Driver

    path = _fp8_config_dir(tmp_path, arch, qc)
    args = ServerArgs(model_path=path, load_format="dummy", dtype="bfloat16", device="cuda",
                      attention_backend="triton", max_total_tokens=8192, max_running_requests=32,
                      cuda_graph_max_bs=16, quantization="fp8" if qc is None else None,
                      kv_cache_dtype=kv_cache_dtype)
    runner = ModelRunner(ModelConfig.from_path(path, None, "bfloat16", "cuda"), args, "cuda")
    qkv = runner.model.model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == torch.float8_e4m3fn and runner.cuda_graph_runner is not None
    want_kv = torch.float8_e4m3fn if kv_cache_dtype == "fp8_e4m3" else torch.bfloat16
    assert runner.token_to_kv_pool.dtype == want_kv
    load_random(runner.model, seed=5)
    drv = Driver(runner)
    gen = torch.Generator().manual_seed(3)
    rids = [f"r{i}" for i in range(20)]
    drv.step([(rid, torch.randint(3, VOCAB, (int(torch.randint(5, 40, (1,), generator=gen)),),
                                  generator=gen).tolist()) for rid in rids])
    for size in (1, 3, 8, 13, 16):
        items = [(rid, torch.randint(3, VOCAB, (1,), generator=gen).tolist()) for rid in rids[:size]]
        batch = drv.batch(items)
        graph = drv.run(batch)
        eager = drv.run(batch, use_graphs=False)
        scale = max(1.0, eager.abs().max().item())
        assert (graph - eager).abs().max().item() <= GRAPH_TOL * scale, f"batch {size}"
        assert torch.equal(graph.argmax(-1), eager.argmax(-1)), f"batch {size}"


@pytest.mark.gpu
def test_kv_pool_grows_with_fp8_weights(tmp_path):
    """Llama-3.1-8B's shapes with 8 layers, dummy weights: with --quantization fp8 the KV pool (sized from the free
    memory after loading) holds at least 80% of the tokens the saved weight bytes pay for. The bf16 runner goes
    first, so memory it might leave behind could only shrink the FP8 pool (the check stays conservative)."""
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.server_args import ServerArgs

    src = REPO.parent / "shared" / "data" / "configs" / "meta-llama--Meta-Llama-3.1-8B" / "config.json"
    if not src.exists():
        pytest.skip(f"{src} is absent")
    cfg = json.loads(src.read_text())
    cfg["num_hidden_layers"] = 8
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    out = {}
    for q in (None, "fp8"):
        args = ServerArgs(model_path=str(tmp_path), load_format="dummy", dtype="bfloat16", device="cuda",
                          quantization=q, max_running_requests=64, cuda_graph_max_bs=8, context_length=4096)
        runner = ModelRunner(ModelConfig.from_path(str(tmp_path), 4096, "bfloat16", "cuda"), args, "cuda")
        out[q] = (runner.max_total_tokens, runner.param_bytes, runner.token_to_kv_pool.kv_size_bytes())
        del runner
        gc.collect()
        torch.cuda.empty_cache()
    (t16, w16, kv16), (t8, w8, kv8) = out[None], out["fp8"]
    per_token = kv16 / t16
    print(f"bf16: {t16} tokens, weights {w16 / 2**30:.2f} GiB; fp8: {t8} tokens, weights {w8 / 2**30:.2f} GiB")
    assert w16 - w8 > 0.3 * w16  # the projections (62% of these bytes) halve; embeddings and LM head stay bf16
    assert t8 - t16 >= 0.8 * (w16 - w8) / per_token
