"""Benchmark: FlashInfer vs the Triton attention backend, one attention layer of Llama-3.1-8B on one GPU.

Shapes: 32 query / 8 KV heads of 128, bf16, the server's paged KV pool (``--page-size``, shuffled pages). Each
backend runs its whole ``forward`` of one layer (KV store + attention; the per-batch metadata / plan is made once,
before timing, as the server does per batch):

* prefill: one request of 1K and of 8K new tokens (no cached prefix), against torch SDPA (FlashAttention-2 in
  PyTorch, contiguous q/k/v, causal) and the causal-FLOP floor at the bf16 matmul rate measured in the same run;
* decode: batch 1 / 32 / 128 at ``--decode-context`` tokens each (default 1024, ``bench_one_batch``'s), against the
  floor of reading every request's K and V once at the device-to-device copy bandwidth measured in the same run.

Timing: CUDA events around ``--inner`` back-to-back calls, median of ``--iters``, after warm-ups (FlashInfer's JIT and
plan, Triton's compile); the backends alternate order between ``--reps`` repetitions (A/B, B/A) and each row reports
the median over repetitions. The server's automatic choice (``--attention-backend`` unset) is triton.

Usage: python benchmark/attention/bench_flashinfer_vs_triton.py [--page-size 1] [--out benchmark/results]
Writes <out>/<date>_attention_flashinfer_vs_triton_<gpu>.json (the record) and .md (the table rendered from it).
``--record-dir DIR`` also writes a :mod:`benchmark.common.records` record (``what`` = ``flashinfer_vs_triton``) under
``DIR/attention/``: the same rows, with Triton (the automatic choice) and torch SDPA as the same-run baselines and
the floor column.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO / "python"), str(REPO / "sgl-kernel" / "python"), str(REPO)]  # + the benchmark package

NH, NKV, HD, LAYERS = 32, 8, 128, 1
DTYPE = torch.bfloat16


def time_ms(fn, iters: int, inner: int, warmup: int = 3) -> float:
    """Milliseconds per ``fn()``: the median of ``iters`` CUDA-event samples of ``inner`` back-to-back calls after
    ``warmup`` calls (:func:`benchmark.common.timing.time_cuda_events`; the host launch latency of the first call is
    amortized). Raises RuntimeError without CUDA."""
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    from benchmark.common.timing import time_cuda_events

    return time_cuda_events(fn, iters=iters, warmup=warmup, inner=inner).median_ms


def copy_bandwidth() -> float:
    """Bytes/s of a 4 GiB device-to-device copy (read + written bytes / time)."""
    n = 4 << 30
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    t = time_ms(lambda: dst.copy_(src), iters=10, inner=2)
    del src, dst
    return 2 * n / (t * 1e-3)


def matmul_rate() -> float:
    """FLOP/s of a bf16 8192^3 matmul."""
    a = torch.randn(8192, 8192, dtype=DTYPE, device="cuda")
    t = time_ms(lambda: a @ a, iters=10, inner=2)
    return 2 * 8192 ** 3 / (t * 1e-3)


def make_batch(backend, prompt_lens: list[int], new_lens: list[int], page_size: int, gen: torch.Generator):
    """A ForwardBatch of requests with ``prompt_lens`` cached tokens and ``new_lens`` new ones, their pages shuffled
    over a pool just large enough, metadata built on ``backend``; returns (fb, q, k, v, layer)."""
    from sglang.srt.forward_batch_info import ForwardBatch, ForwardMode
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool

    bs = len(new_lens)
    seq = [p + n for p, n in zip(prompt_lens, new_lens)]
    pages = [(s + page_size - 1) // page_size for s in seq]
    order = (torch.randperm(sum(pages), generator=gen) + 1).tolist()
    ctx = max(seq) + page_size
    r2t = torch.zeros(bs, ctx, dtype=torch.int32)
    out_loc, off = [], 0
    for i in range(bs):
        mine = order[off: off + pages[i]]
        off += pages[i]
        slots = torch.tensor([mine[t // page_size] * page_size + t % page_size for t in range(seq[i])])
        r2t[i, : seq[i]] = slots.to(torch.int32)
        out_loc.append(slots[prompt_lens[i]:])
    pool = MHATokenToKVPool((sum(pages) + 1) * page_size, page_size, DTYPE, NKV, HD, LAYERS, "cuda")
    pool.kv_data.normal_()
    rpool = ReqToTokenPool(bs, ctx, "cuda")
    rpool.req_to_token.copy_(r2t)
    n = sum(new_lens)

    def t(x):
        return torch.tensor(x, dtype=torch.int64, device="cuda")

    decode = all(x == 1 for x in new_lens) and all(p > 0 for p in prompt_lens)
    fb = ForwardBatch(
        forward_mode=ForwardMode.DECODE if decode else ForwardMode.EXTEND, batch_size=bs, input_ids=t([1] * n),
        positions=t([0] * n), out_cache_loc=torch.cat(out_loc).cuda(), req_pool_indices=t(list(range(bs))),
        seq_lens=t(seq), prefix_lens=t(prompt_lens), extend_lens=t(new_lens),
        extend_start_loc=t([sum(new_lens[:i]) for i in range(bs)]), seq_lens_cpu=seq, prefix_lens_cpu=prompt_lens,
        extend_lens_cpu=new_lens, req_to_token_pool=rpool, token_to_kv_pool=pool, attn_backend=backend)
    backend.init_forward_metadata(fb)
    q = torch.randn(n, NH * HD, dtype=DTYPE, device="cuda", generator=None)
    k = torch.randn(n, NKV * HD, dtype=DTYPE, device="cuda")
    v = torch.randn(n, NKV * HD, dtype=DTYPE, device="cuda")
    return fb, q, k, v, RadixAttention(NH, HD, HD ** -0.5, NKV, 0)


def run_backend(name: str, workload: dict, page_size: int, iters: int, inner: int) -> float:
    """Milliseconds of one layer's ``forward`` of backend ``name`` on ``workload``."""
    from sglang.srt.layers.attention import create_attention_backend

    backend = create_attention_backend(name)
    gen = torch.Generator().manual_seed(0)
    fb, q, k, v, layer = make_batch(backend, workload["prompt"], workload["new"], page_size, gen)
    ms = time_ms(lambda: backend.forward(q, k, v, layer, fb), iters, inner)
    del fb
    torch.cuda.empty_cache()
    return ms


def sdpa_ms(tokens: int, iters: int, inner: int) -> float:
    """torch SDPA, causal, one sequence of ``tokens`` (GQA by repeating KV heads outside the timed call)."""
    q = torch.randn(1, NH, tokens, HD, dtype=DTYPE, device="cuda")
    kv = torch.randn(1, NKV, tokens, HD, dtype=DTYPE, device="cuda").repeat_interleave(NH // NKV, 1)
    f = torch.nn.functional.scaled_dot_product_attention
    return time_ms(lambda: f(q, kv, kv, is_causal=True), iters, inner)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--page-size", type=int, default=1)
    ap.add_argument("--decode-context", type=int, default=1024)
    ap.add_argument("--iters", type=int, default=15)
    ap.add_argument("--inner", type=int, default=8)
    ap.add_argument("--reps", type=int, default=2, help="repetitions, backend order alternated")
    ap.add_argument("--out", default=str(REPO / "benchmark" / "results"))
    from benchmark.common.records import add_record_dir_argument
    add_record_dir_argument(ap, "attention")
    args = ap.parse_args()
    try:
        import flashinfer
        fi_version = flashinfer.__version__
    except ImportError as e:
        fi_version = None
        print(f"flashinfer not importable ({e}): its rows are not measured")
    backends = ["triton"] + (["flashinfer"] if fi_version else [])
    ctx = args.decode_context
    workloads = [
        {"name": "prefill 1K", "prompt": [0], "new": [1024]},
        {"name": "prefill 8K", "prompt": [0], "new": [8192]},
        {"name": f"decode bs 1 x {ctx}", "prompt": [ctx - 1], "new": [1]},
        {"name": f"decode bs 32 x {ctx}", "prompt": [ctx - 1] * 32, "new": [1] * 32},
        {"name": f"decode bs 128 x {ctx}", "prompt": [ctx - 1] * 128, "new": [1] * 128},
    ]
    bw, mm = copy_bandwidth(), matmul_rate()
    rows = []
    for w in workloads:
        times = {b: [] for b in backends}
        for rep in range(args.reps):
            for b in (backends if rep % 2 == 0 else list(reversed(backends))):
                times[b].append(run_backend(b, w, args.page_size, args.iters, args.inner))
        row = {"workload": w["name"], **{f"{b}_ms": statistics.median(times[b]) for b in backends}}
        if w["name"].startswith("prefill"):
            n = w["new"][0]
            row["sdpa_ms"] = sdpa_ms(n, args.iters, args.inner)
            row["floor_ms"] = 4 * NH * HD * n * (n + 1) / 2 / mm * 1e3  # causal FLOPs at the matmul rate
        else:
            kv_bytes = 2 * NKV * HD * DTYPE.itemsize * sum(p + 1 for p in w["prompt"])
            row["floor_ms"] = kv_bytes / (bw / 2) * 1e3  # each K/V byte read once (copy bandwidth counts 2 bytes)
        if "flashinfer_ms" in row:
            row["flashinfer_over_triton"] = row["flashinfer_ms"] / row["triton_ms"]
        for b in backends + (["sdpa"] if "sdpa_ms" in row else []):
            row[f"{b}_over_floor"] = row[f"{b}_ms"] / row["floor_ms"]
        rows.append(row)
        print(json.dumps(row))
    gpu = torch.cuda.get_device_name()
    try:
        commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True).stdout.strip() or "unknown"
    except OSError:
        commit = "unknown"
    now = datetime.datetime.now(datetime.timezone.utc)
    record = {"benchmark": "attention_flashinfer_vs_triton", "mode": f"one layer, page size {args.page_size}",
              "git_commit": commit, "date": now.isoformat(timespec="seconds"), "gpu": gpu,
              "gpu_count": torch.cuda.device_count(), "torch": torch.__version__, "cuda": torch.version.cuda,
              "nccl": ".".join(map(str, torch.cuda.nccl.version())) if hasattr(torch.cuda, "nccl") else None,
              "flashinfer": fi_version, "command": " ".join([sys.executable] + sys.argv),
              "copy_bandwidth_gbps": bw / 1e9, "matmul_tflops": mm / 1e12, "automatic_choice": "triton",
              "rows": rows}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"{now:%Y-%m-%d}_attention_flashinfer_vs_triton_{gpu.split()[-1].lower()}_ps{args.page_size}"
    stem.with_suffix(".json").write_text(json.dumps(record, indent=1))
    stem.with_suffix(".md").write_text(render(record))
    print(render(record))
    if args.record_dir:
        sys.path.insert(0, str(REPO))
        from benchmark.common import records

        js, _ = records.write_record(make_fi_record(rows, args, fi_version, bw, mm), Path(args.record_dir))
        print(f"record: {js}")


def make_fi_record(rows: list[dict], args, fi_version, bw: float, mm: float, env: dict | None = None) -> dict:
    """The rows of :func:`main` as a :mod:`benchmark.common.records` record: ``triton_ms`` (the automatic choice) and
    ``sdpa_ms`` are the same-run baselines, ``floor_ms`` the floor. Headline: FlashInfer vs Triton at the largest
    decode batch and at the 8K prefill (Triton vs its floor where FlashInfer was not measured)."""
    from benchmark.common import records

    rows = records.add_ratio(rows, "triton_over_sdpa", "triton_ms", "sdpa_ms")
    rows = [{k: v for k, v in r.items() if v is not None} for r in rows]
    headline = []
    for name in ([r["workload"] for r in rows if r["workload"].startswith("decode")][-1:]
                 + [r["workload"] for r in rows if r["workload"] == "prefill 8K"]):
        r = next(x for x in rows if x["workload"] == name)
        if "flashinfer_ms" in r:
            headline.append({"label": f"FlashInfer vs Triton attention layer, {name}, page size {args.page_size}",
                             "value": round(r["flashinfer_ms"], 4), "unit": "ms",
                             "baseline": round(r["triton_ms"], 4), "ratio": round(r["flashinfer_over_triton"], 3)})
        else:
            headline.append({"label": f"Triton attention layer vs its floor, {name}, page size {args.page_size}",
                             "value": round(r["triton_ms"], 4), "unit": "ms", "baseline": round(r["floor_ms"], 4),
                             "ratio": round(r["triton_over_floor"], 3)})
    return records.make_record(
        subject="attention", benchmark="benchmark.attention.bench_flashinfer_vs_triton",
        mode=f"page-size-{args.page_size}", what="flashinfer_vs_triton", rows=rows, env=env,
        params={"page_size": args.page_size, "decode_context": args.decode_context, "iters": args.iters,
                "inner": args.inner, "reps": args.reps, "flashinfer": fi_version, "automatic_choice": "triton",
                "copy_bandwidth_gbps": round(bw / 1e9, 1), "matmul_tflops": round(mm / 1e12, 1)},
        baselines=[c for c in ("triton_ms", "sdpa_ms") if any(c in r for r in rows)],
        units={k: "ms" for r in rows for k in r if k.endswith("_ms")},
        floor={"column": "floor_ms", "what": "prefill: causal FLOPs at the bf16 matmul rate; decode: each K/V byte "
                                             "read once at the device-to-device copy bandwidth; both same run"},
        headline=headline, gpu_count=1)


def render(record: dict) -> str:
    """The markdown table of a record written by :func:`main`."""
    cols = [c for c in ("triton_ms", "flashinfer_ms", "sdpa_ms", "floor_ms", "flashinfer_over_triton",
                        "triton_over_floor", "flashinfer_over_floor") if any(c in r for r in record["rows"])]
    lines = [f"# FlashInfer vs Triton attention ({record['gpu']}, {record['mode']})", "",
             f"{record['date']}, commit {record['git_commit']}, torch {record['torch']}, FlashInfer "
             f"{record['flashinfer']}, copy {record['copy_bandwidth_gbps']:.0f} GB/s, bf16 matmul "
             f"{record['matmul_tflops']:.0f} TFLOP/s; automatic choice: {record['automatic_choice']}.",
             f"Command: `{record['command']}`", "", "| workload | " + " | ".join(cols) + " |",
             "|---|" + "---:|" * len(cols)]
    for r in record["rows"]:
        lines.append(f"| {r['workload']} | " + " | ".join(f"{r[c]:.4g}" if c in r else "-" for c in cols) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
