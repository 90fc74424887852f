"""Metrics, result blocks and plots shared by the bench CLIs.

Units: every latency inside :class:`RequestOutput` is in seconds; the metric dicts report
latencies in milliseconds (``*_ms`` keys) as SGLang's ``bench_serving`` does.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import numpy as np

logger = logging.getLogger(__name__)

RULE = "=" * 50


@dataclass
class RequestOutput:
    """What one benchmark request measured (filled in by the request coroutine).

    Attributes:
        success: the request finished without an error.
        prompt_len: prompt tokens (from the dataset row).
        output_len: generated tokens as reported by the server (0 if unknown).
        generated_text: the full generated text.
        latency: end-to-end seconds, send to last byte.
        ttft: seconds from send to the first generated token.
        itl: inter-token latencies in seconds, one per token after the first.
        error: error text when ``success`` is False.
    """

    success: bool = False
    prompt_len: int = 0
    output_len: int = 0
    generated_text: str = ""
    latency: float = 0.0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""


def _stats(values: Sequence[float], prefix: str, pcts: Sequence[int], scale: float = 1000.0) -> dict[str, float]:
    arr = np.asarray(values, dtype=np.float64) * scale
    if arr.size == 0:
        arr = np.zeros(1)
    out = {f"mean_{prefix}_ms": float(arr.mean()), f"median_{prefix}_ms": float(np.median(arr)),
           f"std_{prefix}_ms": float(arr.std())}
    for p in pcts:
        out[f"p{p}_{prefix}_ms"] = float(np.percentile(arr, p))
    out[f"max_{prefix}_ms"] = float(arr.max())
    return out


def compute_metrics(outputs: Sequence[RequestOutput], duration_s: float,
                    retokenized_lens: Optional[Sequence[int]] = None) -> dict[str, Any]:
    """Aggregate SGLang's serving metrics over the successful requests.

    Args:
        outputs: one per request, in any order.
        duration_s: wall-clock seconds of the whole run (> 0).
        retokenized_lens: per-output token counts of the generated text re-encoded with the
            benchmark tokenizer (same order as ``outputs``), or None.

    Returns:
        A flat dict: ``completed``, token totals, throughputs (per second), ``concurrency``
        (sum of request latencies / duration) and ``{mean,median,std,pNN,max}_{e2e_latency,
        ttft,tpot,itl}_ms``. TPOT is ``(latency - ttft) / (output_len - 1)`` over requests with
        more than one output token.

    Raises:
        ValueError: ``duration_s`` is not positive.
    """
    if duration_s <= 0:
        raise ValueError(f"duration_s={duration_s} is invalid: the benchmark duration must be positive")
    ok = [o for o in outputs if o.success]
    in_tok = sum(o.prompt_len for o in ok)
    out_tok = sum(o.output_len for o in ok)
    retok = sum(n for o, n in zip(outputs, retokenized_lens) if o.success) if retokenized_lens is not None else out_tok
    tpots = [(o.latency - o.ttft) / (o.output_len - 1) for o in ok if o.output_len > 1]
    itls = [x for o in ok for x in o.itl]
    m: dict[str, Any] = {
        "duration": duration_s,
        "completed": len(ok),
        "failed": len(outputs) - len(ok),
        "total_input_tokens": in_tok,
        "total_output_tokens": out_tok,
        "total_output_tokens_retokenized": retok,
        "request_throughput": len(ok) / duration_s,
        "input_throughput": in_tok / duration_s,
        "output_throughput": out_tok / duration_s,
        "output_throughput_retokenized": retok / duration_s,
        "total_throughput": (in_tok + out_tok) / duration_s,
        "concurrency": sum(o.latency for o in ok) / duration_s,
    }
    m.update(_stats([o.latency for o in ok], "e2e_latency", (90, 99)))
    m.update(_stats([o.ttft for o in ok], "ttft", (99,)))
    m.update(_stats(tpots, "tpot", (99,)))
    m.update(_stats(itls, "itl", (95, 99)))
    return m


def _line(label: str, value: Any) -> str:
    if isinstance(value, float):
        return "{:<40} {:<10.2f}".format(label, value)
    return "{:<40} {:<10}".format(label, "inf" if value is None else value)


def _section(title: str) -> str:
    return "{s:{c}^{n}}".format(s=title, n=50, c="-")


def format_serving_result(m: dict[str, Any]) -> str:
    """SGLang's ``Serving Benchmark Result`` block (same labels) for a :func:`compute_metrics`
    dict extended with ``backend``, ``request_rate`` and ``max_concurrency``."""
    rate = m.get("request_rate")
    rate_s = "inf" if rate is None or rate == float("inf") else str(rate)
    conc = m.get("max_concurrency")
    lines = [
        "{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="="),
        _line("Backend:", m["backend"]),
        _line("Traffic request rate:", rate_s),
        _line("Max request concurrency:", "not set" if conc is None else conc),
        _line("Successful requests:", m["completed"]),
        _line("Benchmark duration (s):", m["duration"]),
        _line("Total input tokens:", m["total_input_tokens"]),
        _line("Total generated tokens:", m["total_output_tokens"]),
        _line("Total generated tokens (retokenized):", m["total_output_tokens_retokenized"]),
        _line("Request throughput (req/s):", m["request_throughput"]),
        _line("Input token throughput (tok/s):", m["input_throughput"]),
        _line("Output token throughput (tok/s):", m["output_throughput"]),
        _line("Total token throughput (tok/s):", m["total_throughput"]),
        _line("Concurrency:", m["concurrency"]),
        _section("End-to-End Latency"),
        _line("Mean E2E Latency (ms):", m["mean_e2e_latency_ms"]),
        _line("Median E2E Latency (ms):", m["median_e2e_latency_ms"]),
        _line("P90 E2E Latency (ms):", m["p90_e2e_latency_ms"]),
        _line("P99 E2E Latency (ms):", m["p99_e2e_latency_ms"]),
        _section("Time to First Token"),
        _line("Mean TTFT (ms):", m["mean_ttft_ms"]),
        _line("Median TTFT (ms):", m["median_ttft_ms"]),
        _line("P99 TTFT (ms):", m["p99_ttft_ms"]),
        _section("Time per Output Token (excl. 1st token)"),
        _line("Mean TPOT (ms):", m["mean_tpot_ms"]),
        _line("Median TPOT (ms):", m["median_tpot_ms"]),
        _line("P99 TPOT (ms):", m["p99_tpot_ms"]),
        _section("Inter-Token Latency"),
        _line("Mean ITL (ms):", m["mean_itl_ms"]),
        _line("Median ITL (ms):", m["median_itl_ms"]),
        _line("P95 ITL (ms):", m["p95_itl_ms"]),
        _line("P99 ITL (ms):", m["p99_itl_ms"]),
        _line("Max ITL (ms):", m["max_itl_ms"]),
        RULE,
    ]
    return "\n".join(lines)


def format_offline_result(r: dict[str, Any]) -> str:
    """SGLang's ``Offline Throughput Benchmark Result`` block (same labels)."""
    lines = [
        "{s:{c}^{n}}".format(s=" Offline Throughput Benchmark Result ", n=50, c="="),
        _line("Backend:", r["backend"]),
        _line("Successful requests:", r["successful_requests"]),
        _line("Benchmark duration (s):", r["total_latency"]),
        _line("Total input tokens:", r["total_input_tokens"]),
        _line("Total generated tokens:", r["total_output_tokens"]),
        _line("Last generation throughput (tok/s):", r["last_gen_throughput"]),
        _line("Request throughput (req/s):", r["request_throughput"]),
        _line("Input token throughput (tok/s):", r["input_throughput"]),
        _line("Output token throughput (tok/s):", r["output_throughput"]),
        _line("Total token throughput (tok/s):", r["total_throughput"]),
        RULE,
    ]
    return "\n".join(lines)


def append_jsonl(path: str, record: dict[str, Any]) -> None:
    """Append ``record`` as one JSON line to ``path`` (created with its folder if absent)."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")


def plot_latency_vs_load(results: Sequence[dict[str, Any]], path: str) -> str:
    """Write a PNG of median/P99 TTFT, ITL and E2E latency (ms) against the achieved request
    throughput (req/s), one point per run in ``results`` (:func:`compute_metrics` dicts).

    Returns:
        ``path``.

    Raises:
        ImportError: matplotlib is not installed (``pip install "sglang[bench]"`` or ``pip install matplotlib``).
        ValueError: ``results`` is empty.
    """
    if not results:
        raise ValueError("plot_latency_vs_load needs at least one benchmark result")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ImportError("--plot needs matplotlib: pip install matplotlib (or the 'bench' extra of sglang)") from e
    pts = sorted(results, key=lambda r: r["request_throughput"])
    x = [r["request_throughput"] for r in pts]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for ax, (key, title) in zip(axes, (("ttft", "Time to first token"), ("itl", "Inter-token latency"),
                                       ("e2e_latency", "End-to-end latency"))):
        ax.plot(x, [r[f"median_{key}_ms"] for r in pts], "o-", label="median")
        ax.plot(x, [r[f"p99_{key}_ms"] for r in pts], "s--", label="P99")
        ax.set_title(title)
        ax.set_xlabel("Request throughput (req/s)")
        ax.set_ylabel("ms")
        ax.grid(True, alpha=0.3)
        ax.legend()
    labels = ", ".join(_load_label(r) for r in pts)
    fig.suptitle(f"{pts[0].get('backend', '')} latency vs load ({labels})", fontsize=9)
    fig.tight_layout()
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _load_label(r: dict[str, Any]) -> str:
    rate = r.get("request_rate")
    conc = r.get("max_concurrency")
    rate_s = "inf" if rate is None or rate == float("inf") else f"{rate:g}"
    return f"rate={rate_s}" + ("" if conc is None else f"/conc={conc}")
