"""Benchmark: Triton paged decode (and extend) attention against the HBM / bf16-matmul floors of the same GPU.

Decode: batch B x context C (default 64 x 4096) with Llama-3-8B heads (32 q / 8 kv, head_dim 128, bf16) on
three KV layouts (contiguous slots, shuffled 16-token pages, shuffled single tokens). Achieved KV bandwidth =
bytes of K and V read / kernel time (split + reduce kernels), compared with the HBM bandwidth of a large
device-to-device copy measured in the same run (bytes read + written / time). A sweep over KV splits and
tile / pipelining choices follows, so defaults can be tuned from one run.
Extend: one 8K-token prefill (and 4K new tokens after a 4K cached prefix) in TFLOP/s (causal FLOPs, 4*h*d per
visible (query, key) pair) against a bf16 8192^3 matmul measured in the same run.

Usage:
  python benchmark/attention/bench_triton_attention.py [--batch 64 --context 4096] [--out benchmark/results] [--no-sweep]
  python benchmark/attention/bench_triton_attention.py --record-dir benchmark/results   # + a benchmark record
Writes <out>/<date>_triton_attention.md (date, hardware, command, tables) and prints the tables. ``--record-dir DIR``
also writes a :mod:`benchmark.common.records` record (``what`` = ``triton_attention``) under ``DIR/attention/``:
every decode and extend case with its same-run floor (HBM copy GB/s, bf16 matmul TFLOP/s) and the ratio to it.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import platform
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO / "python"), str(REPO)]  # sglang, and the benchmark package when run as a file
logger = logging.getLogger(__name__)


def time_ms(fn, iters: int = 15, warmup: int = 3, inner: int = 8) -> float:
    """Milliseconds per ``fn()``: the median of ``iters`` CUDA-event samples of ``inner`` back-to-back calls after
    ``warmup`` calls (:func:`benchmark.common.timing.time_cuda_events`; the host launch latency of the first call is
    amortized). Raises RuntimeError without CUDA."""
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    from benchmark.common.timing import time_cuda_events

    return time_cuda_events(fn, iters=iters, warmup=warmup, inner=inner).median_ms


def hbm_bandwidth(gib: float = 4.0) -> float:
    """Bytes/s of a device-to-device copy of ``gib`` GiB (read + written bytes / time)."""
    n = int(gib * 2**30)
    src = torch.empty(n, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    t = time_ms(lambda: dst.copy_(src), iters=10, inner=4)
    del src, dst
    return 2 * n / (t * 1e-3)


def matmul_rate(n: int = 8192) -> float:
    """FLOP/s of a bf16 n x n x n matmul on random data."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    t = time_ms(lambda: a @ b, iters=10, inner=4)
    return 2 * n ** 3 / (t * 1e-3)


def layout(kind: str, bs: int, ctx: int, gen: torch.Generator) -> torch.Tensor:
    """req_to_token [bs, ctx] int32 over slots 1 .. bs*ctx (slot 0 is the dummy page)."""
    total = bs * ctx
    if kind == "contiguous":
        slots = torch.arange(total)
    elif kind == "pages16":
        page = 16
        perm = torch.randperm(total // page, generator=gen)
        slots = (perm[:, None] * page + torch.arange(page)).reshape(-1)
    elif kind == "tokens":
        slots = torch.randperm(total, generator=gen)
    else:
        raise ValueError(f"unknown layout {kind!r}")
    return (slots + 1).view(bs, ctx).to(torch.int32).cuda()


def bench_decode(args, bw: float, out_rows: list | None = None) -> tuple[list[str], list[str]]:
    """Time Triton decode attention (bf16, CUDA) on the three KV layouts, then sweep KV splits and BLOCK_N/warps/stages
    on 16-token pages; returns the (main, sweep) markdown table lines, KV GB/s vs ``bw`` (HBM bytes/s). ``out_rows``:
    a list that also gets each case as a dict (for the record)."""
    from sglang.srt.layers.attention.triton_ops.decode_attention import (decode_attention_fwd,
                                                                          decode_attention_workspace,
                                                                          default_num_kv_splits)

    bs, ctx, nh, nkv, hd = args.batch, args.context, args.heads, args.kv_heads, args.head_dim
    dt = torch.bfloat16
    gen = torch.Generator().manual_seed(0)
    slots = bs * ctx + 1
    k_buf = torch.randn(slots, nkv, hd, device="cuda", dtype=dt)
    v_buf = torch.randn(slots, nkv, hd, device="cuda", dtype=dt)
    q = torch.randn(bs, nh, hd, device="cuda", dtype=dt)
    out = torch.empty_like(q)
    seq = torch.full((bs,), ctx, dtype=torch.int64, device="cuda")
    rows = torch.arange(bs, device="cuda")
    kv_bytes = 2 * bs * ctx * nkv * hd * dt.itemsize
    default_splits = default_num_kv_splits(bs, nkv, torch.device("cuda"))
    mid_o, mid_lse = decode_attention_workspace(bs, nh, hd, 16, torch.device("cuda"))

    def run(r2t, splits, **kw):
        """Milliseconds of one decode-attention call over ``r2t`` with ``splits`` KV splits (kernel options: kw)."""
        return time_ms(lambda: decode_attention_fwd(q, k_buf, v_buf, out, r2t, rows, seq, hd ** -0.5, splits,
                                                    mid_o, mid_lse, **kw))

    def row(name, t):
        """A markdown row: time in us, achieved KV GB/s, the HBM copy GB/s and their ratio."""
        achieved = kv_bytes / (t * 1e-3)
        if out_rows is not None:
            out_rows.append({"part": "decode", "case": name, "time_us": round(t * 1e3, 2),
                             "kv_gbps": round(achieved / 1e9, 1), "hbm_copy_gbps": round(bw / 1e9, 1)})
        return f"| {name} | {t * 1e3:.1f} | {achieved / 1e9:.0f} | {bw / 1e9:.0f} | {achieved / bw:.2f} |"

    head = ["| layout / config | time (us) | KV GB/s | HBM copy GB/s | ratio |", "|---|---|---|---|---|"]
    main = list(head)
    tables = {}
    for kind in ("contiguous", "pages16", "tokens"):
        tables[kind] = layout(kind, bs, ctx, gen)
        main.append(row(f"{kind}, splits={default_splits} (default)", run(tables[kind], default_splits)))
    sweep = list(head)
    if args.sweep:
        r2t = tables["pages16"]
        for s in (1, 2, 4, 8, 16):
            sweep.append(row(f"pages16, splits={s}", run(r2t, s)))
        for bn in (32, 64, 128):
            for warps in (4, 8):
                for stages in (1, 2, 3, 4):
                    try:
                        t = run(r2t, default_splits, block_n=bn, num_warps=warps, num_stages=stages)
                    except Exception as e:  # out of shared memory / resources: report and go on
                        sweep.append(f"| pages16, BLOCK_N={bn} warps={warps} stages={stages} | failed: "
                                     f"{type(e).__name__} | | | |")
                        continue
                    sweep.append(row(f"pages16, splits={default_splits} BLOCK_N={bn} warps={warps} stages={stages}", t))
    return main, sweep


def bench_extend(args, mm: float, out_rows: list | None = None) -> list[str]:
    """Time Triton extend attention (bf16, CUDA) for an 8K prefill and 4K new tokens after a 4K prefix; returns markdown
    table lines, causal TFLOP/s vs ``mm`` (matmul FLOP/s); ``out_rows`` as in :func:`bench_decode`."""
    from sglang.srt.layers.attention.triton_ops.extend_attention import extend_attention_fwd

    nh, nkv, hd = args.heads, args.kv_heads, args.head_dim
    dt = torch.bfloat16
    lines = ["| case | time (ms) | TFLOP/s | bf16 matmul TFLOP/s | ratio |", "|---|---|---|---|---|"]
    for prefix, new in ((0, 8192), (4096, 4096)):
        seq = prefix + new
        k_buf = torch.randn(seq + 1, nkv, hd, device="cuda", dtype=dt)
        v_buf = torch.randn(seq + 1, nkv, hd, device="cuda", dtype=dt)
        r2t = (torch.arange(seq, device="cuda") + 1).to(torch.int32).view(1, seq)
        q = torch.randn(new, nh, hd, device="cuda", dtype=dt)
        out = torch.empty_like(q)

        def t(x):
            """A one-element int64 CUDA tensor holding ``x``."""
            return torch.tensor([x], device="cuda")

        ms = time_ms(lambda: extend_attention_fwd(q, out, k_buf, v_buf, r2t, t(0), t(prefix), t(new), t(0), new,
                                                  hd ** -0.5), iters=8, inner=3)
        pairs = new * prefix + new * (new + 1) / 2
        flops = 4 * nh * hd * pairs
        rate = flops / (ms * 1e-3)
        if out_rows is not None:
            out_rows.append({"part": "extend", "case": f"prefix {prefix} + new {new}", "time_ms": round(ms, 4),
                             "tflops": round(rate / 1e12, 2), "matmul_tflops": round(mm / 1e12, 2)})
        lines.append(f"| prefix {prefix} + new {new} | {ms:.3f} | {rate / 1e12:.0f} | {mm / 1e12:.0f} | {rate / mm:.2f} |")
    return lines


def main() -> None:
    """CLI entry: measure the floors, run the decode and extend benchmarks, write and log the markdown report. Exits if
    no CUDA GPU."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--no-sweep", dest="sweep", action="store_false")
    p.add_argument("--out", default=str(REPO / "benchmark" / "results" / "attention"))
    from benchmark.common.records import add_record_dir_argument
    add_record_dir_argument(p, "attention")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not torch.cuda.is_available():
        raise SystemExit("bench_triton_attention needs a CUDA GPU")
    import triton

    props = torch.cuda.get_device_properties(0)
    bw = hbm_bandwidth()
    mm = matmul_rate()
    cases: list = []
    main_rows, sweep_rows = bench_decode(args, bw, cases)
    ext_rows = bench_extend(args, mm, cases)
    date = datetime.date.today().isoformat()
    cmd = "python " + " ".join([str(Path(sys.argv[0]))] + sys.argv[1:])
    text = "\n".join([
        f"# Triton attention kernels ({date})",
        "",
        f"- hardware: {props.name}, {props.multi_processor_count} SMs, {props.total_memory / 2**30:.0f} GiB; "
        f"torch {torch.__version__}, triton {triton.__version__}, CUDA {torch.version.cuda}, {platform.node()}",
        f"- command: `{cmd}`",
        f"- floors measured in this run: HBM device-to-device copy {bw / 1e9:.0f} GB/s (read + write bytes / time); "
        f"bf16 8192^3 matmul {mm / 1e12:.0f} TFLOP/s",
        f"- decode: batch {args.batch} x context {args.context}, {args.heads} q / {args.kv_heads} kv heads, head_dim "
        f"{args.head_dim}, bf16; KV bytes = 2 * B * C * kv_heads * head_dim * 2; ratio = KV GB/s / HBM copy GB/s "
        "(target >= 0.70)",
        "",
        "## Paged decode attention", "", *main_rows, "",
        "## Extend / prefill attention (causal FLOPs)", "", *ext_rows, "",
    ] + (["## Decode sweep (pages16 layout)", "", *sweep_rows, ""] if args.sweep else []))
    print(text)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{date}_triton_attention.md"
    path.write_text(text)
    logger.info("wrote %s", path)
    if args.record_dir:
        if str(REPO) not in sys.path:
            sys.path.insert(0, str(REPO))
        from benchmark.common import records

        js, _ = records.write_record(make_attention_record(cases, args), Path(args.record_dir))
        logger.info("record: %s", js)


def make_attention_record(cases: list[dict], args, env: dict | None = None) -> dict:
    """The cases :func:`bench_decode` / :func:`bench_extend` collected as a :mod:`benchmark.common.records` record:
    decode KV GB/s against the same-run HBM copy bandwidth (``kv_of_copy``), extend TFLOP/s against the same-run
    bf16 matmul (``of_matmul``). Headline: the default-split paged (16-token pages) decode and the 8K prefill."""
    from benchmark.common import records

    rows = records.add_ratio(cases, "kv_of_copy", "kv_gbps", "hbm_copy_gbps")
    rows = records.add_ratio(rows, "of_matmul", "tflops", "matmul_tflops")
    rows = [{k: v for k, v in r.items() if v is not None} for r in rows]
    headline = []
    dec = next((r for r in rows if r["part"] == "decode" and r["case"].startswith("pages16")
                and "(default)" in r["case"]), None)
    if dec is not None:
        headline.append({"label": f"Triton paged decode attention, batch {args.batch} x context {args.context}, "
                                  "16-token pages, KV bandwidth vs HBM copy", "value": dec["kv_gbps"], "unit": "GB/s",
                         "baseline": dec["hbm_copy_gbps"], "ratio": dec["kv_of_copy"]})
    ext = next((r for r in rows if r["part"] == "extend"), None)
    if ext is not None:
        headline.append({"label": f"Triton extend attention, {ext['case']} (causal), vs bf16 matmul",
                         "value": ext["tflops"], "unit": "TFLOP/s", "baseline": ext["matmul_tflops"],
                         "ratio": ext["of_matmul"]})
    return records.make_record(
        subject="attention", benchmark="benchmark.attention.bench_triton_attention",
        mode="decode+extend" + ("+sweep" if args.sweep else ""), what="triton_attention", rows=rows, env=env,
        params={"batch": args.batch, "context": args.context, "heads": args.heads, "kv_heads": args.kv_heads,
                "head_dim": args.head_dim, "dtype": "bfloat16"},
        baselines=[c for c in ("hbm_copy_gbps", "matmul_tflops") if any(c in r for r in rows)],
        units={"time_us": "us", "time_ms": "ms", "kv_gbps": "GB/s", "hbm_copy_gbps": "GB/s", "tflops": "TFLOP/s",
               "matmul_tflops": "TFLOP/s"},
        floor={"columns": ["hbm_copy_gbps", "matmul_tflops"],
               "what": "decode: device-to-device copy of 4 GiB (read + write bytes / time); extend: bf16 8192^3 "
                       "matmul; both measured in this run"},
        headline=headline, gpu_count=1)


if __name__ == "__main__":
    main()
