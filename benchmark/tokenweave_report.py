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
