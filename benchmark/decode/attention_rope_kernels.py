"""Decode kernels, old vs new in one run: split-KV decode attention and RoPE + KV-cache store, at the decode
shapes of Llama-3.1-8B (32 q / 8 KV heads, head_dim 128, bf16) and 1K context, batch 1 / 32 / 128.

Decode attention (per layer call, shuffled 16-token pages): the legacy kernel with the legacy split rule
(``SGLANG_TRITON_DECODE_LEGACY=1``), the new default (``default_num_kv_splits(policy="wave")``), then the new kernel
at every split count in 1..16 and a few BLOCK_N / num_warps choices at the default count, so the split rule and
tiles can be re-tuned from this one run. Columns: microseconds, KV GB/s (K and V bytes read / time), that over the
HBM device-to-device copy bandwidth measured in the same run, and the speed-up over legacy.
RoPE + KV store (per layer call, N new tokens, positions random, slots shuffled): the unfused sequence
(Triton RoPE in place, ``v.contiguous()``, two indexed stores into the pool) vs the fused kernel.
Decode-batch GEMMs (1 and 16 rows, the Llama-3.1-8B projections): cuBLAS vs the skinny weight-streaming Triton
kernel (``sgl_kernel.triton.skinny_gemm``, measured only, not called by the layers), each config.
Sampling columns: host microseconds per step to ship the five per-request sampling columns (five pinned copies vs
one packed copy).

Usage: python benchmark/decode/attention_rope_kernels.py [--out DIR] [--context 1024] [--batches 1 32 128]
    [--record-dir DIR]
Writes <out>/<date>_decode_attention_rope_kernels.md (date, hardware, command, tables) and prints it; ``--record-dir``
also the project's JSON record + markdown under DIR/decode/ (:func:`kernels_record`). Needs CUDA.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
from pathlib import Path
from typing import Optional

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "python"))
sys.path.insert(0, str(REPO / "sgl-kernel" / "python"))
sys.path.insert(0, str(REPO))  # the benchmark package

from benchmark.attention.bench_triton_attention import hbm_bandwidth, layout, time_ms  # noqa: E402

NH, NKV, HD = 32, 8, 128


def attention_rows(bs: int, ctx: int, bw: float, rows_out: Optional[list] = None) -> list[str]:
    """Markdown rows of the decode-attention comparison at ``bs`` x ``ctx``; ``rows_out`` (when given) gets each as a
    flat dict for :func:`kernels_record`."""
    from sgl_kernel.triton.decode_attention import (decode_attention_fwd, decode_attention_workspace,
                                                    default_num_kv_splits)

    dt, dev = torch.bfloat16, torch.device("cuda")
    gen = torch.Generator().manual_seed(bs)
    slots = bs * ctx + 1
    k_buf = torch.randn(slots, NKV, HD, device=dev, dtype=dt)
    v_buf = torch.randn(slots, NKV, HD, device=dev, dtype=dt)
    q = torch.randn(bs, NH, HD, device=dev, dtype=dt)
    out = torch.empty_like(q)
    seq = torch.full((bs,), ctx, dtype=torch.int64, device=dev)
    rows = torch.arange(bs, device=dev)
    r2t = layout("pages16", bs, ctx, gen)
    mid_o, mid_lse = decode_attention_workspace(bs, NH, HD, 16, dev)
    kv_bytes = 2 * bs * ctx * NKV * HD * dt.itemsize

    def run(splits, **kw):
        return time_ms(lambda: decode_attention_fwd(q, k_buf, v_buf, out, r2t, rows, seq, HD ** -0.5, splits,
                                                    mid_o, mid_lse, **kw), iters=11, inner=20)

    legacy_s = default_num_kv_splits(bs, NKV, dev, 16, "legacy")
    new_s = default_num_kv_splits(bs, NKV, dev, 16, "wave")
    base = run(legacy_s, legacy=True)
    lines = []

    def row(name, t):
        gbs = kv_bytes / (t * 1e-3) / 1e9
        lines.append(f"| {bs} | {name} | {t * 1e3:.1f} | {gbs:.0f} | {gbs * 1e9 / bw:.2f} | {base / t:.2f} |")
        _add(rows_out, "decode_attention", bs, name.strip("*"), t * 1e3, "legacy kernel, legacy rule", base * 1e3,
             kv_bytes / bw * 1e6)

    row(f"legacy kernel, legacy rule (splits={legacy_s})", base)
    row(f"**new kernel, wave rule (splits={new_s})**", run(new_s))
    for s in (1, 2, 3, 4, 5, 6, 8, 12, 16):
        if s != new_s:
            row(f"new kernel, splits={s}", run(s))
    for bn, warps in ((32, 4), (32, 8), (64, 8), (128, 8)):
        try:
            row(f"new kernel, splits={new_s}, BLOCK_N={bn} warps={warps}", run(new_s, block_n=bn, num_warps=warps))
        except Exception as e:  # out of resources: report and go on
            lines.append(f"| {bs} | BLOCK_N={bn} warps={warps} | failed: {type(e).__name__} | | | |")
            _add(rows_out, "decode_attention", bs, f"BLOCK_N={bn} warps={warps}", None, "legacy kernel, legacy rule",
                 base * 1e3, kv_bytes / bw * 1e6, error=f"failed: {type(e).__name__}")
    return lines


def rope_kv_rows(n: int, rows_out: Optional[list] = None) -> list[str]:
    """Markdown row: unfused RoPE + stores vs the fused kernel for ``n`` new tokens (one layer); ``rows_out`` as in
    :func:`attention_rows`."""
    from sglang.srt.layers.rotary_embedding import get_rope
    from sgl_kernel.triton.rope import apply_rope
    from sgl_kernel.triton.rope_kv_store import rope_and_store_kv

    dt, dev = torch.bfloat16, "cuda"
    emb = get_rope(HD, HD, 8192, 500000.0).to(dev)
    pos = torch.randint(0, 8192, (n,), device=dev)
    qkv = torch.randn(n, (NH + 2 * NKV) * HD, device=dev, dtype=dt)
    q, k, v = qkv[:, : NH * HD], qkv[:, NH * HD: (NH + NKV) * HD], qkv[:, (NH + NKV) * HD:]
    pool = torch.zeros(2, 200_000, NKV, HD, device=dev, dtype=dt)
    kb, vb = pool[0], pool[1]
    loc = torch.randperm(200_000, device=dev)[:n]

    def unfused():
        apply_rope(pos, q, k, emb.cos_sin_cache, HD, True)
        vc = v.contiguous()
        kb[loc] = k.view(-1, NKV, HD)
        vb[loc] = vc.view(-1, NKV, HD)

    def fused():
        rope_and_store_kv(pos, q, k, v, emb.cos_sin_cache, HD, True, kb, vb, loc)

    t_old = time_ms(unfused, iters=11, inner=50)
    t_new = time_ms(fused, iters=11, inner=50)
    _add(rows_out, "rope_kv_store", n, "fused RoPE + KV store", t_new * 1e3,
         "unfused: RoPE + v.contiguous + 2 index_put", t_old * 1e3)
    return [f"| {n} | {t_old * 1e3:.1f} | {t_new * 1e3:.1f} | {t_old / t_new:.2f} | {32 * (t_old - t_new):.1f} |"]


GEMM_SHAPES = (("qkv_proj", 6144, 4096), ("o_proj", 4096, 4096), ("gate_up_proj", 28672, 4096),
               ("down_proj", 4096, 14336), ("lm_head", 128256, 4096))
GEMM_CONFIGS = ((16, 256, 4, 4), (16, 512, 4, 4), (16, 512, 4, 3), (32, 256, 4, 4), (64, 128, 4, 4))


def gemm_rows(m: int, bw: float, rows_out: Optional[list] = None) -> list[str]:
    """Markdown rows: cuBLAS (F.linear) vs the skinny weight-streaming Triton GEMM (each config) at ``m`` rows, for the
    Llama-3.1-8B projections; weight GB/s over the HBM copy bandwidth. ``rows_out`` as in :func:`attention_rows`."""
    from sgl_kernel.triton.skinny_gemm import skinny_gemm

    lines = []
    for name, n, k in GEMM_SHAPES:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
        wbytes = n * k * 2
        t_ref = time_ms(lambda: torch.nn.functional.linear(x, w), iters=11, inner=20)
        best, cfg_best, err = float("inf"), None, 0.0
        for bn, bk, warps, stages in GEMM_CONFIGS:
            try:
                t = time_ms(lambda: skinny_gemm(x, w, block_n=bn, block_k=bk, num_warps=warps, num_stages=stages),
                            iters=11, inner=20)
            except Exception as e:  # out of resources: skip the config
                lines.append(f"| {m} | {name} {n}x{k} | config {bn}/{bk}/{warps}/{stages} failed: {type(e).__name__} "
                             "| | | | |")
                continue
            if t < best:
                best, cfg_best = t, (bn, bk, warps, stages)
        if cfg_best is not None:
            y = skinny_gemm(x, w, block_n=cfg_best[0], block_k=cfg_best[1], num_warps=cfg_best[2],
                            num_stages=cfg_best[3])
            ref = torch.nn.functional.linear(x, w)
            err = ((y.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
        _add(rows_out, "gemm", m, f"{name} {n}x{k}, skinny {cfg_best}", None if cfg_best is None else best * 1e3,
             "cuBLAS F.linear", t_ref * 1e3, wbytes / bw * 1e6, max_rel_err=err if cfg_best is not None else None,
             error=None if cfg_best is not None else "no skinny config ran")
        lines.append(f"| {m} | {name} {n}x{k} | {t_ref * 1e3:.1f} ({wbytes / (t_ref * 1e-3) / bw:.2f}) | "
                     f"{best * 1e3:.1f} ({wbytes / (best * 1e-3) / bw:.2f}) | {cfg_best} | {t_ref / best:.2f} | "
                     f"{err:.1e} |")
    return lines


def sampling_rows(bs: int, rows_out: Optional[list] = None) -> list[str]:
    """Markdown row: host microseconds to ship the five sampling columns, five pinned copies vs one packed copy;
    ``rows_out`` as in :func:`attention_rows`."""
    from sglang.srt.utils.tensor_transfer import columns_to_device, host_to_device

    cols = [([0.7] * bs, torch.float32), ([0.9] * bs, torch.float32), ([50] * bs, torch.int64),
            ([0.0] * bs, torch.float32), ([False] * bs, torch.bool)]

    def five():
        return [host_to_device(torch.tensor(v, dtype=d), "cuda") for v, d in cols]

    def packed():
        return columns_to_device(cols, "cuda")

    res = []
    for fn in (five, packed):
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(200):
            fn()
        res.append((time.perf_counter() - t0) / 200 * 1e6)
        torch.cuda.synchronize()
    _add(rows_out, "sampling_columns", bs, "one packed copy (host us)", res[1], "five pinned copies", res[0])
    return [f"| {bs} | {res[0]:.1f} | {res[1]:.1f} | {res[0] - res[1]:.1f} |"]


def _add(rows_out: Optional[list], section: str, size: int, case: str, time_us: Optional[float], baseline: str,
         baseline_us: float, floor_us: Optional[float] = None, **extra) -> None:
    """Append one measured case to ``rows_out`` (no-op when None): see :func:`kernels_record` for the columns."""
    if rows_out is not None:
        rows_out.append({"section": section, "size": size, "case": case, "time_us": time_us, "baseline": baseline,
                         "baseline_us": baseline_us, "floor_us": floor_us, **extra})


SIZE_NAME = {"decode_attention": "batch", "rope_kv_store": "new tokens", "gemm": "rows (M)",
             "sampling_columns": "batch"}


def kernels_record(rows: list, bw: float, params: dict, env: Optional[dict] = None,
                   command: Optional[str] = None) -> dict:
    """``--record-dir``: the cases of one run as a :mod:`benchmark.common.records` record (subject decode, mode
    ``attention-kernels``, ``what`` = ``decode_attention_rope_kernels``). One row per case: ``section``
    (decode_attention, rope_kv_store, gemm, sampling_columns), ``size`` (:data:`SIZE_NAME`), ``case``, ``time_us``, the
    same-run ``baseline`` and its ``baseline_us`` (legacy kernel and split rule; unfused RoPE + stores; cuBLAS; five
    pinned copies), ``speedup`` = baseline / time, ``error`` for a case that failed, ``max_rel_err`` of the best skinny
    GEMM vs cuBLAS, and for attention and GEMMs the HBM floor ``floor_us`` (bytes read / the copy bandwidth ``bw``
    measured in the run) with ``over_floor`` = time / floor. Headline: at the largest size, the new decode-attention
    default vs legacy and the fused RoPE + KV store vs unfused."""
    from benchmark.common import records

    rows = records.add_ratio(records.add_ratio(rows, "speedup", "baseline_us", "time_us"), "over_floor", "time_us",
                             "floor_us")
    headline = []
    for section, pick, label in (("decode_attention", lambda r: r["case"].startswith("new kernel, wave rule"),
                                  "decode attention per layer, new kernel + wave rule vs legacy"),
                                 ("rope_kv_store", lambda r: True, "RoPE + KV store per layer, fused vs unfused")):
        sec = [r for r in rows if r["section"] == section and r["time_us"] is not None and pick(r)]
        if sec:
            r = max(sec, key=lambda r: r["size"])
            headline.append({"label": f"{label}, {SIZE_NAME[section]} {r['size']}", "value": round(r["time_us"], 2),
                             "unit": "us", "baseline": round(r["baseline_us"], 2),
                             "ratio": round(r["baseline_us"] / r["time_us"], 3)})
    return records.make_record(
        subject="decode", benchmark="benchmark.decode.bench", mode="attention-kernels",
        what="decode_attention_rope_kernels", rows=rows, params=dict(params, hbm_copy_bytes_per_s=bw),
        baselines=["baseline_us"] if rows else [], units={"time_us": "us", "baseline_us": "us", "floor_us": "us"},
        floor={"column": "floor_us", "what": "bytes read (KV for attention, weights for GEMMs) / HBM device-to-device "
                                             "copy bandwidth measured first in this run; over_floor = time / floor"},
        headline=headline, notes=["size is " + ", ".join(f"{k}: {v}" for k, v in SIZE_NAME.items()) + ".",
                                  "headline ratio and speedup = baseline / time (> 1: the new path is faster)."],
        gpu_count=1, env=env, command=command)


def main() -> int:
    """CLI entry; returns 0 (SystemExit without CUDA)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(REPO / "benchmark" / "results" / "decode"))
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 32, 128])
    from benchmark.common.records import add_record_dir_argument
    add_record_dir_argument(p, "decode")
    a = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmark/decode/attention_rope_kernels.py needs a CUDA GPU")
    import triton

    props = torch.cuda.get_device_properties(0)
    bw = hbm_bandwidth()
    text = [f"# Decode attention and RoPE + KV-store kernels, old vs new ({datetime.date.today().isoformat()})", "",
            f"- hardware: {props.name}, {props.multi_processor_count} SMs; torch {torch.__version__}, "
            f"triton {triton.__version__}",
            f"- command: `python {' '.join(sys.argv)}`",
            f"- HBM device-to-device copy bandwidth in this run: {bw / 1e9:.0f} GB/s", "",
            f"## Decode attention per layer ({a.context} context, shuffled 16-token pages, Llama-3.1-8B heads)", "",
            "| batch | kernel / split count | time (us) | KV GB/s | / HBM copy | speed-up vs legacy |",
            "|---:|---|---:|---:|---:|---:|"]
    rows: list = []
    for bs in a.batches:
        text += attention_rows(bs, a.context, bw, rows)
        print("\n".join(text[-1:]), flush=True)
    text += ["", "## RoPE + KV-cache store per layer (bf16, 32 q / 8 KV heads)", "",
             "| new tokens | unfused: RoPE + v.contiguous + 2 index_put (us) | fused (us) | speed-up | "
             "saved per 32-layer step (us) |", "|---:|---:|---:|---:|---:|"]
    for n in a.batches:
        text += rope_kv_rows(n, rows)
    text += ["", "## Decode-batch GEMMs: cuBLAS vs the skinny weight-streaming Triton kernel (not wired yet)", "",
             "BLOCK_N/BLOCK_K/warps/stages of the best config; (x.xx) = weight bytes / time over the HBM copy "
             "bandwidth; err = max abs difference / max abs value vs cuBLAS.", "",
             "| rows | projection | cuBLAS us (of HBM) | skinny us (of HBM) | best config | speed-up | err |",
             "|---:|---|---:|---:|---|---:|---:|"]
    for m in (1, 16):
        text += gemm_rows(m, bw, rows)
    text += ["", "## Sampling columns, host time per step", "",
             "| batch | five pinned copies (us) | one packed copy (us) | saved (us) |", "|---:|---:|---:|---:|"]
    for bs in a.batches:
        text += sampling_rows(bs, rows)
    md = "\n".join(text) + "\n"
    print(md)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{datetime.date.today().isoformat()}_decode_attention_rope_kernels.md").write_text(md)
    if a.record_dir:
        from benchmark.common.records import write_record

        rec = kernels_record(rows, bw, {"context": a.context, "batches": a.batches, "device": props.name})
        print(f"record: {write_record(rec, Path(a.record_dir))[0]}")
    return 0


if __name__ == "__main__":
    os.environ.pop("TRITON_INTERPRET", None)
    sys.exit(main())
