"""Online serving benchmark: ``python -m sglang.bench_serving`` (SGLang's flags and result block).

Sends a dataset of requests (:mod:`sglang.benchmark_datasets`) to a running server with Poisson
arrivals at ``--request-rate`` (``inf``: all at once), at most ``--max-concurrency`` in flight,
streams every response and reports throughput, TTFT, TPOT and ITL (:mod:`sglang.benchmark_utils`).

Backends: ``sglang`` (native ``POST /generate`` SSE) and ``sglang-oai`` / ``vllm`` (OpenAI
``POST /v1/completions`` streaming), so it can drive other servers too. ``--request-rate`` and
``--max-concurrency`` take several values (space or comma separated) for a load sweep; ``--plot``
then draws latency against load (matplotlib PNG).

Example::

    python -m sglang.bench_serving --backend sglang --port 30000 --dataset-name random \\
        --random-input-len 1024 --random-output-len 256 --num-prompts 512 --max-concurrency 64
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import itertools
import json
import logging
import os
import random
import sys
import time
from dataclasses import dataclass, replace
from typing import Any, Optional

from sglang.benchmark_datasets import DatasetConfig, DatasetRow, add_dataset_args, count_tokens, get_dataset
from sglang.benchmark_utils import (RequestOutput, append_jsonl, compute_metrics, format_serving_result,
                                    plot_latency_vs_load)

logger = logging.getLogger(__name__)

BACKENDS = ("sglang", "sglang-native", "sglang-oai", "vllm")
AIOHTTP_TIMEOUT_S = 6 * 60 * 60
_GENERATE_TOP_LEVEL = frozenset({"rid", "return_logprob", "logprob_start_len", "top_logprobs_num",
                                 "return_text_in_logprobs", "lora_path"})
"""``/generate`` body fields that ``--extra-request-body`` sets at the top level; other keys go
into ``sampling_params`` (so ``{"temperature": 0.6}`` works for every backend)."""


@dataclass(frozen=True)
class RequestSpec:
    """One request to send: the dataset row plus what every request shares."""

    url: str
    backend: str
    model: str
    row: DatasetRow
    ignore_eos: bool
    extra_body: dict
    headers: dict


def _sse_payloads(line: bytes) -> Optional[str]:
    """The payload of one SSE ``data:`` line, or None for other lines."""
    s = line.decode("utf-8", errors="replace").strip()
    if not s.startswith("data:"):
        return None
    return s[5:].strip()


class _StreamError(Exception):
    """The server answered with a non-200 status or streamed an error chunk (message: what it said)."""


async def _stream_json(session, spec: RequestSpec, body: dict):
    """POST ``body`` to ``spec.url`` and yield each streamed JSON chunk (``data: [DONE]`` ends it).

    Raises:
        _StreamError: a non-200 status (``"HTTP <code>: <body>"``) or a chunk carrying ``"error"``.
    """
    async with session.post(spec.url, json=body, headers=spec.headers) as resp:
        if resp.status != 200:
            raise _StreamError(f"HTTP {resp.status}: {(await resp.text())[:500]}")
        async for line in resp.content:
            payload = _sse_payloads(line)
            if not payload or payload == "[DONE]":
                continue
            data = json.loads(payload)
            if "error" in data:
                raise _StreamError(str(data["error"]))
            yield data


async def request_sglang(session, spec: RequestSpec) -> RequestOutput:
    """Send one native ``/generate`` streaming request and time every chunk.

    A chunk that carries k > 1 new tokens contributes k ITL entries of (gap / k); the tokens of
    the first chunk add none.
    """
    row = spec.row
    sp = {"temperature": 0.0, "max_new_tokens": row.output_len, "ignore_eos": spec.ignore_eos}
    body: dict[str, Any] = {"sampling_params": sp, "stream": True}
    body["input_ids" if isinstance(row.prompt, list) else "text"] = row.prompt
    extra = dict(spec.extra_body)
    sp.update(extra.pop("sampling_params", {}) or {})
    for k in list(extra):  # sampling fields given at the top level go into sampling_params
        if k not in _GENERATE_TOP_LEVEL:
            sp[k] = extra.pop(k)
    body.update(extra)
    out = RequestOutput(prompt_len=row.prompt_len)
    start = last = time.perf_counter()
    n_prev = 0
    try:
        async for data in _stream_json(session, spec, body):
            now = time.perf_counter()
            n = int(data.get("meta_info", {}).get("completion_tokens", len(data.get("output_ids", []))))
            out.generated_text = data.get("text", out.generated_text)
            if n > n_prev:
                if n_prev == 0:
                    out.ttft = now - start
                else:
                    gap = (now - last) / (n - n_prev)
                    out.itl.extend([gap] * (n - n_prev))
                last = now
                n_prev = n
        out.latency = time.perf_counter() - start
        out.output_len = n_prev
        out.success = True
    except _StreamError as e:  # the server said no: keep its message
        out.error = str(e)
    except Exception as e:  # network errors, bad JSON: the request counts as failed
        out.error = f"{type(e).__name__}: {e}"
    return out


async def request_openai_completions(session, spec: RequestSpec) -> RequestOutput:
    """Send one OpenAI ``/v1/completions`` streaming request (asks for usage in the last chunk;
    the output length falls back to 0 and is retokenized later when the server sends none)."""
    row = spec.row
    body: dict[str, Any] = {"model": spec.model, "prompt": row.prompt, "temperature": 0.0,
                            "max_tokens": row.output_len, "stream": True, "ignore_eos": spec.ignore_eos,
                            "stream_options": {"include_usage": True}}
    body.update(spec.extra_body)
    out = RequestOutput(prompt_len=row.prompt_len)
    start = last = time.perf_counter()
    text: list[str] = []
    usage_tokens = 0
    try:
        async for data in _stream_json(session, spec, body):
            if data.get("usage"):
                usage_tokens = int(data["usage"].get("completion_tokens") or 0)
            delta = "".join(c.get("text") or "" for c in data.get("choices") or [])
            if not delta:
                continue
            now = time.perf_counter()
            if not text:
                out.ttft = now - start
            else:
                out.itl.append(now - last)
            last = now
            text.append(delta)
        out.latency = time.perf_counter() - start
        out.generated_text = "".join(text)
        out.output_len = usage_tokens
        out.success = True
    except _StreamError as e:  # the server said no: keep its message
        out.error = str(e)
    except Exception as e:
        out.error = f"{type(e).__name__}: {e}"
    return out


def _route(backend: str) -> str:
    return "/generate" if backend in ("sglang", "sglang-native") else "/v1/completions"


def _request_fn(backend: str):
    return request_sglang if backend in ("sglang", "sglang-native") else request_openai_completions


async def _arrivals(n: int, rate: float, rng: random.Random):
    """Yield 0..n-1 with exponential gaps of mean 1/rate seconds (a Poisson process); no wait
    when ``rate`` is inf."""
    for i in range(n):
        yield i
        if rate != float("inf") and i < n - 1:
            await asyncio.sleep(rng.expovariate(rate))


async def run_benchmark(rows: list[DatasetRow], base: RequestSpec, request_rate: float,
                        max_concurrency: Optional[int], seed: int, disable_tqdm: bool,
                        warmup_requests: int = 1) -> tuple[list[RequestOutput], float]:
    """Send every row; returns (outputs in row order, wall-clock seconds of the measured run).

    Raises:
        RuntimeError: every warmup request failed (the message holds the first error).
    """
    import aiohttp
    from tqdm.asyncio import tqdm

    fn = _request_fn(base.backend)
    timeout = aiohttp.ClientTimeout(total=AIOHTTP_TIMEOUT_S)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0),
                                     read_bufsize=1 << 20) as session:
        if warmup_requests > 0:
            w_row = replace(rows[0], output_len=min(rows[0].output_len, 16))
            warm = await asyncio.gather(*[fn(session, replace(base, row=w_row)) for _ in range(warmup_requests)])
            if not any(w.success for w in warm):
                raise RuntimeError(f"warmup request failed: {warm[0].error}; check --backend, the URL, "
                                   "--model and OPENAI_API_KEY")
        sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        pbar = None if disable_tqdm else tqdm(total=len(rows))

        async def one(i: int) -> RequestOutput:
            """Send request ``i`` (under the concurrency semaphore, if any) and tick the progress bar."""
            if sem is None:
                o = await fn(session, replace(base, row=rows[i]))
            else:
                async with sem:
                    o = await fn(session, replace(base, row=rows[i]))
            if pbar is not None:
                pbar.update(1)
            return o

        start = time.perf_counter()
        tasks = []
        async for i in _arrivals(len(rows), request_rate, random.Random(seed)):
            tasks.append(asyncio.create_task(one(i)))
        outputs = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        if pbar is not None:
            pbar.close()
    return list(outputs), duration


# ----------------------------------------------------------------------------- CLI
def _float_list(values: list[str], flag: str) -> list[float]:
    out = []
    for v in (p for s in values for p in s.split(",") if p):
        try:
            x = float(v)
        except ValueError:
            raise ValueError(f"{flag}={v!r} is invalid: use a number or inf") from None
        if x <= 0:
            raise ValueError(f"{flag}={v!r} is invalid: use a positive number or inf")
        out.append(x)
    return out


def _int_list(values: Optional[list[str]], flag: str) -> list[Optional[int]]:
    if not values:
        return [None]
    out: list[Optional[int]] = []
    for v in (p for s in values for p in s.split(",") if p):
        if not v.isdigit() or int(v) < 1:
            raise ValueError(f"{flag}={v!r} is invalid: use positive integers")
        out.append(int(v))
    return out


def build_parser() -> argparse.ArgumentParser:
    """The ``bench_serving`` argument parser (SGLang's flag names)."""
    p = argparse.ArgumentParser(prog="python -m sglang.bench_serving", description=__doc__.split("\n")[0])
    p.add_argument("--backend", choices=BACKENDS, default="sglang")
    p.add_argument("--base-url", default=None, help="Server URL; overrides --host/--port.")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=None, help="Default: 30000 (sglang*), 8000 (vllm).")
    p.add_argument("--model", default=None, help="Model name; default: the server's (/v1/models).")
    p.add_argument("--tokenizer", default=None,
                   help="Tokenizer folder; default: --model if a folder, else the server's tokenizer path.")
    add_dataset_args(p, seed_help="Dataset sampling and arrival-time seed.")
    p.add_argument("--request-rate", nargs="+", default=["inf"],
                   help="Requests/s (Poisson arrivals) or inf; several values sweep the load.")
    p.add_argument("--max-concurrency", nargs="+", default=None,
                   help="Max requests in flight; several values sweep the load.")
    p.add_argument("--warmup-requests", type=int, default=1)
    p.add_argument("--disable-tqdm", action="store_true")
    p.add_argument("--disable-ignore-eos", action="store_true", help="Let requests stop at EOS.")
    p.add_argument("--extra-request-body", default=None, help="JSON merged into every request body.")
    p.add_argument("--flush-cache", action="store_true", help="POST /flush_cache before the run (sglang).")
    p.add_argument("--output-file", default=None, help="Append one JSON line per run.")
    p.add_argument("--output-details", action="store_true", help="Add per-request arrays to the JSON line.")
    p.add_argument("--plot", default=None, metavar="PNG", help="Latency-vs-load PNG over the runs (matplotlib).")
    return p


def _base_url(args) -> str:
    if args.base_url:
        return args.base_url.rstrip("/")
    port = args.port if args.port is not None else (8000 if args.backend == "vllm" else 30000)
    return f"http://{args.host}:{port}"


def _headers() -> dict:
    key = os.environ.get("OPENAI_API_KEY")
    return {"Authorization": f"Bearer {key}"} if key else {}


def _resolve_model_and_tokenizer(args, base_url: str, headers: dict) -> tuple[str, str]:
    import requests

    model, tok = args.model, args.tokenizer
    if model is None:
        try:
            r = requests.get(base_url + "/v1/models", headers=headers, timeout=30)
            model = r.json()["data"][0]["id"]
        except Exception as e:
            raise ValueError(f"--model is not set and {base_url}/v1/models gave no model ({e}): pass --model") from e
    if tok is None:
        if os.path.isdir(model):
            tok = model
        elif args.backend in ("sglang", "sglang-native", "sglang-oai"):
            try:
                tok = requests.get(base_url + "/get_model_info", headers=headers, timeout=30).json()["tokenizer_path"]
            except Exception:
                tok = None
        if not tok or not os.path.isdir(tok):
            raise ValueError(f"no local tokenizer for model {model!r}: pass --tokenizer with a tokenizer folder")
    return model, tok


def _record(args, m: dict, rate: float, conc: Optional[int]) -> dict:
    rec = {"backend": args.backend, "dataset_name": args.dataset_name, "request_rate": rate,
           "max_concurrency": conc, "num_prompts": args.num_prompts, "sharegpt_output_len": args.sharegpt_output_len,
           "random_input_len": args.random_input_len, "random_output_len": args.random_output_len,
           "random_range_ratio": args.random_range_ratio, "seed": args.seed}
    rec.update(m)
    return rec


def _dataset_config(args) -> DatasetConfig:
    """The dataset settings, validated. ``--dataset-name sharegpt`` (the default) without ``--dataset-path``
    uses random prompts instead, with a warning (SGLang would download ShareGPT; this benchmark never
    downloads).

    Raises:
        ValueError: a bad dataset flag, or a ``--dataset-path`` that does not exist (named).
    """
    name = args.dataset_name
    if name == "sharegpt" and not args.dataset_path:
        logger.warning("no --dataset-path for the sharegpt dataset (nothing is downloaded): using --dataset-name "
                       "random (--random-input-len %d, --random-output-len %d)", args.random_input_len,
                       args.random_output_len)
        name = "random"
    if name == "sharegpt" and not os.path.exists(args.dataset_path):
        raise ValueError(f"--dataset-path={args.dataset_path!r} does not exist: pass a ShareGPT JSON file or folder")
    return DatasetConfig.from_args(args, name)


def main(argv: Optional[list[str]] = None) -> list[dict]:
    """Run the benchmark(s) described by ``argv``; returns one result dict per (rate, concurrency).

    Raises:
        ValueError: bad flags (the message names the flag).
        RuntimeError: the server answered no request.
    """
    args = build_parser().parse_args(argv)
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        raise ImportError("--plot needs matplotlib: pip install matplotlib (or the 'bench' extra of sglang)")
    rates = _float_list(args.request_rate, "--request-rate")
    concs = _int_list(args.max_concurrency, "--max-concurrency")
    extra = json.loads(args.extra_request_body) if args.extra_request_body else {}
    if not isinstance(extra, dict):
        raise ValueError("--extra-request-body must be a JSON object")
    cfg = _dataset_config(args)  # every flag is checked before the server is contacted or a tokenizer loads
    args.dataset_name = cfg.name  # what the results record
    base_url = _base_url(args)
    headers = _headers()
    model, tok_path = _resolve_model_and_tokenizer(args, base_url, headers)
    from sglang.srt.utils.common import get_tokenizer

    tokenizer = get_tokenizer(tok_path)
    rows = get_dataset(cfg, tokenizer)
    print(f"#Input tokens: {sum(r.prompt_len for r in rows)}\n#Output tokens: {sum(r.output_len for r in rows)}")
    base = RequestSpec(url=base_url + _route(args.backend), backend=args.backend, model=model, row=rows[0],
                       ignore_eos=not args.disable_ignore_eos, extra_body=extra, headers=headers)
    results = []
    for rate, conc in itertools.product(rates, concs):
        if args.flush_cache and args.backend.startswith("sglang"):
            import requests

            requests.post(base_url + "/flush_cache", headers=headers, timeout=60)
        print(f"Traffic request rate: {rate}\nMax request concurrency: {conc}")
        outputs, duration = asyncio.run(run_benchmark(rows, base, rate, conc, args.seed, args.disable_tqdm,
                                                      args.warmup_requests))
        retok = [count_tokens(tokenizer, o.generated_text) if o.success else 0 for o in outputs]
        for o, n in zip(outputs, retok):
            if o.success and o.output_len == 0:
                o.output_len = n  # the server reported no token count: use the retokenized one
        if not any(o.success for o in outputs):
            raise RuntimeError(f"all {len(outputs)} requests failed; first error: {outputs[0].error}")
        for o in outputs:
            if not o.success:
                logger.warning("request failed: %s", o.error)
        rec = _record(args, compute_metrics(outputs, duration, retok), rate, conc)
        print(format_serving_result(rec))
        if args.output_file:
            line = dict(rec)
            if args.output_details:
                line.update(input_lens=[o.prompt_len for o in outputs], output_lens=[o.output_len for o in outputs],
                            ttfts=[o.ttft for o in outputs], itls=[o.itl for o in outputs],
                            generated_texts=[o.generated_text for o in outputs], errors=[o.error for o in outputs])
            append_jsonl(args.output_file, line)
        results.append(rec)
    if args.plot:
        print(f"Latency-vs-load plot: {plot_latency_vs_load(results, args.plot)}")
    return results


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        main()
    except (ValueError, RuntimeError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
