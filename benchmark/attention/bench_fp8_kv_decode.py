"""Decode attention kernel time over a BF16 vs an FP8 (E4M3) KV cache, against the memory floor.

One layer of Llama-3.1-8B's decode attention (32 query heads, 8 KV heads, head_dim 128, pages of 16 slots in a
shuffled order), the server's split-KV Triton kernel (:func:`sgl_kernel.triton.decode_attention.decode_attention_fwd`
with the split count the backend picks, reported per row) at batch 1 / 32 / 128 and contexts 1K / 4K. FP8 halves the
bytes the kernel must stream; the floor of each row is its KV bytes (batch x context x 2 x KV heads x head_dim x
element size) over the device-to-device copy bandwidth measured in the same run (read + written bytes / time, a
4 GiB copy). Timing: each measurement replays a CUDA graph of ``--inner`` back-to-back launches (as the decode step
replays them) between CUDA events, after warm-up replays; ``--reps`` measurements per row with the BF16 / FP8 order
alternated, the median reported. One extend row per ``--extend-tokens`` (default one 4096-token prefill) times the
compute-bound prefill kernel over both caches. The baseline is the same kernel on a BF16 cache (the FP8 KV path
is the Triton backend's; FlashInfer's FP8 decode is not part of this comparison).

``--smoke``: the same flow on the CPU under ``TRITON_INTERPRET=1`` at toy shapes with wall-clock timing (checks the
script, not the speed). Writes ``<out>/fp8_kv_decode.json`` and ``.md``. ``--record-dir DIR`` also writes a
:mod:`benchmark.common.records` record (``what`` = ``fp8_kv_decode``) under ``DIR/attention/``: the decode and extend
rows with the BF16 cache as the same-run baseline and the copy-bandwidth floor.

    python benchmark/attention/bench_fp8_kv_decode.py --out /tmp/fp8kv            # GPU, ~60 s on an H100
    python benchmark/attention/bench_fp8_kv_decode.py --smoke --out /tmp/fp8kv    # CPU, ~30 s
    python benchmark/attention/bench_fp8_kv_decode.py --out /tmp/fp8kv --record-dir benchmark/results
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # the benchmark package when run as a file
    sys.path.insert(0, str(REPO))


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="folder for fp8_kv_decode.json / .md")
    p.add_argument("--batches", default="1,32,128")
    p.add_argument("--contexts", default="1024,4096")
    p.add_argument("--reps", type=int, default=20, help="measurements per row and KV dtype (median reported)")
    p.add_argument("--inner", type=int, default=20, help="kernel launches per graph replay")
    p.add_argument("--kv-dtype", default="fp8_e4m3", choices=["fp8_e4m3", "fp8_e5m2"])
    p.add_argument("--policy", default="balanced", choices=["balanced", "wave"],
                   help="decode split policy (SGLANG_DECODE_SPLIT_POLICY; balanced is the server's default: rows "
                        "longest first, length-aware split counts)")
    p.add_argument("--extend-tokens", default="4096", help="prefill (extend) rows: one request of N new tokens each "
                   "(comma separated; empty: none), to see what reading FP8 costs the compute-bound extend kernel")
    p.add_argument("--smoke", action="store_true", help="CPU + TRITON_INTERPRET at toy shapes (flow check)")
    from benchmark.common.records import add_record_dir_argument
    add_record_dir_argument(p, "attention")
    ns = p.parse_args(argv)
    ns.batches = [int(x) for x in ns.batches.split(",")]
    ns.contexts = [int(x) for x in ns.contexts.split(",")]
    ns.extend_tokens = [int(x) for x in ns.extend_tokens.split(",") if x.strip()]
    if ns.smoke:
        ns.batches, ns.contexts, ns.reps, ns.inner, ns.extend_tokens = [1, 2], [32, 64], 2, 1, [48]
    if min(ns.batches + ns.contexts) < 1 or ns.reps < 1 or ns.inner < 1:
        raise SystemExit("--batches, --contexts, --reps and --inner must be positive")
    return ns


def make_pool(dtype, bs: int, ctx: int, nkv: int, hd: int, page: int, device: str, seed: int):
    """One-layer pool of ``bs * ctx`` slots (+ the dummy page) filled with N(0, 1) K/V (quantized for FP8, scale
    1.0) and a ``req_to_token`` [bs, ctx] over pages of ``page`` slots in a shuffled order."""
    import torch

    from sglang.srt.mem_cache.kv_quant import quantize_kv
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    total = bs * ctx
    pool = MHATokenToKVPool(total, page, dtype, nkv, hd, 1, device)
    gen = torch.Generator(device=device).manual_seed(seed)
    flat = pool.kv_data.view(-1)
    chunk = 1 << 26
    for i in range(0, flat.numel(), chunk):
        x = torch.randn(min(chunk, flat.numel() - i), generator=gen, device=device, dtype=torch.bfloat16)
        flat[i:i + x.numel()] = quantize_kv(x, 1.0, dtype).view(pool.store_dtype)
    pages = torch.randperm(total // page, generator=torch.Generator().manual_seed(seed)) + 1  # page 0: dummy
    slots = (pages[:, None] * page + torch.arange(page)).reshape(bs, ctx)
    return pool, slots.to(torch.int32).to(device)


def bench_row(bs: int, ctx: int, kv_dtype, ns, device: str, bandwidth: float) -> dict:
    """Both KV dtypes at one (batch, context): median per-launch time (us), split count, bytes, floors."""
    import torch

    from sgl_kernel.triton.decode_attention import (BALANCED_MIN_SPLIT_LEN, decode_attention_fwd, decode_row_order,
                                                    default_num_kv_splits)

    nh, nkv, hd, page = (32, 8, 128, 16) if not ns.smoke else (4, 2, 16, 16)
    dev = torch.device(device)
    splits = default_num_kv_splits(bs, nkv, dev, 16, policy=ns.policy)
    balanced = ns.policy == "balanced"  # as TritonAttnBackend launches it (order and rule built once, as in a graph)
    min_split_len = BALANCED_MIN_SPLIT_LEN if balanced and splits > 1 else 0
    q = torch.randn(bs, nh, hd, device=device, dtype=torch.bfloat16)
    cases = {}
    for name, dtype in (("bf16", torch.bfloat16), ("fp8", kv_dtype)):
        pool, r2t = make_pool(dtype, bs, ctx, nkv, hd, page, device, seed=bs * 7 + ctx)
        k_buf, v_buf = pool.get_kv_buffer(0)
        out = torch.empty_like(q)
        mid_o = torch.empty(bs, nh, splits, hd, device=device, dtype=torch.float32)
        mid_lse = torch.empty(bs, nh, splits, device=device, dtype=torch.float32)
        rows = torch.arange(bs, device=device, dtype=torch.int64)
        lens = torch.full((bs,), ctx, device=device, dtype=torch.int64)
        order = decode_row_order(lens) if balanced else None

        def launch(k_buf=k_buf, v_buf=v_buf, out=out, mid_o=mid_o, mid_lse=mid_lse, r2t=r2t, rows=rows, lens=lens,
                   order=order):
            decode_attention_fwd(q, k_buf, v_buf, out, r2t, rows, lens, hd ** -0.5, splits, mid_o, mid_lse,
                                 order=order, min_split_len=min_split_len, k_scale=1.0, v_scale=1.0)

        cases[name] = dict(pool=pool, launch=launch, out=out,
                           kv_bytes=bs * ctx * 2 * nkv * hd * pool.kv_data.element_size())
    for c in cases.values():
        c["run"] = _graph_runner(c["launch"], ns.inner, device)
    times = {"bf16": [], "fp8": []}
    for rep in range(ns.reps):
        order = ("bf16", "fp8") if rep % 2 == 0 else ("fp8", "bf16")
        for name in order:
            times[name].append(cases[name]["run"]() / ns.inner * 1e6)
    diff = (cases["fp8"]["out"].float() - cases["bf16"]["out"].float()).abs().max().item()
    row = {"batch": bs, "context": ctx, "splits": splits, "max_abs_out_diff": diff}
    for name in ("bf16", "fp8"):
        t = statistics.median(times[name])
        floor = cases[name]["kv_bytes"] / bandwidth * 1e6
        row.update({f"{name}_us": t, f"{name}_kv_bytes": cases[name]["kv_bytes"], f"{name}_floor_us": floor,
                    f"{name}_vs_floor": t / floor, f"{name}_us_all": times[name]})
    row["fp8_speedup"] = row["bf16_us"] / row["fp8_us"]
    for c in cases.values():
        del c["pool"]
    return row


def bench_extend_row(tokens: int, kv_dtype, ns, device: str) -> dict:
    """One request prefilling ``tokens`` new tokens (no cached prefix) through the extend kernel over a BF16 and an
    FP8 cache: median per-launch time (us); the kernel is compute-bound, so this shows the cost of widening FP8."""
    import torch

    from sgl_kernel.triton.extend_attention import extend_attention_fwd

    nh, nkv, hd, page = (32, 8, 128, 16) if not ns.smoke else (4, 2, 16, 16)
    q = torch.randn(tokens, nh, hd, device=device, dtype=torch.bfloat16)
    i64 = dict(device=device, dtype=torch.int64)
    rows, zero, lens = torch.zeros(1, **i64), torch.zeros(1, **i64), torch.full((1,), tokens, **i64)
    cases = {}
    for name, dtype in (("bf16", torch.bfloat16), ("fp8", kv_dtype)):
        pool, r2t = make_pool(dtype, 1, tokens, nkv, hd, page, device, seed=tokens)
        k_buf, v_buf = pool.get_kv_buffer(0)
        out = torch.empty_like(q)

        def launch(k_buf=k_buf, v_buf=v_buf, out=out, r2t=r2t):
            extend_attention_fwd(q, out, k_buf, v_buf, r2t, rows, zero, lens, zero, tokens, hd ** -0.5)

        cases[name] = dict(pool=pool, run=_graph_runner(launch, ns.inner, device))
    times = {"bf16": [], "fp8": []}
    for rep in range(ns.reps):
        for name in (("bf16", "fp8") if rep % 2 == 0 else ("fp8", "bf16")):
            times[name].append(cases[name]["run"]() / ns.inner * 1e6)
    row = {"extend_tokens": tokens, "bf16_us": statistics.median(times["bf16"]),
           "fp8_us": statistics.median(times["fp8"])}
    row["fp8_vs_bf16"] = row["fp8_us"] / row["bf16_us"]
    flops = 4.0 * nh * hd * tokens * (tokens + 1) / 2  # causal: QK^T and PV over the visible pairs
    row["bf16_tflops"], row["fp8_tflops"] = flops / row["bf16_us"] / 1e6, flops / row["fp8_us"] / 1e6
    return row


def _graph_runner(launch, inner: int, device: str):
    """A callable returning the seconds of one measurement of ``inner`` launches: a CUDA graph replay between
    events on CUDA (3 warm-up replays first), wall clock on the CPU."""
    import torch

    if device == "cpu":
        launch()

        def run_cpu() -> float:
            t0 = time.perf_counter()
            for _ in range(inner):
                launch()
            return time.perf_counter() - t0
        return run_cpu
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            launch()  # compile / autotune outside the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(inner):
            launch()
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def run_cuda() -> float:
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e-3
    return run_cuda


def copy_bandwidth(device: str, gib: float) -> float:
    """Bytes/s of a device copy of ``gib`` GiB (read + written bytes / median time of 10 copies)."""
    import torch

    n = int(gib * 2**30)
    src = torch.empty(n, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    ts = []
    for i in range(12):
        if device == "cpu":
            t0 = time.perf_counter()
            dst.copy_(src)
            dt = time.perf_counter() - t0
        else:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            dst.copy_(src)
            b.record()
            b.synchronize()
            dt = a.elapsed_time(b) * 1e-3
        if i >= 2:
            ts.append(dt)
    return 2 * n / statistics.median(ts)


def render(res: dict) -> str:
    """The markdown table of a result record."""
    out = [f"# Decode attention: BF16 vs {res['kv_dtype']} KV cache ({res['date']}, {res['gpu']})", "",
           f"Command: `{res['command']}`  ", f"Commit {res['commit']}, torch {res['torch']}, triton {res['triton']}, "
           f"NCCL {res['nccl']}, mode {res['mode']}; copy bandwidth {res['copy_bandwidth_gbs']:.0f} GB/s "
           f"(read + written bytes / time); one attention layer of {res['shape']}, pages of 16; "
           f"median of {res['reps']} timed replays of {res['inner']} launches (CUDA graphs on a GPU), BF16/FP8 order "
           "alternated; "
           f"splits = the backend's automatic choice (decode split policy {res.get('policy', 'wave')}).", "",
           "| batch | context | splits | BF16 us | BF16 floor us | BF16/floor | FP8 us | FP8 floor us | FP8/floor | "
           "FP8 speedup |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        out.append(f"| {r['batch']} | {r['context']} | {r['splits']} | {r['bf16_us']:.2f} | {r['bf16_floor_us']:.2f} | "
                   f"{r['bf16_vs_floor']:.2f} | {r['fp8_us']:.2f} | {r['fp8_floor_us']:.2f} | "
                   f"{r['fp8_vs_floor']:.2f} | {r['fp8_speedup']:.2f}x |")
    if res.get("extend_rows"):
        out += ["", "Extend (prefill attention, one request, no cached prefix): the kernel is compute-bound; FP8 tiles "
                "are widened to BF16 before the tensor-core products.", "",
                "| new tokens | BF16 us | FP8 us | FP8 / BF16 time | BF16 TFLOP/s | FP8 TFLOP/s |",
                "|---|---|---|---|---|---|"]
        for r in res["extend_rows"]:
            out.append(f"| {r['extend_tokens']} | {r['bf16_us']:.1f} | {r['fp8_us']:.1f} | {r['fp8_vs_bf16']:.2f} | "
                       f"{r['bf16_tflops']:.1f} | {r['fp8_tflops']:.1f} |")
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    ns = parse_args(sys.argv[1:] if argv is None else argv)
    if ns.smoke:
        os.environ["TRITON_INTERPRET"] = "1"
    sys.path[:0] = [str(REPO / "python"), str(REPO / "sgl-kernel" / "python")]
    import torch
    import triton

    from sglang.srt.mem_cache.kv_quant import resolve_kv_cache_dtype

    device = "cpu" if ns.smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA GPU: run with --smoke on a CPU machine")
    kv_dtype = resolve_kv_cache_dtype(ns.kv_dtype, torch.bfloat16)
    bw = copy_bandwidth(device, 0.0625 if ns.smoke else 4.0)
    try:
        commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True).stdout.strip() or "unknown"
    except OSError:
        commit = "unknown"
    res = {"benchmark": "fp8_kv_decode_attention", "mode": "smoke (CPU, TRITON_INTERPRET)" if ns.smoke else "gpu",
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "gpu": torch.cuda.get_device_name(0) if device == "cuda" else "cpu", "gpu_count": 1,
           "torch": torch.__version__, "triton": triton.__version__,
           "nccl": ".".join(map(str, torch.cuda.nccl.version())) if device == "cuda" else "-",
           "commit": commit, "command": "python benchmark/attention/bench_fp8_kv_decode.py " + " ".join(
               sys.argv[1:] if argv is None else argv),
           "shape": "toy shape (4 q / 2 KV heads, head_dim 16)" if ns.smoke else
           "Llama-3.1-8B (32 q / 8 KV heads, head_dim 128)",
           "kv_dtype": ns.kv_dtype, "policy": ns.policy, "reps": ns.reps, "inner": ns.inner,
           "copy_bandwidth_gbs": bw / 1e9, "rows": []}
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    for bs in ns.batches:
        for ctx in ns.contexts:
            row = bench_row(bs, ctx, kv_dtype, ns, device, bw)
            res["rows"].append(row)
            print(f"batch {bs:4d} ctx {ctx:5d} splits {row['splits']:2d}: bf16 {row['bf16_us']:8.2f} us "
                  f"({row['bf16_vs_floor']:.2f}x floor)  fp8 {row['fp8_us']:8.2f} us ({row['fp8_vs_floor']:.2f}x "
                  f"floor)  speedup {row['fp8_speedup']:.2f}x", flush=True)
            if device == "cuda":
                torch.cuda.empty_cache()
    res["extend_rows"] = []
    for tokens in ns.extend_tokens:
        row = bench_extend_row(tokens, kv_dtype, ns, device)
        res["extend_rows"].append(row)
        print(f"extend {tokens} tokens: bf16 {row['bf16_us']:.1f} us, fp8 {row['fp8_us']:.1f} us "
              f"({row['fp8_vs_bf16']:.2f}x)", flush=True)
    (out / "fp8_kv_decode.json").write_text(json.dumps(res, indent=1))
    (out / "fp8_kv_decode.md").write_text(render(res))
    print(render(res))
    if ns.record_dir:
        sys.path.insert(0, str(REPO))
        from benchmark.common import records

        js, _ = records.write_record(make_fp8_kv_record(res, ns), Path(ns.record_dir))
        print(f"record: {js}")
    return 0


def make_fp8_kv_record(res: dict, ns, env: dict | None = None) -> dict:
    """``res`` of :func:`main` as a :mod:`benchmark.common.records` record: decode rows (``part`` = decode) and
    extend rows (``part`` = extend), ``bf16_us`` the same-run baseline. Headline: FP8 vs BF16 decode at the largest
    batch and context, and the first extend row."""
    from benchmark.common import records

    rows = ([{"part": "decode", **r} for r in res["rows"]]
            + [{"part": "extend", **r} for r in res.get("extend_rows", [])])
    headline = []
    if res["rows"]:
        big = max(res["rows"], key=lambda r: (r["batch"] * r["context"], r["batch"]))
        headline.append({"label": f"decode attention, batch {big['batch']} x context {big['context']}, "
                                  f"{res['kv_dtype']} vs BF16 KV cache", "value": round(big["fp8_us"], 2),
                         "unit": "us", "baseline": round(big["bf16_us"], 2), "ratio": round(big["fp8_speedup"], 3)})
        headline.append({"label": f"{res['kv_dtype']} decode attention vs its memory floor, batch {big['batch']} x "
                                  f"context {big['context']}", "value": round(big["fp8_us"], 2), "unit": "us",
                         "baseline": round(big["fp8_floor_us"], 2), "ratio": round(big["fp8_vs_floor"], 3)})
    if res.get("extend_rows"):
        e = res["extend_rows"][0]
        headline.append({"label": f"extend attention, {e['extend_tokens']} new tokens, {res['kv_dtype']} vs BF16 "
                                  "KV cache (time ratio)", "value": round(e["fp8_us"], 1), "unit": "us",
                         "baseline": round(e["bf16_us"], 1), "ratio": round(e["fp8_vs_bf16"], 3)})
    return records.make_record(
        subject="attention", benchmark="benchmark.attention.bench_fp8_kv_decode",
        mode=("smoke-" if ns.smoke else "") + f"{res['kv_dtype']}-{res['policy']}", what="fp8_kv_decode",
        rows=rows, env=env, gpu_count=0 if ns.smoke else 1,
        params={"shape": res["shape"], "kv_dtype": res["kv_dtype"], "policy": res["policy"], "reps": res["reps"],
                "inner": res["inner"], "copy_bandwidth_gbs": round(res["copy_bandwidth_gbs"], 1)},
        baselines=("bf16_us",), units={k: "us" for r in rows for k in r if k.endswith("_us")}
        | {"bf16_tflops": "TFLOP/s", "fp8_tflops": "TFLOP/s"},
        floor={"columns": ["bf16_floor_us", "fp8_floor_us"],
               "what": "KV bytes / device-to-device copy bandwidth measured in the same run (4 GiB copy)"},
        headline=headline, notes=["fp8_speedup = bf16_us / fp8_us; fp8_vs_bf16 (extend) = fp8_us / bf16_us"])


if __name__ == "__main__":
    raise SystemExit(main())
