"""Decode-sized GEMMs timed inside CUDA graphs: which kernel reads the weight fastest at 1-32 rows.

The decode step replays a CUDA graph, so host launch cost does not count there; timing single launches from Python
(as ``benchmark/decode/attention_rope_kernels.py`` does) mostly measures the Triton launcher for the small projections. Here each
variant is captured ``--inner`` times back to back in one CUDA graph and the graph is replayed; the time per call
is the replay time / inner. The calls cycle over enough copies of the weight (>= ``--rotate-mib`` in all) that a
call never finds its weight in L2 (an H100 has 50 MiB: a 32 MiB o_proj repeated back to back would be read from
L2, as in this benchmark's first run of 2026-11-25 08:10, which reported o_proj above the HBM bandwidth). Variants, for ``y = x @ w.T`` with x ``[M, K]``, w ``[N, K]`` (Llama-3.1-8B shapes, bf16):

* ``cublas``   ``F.linear(x, w)`` (what the layers call today);
* ``cublas_t`` ``(w @ x.T).T``: the same product with the roles swapped, so cuBLAS picks another kernel family;
* ``mv``       ``torch.mv(w, x[0])`` at M = 1 (cuBLAS GEMV);
* ``skinny``   the weight-streaming Triton kernel (``sgl_kernel.triton.skinny_gemm``) at several tiles, M <= 16.

Columns: microseconds per call and that as a share of the HBM copy bandwidth measured in the same run (weight
bytes / time / bandwidth; 1.00 = the weight streamed at copy speed). The last column is cuBLAS time / best time.

Usage: python benchmark/decode/gemm_kernels.py [--rows 1 16 32] [--inner 20] [--out DIR] [--record-dir DIR]
Writes ``<out>/<date>_decode_gemms.md`` (date, hardware, command, table) and prints it. Needs CUDA. ``--record-dir DIR``
also writes a :mod:`benchmark.common.records` record (``what`` = ``decode_gemms``) under ``DIR/decode/``
(:func:`gemm_kernels_record`).
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
from pathlib import Path

from typing import Optional

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "sgl-kernel" / "python"))
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # the benchmark package when run as a file

SHAPES = {"qkv_proj": (6144, 4096), "o_proj": (4096, 4096), "gate_up_proj": (28672, 4096),
          "down_proj": (4096, 14336), "lm_head": (128256, 4096)}
SKINNY_TILES = [(16, 512, 4, 4), (32, 256, 4, 4), (8, 512, 4, 4), (16, 256, 4, 3), (64, 128, 4, 4)]


def copy_bandwidth(nbytes: int = 1 << 30) -> float:
    """HBM device-to-device copy bandwidth in bytes/s ((read + write) / time), median of 10."""
    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    times = []
    for _ in range(12):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        b.copy_(a)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) * 1e-3)
    return 2 * nbytes / sorted(times[2:])[len(times[2:]) // 2]


def graph_time_us(fn, inner: int, copies: int = 1, replays: int = 20) -> float:
    """Microseconds per call of ``fn(i)`` captured ``inner`` times in one CUDA graph, call j using weight copy
    ``j % copies`` (median over replays)."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for i in range(min(3, copies)):
            fn(i)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=stream):
        for j in range(inner):
            fn(j % copies)
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    from benchmark.common.timing import time_cuda_events

    return time_cuda_events(g.replay, iters=replays, warmup=0).median_ms * 1e3 / inner


def rows_for(m: int, inner: int, bw: float, rotate_bytes: int, found: Optional[list] = None) -> list[str]:
    """Markdown rows for ``m`` input rows over every projection; each variant checked against cuBLAS. ``found``: a
    list that also gets each (rows, projection) case as a dict (for the record): the shape, the weight bytes, the
    microseconds of every variant measured (``res``), the best skinny tile and the relative errors."""
    from sgl_kernel.triton.skinny_gemm import MAX_M, skinny_gemm

    out = []
    gen = torch.Generator(device="cuda").manual_seed(m)
    for name, (n, k) in SHAPES.items():
        wbytes = n * k * 2
        copies = max(1, -(-rotate_bytes // wbytes))
        ws = [(torch.randn(n, k, generator=gen, device="cuda") * 0.02).to(torch.bfloat16) for _ in range(copies)]
        w = ws[0]
        x = torch.randn(m, k, generator=gen, device="cuda").to(torch.bfloat16)
        ref = torch.nn.functional.linear(x, w).float()

        def share(us: float) -> str:
            return f"{us:.1f} ({wbytes / (us * 1e-6) / bw:.2f})"

        res = {"cublas": graph_time_us(lambda i: torch.nn.functional.linear(x, ws[i]), inner, copies)}
        err = {}
        res["cublas_t"] = graph_time_us(lambda i: (ws[i] @ x.T).T, inner, copies)
        err["cublas_t"] = ((w @ x.T).T.float() - ref).abs().max().item()
        if m == 1:
            res["mv"] = graph_time_us(lambda i: torch.mv(ws[i], x[0]), inner, copies)
            err["mv"] = (torch.mv(w, x[0]).float() - ref[0]).abs().max().item()
        best_skinny, best_cfg = None, None
        if m <= MAX_M:
            for bn, bk, warps, stages in SKINNY_TILES:
                def call(i=0, bn=bn, bk=bk, warps=warps, stages=stages):
                    return skinny_gemm(x, ws[i], block_n=bn, block_k=bk, num_warps=warps, num_stages=stages)
                try:
                    t = graph_time_us(call, inner, copies)
                except Exception as e:  # noqa: BLE001 - a tile that does not compile is skipped, named
                    out.append(f"<!-- skinny {bn, bk, warps, stages} at {name} m={m} failed: {type(e).__name__} -->")
                    continue
                if best_skinny is None or t < best_skinny:
                    best_skinny, best_cfg = t, (bn, bk, warps, stages)
                    err["skinny"] = (call().float() - ref).abs().max().item()
            if best_skinny is not None:
                res["skinny"] = best_skinny
        scale = ref.abs().max().item()
        best = min(res, key=res.get)
        errs = ", ".join(f"{k} {v / scale:.1e}" for k, v in err.items())
        if found is not None:
            found.append({"rows": m, "projection": name, "n": n, "k": k, "weight_bytes": wbytes, "res": dict(res),
                          "skinny_tile": list(best_cfg) if "skinny" in res else None,
                          "rel_err": {key: v / scale for key, v in err.items()}})
        out.append(f"| {m} | {name} {n}x{k} | {share(res['cublas'])} | {share(res['cublas_t'])} | "
                   f"{share(res['mv']) if 'mv' in res else '-'} | "
                   f"{share(res['skinny']) + f' {best_cfg}' if 'skinny' in res else '-'} | {best} | "
                   f"{res['cublas'] / res[best]:.2f} | {errs} |")
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16, 32])
    p.add_argument("--inner", type=int, default=20)
    p.add_argument("--rotate-mib", type=int, default=256, help="weight copies cycled per shape, in MiB (beats L2)")
    p.add_argument("--out", default=str(REPO / "benchmark" / "results" / "decode"))
    from benchmark.common.records import add_record_dir_argument
    add_record_dir_argument(p, "decode")
    ns = p.parse_args()
    if not torch.cuda.is_available():
        sys.stderr.write("benchmark/decode/gemm_kernels.py: needs a CUDA GPU\n")
        return 2
    bw = copy_bandwidth()
    now = datetime.datetime.now(datetime.timezone.utc)
    text = [f"# Decode-sized GEMMs inside CUDA graphs ({now:%Y-%m-%d %H:%M} UTC)", "",
            f"- hardware: {torch.cuda.get_device_name()}; torch {torch.__version__}",
            f"- command: python benchmark/decode/gemm_kernels.py --rows {' '.join(map(str, ns.rows))} "
            f"--inner {ns.inner} --rotate-mib {ns.rotate_mib}",
            f"- HBM copy bandwidth (same run): {bw / 1e12:.2f} TB/s; (x.xx) = weight bytes / time / that bandwidth",
            "- err: max |variant - cuBLAS| / max |cuBLAS| (bf16 outputs)", "",
            "| rows | projection | cublas us | cublas_t us | mv us | skinny us (tile) | best | cublas / best | err |",
            "|---:|---|---:|---:|---:|---:|---|---:|---|"]
    found: list = []
    for m in ns.rows:
        text += rows_for(m, ns.inner, bw, ns.rotate_mib << 20, found)
    body = "\n".join(text) + "\n"
    os.makedirs(ns.out, exist_ok=True)
    path = Path(ns.out) / f"{now:%Y-%m-%d_%H%M}_decode_gemms.md"
    path.write_text(body)
    sys.stdout.write(body + f"\nwrote {path}\n")
    if ns.record_dir:
        from benchmark.common import records

        js, _ = records.write_record(gemm_kernels_record(found, bw, ns), Path(ns.record_dir))
        sys.stdout.write(f"record: {js}\n")
    return 0


def gemm_kernels_record(found: list[dict], bw: float, ns, env: Optional[dict] = None) -> dict:
    """The cases :func:`rows_for` collected (``found``) as a :mod:`benchmark.common.records` record. A row per
    (rows, projection): each variant's microseconds (``<variant>_us``), the best variant, the floor ``floor_us`` (the
    weight bytes streamed at the same-run copy bandwidth ``bw`` bytes/s), ``cublas_vs_best`` (cuBLAS time / best
    time, the speed-up over the baseline ``cublas_us``) and ``best_of_floor`` (floor / best time, 1.0 = copy speed).
    Headline: the lm_head and down_proj cases at the smallest row count."""
    from benchmark.common import records

    rows = []
    for c in found:
        res = c["res"]
        best = min(res, key=res.get)
        row = {"rows": c["rows"], "projection": c["projection"], "n": c["n"], "k": c["k"],
               "weight_mib": round(c["weight_bytes"] / 2**20, 2)}
        row.update({f"{v}_us": round(res[v], 2) if v in res else None for v in ("cublas", "cublas_t", "mv", "skinny")})
        row.update({"skinny_tile": c.get("skinny_tile"), "best": best, "best_us": round(res[best], 2),
                    "floor_us": round(c["weight_bytes"] / bw * 1e6, 2),
                    "max_rel_err": max(c["rel_err"].values()) if c.get("rel_err") else None})
        rows.append(row)
    rows = records.add_ratio(rows, "cublas_vs_best", "cublas_us", "best_us")
    rows = records.add_ratio(rows, "best_of_floor", "floor_us", "best_us")
    m0 = min((r["rows"] for r in rows), default=None)
    headline = [{"label": f"decode GEMM {r['projection']} {r['n']}x{r['k']} at {m0} row(s), best ({r['best']}) "
                          "vs cuBLAS, in a CUDA graph", "value": r["best_us"], "unit": "us",
                 "baseline": r["cublas_us"], "ratio": r["cublas_vs_best"]}
                for proj in ("lm_head", "down_proj") for r in rows if r["rows"] == m0 and r["projection"] == proj]
    return records.make_record(
        subject="decode", benchmark="benchmark.decode.gemm_kernels", mode="graph", what="decode_gemms", rows=rows,
        env=env, params={"rows": list(ns.rows), "inner": ns.inner, "rotate_mib": ns.rotate_mib, "dtype": "bfloat16",
                         "copy_bandwidth_gbps": round(bw / 1e9, 1)},
        baselines=["cublas_us"],
        units={c: "us" for c in ("cublas_us", "cublas_t_us", "mv_us", "skinny_us", "best_us", "floor_us")}
        | {"weight_mib": "MiB"},
        floor={"column": "floor_us", "what": "weight bytes / HBM device-to-device copy bandwidth (read + write bytes "
                                             "/ time of a 1 GiB copy) measured in this run"},
        headline=headline, gpu_count=1)


if __name__ == "__main__":
    sys.exit(main())
