"""Report helpers of ``bench_tokenweave.py`` layer mode: the host-vs-GPU table and the auto-off decision."""

from __future__ import annotations

from typing import Optional


def host_table(cases: list[tuple[str, int, dict]], tokens: list[int], variants: list[str]) -> list[str]:
    """Markdown rows: per case and token count, each variant's GPU ms (CUDA events), host enqueue ms (until
    ``run`` returned) and host / GPU; kernel launches and tensor allocations per forward where profiled
    (``--profile-tokens``, variants nccl and tokenweave)."""
    lines = ["| model | TP | tokens | variant | GPU ms | host ms | host / GPU | launches | allocations |",
             "|---|---:|---:|---|---:|---:|---:|---:|---:|"]
    for model, tp, res in cases:
        for t in tokens:
            for v in variants:
                g, h = res.get(f"{v}|{t}"), res.get(f"host|{v}|{t}")
                n, a = res.get(f"launches|{v}|{t}"), res.get(f"allocs|{v}|{t}")
                if g and h:
                    lines.append(f"| {model} | {tp} | {t} | {v} | {g:.3f} | {h:.3f} | {h / g:.2f} | "
                                 f"{int(n) if n else '-'} | {int(a) if a else '-'} |")
    return lines


def auto_off_decision(results: dict, tokens: list[int]) -> tuple[list[str], Optional[int]]:
    """Per token count: TokenWeave on when its ms is below ``nccl`` (and ``nccl_symm`` where measured), and the
    smallest measured T from which it stays on at every larger measured T (the ``--tokenweave-min-tokens``
    these numbers support; None: off at every T measured). Returns (markdown lines, that T or None)."""
    on = {}
    for t in tokens:
        tw, base = results.get(f"tokenweave|{t}"), [results.get(f"{b}|{t}") for b in ("nccl", "nccl_symm")]
        base = [b for b in base if b]
        on[t] = bool(tw and base and tw < min(base))
    ok = [t for t in sorted(tokens) if all(on[u] for u in tokens if u >= t)]
    best = ok[0] if ok else None
    lines = [f"- auto-off at T={t}: TokenWeave {'ON' if on[t] else 'OFF'}" for t in sorted(tokens)]
    lines.append(f"- supported --tokenweave-min-tokens: {best}" if best else
                 "- supported --tokenweave-min-tokens: none (TokenWeave loses at every T measured: keep it off)")
    return lines, best


def target_of(tokens: int) -> float:
    """Issue 25's TokenWeave / NCCL target at ``tokens`` (4 layers): <= 0.95 at 1024-2048, <= 0.8 from 4096, and
    never above 1.0 elsewhere."""
    return 0.8 if tokens >= 4096 else 0.95 if tokens >= 1024 else 1.0


def targets_table(cases: list[tuple[str, int, dict]], tokens: list[int]) -> list[str]:
    """Markdown rows: per case and T, TokenWeave / NCCL (and without the GEMM carveout where measured) against
    the issue's target, and ``nocomm / nccl``: the no-communication bound (perfect overlap, free split). A target
    below that bound cannot be met by overlap at this TP size; the row says so."""
    lines = ["| model | TP | tokens | tokenweave / nccl | nocarve / nccl | nocomm / nccl (bound) | target | met | "
             "target reachable by overlap |", "|---|---:|---:|---:|---:|---:|---:|---|---|"]
    f = lambda v: f"{v:.3f}" if v else "n/a"  # noqa: E731
    for model, tp, res in cases:
        for t in tokens:
            nccl = res.get(f"nccl|{t}")
            r = {v: (res.get(f"{v}|{t}") / nccl if res.get(f"{v}|{t}") and nccl else None)
                 for v in ("tokenweave", "tokenweave_nocarve", "nocomm")}
            goal = target_of(t)
            met = "n/a" if r["tokenweave"] is None else ("yes" if r["tokenweave"] <= goal else "no")
            reach = "n/a" if r["nocomm"] is None else ("yes" if r["nocomm"] <= goal else
                                                       f"no (bound {r['nocomm']:.3f} > {goal})")
            lines.append(f"| {model} | {tp} | {t} | {f(r['tokenweave'])} | {f(r['tokenweave_nocarve'])} | "
                         f"{f(r['nocomm'])} | <= {goal} | {met} | {reach} |")
    return lines
