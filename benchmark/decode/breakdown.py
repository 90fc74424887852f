"""Where one decode CUDA-graph replay spends its time against the bytes each kernel class must move.

:func:`kernel_events` profiles one call (torch.profiler / CUPTI; graph kernels included) and returns its device
kernels in launch order. :func:`assign_classes` names each kernel's class: the GEMMs by layer role from their
position in a Llama-style decoder step (``qkv`` before the layer's attention; after it ``o``, ``gate_up``,
``down``; the GEMM after the last layer's ``down`` is ``lm_head``; split-K reduce kernels join the GEMM before
them), then ``attention`` (decode split + reduce), ``norm``, ``rope_kv`` (RoPE + KV-cache write), ``act``,
``sampling`` (the in-graph argmax / softmax / top-k), ``embed_copy`` (embedding gather, casts, copies), ``misc``.
:func:`min_bytes` is the least HBM traffic of each class (weights once, KV once, each activation read/written once)
from the model's shapes; :func:`role_table` puts time, bytes, achieved bandwidth, its fraction of the copy bandwidth
measured in the same process, and the time above each class's own floor side by side, so the gap between the
replay and the memory floor is split into its causes. Roofline reasoning: Williams et al., "Roofline", CACM 2009.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from typing import Callable, Dict, List, Sequence, Tuple

GEMM_ROLES = ("qkv", "o", "gate_up", "down", "lm_head")
CLASSES = GEMM_ROLES + ("gemm_other", "attention", "norm", "rope_kv", "act", "sampling", "embed_copy", "misc")
_PATTERNS = (  # first match on the lower-case kernel name
    ("sampling", r"argmax|argmin|softmax|topk|top_k|sampl|multinomial|gumbel"),
    ("attention", r"attention|attn|flash|fmha|_fwd_kernel|extend|decode_split|decode_reduce|_decode_"),
    ("gemm_aux", r"splitk_?reduce|splitkreduce"),
    ("gemm", r"gemm|nvjet|cutlass|cublas|xmma|sm90_xmma|matmul|_mm_|skinny"),
    ("norm", r"rms|norm"),
    ("act", r"silu|act_and_mul|gelu|swiglu"),
    ("rope_kv", r"rope|rotary|kv_store|store_kv|set_kv"),
    ("embed_copy", r"memcpy|memset|copy|cat|index|fill|gather|scatter|embedding"),
)
_ROLE_AFTER_ATTENTION = ("o", "gate_up", "down")


def kernel_class(name: str) -> str:
    """The coarse class of a kernel name: one of the ``_PATTERNS`` names (``gemm`` / ``gemm_aux`` unresolved by
    role) or ``misc``."""
    low = name.lower()
    for cls, pattern in _PATTERNS:
        if re.search(pattern, low):
            return cls
    return "misc"


def assign_classes(names: Sequence[str]) -> List[str]:
    """Per kernel (launch order of one decode step), its class in :data:`CLASSES`: GEMMs get their layer role.

    With ``A`` the attention groups (consecutive attention kernels), a GEMM before the first group is ``qkv``; the
    j-th GEMM after group g is ``o`` / ``gate_up`` / ``down`` for j = 0 / 1 / 2, and j = 3 is the next layer's
    ``qkv`` (or ``lm_head`` after the last group); any other GEMM is ``gemm_other``. A ``gemm_aux`` kernel (split-K
    reduce) takes the class of the GEMM before it.
    """
    coarse = [kernel_class(n) for n in names]
    groups, prev = 0, None
    for c in coarse:
        groups += c == "attention" and prev != "attention"
        prev = c
    out, g, j, last_gemm, prev = [], 0, -1, "gemm_other", None  # g attention groups seen; j GEMMs since the last
    for c in coarse:
        if c == "attention":
            if prev != "attention":
                g, j = g + 1, -1
            out.append(c)
        elif c == "gemm":
            j += 1
            if g == 0:
                role = "qkv" if j == 0 else "gemm_other"
            elif j < 3:
                role = _ROLE_AFTER_ATTENTION[j]
            elif j == 3:
                role = "qkv" if g < groups else "lm_head"
            else:
                role = "gemm_other"
            last_gemm = role
            out.append(role)
        elif c == "gemm_aux":
            out.append(last_gemm)
        else:
            out.append(c)
        prev = c
    return out


def kernel_events(fn: Callable[[], object]) -> List[Tuple[str, float]]:
    """``[(kernel name, device microseconds)]`` of one ``fn()`` call in launch order (kernels, memcpy, memset), from
    a torch.profiler chrome trace. Raises RuntimeError when the profiler records no device kernel (no CUPTI)."""
    return [(n, dur) for n, _, dur in kernel_trace(fn)]


def kernel_trace(fn: Callable[[], object]) -> List[Tuple[str, float, float]]:
    """``[(kernel name, start us, duration us)]`` of one ``fn()`` call, by start time (see :func:`kernel_events`)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
    finally:
        os.unlink(path)
    evs = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"
           and e.get("cat", "").lower() in ("kernel", "gpu_memcpy", "gpu_memset")]
    evs.sort(key=lambda e: float(e["ts"]))
    if evs:
        return [(e["name"], float(e["ts"]), float(e.get("dur", 0.0))) for e in evs]
    dev = [e for e in prof.events() if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA]
    if not dev:  # neither the trace nor the event list has device kernels
        raise RuntimeError("the profiler recorded no device kernels (CUPTI unavailable?)")
    dev.sort(key=lambda e: e.time_range.start)
    return [(e.name, float(e.time_range.start), float(e.time_range.elapsed_us())) for e in dev]


def served_timeline(trace: Sequence[Tuple[str, float, float]], graph_kernels: int) -> dict:
    """GPU busy / idle of the steady decode part of a served run's ``trace`` (:func:`kernel_trace`): the kernels
    after the last prefill (``extend``) kernel. Steps are counted by the in-graph argmax (``sampling`` kernels).

    Returns ``{"steps", "period_us", "busy_us", "idle_us" (per step: GPU time span, union of kernel intervals, the
    rest), "kernels_per_step", "extra_per_step" (kernels per step beyond ``graph_kernels``, i.e. launched outside
    the graph), "gaps": [(us, kernel before, kernel after)] (the 4 largest idle gaps)}``; ``{"error"}`` when fewer
    than 2 whole steps are found."""
    last_prefill = max((i for i, (n, _, _) in enumerate(trace) if "extend" in n.lower()), default=-1)
    ev = sorted(trace[last_prefill + 1:], key=lambda e: e[1])
    marks = [i for i, (n, _, _) in enumerate(ev) if kernel_class(n) == "sampling"]
    if len(marks) < 3:
        return {"error": f"{len(marks)} decode steps found in the trace"}
    ev = ev[marks[0] + 1: marks[-1] + 1]  # whole steps: after one argmax up to the last
    steps = len(marks) - 1
    span = ev[-1][1] + ev[-1][2] - ev[0][1]
    busy, end, gaps = 0.0, ev[0][1], []
    for i, (n, ts, dur) in enumerate(ev):  # union of busy intervals (streams may overlap)
        if ts > end and i:
            gaps.append((ts - end, ev[i - 1][0][:50], n[:50]))
        busy += max(0.0, ts + dur - max(ts, end))
        end = max(end, ts + dur)
    gaps.sort(key=lambda g: -g[0])
    return {"steps": steps, "period_us": span / steps, "busy_us": busy / steps, "idle_us": (span - busy) / steps,
            "kernels_per_step": len(ev) / steps, "extra_per_step": len(ev) / steps - graph_kernels,
            "gaps": [(round(g, 1), a, b) for g, a, b in gaps[:4]]}


def min_bytes(dims: Dict[str, int], bs: int, kv_tokens: int) -> Dict[str, float]:
    """Least HBM bytes per class for one decode step of ``bs`` sequences reading ``kv_tokens`` cached tokens in all.

    ``dims``: ``layers, hidden, inter, heads, kv_heads, head_dim, vocab, itemsize`` (bytes per weight / activation
    element) and optional ``logit_itemsize`` (default 4). GEMMs: weight once + input and output rows once; attention:
    K and V of every cached token + q in + out; norms: fused add + RMSNorm reads x and the residual and writes both
    (2L + 1 of them, the weight vector once each); rope_kv: q, k, v in, rotated q out, k and v into the cache;
    act: gate and up in, product out; sampling: the fp32 logits once; embed_copy: one embedding row per sequence
    and the cast of the logits to fp32 (read in the model dtype, written in fp32).
    """
    L, H, I = dims["layers"], dims["hidden"], dims["inter"]
    nh, kvh, hd, V, b = dims["heads"], dims["kv_heads"], dims["head_dim"], dims["vocab"], dims["itemsize"]
    q, kv = nh * hd, kvh * hd

    def gemm(n: int, k: int) -> float:
        return (n * k + bs * (n + k)) * b

    return {
        "qkv": L * gemm(q + 2 * kv, H), "o": L * gemm(H, q), "gate_up": L * gemm(2 * I, H),
        "down": L * gemm(H, I), "lm_head": gemm(V, H),
        "attention": L * (kv_tokens * 2 * kv + 2 * bs * q) * b,
        "norm": (2 * L + 1) * (4 * bs * H + H) * b,
        "rope_kv": L * bs * (2 * q + 5 * kv) * b,
        "act": L * bs * 3 * I * b,
        "sampling": bs * V * dims.get("logit_itemsize", 4),
        "embed_copy": 2 * bs * H * b + bs * V * (b + dims.get("logit_itemsize", 4)),
    }


def role_breakdown(names_us: Sequence[Tuple[str, float]], nbytes: Dict[str, float], copy_bw: float) -> dict:
    """Aggregate ``names_us`` (from :func:`kernel_events`) by :func:`assign_classes` against ``nbytes`` (from
    :func:`min_bytes`) and the copy bandwidth ``copy_bw`` (bytes/s). Returns ``{"total_ms", "floor_ms" (all bytes at
    copy_bw), "rows": [{"cls", "kernels", "ms", "bytes", "gbps", "of_copy", "over_ms"}], "top": {cls: [(kernel,
    ms, calls)]}}``."""
    classes = assign_classes([n for n, _ in names_us])
    ms: Dict[str, float] = {}
    count: Dict[str, int] = {}
    per_kernel: Dict[Tuple[str, str], List[float]] = {}
    for (name, us), cls in zip(names_us, classes):
        ms[cls] = ms.get(cls, 0.0) + us / 1e3
        count[cls] = count.get(cls, 0) + 1
        per_kernel.setdefault((cls, name[:80]), []).append(us / 1e3)
    rows = []
    for cls in CLASSES:
        if cls not in ms and not nbytes.get(cls):
            continue
        t, nb = ms.get(cls, 0.0), float(nbytes.get(cls, 0.0))
        gbps = nb / (t / 1e3) / 1e9 if t > 0 else 0.0
        rows.append({"cls": cls, "kernels": count.get(cls, 0), "ms": t, "bytes": nb, "gbps": gbps,
                     "of_copy": gbps * 1e9 / copy_bw if copy_bw else 0.0,
                     "over_ms": t - nb / copy_bw * 1e3})
    top: Dict[str, List[Tuple[str, float, int]]] = {}
    for (cls, name), v in sorted(per_kernel.items(), key=lambda kv_: -sum(kv_[1])):
        if len(top.setdefault(cls, [])) < 2:
            top[cls].append((name, sum(v), len(v)))
    total = sum(ms.values())
    return {"total_ms": total, "floor_ms": sum(nbytes.values()) / copy_bw * 1e3, "rows": rows, "top": top}


def render_role_table(label: str, b: dict, copy_bw: float) -> List[str]:
    """Markdown lines for one :func:`role_breakdown` result."""
    out = [f"### {label}: {b['total_ms']:.3f} ms of kernels, {b['floor_ms']:.3f} ms if every class moved its bytes "
           f"at the copy bandwidth ({copy_bw / 1e12:.2f} TB/s); gap {b['total_ms'] - b['floor_ms']:.3f} ms", "",
           "| class | kernels | ms | share | min MB | GB/s | of copy bw | ms over its floor | top kernel |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    tot = b["total_ms"] or 1.0
    for r in b["rows"]:
        top = b["top"].get(r["cls"], [])
        tk = f"`{top[0][0][:60]}` {top[0][1]:.2f} ms x{top[0][2]}" if top else ""
        out.append(f"| {r['cls']} | {r['kernels']} | {r['ms']:.3f} | {100 * r['ms'] / tot:.0f}% | "
                   f"{r['bytes'] / 1e6:.1f} | {r['gbps']:.0f} | {r['of_copy']:.2f} | {r['over_ms']:+.3f} | {tk} |")
    return out + [""]


def model_dims(mc, kv_heads: int, heads: int) -> Dict[str, int]:
    """:func:`min_bytes` dims from a ModelConfig (``kv_heads`` / ``heads``: this rank's)."""
    inter = mc.hf_config.get("intermediate_size")
    if not inter:
        raise ValueError(f"{mc.path}: config.json has no intermediate_size; the decode breakdown needs a dense MLP")
    return {"layers": mc.num_hidden_layers, "hidden": mc.hidden_size, "inter": int(inter),
            "heads": heads, "kv_heads": kv_heads, "head_dim": mc.head_dim, "vocab": mc.vocab_size,
            "itemsize": mc.dtype.itemsize}  # logits are cast to fp32 (LogitsProcessor): logit_itemsize 4
