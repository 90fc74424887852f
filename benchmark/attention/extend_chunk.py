"""Prefill attention of one chunked-prefill step as the serving workload forms it: the Triton extend kernel against
PyTorch's fused attention for the rows without a cached prefix (``SGLANG_EXTEND_ATTENTION``), same run.

A chunk is ``--chunk`` tokens (default 8192, the server's chunked prefill size) filled with requests whose prompt
lengths are drawn uniformly from 1..``--max-len`` (SGLang's random dataset at range ratio 0: 1..4096); the last one
is cut at the chunk's end. Cases: ``fresh`` (every row prefix-free, the first chunks of the offline test) and
``continued`` (the first row continues a chunked request: a prefix of ``--prefix`` tokens). Llama-3.1-8B attention
shapes (32 query heads, 8 KV heads, head_dim 128, bf16), KV in a shuffled paged pool. Arms, each through
``TritonAttnBackend.forward`` (RoPE off; the K/V store included, as in the server):

* ``triton``: the Triton extend kernel for every row (the default);
* ``sdpa``: prefix-free rows through one ``scaled_dot_product_attention(is_causal=True)`` each (KV heads repeated);
* ``varlen``: prefix-free rows through one FlashAttention-2 variable-length call.

Timing: CUDA events, arms alternated per round (``benchmark.common.timing.compare``), medians. Every arm's output
is checked against the ``triton`` arm's (max abs error printed). Prints a table (per layer ms, the ratio to
``triton``, the fastest arm = the automatic choice) and writes a ``benchmark.common.records`` record with
``--record-dir``. Also measures SDPA on the single 8K causal prompt of the earlier comparison, for reference.

Usage: python benchmark/attention/extend_chunk.py [--chunk 8192] [--record-dir benchmark/results]
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "python"))

ARMS = ("triton", "sdpa", "varlen")


def chunk_rows(chunk: int, max_len: int, seed: int, prefix: int) -> tuple[list[int], list[int]]:
    """(prefix_lens, extend_lens) of one chunk: an optional continued row (``prefix`` > 0, half the chunk at most),
    then fresh requests of uniform 1..max_len tokens until the chunk is full (the last one cut)."""
    rng = random.Random(seed)
    pre, ext, left = [], [], chunk
    if prefix > 0:
        first = min(rng.randint(1, max_len), chunk // 2)
        pre.append(prefix)
        ext.append(first)
        left -= first
    while left > 0:
        n = min(rng.randint(1, max_len), left)
        pre.append(0)
        ext.append(n)
        left -= n
    return pre, ext


def build(pre: list[int], ext: list[int], device: str, dtype=torch.bfloat16, nh=32, nkv=8, hd=128, seed=0):
    """q/k/v of the new tokens and a ForwardBatch factory over a shuffled paged pool (one layer)."""
    from sglang.srt.forward_batch_info import ForwardBatch, ForwardMode
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool

    gen = torch.Generator().manual_seed(seed)
    bs = len(pre)
    seq = [p + e for p, e in zip(pre, ext)]
    slots = sum(seq) + 16
    perm = torch.randperm(slots, generator=gen)[: sum(seq)] + 1
    r2t = torch.zeros(bs + 1, max(seq) + 8, dtype=torch.int32)
    loc, off = [], 0
    for i in range(bs):
        r2t[i, : seq[i]] = perm[off: off + seq[i]].to(torch.int32)
        loc.append(perm[off + pre[i]: off + seq[i]])
        off += seq[i]
    n = sum(ext)
    q = torch.randn(n, nh * hd, generator=gen).to(dtype).to(device)
    k = torch.randn(n, nkv * hd, generator=gen).to(dtype).to(device)
    v = torch.randn(n, nkv * hd, generator=gen).to(dtype).to(device)
    pool = MHATokenToKVPool(slots, 1, dtype, nkv, hd, 1, device)
    pool.k_buffer[0].copy_(torch.randn(slots + 1, nkv, hd, generator=gen).to(dtype))
    pool.v_buffer[0].copy_(torch.randn(slots + 1, nkv, hd, generator=gen).to(dtype))
    rpool = ReqToTokenPool(bs + 1, max(seq) + 8, device)
    rpool.req_to_token.copy_(r2t)
    layer = RadixAttention(nh, hd, hd ** -0.5, nkv, 0)
    starts = [sum(ext[:i]) for i in range(bs)]

    def t(x):
        return torch.tensor(x, dtype=torch.int64, device=device)

    def make(backend):
        fb = ForwardBatch(forward_mode=ForwardMode.EXTEND, batch_size=bs, input_ids=t([1] * n), positions=t([0] * n),
                          out_cache_loc=torch.cat(loc).to(device), req_pool_indices=t(list(range(bs))),
                          seq_lens=t(seq), prefix_lens=t(pre), extend_lens=t(ext), extend_start_loc=t(starts),
                          seq_lens_cpu=seq, prefix_lens_cpu=pre, extend_lens_cpu=ext, req_to_token_pool=rpool,
                          token_to_kv_pool=pool, attn_backend=backend)
        backend.init_forward_metadata(fb)
        return fb

    return q, k, v, layer, make


def attention_tflop(pre: list[int], ext: list[int], nh=32, hd=128) -> float:
    """Causal attention FLOP of the rows (QK^T and PV, 2 FLOP per multiply-add), TFLOP."""
    return sum(4.0 * e * (p + (e + 1) / 2) * hd * nh for p, e in zip(pre, ext)) / 1e12


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--chunk", type=int, default=8192)
    p.add_argument("--max-len", type=int, default=4096)
    p.add_argument("--prefix", type=int, default=3000, help="prefix of the continued row in the 'continued' case")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--iters", type=int, default=10)
    from benchmark.common.records import add_record_dir_argument
    add_record_dir_argument(p, "attention")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("extend_chunk: needs a CUDA GPU (the Triton kernel and FlashAttention run there)")
        return 0
    from benchmark.common.timing import compare, median
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend

    dev = "cuda"
    rows = []
    cases = [(f"fresh s{sd}", 0, sd) for sd in a.seeds] + [(f"continued s{sd}", a.prefix, sd) for sd in a.seeds[:1]]
    for name, prefix, seed in cases:
        pre, ext = chunk_rows(a.chunk, a.max_len, seed, prefix)
        q, k, v, layer, make = build(pre, ext, dev, seed=seed)
        fbs, outs = {}, {}
        for arm in ARMS:
            be = TritonAttnBackend(extend_impl=arm)
            fbs[arm] = (be, make(be))
            outs[arm] = be.forward(q, k, v, layer, fbs[arm][1])
        torch.cuda.synchronize()
        err = {arm: (outs[arm].float() - outs["triton"].float()).abs().max().item() for arm in ARMS}
        t = compare({arm: (lambda arm=arm: fbs[arm][0].forward(q, k, v, layer, fbs[arm][1])) for arm in ARMS},
                    device=dev, rounds=a.rounds, iters=a.iters)
        ms = {arm: median(t[arm].samples_ms) for arm in ARMS}
        tf = attention_tflop(pre, ext)
        best = min(ms, key=ms.get)
        rows.append({"case": name, "rows": len(ext), "prefix_free_rows": sum(1 for x in pre if x == 0),
                     "longest": max(ext), "tflop": round(tf, 4), **{f"{arm}_ms": round(ms[arm], 4) for arm in ARMS},
                     **{f"{arm}_vs_triton": round(ms["triton"] / ms[arm], 3) for arm in ARMS if arm != "triton"},
                     "triton_tflops": round(tf / ms["triton"] * 1e3, 1), "best": best,
                     "max_err_vs_triton": round(max(err.values()), 4)})
        del fbs, outs, q, k, v
        torch.cuda.empty_cache()
    # the earlier single-prompt comparison: one 8K causal prompt, SDPA alone
    qd = torch.randn(1, 32, a.chunk, 128, device=dev, dtype=torch.bfloat16)
    kd = torch.randn(1, 32, a.chunk, 128, device=dev, dtype=torch.bfloat16)
    sd = compare({"sdpa_8k_dense": lambda: torch.nn.functional.scaled_dot_product_attention(qd, kd, kd, is_causal=True)},
                 device=dev, rounds=2, iters=a.iters)
    single = median(sd["sdpa_8k_dense"].samples_ms)
    gpu = torch.cuda.get_device_name(0)
    print(f"\n{gpu}; chunk {a.chunk} tokens of 1..{a.max_len}-token requests; per-layer attention (K/V store included)")
    print("| case | rows | prefix-free | longest | TFLOP | triton ms | sdpa ms | varlen ms | sdpa x | varlen x | "
          "triton TFLOP/s | best | max err |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|")
    for r in rows:
        print(f"| {r['case']} | {r['rows']} | {r['prefix_free_rows']} | {r['longest']} | {r['tflop']:.3f} | "
              f"{r['triton_ms']:.3f} | {r['sdpa_ms']:.3f} | {r['varlen_ms']:.3f} | {r['sdpa_vs_triton']:.2f} | "
              f"{r['varlen_vs_triton']:.2f} | {r['triton_tflops']:.0f} | {r['best']} | {r['max_err_vs_triton']:.3g} |")
    print(f"reference: SDPA on one dense {a.chunk}-token causal prompt (32 heads, d 128): {single:.3f} ms")
    if a.record_dir:
        from benchmark.common.records import make_record, write_record

        rec = make_record(subject="attention", benchmark="benchmark.attention.extend_chunk", mode="chunk",
                          what="extend_chunk_vs_sdpa", rows=rows, baselines=["triton_ms"],
                          params=vars(a) | {"sdpa_8k_dense_ms": round(single, 4)}, units={
                              f"{arm}_ms": "ms" for arm in ARMS} | {"triton_tflops": "TFLOP/s"},
                          notes=["x columns: triton ms / arm ms (> 1: the arm is faster)."])
        print(write_record(rec, Path(a.record_dir)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
