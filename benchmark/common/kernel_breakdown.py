"""GPU time of one call split by kernel category (torch.profiler / CUPTI), for the prefill and decode analysis.

Categories (first match on the kernel name, lower case): ``gemm`` (cuBLAS / CUTLASS / nvjet / Triton GEMMs),
``attention`` (flash / extend / decode split + reduce kernels), ``norm`` (RMSNorm, fused add + norm), ``act``
(SiLU-and-mul), ``rope`` (RoPE, fused RoPE + KV store), ``copy`` (memcpy / memset / cat / index / fill), ``other``.
Kernels inside CUDA-graph replays are attributed the same way (CUPTI reports graph kernels).
"""

from __future__ import annotations

import collections
import re
from typing import Callable

import torch

CATEGORIES = (
    ("attention", r"attention|attn|flash|fmha|_fwd_kernel|extend|decode_split|decode_reduce"),
    ("gemm", r"gemm|nvjet|cutlass|cublas|xmma|sm90_|matmul|_mm_|skinny"),
    ("norm", r"rms|norm"),
    ("act", r"silu|act_and_mul|gelu|swiglu"),
    ("rope", r"rope|rotary"),
    ("copy", r"memcpy|memset|copy|cat|index|fill|gather|scatter"),
)


def categorize(name: str) -> str:
    """The category of a kernel name (see the module docstring)."""
    low = name.lower()
    for cat, pattern in CATEGORIES:
        if re.search(pattern, low):
            return cat
    return "other"


def kernel_breakdown(fn: Callable[[], object], top: int = 6) -> dict:
    """Run ``fn`` once under the profiler (after the caller's warm-up) and return ``{"total_ms", "by_category":
    {cat: ms}, "top": [(kernel name, ms, calls)]}`` of device kernel time; ``{"error": ...}`` if profiling fails."""
    from torch.profiler import ProfilerActivity, profile

    try:
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        by_cat: dict[str, float] = collections.Counter()
        kernels = []
        for ev in prof.key_averages():
            us = getattr(ev, "device_time_total", None)
            if us is None:
                us = getattr(ev, "cuda_time_total", 0.0)
            if not us or ev.key.startswith("ProfilerStep"):
                continue
            by_cat[categorize(ev.key)] += us / 1e3
            kernels.append((ev.key[:90], us / 1e3, ev.count))
        kernels.sort(key=lambda k: -k[1])
        return {"total_ms": sum(by_cat.values()), "by_category": dict(by_cat), "top": kernels[:top]}
    except Exception as e:  # a profiler without CUPTI: report, do not fail the benchmark
        return {"error": f"{type(e).__name__}: {e}"[:300]}


def render_breakdowns(rows: list[dict]) -> list[str]:
    """Markdown lines: one table row per profiled call (ms and share per category), then its top kernels."""
    cats = [c for c, _ in CATEGORIES] + ["other"]
    out = ["| call | total (ms) | " + " | ".join(cats) + " |", "|---|---:|" + "---:|" * len(cats)]
    tops = []
    for r in rows:
        b = r["breakdown"]
        if "error" in b:
            out.append(f"| {r['label']} | n/a ({b['error']}) |" + " |" * len(cats))
            continue
        tot = b["total_ms"] or 1.0
        cells = [f"{b['by_category'].get(c, 0.0):.2f} ({100 * b['by_category'].get(c, 0.0) / tot:.0f}%)"
                 for c in cats]
        out.append(f"| {r['label']} | {b['total_ms']:.2f} | " + " | ".join(cells) + " |")
        tops.append(f"- {r['label']}: " + "; ".join(f"`{n}` {ms:.2f} ms x{c}" for n, ms, c in b["top"]))
    return out + [""] + tops
