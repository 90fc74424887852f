"""FP8 vs bf16 GEMMs at Llama-3.1-8B's linear shapes (used by ``bench_fp8.py``; importable, no main).

Per (shape, M) every method is timed as the decode-GEMM tuner times kernels (:func:`sglang.srt.layers.decode_gemm.
time_per_call_us`: one CUDA graph cycling through enough distinct weight copies that L2 (50 MB on an H100) holds
none of them, CUDA events, warm-up, median of replays), in two passes whose method order is reversed (the reported
time is the mean of the two passes' medians). Methods:

* ``bf16 cuBLAS``: ``F.linear`` on bf16 weights (the baseline the server runs without ``--quantization``);
* ``fp8 W8A8 (quant + _scaled_mm)``: the FP8 layer's default path: per-token activation quantization (Triton) +
  ``torch._scaled_mm`` with row-wise scales;
* ``_scaled_mm only``: the same GEMM on pre-quantized activations (what the quantization kernel costs);
* ``fp8 W8A8 (quant + Triton)``: the Triton W8A8 GEMM instead of ``_scaled_mm`` (the fallback path);
* ``fp8 weight-only skinny`` (M <= 128): the best decode-GEMM candidate config of the weight-streaming kernel;
* ``auto``: what the served layer runs: the decode-GEMM table's pick (:func:`~sglang.srt.layers.decode_gemm.autotune`
  on these weights) for M <= 128, the W8A8 path above that;
* block-wise (``--block``): the Triton GEMM with 128 x 128 weight / 1 x 128 activation scales (quantization
  included), and ``torch`` block-wise ``scaled_mm`` where this torch offers it.

Floors: decode-sized M: the operand bytes (weight + activation in + output) over the measured copy bandwidth;
M = 8192: the measured matmul peak of the dtype (bf16 cuBLAS 8192^3; FP8 the best of ``_scaled_mm`` row-wise and
tensor-wise 8192^3).
"""

from __future__ import annotations

import logging
import statistics
from typing import Callable, Optional

import torch
import torch.nn.functional as F

logger = logging.getLogger("fp8_gemm_rates")

LLAMA8B_SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
COPY_BYTES = 256 << 20  # distinct weight copies per timing pass: at least this many FP8 bytes


def _events_ms(fn: Callable[[], object], reps: int = 10, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def fp8_matmul_peaks(n: int = 8192) -> dict:
    """FLOP/s of FP8 ``torch._scaled_mm`` n x n x n: row-wise scales (bf16 out, what the layers run) and tensor-wise
    (with and without fast accumulation); ``peak`` = the best of them. Keys map to FLOP/s (None: unsupported)."""
    a = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn).t()
    out = {}
    for name, kw in (("rowwise", dict(scale_a=torch.ones(n, 1, device="cuda"), scale_b=torch.ones(1, n, device="cuda"),
                                      out_dtype=torch.bfloat16)),
                     ("tensorwise", dict(scale_a=torch.ones((), device="cuda"), scale_b=torch.ones((), device="cuda"),
                                         out_dtype=torch.bfloat16)),
                     ("tensorwise_fast_accum", dict(scale_a=torch.ones((), device="cuda"),
                                                    scale_b=torch.ones((), device="cuda"), out_dtype=torch.bfloat16,
                                                    use_fast_accum=True))):
        try:
            t = _events_ms(lambda kw=kw: torch._scaled_mm(a, b, **kw))
            out[name] = 2.0 * n ** 3 / (t * 1e-3)
        except RuntimeError as e:
            logger.warning("_scaled_mm %s unsupported: %s", name, e)
            out[name] = None
    out["peak"] = max(v for v in out.values() if v is not None)
    return out


def _block_scaled_mm(xq, xs, wq, ws, transpose_ws: bool):
    """torch's DeepSeek-style block-wise ``scaled_mm`` (1 x 128 activation, 128 x 128 weight scales; activation
    scales outer-dim major), or None when this torch has no ``F.scaled_mm``."""
    sm = getattr(F, "scaled_mm", None)
    st = getattr(F, "ScalingType", None)
    if sm is None or st is None:
        return None
    return sm(xq, wq.t(), xs.t().contiguous().t(), st.BlockWise1x128, ws.t().contiguous() if transpose_ws else ws,
              st.BlockWise128x128, output_dtype=torch.bfloat16)


def _torch_block_layout(xq, xs, wq, ws) -> Optional[bool]:
    """The weight-scale layout (transposed or not) under which torch's block-wise ``scaled_mm`` reproduces the
    reference on these operands, or None (unavailable here, or neither layout matches)."""
    from sglang.srt.layers.quantization import fp8_ref

    want = fp8_ref.w8a8_scaled_gemm_ref(xq, xs, wq, ws, None, torch.float32, 128, 128)
    for transpose in (False, True):
        try:
            got = _block_scaled_mm(xq, xs, wq, ws, transpose)
        except (RuntimeError, TypeError, ValueError, AttributeError) as e:
            logger.info("torch block-wise scaled_mm (transpose=%s): %s", transpose, e)
            continue
        if got is None:
            return None
        if (got.float() - want).abs().max() <= 2e-2 * want.abs().max():
            return transpose
    return None


def gemm_rows(ms: list[int], bw: float, mm_bf16: float, mm_fp8: float, block: bool = True, seed: int = 0,
              shapes: Optional[dict] = None) -> list[dict]:
    """One row per (shape, M, method): ``us``, ``tflops``, ``floor_us`` (decode-sized M: bytes / ``bw``) or
    ``peak_tflops`` (M = 8192: the dtype's matmul peak), ``ratio`` (time / floor, or rate / peak), ``chosen``
    (the automatic choice for ``auto`` rows)."""
    from sgl_kernel.triton.fp8 import per_token_group_quant_fp8, per_token_quant_fp8, skinny_fp8_gemm, \
        w8a8_scaled_gemm

    from sglang.srt.layers import decode_gemm
    from sglang.srt.layers.quantization import fp8_ops, fp8_ref

    shapes = shapes or LLAMA8B_SHAPES
    gen = torch.Generator().manual_seed(seed)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for name, (n, k) in shapes.items():
        copies = max(2, -(-COPY_BYTES // (n * k)))
        w16 = [(torch.randn(n, k, generator=gen) / k ** 0.5).to(torch.bfloat16).cuda() for _ in range(copies)]
        q = [fp8_ref.quant_weight_per_channel(w.float()) for w in w16]
        w8 = [wq for wq, _ in q]
        s8 = {id(wq): s for wq, s in q}
        bq = [fp8_ref.quant_weight_block(w.float(), 128, 128) for w in w16] if block else []
        b8, bs8 = [wq for wq, _ in bq], {id(wq): s for wq, s in bq}
        small = [m for m in ms if m <= 128]
        table = decode_gemm.autotune({(n, k, "float8_e4m3fn"): w8}, decode_gemm.buckets_for(small, 128), "cuda") \
            if small else None
        for m in ms:
            x = torch.randn(m, k, generator=gen).to(torch.bfloat16).cuda()
            xq, xs = per_token_quant_fp8(x)
            methods: dict[str, tuple[Callable, list]] = {
                "bf16 cuBLAS": (lambda w: F.linear(x, w), w16),
                "fp8 W8A8 (quant + _scaled_mm)": (lambda w: fp8_ops.linear_per_channel(x, w, s8[id(w)]), w8),
                "_scaled_mm only": (lambda w: fp8_ops.scaled_mm_rowwise(xq, xs, w, s8[id(w)], None, torch.bfloat16),
                                    w8),
                "fp8 W8A8 (quant + Triton)": (lambda w: w8a8_scaled_gemm(*per_token_quant_fp8(x), w, s8[id(w)]), w8),
            }
            if block:
                methods["fp8 block 128x128 (Triton)"] = (
                    lambda w: fp8_ops.linear_block(x, w, bs8[id(w)], (128, 128), 128), b8)
                xgq, xgs = per_token_group_quant_fp8(x, 128)
                tr = _torch_block_layout(xgq, xgs, b8[0], bs8[id(b8[0])])
                if tr is not None:  # only where it computes the same product (checked on these operands)
                    methods["fp8 block 128x128 (torch scaled_mm, act pre-quantized)"] = (
                        lambda w, tr=tr: _block_scaled_mm(xgq, xgs, w, bs8[id(w)], tr), b8)
            best = None
            if m <= 128:
                for cfg in decode_gemm.candidates(m, n, k, sms):
                    try:
                        t = decode_gemm.time_per_call_us(lambda w, c=cfg: skinny_fp8_gemm(x, w, s8[id(w)],
                                                                                            **c.kwargs()), w8)
                    except Exception as e:  # a config that does not launch here
                        logger.info("skinny fp8 %s failed: %s", cfg, e)
                        continue
                    if best is None or t < best[0]:
                        best = (t, cfg)
                if best is not None:
                    methods["fp8 weight-only skinny"] = (
                        lambda w, c=best[1]: skinny_fp8_gemm(x, w, s8[id(w)], **c.kwargs()), w8)
            times: dict[str, list[float]] = {key: [] for key in methods}
            for order in (list(methods), list(methods)[::-1]):
                for key in order:
                    fn, ws = methods[key]
                    times[key].append(decode_gemm.time_per_call_us(fn, ws))
            res = {key: sum(v) / len(v) for key, v in times.items()}
            if m <= 128:
                cfg = table.lookup(n, k, torch.float8_e4m3fn, m) if table is not None else None
                chosen = f"skinny {cfg}" if cfg is not None else "W8A8 (quant + _scaled_mm)"
                res["auto"] = res["fp8 weight-only skinny"] if cfg is not None and "fp8 weight-only skinny" in res \
                    else res["fp8 W8A8 (quant + _scaled_mm)"]
            else:
                chosen, res["auto"] = "W8A8 (quant + _scaled_mm)", res["fp8 W8A8 (quant + _scaled_mm)"]
            for key, us in res.items():
                fp8 = key != "bf16 cuBLAS"
                flops = 2.0 * m * n * k
                row = {"shape": name, "n": n, "k": k, "m": m, "method": key, "us": us,
                       "tflops": flops / (us * 1e-6) / 1e12}
                if m <= 128:
                    nbytes = n * k * (1 if fp8 else 2) + 2 * m * (k + n)
                    row["floor_us"] = nbytes / bw * 1e6
                    row["ratio"] = us / row["floor_us"]
                else:
                    row["peak_tflops"] = (mm_fp8 if fp8 else mm_bf16) / 1e12
                    row["ratio"] = row["tflops"] / row["peak_tflops"]
                if key == "auto":
                    row["chosen"] = chosen
                if key == "fp8 weight-only skinny" and best is not None:
                    row["config"] = str(best[1])
                rows.append(row)
            logger.info("%s M=%d: %s", name, m, ", ".join(f"{key} {us:.1f} us" for key, us in res.items()))
        del w16, w8, b8, q, bq
        torch.cuda.empty_cache()
    return rows


def render_gemm(rows: list[dict]) -> list[str]:
    """Markdown: one table per M, a row per (shape, method) with the bf16 baseline's time beside."""
    out = []
    for m in sorted({r["m"] for r in rows}):
        sub = [r for r in rows if r["m"] == m]
        bound = "floor = operand bytes / copy bandwidth" if m <= 128 else "ratio = rate / the dtype's matmul peak"
        out += [f"### M = {m} ({bound})", "", "| shape | method | us | TFLOP/s | ratio | vs bf16 cuBLAS | note |",
                "|---|---|---:|---:|---:|---:|---|"]
        base = {r["shape"]: r["us"] for r in sub if r["method"] == "bf16 cuBLAS"}
        for r in sub:
            note = r.get("chosen", r.get("config", ""))
            out.append(f"| {r['shape']} {r['n']}x{r['k']} | {r['method']} | {r['us']:.1f} | {r['tflops']:.1f} | "
                       f"{r['ratio']:.2f} | {base[r['shape']] / r['us']:.2f}x | {note} |")
        out.append("")
    return out
