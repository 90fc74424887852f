"""Offline throughput benchmark: ``python -m sglang.bench_offline_throughput`` (SGLang's flags).

Runs the whole dataset through an in-process :class:`sglang.srt.entrypoints.engine.Engine` in
one batched ``generate`` call (no HTTP) and prints SGLang's ``Offline Throughput Benchmark
Result`` block. Every ``launch_server`` flag (``--model-path``, ``--load-format dummy``,
``--tp-size``, ...) is accepted and passed to the engine.

Example::

    python -m sglang.bench_offline_throughput --model-path ../shared/data/configs/meta-llama--Meta-Llama-3.1-8B \\
        --load-format dummy --tokenizer-path ../shared/data/tokenizers/llama3 --dtype bfloat16 \\
        --dataset-name random --random-input-len 1024 --random-output-len 256 --num-prompts 512
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import time
from typing import Any, Optional

from sglang.benchmark_datasets import DatasetConfig, DatasetRow, add_dataset_args, get_dataset
from sglang.benchmark_utils import append_jsonl, format_offline_result

logger = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    """Bench flags (SGLang's names) plus every ``ServerArgs`` flag."""
    from sglang.srt.server_args import ServerArgs

    p = argparse.ArgumentParser(prog="python -m sglang.bench_offline_throughput", description=__doc__.split("\n")[0])
    p.add_argument("--backend", choices=("engine",), default="engine")
    p.add_argument("--result-filename", default="", help="Append the result dict as one JSON line.")
    add_dataset_args(p)
    p.add_argument("--disable-ignore-eos", action="store_true")
    p.add_argument("--extra-request-body", default=None, help="JSON merged into every request's sampling params.")
    p.add_argument("--skip-warmup", action="store_true")
    ServerArgs.add_cli_args(p)
    return p


def _sampling_params(rows: list[DatasetRow], ignore_eos: bool, extra: dict) -> list[dict]:
    return [{"temperature": 0.0, "max_new_tokens": r.output_len, "ignore_eos": ignore_eos, **extra} for r in rows]


def _generate(engine: Any, rows: list[DatasetRow], params: list[dict]) -> list[dict]:
    if isinstance(rows[0].prompt, list):
        outs = engine.generate(input_ids=[r.prompt for r in rows], sampling_params=params)
    else:
        outs = engine.generate(prompt=[r.prompt for r in rows], sampling_params=params)
    return outs if isinstance(outs, list) else [outs]


def _last_gen_throughput(engine: Any) -> Optional[float]:
    """The scheduler's most recent decode throughput (tok/s) when the engine reports one."""
    info_fn = getattr(engine, "get_server_info", None)
    if info_fn is None:
        return None
    try:
        states = info_fn().get("internal_states") or [{}]
        v = states[0].get("last_gen_throughput")
        return float(v) if v is not None else None
    except Exception as e:  # informational only
        logger.debug("no last_gen_throughput from the engine: %s", e)
        return None


def throughput_test_once(engine: Any, rows: list[DatasetRow], ignore_eos: bool, extra: dict) -> dict[str, Any]:
    """Generate every row in one batched call; returns SGLang's offline result dict.

    Keys: ``backend``, ``successful_requests``, ``total_latency`` (s), ``total_input_tokens``,
    ``total_output_tokens`` (from each output's ``meta_info.completion_tokens``),
    ``last_gen_throughput``, ``request_throughput`` (req/s), ``input_throughput``,
    ``output_throughput``, ``total_throughput`` (tok/s).
    """
    params = _sampling_params(rows, ignore_eos, extra)
    start = time.perf_counter()
    outs = _generate(engine, rows, params)
    latency = time.perf_counter() - start
    in_tok = sum(int(o["meta_info"].get("prompt_tokens", r.prompt_len)) for o, r in zip(outs, rows))
    out_tok = sum(int(o["meta_info"]["completion_tokens"]) for o in outs)
    out_tps = out_tok / latency
    last = _last_gen_throughput(engine)
    return {
        "backend": "engine",
        "successful_requests": len(outs),
        "total_latency": latency,
        "total_input_tokens": in_tok,
        "total_output_tokens": out_tok,
        "last_gen_throughput": out_tps if last is None else last,
        "request_throughput": len(outs) / latency,
        "input_throughput": in_tok / latency,
        "output_throughput": out_tps,
        "total_throughput": (in_tok + out_tok) / latency,
    }


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    """Parse ``argv``, run warmup + benchmark, print the result block, append the JSON line.

    Raises:
        ValueError: bad flags or dataset (the message names the flag).
    """
    from sglang.srt.server_args import ServerArgs

    args = build_parser().parse_args(argv)
    extra = json.loads(args.extra_request_body) if args.extra_request_body else {}
    if not isinstance(extra, dict):
        raise ValueError("--extra-request-body must be a JSON object")
    server_args = ServerArgs.from_cli_args(args)
    from sglang.srt.entrypoints.launch import resolve_model
    from sglang.srt.utils.common import get_tokenizer

    tokenizer = get_tokenizer(resolve_model(server_args).resolved_tokenizer_path, server_args.trust_remote_code)
    cfg = DatasetConfig.from_args(args)
    rows = get_dataset(cfg, tokenizer)
    from sglang.srt.entrypoints.engine import Engine

    engine = Engine(**dataclasses.asdict(server_args))
    try:
        ignore_eos = not args.disable_ignore_eos
        if not args.skip_warmup:
            warm = [dataclasses.replace(r, output_len=min(r.output_len, 16)) for r in rows[: min(len(rows), 16)]]
            logger.info("warmup: %d requests", len(warm))
            throughput_test_once(engine, warm, ignore_eos, extra)
        logger.info("benchmark: %d requests", len(rows))
        result = throughput_test_once(engine, rows, ignore_eos, extra)
    finally:
        engine.shutdown()
    if args.result_filename:
        append_jsonl(args.result_filename, result)
    print("\n" + format_offline_result(result))
    return result


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        main()
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
