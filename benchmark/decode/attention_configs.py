"""Tile configs of the split-KV decode attention kernel timed INSIDE a CUDA graph (as the decode step runs
it: 32 back-to-back calls per replay, like 32 layers, so launch overhead is the graph's, not Python's), at the
Llama-3.1-8B decode shape (32 q / 8 KV heads, head_dim 128, bf16), 1K context, shuffled KV slots.

Per batch size: the default config (``_decode_config`` and ``default_num_kv_splits``) and a few
``(BLOCK_N, num_warps, num_stages)`` / split-count alternatives; each is checked against a torch reference
(gathered KV, fp32 softmax) on the same random inputs before it is timed. Columns: microseconds per call (median of
replays / 32), KV bytes read per second over the device copy bandwidth measured in the same run, max abs error.

Usage: python benchmark/decode/attention_configs.py [--out DIR] [--batches 1 32 128] [--context 1024]
       [--alternatives 128/8/3,256/8/3] [--split-counts 1,2,4]
Writes <out>/decode_attention_configs.{md,json} and prints the table. Needs CUDA.
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
