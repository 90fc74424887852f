"""Rank bodies and the ratio table of ``bench_tdist.py`` (kept importable so spawned ranks can unpickle them)."""

from __future__ import annotations

import json
from typing import Dict, List, Optional

import torch

UNAVAILABLE_SHARED = "n/a: ranks share one GPU (NCCL refuses duplicate GPUs)"


def llama_shapes(config_path: str, tp: int) -> Dict[str, tuple]:
    """TP-sharded GEMM shapes of one Llama layer from a HF config.json: name -> (kind, K, N_per_rank).

    AG-GEMM (column-parallel, input all-gathered): qkv [H -> (heads + 2 kv) * d / tp], gate_up [H -> 2 I / tp].
    GEMM-RS (row-parallel, output reduce-scattered): o_proj [heads * d / tp -> H], down [I / tp -> H]."""
    with open(config_path) as f:
        c = json.load(f)
    h, i = c["hidden_size"], c["intermediate_size"]
    heads, kv = c["num_attention_heads"], c.get("num_key_value_heads", c["num_attention_heads"])
    d = c.get("head_dim") or h // heads
    return {"qkv": ("ag", h, (heads + 2 * kv) * d // tp), "gate_up": ("ag", h, 2 * i // tp),
            "o_proj": ("rs", heads * d // tp, h), "down": ("rs", i // tp, h)}


def _timer(heap, fn, iters: int) -> float:
    """ms per call of ``fn`` (2 warm-up calls; all ranks start together)."""
    for _ in range(2):
        fn()
    heap.barrier()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(iters):
        fn()
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) / iters


def _try(heap, note, label, fn, iters):
    try:
        return _timer(heap, fn, iters), ""
    except Exception as ex:  # a baseline that cannot run is reported, never fatal
        note(f"{label} unavailable: {type(ex).__name__}: {ex}")
        heap.barrier()
        return None, f"{type(ex).__name__}: {str(ex)[:120]}"


def rank_body(heap, note, nccl, shapes: Dict[str, tuple], tokens: List[int], iters: int, a2a_hidden: int,
              a2a_tokens: List[int]) -> List[dict]:
    """Time every op on this rank; returns rows {op, shape, M, variant -> ms or None, notes}."""
    import torch.distributed as dist

    from sgl_kernel.tdist.ag_gemm import AgGemm
    from sgl_kernel.tdist.all_to_all import AllToAll
    from sgl_kernel.tdist.gemm_rs import GemmRs
    from sgl_kernel.tdist.layout import split_rows

    w, me, dev = heap.world, heap.rank, heap.device
    dt = torch.bfloat16
    rows_out = []
    symm_group = None
    if nccl is not None:
        try:
            import torch.distributed._symmetric_memory as symm_mem

            symm_group = nccl.group_name
            if hasattr(symm_mem, "enable_symm_mem_for_group"):
                symm_mem.enable_symm_mem_for_group(symm_group)
        except Exception as ex:
            note(f"symmetric memory unavailable: {ex}")
            symm_group = None
    max_m = max(tokens)
    for name, (kind, k, n) in shapes.items():
        for m in tokens:
            note(f"{name} M={m}")
            rows = split_rows(m, w)
            res = {"op": "AG-GEMM" if kind == "ag" else "GEMM-RS", "shape": f"{name} K={k} N={n}", "M": m}
            g = torch.Generator(device="cpu").manual_seed(m + me)
            if kind == "ag":
                a = torch.randn(rows[me], k, generator=g).to(dt).to(dev)
                wt = torch.randn(n, k, generator=g).to(dt).to(dev) / k ** 0.5
                for prod in ("sm", "ce"):
                    op = AgGemm(heap, max_m, k, dt, name=f"b.{name}.{prod}", producer=prod)
                    res[f"tdist_{prod}"], _ = _try(heap, note, f"tdist {prod}", lambda: op(a, wt.t(), rows), iters)
                full = torch.randn(m, k, generator=g).to(dt).to(dev)
                res["cublas_only"], _ = _try(heap, note, "cublas", lambda: full @ wt.t(), iters)
                if nccl is not None and len(set(rows)) == 1:
                    gathered = torch.empty(m, k, dtype=dt, device=dev)

                    def seq():
                        dist.all_gather_into_tensor(gathered, a, group=nccl)
                        return gathered @ wt.t()

                    res["torch_seq"], res["torch_seq_note"] = _try(heap, note, "nccl+cublas", seq, iters)
                    if symm_group is not None:
                        res["symm_fused"], res["symm_note"] = _try(
                            heap, note, "symm fused_all_gather_matmul",
                            lambda: torch.ops.symm_mem.fused_all_gather_matmul(a, [wt.t()], 0, symm_group), iters)
                else:
                    res["torch_seq_note"] = UNAVAILABLE_SHARED if nccl is None else "uneven rows"
            else:
                a = torch.randn(m, k, generator=g).to(dt).to(dev)
                wt = torch.randn(n, k, generator=g).to(dt).to(dev) / k ** 0.5
                op = GemmRs(heap, max(split_rows(max_m, w)), n, dt, name=f"b.{name}")
                res["tdist_sm"], _ = _try(heap, note, "tdist gemm_rs", lambda: op(a, wt.t(), rows), iters)
                res["cublas_only"], _ = _try(heap, note, "cublas", lambda: a @ wt.t(), iters)
                if nccl is not None and m % w == 0:
                    out = torch.empty(m // w, n, dtype=dt, device=dev)

                    def seq():
                        dist.reduce_scatter_tensor(out, a @ wt.t(), group=nccl)
                        return out

                    res["torch_seq"], res["torch_seq_note"] = _try(heap, note, "cublas+nccl", seq, iters)
                    if symm_group is not None:
                        res["symm_fused"], res["symm_note"] = _try(
                            heap, note, "symm fused_matmul_reduce_scatter",
                            lambda: torch.ops.symm_mem.fused_matmul_reduce_scatter(a, wt.t(), "sum", 0, symm_group),
                            iters)
                else:
                    res["torch_seq_note"] = UNAVAILABLE_SHARED if nccl is None else "M not divisible by world"
            rows_out.append(res)
    for t in a2a_tokens:
        note(f"all-to-all T={t}")
        cap = t  # a source may send all its tokens to one destination
        op = AllToAll(heap, cap, a2a_hidden, dt, name=f"b.a2a.{t}")
        g = torch.Generator(device="cpu").manual_seed(t + 7)
        counts = torch.multinomial(torch.ones(w), t, replacement=True, generator=g).bincount(minlength=w)
        x = torch.randn(t, a2a_hidden).to(dt).to(dev)
        sc = counts.to(torch.int32).to(dev)
        res = {"op": "all-to-all", "shape": f"H={a2a_hidden} random counts", "M": t}
        res["tdist_sm"], _ = _try(heap, note, "tdist a2a", lambda: op(x, sc), iters)
        if nccl is not None:
            recv = torch.zeros(w, dtype=torch.int64, device=dev)
            dist.all_to_all_single(recv, counts.to(dev), group=nccl)
            out = torch.empty(int(recv.sum()), a2a_hidden, dtype=dt, device=dev)
            in_s, out_s = counts.tolist(), recv.tolist()
            res["torch_seq"], res["torch_seq_note"] = _try(
                heap, note, "nccl all_to_all_single",
                lambda: dist.all_to_all_single(out, x, out_s, in_s, group=nccl), iters)
        else:
            res["torch_seq_note"] = UNAVAILABLE_SHARED
        rows_out.append(res)
    return rows_out


def _fmt(v: Optional[float]) -> str:
    return "-" if v is None else f"{v:.3f}"


def table(per_rank: List[List[dict]]) -> List[str]:
    """Markdown ratio table; times are the max over ranks (a collective ends when its slowest rank does).
    Ratio columns: baseline ms / best tdist ms (> 1 means tdist is faster)."""
    lines = ["| op | shape | M | tdist SM ms | tdist CE ms | NCCL+cuBLAS ms | symm-mem fused ms | cuBLAS only ms | "
             "torch/tdist | symm/tdist | notes |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for i, row in enumerate(per_rank[0]):
        def mx(key):
            vals = [r[i].get(key) for r in per_rank if r and len(r) > i]
            return None if not vals or any(v is None for v in vals) else max(vals)

        best = min([v for v in (mx("tdist_sm"), mx("tdist_ce")) if v is not None], default=None)
        ts, sf = mx("torch_seq"), mx("symm_fused")
        r1 = f"{ts / best:.2f}x" if ts and best else "-"
        r2 = f"{sf / best:.2f}x" if sf and best else "-"
        notes = "; ".join(x for x in (row.get("torch_seq_note", ""), row.get("symm_note", "")) if x)
        lines.append(f"| {row['op']} | {row['shape']} | {row['M']} | {_fmt(mx('tdist_sm'))} | {_fmt(mx('tdist_ce'))} "
                     f"| {_fmt(ts)} | {_fmt(sf)} | {_fmt(mx('cublas_only'))} | {r1} | {r2} | {notes} |")
    return lines
