"""Tile configs of the split-KV decode attention kernel timed INSIDE a CUDA graph (as the decode step runs
it: 32 back-to-back calls per replay, like 32 layers, so launch overhead is the graph's, not Python's), at the
Llama-3.1-8B decode shape (32 q / 8 KV heads, head_dim 128, bf16), 1K context, shuffled KV slots.

Per batch size: the default config (``_decode_config`` and ``default_num_kv_splits``) and a few
``(BLOCK_N, num_warps, num_stages)`` / split-count alternatives; each is checked against a torch reference
(gathered KV, fp32 softmax) on the same random inputs before it is timed. Columns: microseconds per call (median of
replays / 32), KV bytes read per second over the device copy bandwidth measured in the same run, max abs error.

Usage: python benchmark/decode/attention_configs.py [--out DIR] [--batches 1 32 128] [--context 1024]
       [--alternatives 128/8/3,256/8/3] [--split-counts 1,2,4]
Writes <out>/decode_attention_configs.{md,json} and prints the table. Needs CUDA. ``--record-dir DIR`` also writes
a :mod:`benchmark.common.records` record (``what`` = ``decode_attention_configs``) under ``DIR/decode/``
(:func:`attention_configs_record`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path
from typing import Optional

import torch

REPO = Path(__file__).resolve().parents[2]
for _p in (REPO / "python", REPO / "sgl-kernel" / "python", REPO):
    sys.path.insert(0, str(_p))

NH, NKV, HD = 32, 8, 128
CALLS = 32  # decode attention calls per captured graph (one per layer of Llama-3.1-8B)
ALTERNATIVES = ((64, 4, 2), (64, 4, 3), (128, 4, 3), (32, 4, 3), (64, 8, 3))


def reference(q, k_buf, v_buf, r2t, seq: int) -> torch.Tensor:
    """fp32 GQA decode attention over the first ``seq`` slots of each row of ``r2t``: ``[bs, NH, HD]``."""
    bs = q.shape[0]
    k = k_buf[r2t[:, :seq]].float()  # [bs, seq, NKV, HD]
    v = v_buf[r2t[:, :seq]].float()
    qg = q.float().view(bs, NKV, NH // NKV, HD)
    s = torch.einsum("bkgd,bckd->bkgc", qg, k) * HD ** -0.5
    return torch.einsum("bkgc,bckd->bkgd", s.softmax(-1), v).reshape(bs, NH, HD)


def graph_us(fn) -> float:
    """Microseconds per call of ``fn`` captured ``CALLS`` times in one CUDA graph (median of 7 replays)."""
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        for _ in range(CALLS):
            fn()
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    from benchmark.common.timing import time_cuda_events

    return time_cuda_events(g.replay, iters=7, warmup=1).median_ms * 1e3 / CALLS


def rows_for(bs: int, ctx: int, bw: float, alternatives=ALTERNATIVES, split_counts=(1, 2, 4),
             found: Optional[list] = None) -> list[str]:
    """Markdown rows for one batch size; each measured row is also appended to ``found`` (dicts: batch, splits,
    tile ``[BLOCK_N, warps, stages]``, us, bw_frac, err, default) when given."""
    from sgl_kernel.triton.decode_attention import (_arch_of, _decode_config, decode_attention_fwd,
                                                    decode_attention_workspace, default_num_kv_splits)

    dev, dt = torch.device("cuda"), torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(bs)
    k_buf = torch.randn(bs * ctx + 1, NKV, HD, device=dev, dtype=dt, generator=gen)
    v_buf = torch.randn(bs * ctx + 1, NKV, HD, device=dev, dtype=dt, generator=gen)
    q = torch.randn(bs, NH, HD, device=dev, dtype=dt, generator=gen)
    r2t = (torch.randperm(bs * ctx, device=dev, generator=gen) + 1).view(bs, ctx)
    rows, seq = torch.arange(bs, device=dev), torch.full((bs,), ctx, dtype=torch.int64, device=dev)
    mid_o, mid_lse = decode_attention_workspace(bs, NH, HD, 16, dev)
    ref = reference(q, k_buf, v_buf, r2t, ctx)
    out = torch.empty_like(q)
    kv_read = 2 * bs * ctx * NKV * HD * dt.itemsize
    splits = default_num_kv_splits(bs, NKV, dev)
    default = _decode_config(HD, NH // NKV, splits, _arch_of(dev))
    cands = [(splits, default, "default")] + [(splits, c, "") for c in alternatives if c != default]
    cands += [(s, default, "") for s in split_counts if s != splits]
    lines = []
    for sp, (bn, warps, stages), tag in cands:
        def call(sp=sp, bn=bn, warps=warps, stages=stages):
            decode_attention_fwd(q, k_buf, v_buf, out, r2t, rows, seq, HD ** -0.5, sp, mid_o, mid_lse,
                                 block_n=bn, num_warps=warps, num_stages=stages)
        name = f"splits={sp} BLOCK_N={bn} warps={warps} stages={stages}" + (f" ({tag})" if tag else "")
        try:
            call()
            err = (out.float() - ref).abs().max().item()
            us = graph_us(call)
        except Exception as e:  # out of resources for a config: report and go on
            lines.append(f"| {bs} | {name} | failed: {type(e).__name__} | | |")
            continue
        lines.append(f"| {bs} | {name} | {us:.1f} | {kv_read / (us * 1e-6) / bw:.2f} | {err:.4f} |")
        if found is not None:
            found.append({"batch": bs, "splits": sp, "tile": [bn, warps, stages], "us": us, "err": err,
                          "bw_frac": kv_read / (us * 1e-6) / bw, "default": tag == "default"})
    return lines


def main(argv=None) -> int:
    """Sweep, print and write ``<out>/decode_attention_configs.md``."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="/tmp/out")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 32, 128])
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--alternatives", default=None,
                   help="tiles to try beside the default, 'BLOCK_N/warps/stages,...' (default: the built-in list)")
    p.add_argument("--split-counts", default="1,2,4", help="split counts to try with the default tile ('' for none)")
    from benchmark.common.records import add_record_dir_argument
    add_record_dir_argument(p, "decode")
    cfg = p.parse_args(argv)
    alts = ALTERNATIVES if cfg.alternatives is None else tuple(
        tuple(int(x) for x in a.split("/")) for a in cfg.alternatives.split(",") if a.strip())
    if any(len(a) != 3 for a in alts):
        raise SystemExit(f"--alternatives {cfg.alternatives!r}: want BLOCK_N/warps/stages,...")
    split_counts = tuple(int(x) for x in cfg.split_counts.split(",") if x.strip())
    found: list = []
    from benchmark.attention.bench_triton_attention import hbm_bandwidth

    bw = hbm_bandwidth(4.0)
    text = [f"# Decode attention tile configs in CUDA graphs ({datetime.datetime.now(datetime.timezone.utc):%F %TZ}, "
            f"{torch.cuda.get_device_name(0)})", "",
            f"Copy bandwidth {bw / 1e12:.3f} TB/s (same process); context {cfg.context}; {CALLS} calls per graph.", "",
            "| batch | config | us per call | KV read / copy bw | max abs err vs torch |", "|---:|---|---:|---:|---:|"]
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    for bs in cfg.batches:  # written after every batch size, so a time limit keeps what was measured
        text += rows_for(bs, cfg.context, bw, alts, split_counts, found)
        torch.cuda.empty_cache()
        (out / "decode_attention_configs.md").write_text("\n".join(text) + "\n")
        (out / "decode_attention_configs.json").write_text(json.dumps(found, indent=1))
    sys.stdout.write("\n".join(text) + "\n")
    if cfg.record_dir:
        from benchmark.common import records

        js, _ = records.write_record(attention_configs_record(found, bw, cfg), Path(cfg.record_dir))
        sys.stdout.write(f"record: {js}\n")
    return 0


def attention_configs_record(found: list[dict], bw: float, cfg, env: Optional[dict] = None) -> dict:
    """The configs :func:`rows_for` measured (``found``) as a :mod:`benchmark.common.records` record. A row per
    (batch, config): microseconds per call, the same batch's default config (``default_us``, the same-run baseline)
    and ``vs_default`` (default time / this time: above 1 = faster than the default), the floor ``floor_us`` (the KV
    bytes read at the same-run copy bandwidth ``bw`` bytes/s) and ``of_floor`` (floor / time). Headline per the
    largest batch: the default config against the floor, and the fastest config against the default."""
    from benchmark.common import records

    default_us = {c["batch"]: c["us"] for c in found if c["default"]}
    rows = []
    for c in found:
        bn, warps, stages = c["tile"]
        kv_bytes = 2 * c["batch"] * cfg.context * NKV * HD * 2
        rows.append({"batch": c["batch"], "splits": c["splits"], "block_n": bn, "warps": warps, "stages": stages,
                     "default": c["default"], "us": round(c["us"], 2),
                     "default_us": round(default_us[c["batch"]], 2) if c["batch"] in default_us else None,
                     "floor_us": round(kv_bytes / bw * 1e6, 2), "kv_of_copy": round(c["bw_frac"], 3),
                     "max_abs_err": c["err"]})
    rows = records.add_ratio(rows, "vs_default", "default_us", "us")
    rows = records.add_ratio(rows, "of_floor", "floor_us", "us")
    headline = []
    if rows:
        top = max(r["batch"] for r in rows)
        mine = [r for r in rows if r["batch"] == top]
        dflt = next((r for r in mine if r["default"]), None)
        if dflt is not None:
            headline.append({"label": f"decode attention default config, batch {top} x context {cfg.context}, in a "
                                      "CUDA graph, vs the KV-bytes-at-copy-bandwidth floor", "value": dflt["us"],
                             "unit": "us", "baseline": dflt["floor_us"], "ratio": dflt["of_floor"]})
        best = min(mine, key=lambda r: r["us"])
        if best.get("default_us") is not None:
            headline.append({"label": f"fastest decode attention config at batch {top} (splits={best['splits']} "
                                      f"BLOCK_N={best['block_n']} warps={best['warps']} stages={best['stages']}) "
                                      "vs the default", "value": best["us"], "unit": "us",
                             "baseline": best["default_us"], "ratio": best["vs_default"]})
    return records.make_record(
        subject="decode", benchmark="benchmark.decode.attention_configs", mode="graph",
        what="decode_attention_configs", rows=rows, env=env,
        params={"batches": list(cfg.batches), "context": cfg.context, "q_heads": NH, "kv_heads": NKV, "head_dim": HD,
                "dtype": "bfloat16", "calls_per_graph": CALLS, "copy_bandwidth_gbps": round(bw / 1e9, 1)},
        baselines=["default_us"] if any(r.get("default_us") is not None for r in rows) else [],
        units={"us": "us", "default_us": "us", "floor_us": "us", "max_abs_err": "abs"},
        floor={"column": "floor_us", "what": "KV bytes read (2 * batch * context * kv_heads * head_dim * 2) / HBM "
                                             "device-to-device copy bandwidth of 4 GiB measured in this run"},
        headline=headline, gpu_count=1)


if __name__ == "__main__":
    sys.exit(main())
