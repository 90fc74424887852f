"""The warm-up phase of ``benchmark/disaggregation/bench_pd_serving.py``: the workload's own shape, rate and concurrency, untimed.

A fresh server (or a fresh machine's empty Triton / CUDA-graph caches) compiles kernels the first time a decode
batch size or prefill shape shows up; in a timed run those compiles land in the first requests' TTFT / ITL (issue
24: mean TTFT 202-357 ms against medians of 48-60 ms in the first row of a call). A few full-length requests at the
start do not reach the batch sizes of the run's steady state, so before every timed run the benchmark sends the
same workload (same dataset and lengths, same ``--request-rate`` and ``--max-concurrency``, another seed) for
``--warmup-seconds`` through the same URL, then flushes the prefix cache (so no warm-up prompt is a prefix hit of
the timed run, and the servers are idle when its clock starts). ``python -m sglang.bench_serving`` itself sends a
single warm-up request (SGLang's convention) unless ``--warmup-requests 0``.
"""

from __future__ import annotations

import contextlib
import io
import math
import time
from typing import Callable

import requests

WARMUP_SEED_OFFSET = 1000
"""The warm-up phase's ``bench_serving`` seed is ``--seed`` + this: other prompts and other arrival times."""


def warmup_prompts(args) -> int:
    """The number of requests of the warm-up phase before each timed run (``args``: bench_pd_serving's namespace).

    With ``--request-rate`` r > 0: the workload's own rate for ``--warmup-seconds`` s, ``ceil(r x s)``, at most
    ``--num-prompts`` (arrivals at the run's rate for a few request lifetimes bring the decode batch to the run's
    steady state, Poisson bursts included). Without a rate (all at once): the run's own burst, ``min(--num-prompts,
    2 x --max-concurrency)`` (the cap is reached, then drains through every smaller batch), or ``--num-prompts``
    without a cap. 0 (no phase) when ``--warmup-seconds`` is 0 or less.
    """
    if args.warmup_seconds <= 0:
        return 0
    if args.request_rate > 0:
        return max(1, min(args.num_prompts, math.ceil(args.request_rate * args.warmup_seconds)))
    return min(args.num_prompts, 2 * args.max_concurrency) if args.max_concurrency else args.num_prompts


def bench_in_process(argv: list[str]) -> dict:
    """``python -m sglang.bench_serving <argv>`` in this process (its printed result block captured, not shown); the
    record of its last run. Raises RuntimeError naming what bench_serving said when it fails (bad flag, no request
    answered)."""
    from sglang import bench_serving

    buf = io.StringIO()
    try:
        with contextlib.redirect_stdout(buf):
            return bench_serving.main(argv)[-1]
    except (ValueError, RuntimeError, ImportError, IndexError) as e:
        raise RuntimeError(f"bench_serving (warm-up) failed: {type(e).__name__}: {e}\n{buf.getvalue()[-1500:]}") from e


def flush_when_idle(url: str, timeout: float = 20.0, poll: float = 0.25) -> bool:
    """POST ``url/flush_cache`` until it answers 200 or ``timeout`` s pass (a server, or every worker behind
    ``mini_lb``, answers 400 while requests are running or waiting: the warm-up's tail, a hand-off in flight).

    Returns True when flushed; False, after a printed warning naming the last answer, when never (the timed run then
    goes on: the report says the cache was not flushed)."""
    end, why = time.time() + timeout, "no answer"
    while True:
        try:
            r = requests.post(url + "/flush_cache", timeout=30)
            if r.status_code == 200:
                return True
            why = f"HTTP {r.status_code}: {r.text[:200]}"
        except requests.RequestException as e:
            why = f"{type(e).__name__}: {e}"
        if time.time() >= end:
            break
        time.sleep(poll)
    print(f"[bench_pd_serving] WARNING: {url}/flush_cache not accepted in {timeout:.0f} s ({why})", flush=True)
    return False


def warm_phase(args, url: str, tag: str, run: Callable[[int, int], dict]) -> dict:
    """The warm-up phase before one timed run through ``url`` (``tag``: ``setup/dataset``, for the log line).

    ``run(num_prompts, seed)`` is one ``bench_serving`` call of the timed run's workload with those two values
    replaced; it is called with :func:`warmup_prompts` and ``--seed + WARMUP_SEED_OFFSET``, then
    :func:`flush_when_idle`. Returns the call's record plus ``flushed`` (bool) and ``warmup_seconds`` (wall time,
    s); ``{}`` when the phase is off. Raises what ``run`` raises (RuntimeError when bench_serving fails)."""
    n = warmup_prompts(args)
    if n == 0:
        return {}
    t0 = time.time()
    rec = run(n, args.seed + WARMUP_SEED_OFFSET)
    rec = {**rec, "flushed": flush_when_idle(url), "warmup_seconds": time.time() - t0}
    print(f"[bench_pd_serving] warm-up phase {tag}: {n} requests in {rec['warmup_seconds']:.1f} s, mean TTFT "
          f"{rec.get('mean_ttft_ms', float('nan')):.1f} ms (untimed)", flush=True)
    return rec


def warmup_line(args, warm: dict) -> str:
    """The report's line on the warm-up phases of one dataset (``warm``: setup -> :func:`warm_phase` record)."""
    if args.warmup_seconds <= 0:
        return "warm-up phase: off (--warmup-seconds 0); only the servers' start-up warm-up requests"
    parts = [f"{s} {int(r.get('completed', 0))} requests in {r.get('warmup_seconds', float('nan')):.1f} s, mean / "
             f"p99 TTFT {r.get('mean_ttft_ms', float('nan')):.1f} / {r.get('p99_ttft_ms', float('nan')):.1f} ms"
             + ("" if r.get("flushed", True) else " (**prefix cache not flushed after it**)")
             for s, r in warm.items() if r]
    return ("warm-up phase before every timed run (untimed; excluded from the table and the transfer counters): "
            f"the workload at its own rate / concurrency, {warmup_prompts(args)} requests ("
            + (f"{args.warmup_seconds:g} s of arrivals at {args.request_rate:g} req/s" if args.request_rate > 0 else
               "the run's burst: no --request-rate")
            + f"), seed {args.seed + WARMUP_SEED_OFFSET}, then the prefix cache flushed"
            + (": " + "; ".join(parts) if parts else ""))
