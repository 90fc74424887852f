"""Latency of one static batch without the server (SGLang's ``bench_one_batch``), with tensor parallelism.

Usage::

    python -m sglang.bench_one_batch --model-path PATH --batch-size 1 32 --input-len 1024 --output-len 16 \
        [--load-format dummy] [--tp N] [--debug-nocomm] [--profile-comm] [--result-filename result.jsonl]

For every (batch size, input len, output len) it prefills the batch once and decodes ``output_len - 1``
steps (greedy), timing each forward (model + sampling, device-synchronized), and prints SGLang-like lines;
one JSON line per run is appended to ``--result-filename``.

``--tp N`` spawns N ranks itself (multiprocessing spawn, gloo/NCCL rendezvous on a free local port);
rank 0 prints and writes. ``--debug-nocomm`` runs every TP collective as a no-op
(:class:`~sglang.srt.distributed.communicator.NoCommCommunicator`): outputs are wrong and every line is
labelled so. ``--profile-comm`` measures one prefill forward of T tokens (``--profile-tokens``, default
1 128 1024 4096 8192) with the real communicator and with the no-comm counterfactual in the same
process (the model's communicator is switched between the two), giving the communication share of
the forward ``1 - nocomm/comm`` (TokenWeave, Gond et al. 2025, sec. 2, bounds overlap gains the same way).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import logging
import multiprocessing as mp
import os
import statistics
import sys
import time
from typing import Optional

logger = logging.getLogger("sglang.bench_one_batch")

from sglang.srt.utils.nvls_env import NVLS_OFF_ENV  # noqa: E402  (re-exported for the benchmarks)
DEFAULT_PROFILE_TOKENS = (1, 128, 1024, 4096, 8192)


@dataclasses.dataclass(frozen=True)
class BenchArgs:
    """What to run (see the module docstring); sizes in tokens."""

    batch_size: tuple[int, ...] = (1,)
    input_len: tuple[int, ...] = (1024,)
    output_len: tuple[int, ...] = (16,)
    result_filename: str = "result.jsonl"
    run_name: str = "default"
    debug_nocomm: bool = False
    profile_comm: bool = False
    profile_tokens: tuple[int, ...] = DEFAULT_PROFILE_TOKENS
    profile_repeats: int = 3
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("batch_size", "input_len", "output_len", "profile_tokens"):
            bad = [v for v in getattr(self, name) if v < 1]
            if bad:
                raise ValueError(f"--{name.replace('_', '-')} values must be >= 1, got {bad}")
        if self.profile_repeats < 1:
            raise ValueError(f"--profile-repeats={self.profile_repeats} must be >= 1")


def _sync(runner) -> None:
    import torch

    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)


def _barrier(runner) -> None:
    if runner.tp_size > 1:
        import torch.distributed as dist

        dist.barrier(group=runner.parallel_state.cpu_group)


def prefill_chunks(input_lens: list[int], chunk_tokens: Optional[int]) -> list[list[tuple[int, int, int]]]:
    """Split a static batch's prefill into forwards of at most ``chunk_tokens`` tokens, as the scheduler's chunked
    prefill does: requests in order, a request longer than the room left is split and continues first in the next
    forward. Each forward is a list of ``(request index, start, end)`` token ranges; ``chunk_tokens`` None (chunking
    off, ``--chunked-prefill-size -1``) gives one forward of everything.

    Raises:
        ValueError: ``chunk_tokens < 1`` or an input length < 1.
    """
    if chunk_tokens is not None and chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1 or None, got {chunk_tokens}")
    if any(n < 1 for n in input_lens):
        raise ValueError(f"input lengths must be >= 1, got {input_lens}")
    if chunk_tokens is None:
        return [[(i, 0, n) for i, n in enumerate(input_lens)]] if input_lens else []
    out: list[list[tuple[int, int, int]]] = []
    cur: list[tuple[int, int, int]] = []
    room = chunk_tokens
    for i, n in enumerate(input_lens):
        start = 0
        while start < n:
            take = min(room, n - start)
            cur.append((i, start, start + take))
            start += take
            room -= take
            if room == 0:
                out.append(cur)
                cur, room = [], chunk_tokens
    if cur:
        out.append(cur)
    return out


def chunk_size(server_args) -> Optional[int]:
    """Tokens per prefill forward: ``--chunked-prefill-size`` (unset: the scheduler's default 8192; -1: None, no
    chunking)."""
    from sglang.srt.managers.scheduler import DEFAULT_CHUNKED_PREFILL_SIZE

    cps = server_args.chunked_prefill_size
    if cps is None:
        return DEFAULT_CHUNKED_PREFILL_SIZE
    return None if cps == -1 else cps


class StaticBatch:
    """Requests of one static batch: KV rows/slots taken from the runner's pools, freed by :meth:`free`."""

    def __init__(self, runner, input_ids: list[list[int]], max_new_tokens: int):
        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.sampling.sampling_params import SamplingParams

        self.runner = runner
        self.reqs = []
        for i, ids in enumerate(input_ids):
            params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)
            params.normalize(None)
            self.reqs.append(Req(f"bench-{i}", ids, params))
        rows = runner.req_to_token_pool.alloc(len(input_ids))
        if rows is None:
            raise ValueError(f"batch size {len(input_ids)} exceeds max running requests; lower --batch-size")
        self.rows = list(rows)
        self.slots = []
        self.seq_lens = [0] * len(input_ids)

    def _alloc(self, idx: list[int], n_per_req: list[int]):
        locs = self.runner.allocator.alloc(sum(n_per_req))
        if locs is None:
            raise ValueError("the KV cache is too small for this batch; lower --batch-size/--input-len "
                             "or raise --max-total-tokens/--mem-fraction-static")
        self.slots.append(locs)
        self.runner.req_to_token_pool.write_batch([self.rows[i] for i in idx], [self.seq_lens[i] for i in idx],
                                                  n_per_req, locs)
        return locs

    def step(self, new_tokens: list[list[int]], idx: Optional[list[int]] = None):
        """One forward over ``new_tokens[j]`` for request ``idx[j]`` (default: every request, in order); returns
        the sampled ids (list, one per forwarded request) after sync. A request whose prompt is not complete after
        this step (a prefill chunk) gets no output token."""
        from sglang.srt.forward_batch_info import ForwardMode, ModelWorkerBatch

        idx = list(range(len(self.reqs))) if idx is None else idx
        ext = [len(t) for t in new_tokens]
        prefix = [self.seq_lens[i] for i in idx]
        decode = all(e == 1 and s > 0 for e, s in zip(ext, prefix))
        locs = self._alloc(idx, ext)
        seq = [p + e for p, e in zip(prefix, ext)]
        reqs = [self.reqs[i] for i in idx]
        batch = ModelWorkerBatch(
            forward_mode=ForwardMode.DECODE if decode else ForwardMode.EXTEND,
            input_ids=[t for ts in new_tokens for t in ts],
            positions=[p for s, e in zip(prefix, ext) for p in range(s, s + e)],
            out_cache_loc=locs, req_pool_indices=[self.rows[i] for i in idx], prefix_lens=prefix, extend_lens=ext,
            seq_lens=seq, sample=[True] * len(ext), top_logprobs_nums=[0] * len(ext),
            sampling_info=self.runner.make_sampling_info(reqs),
        )
        _, sample_out = self.runner.forward(batch)
        ids = sample_out.next_token_ids.tolist()
        for i, n, r, t in zip(idx, seq, reqs, ids):
            self.seq_lens[i] = n
            if n >= len(r.origin_input_ids):
                r.output_ids.append(t)
        return ids

    def prefill(self, prompts: list[list[int]], chunk_tokens: Optional[int]) -> list[int]:
        """Prefill every request in forwards of at most ``chunk_tokens`` tokens (:func:`prefill_chunks`; None:
        one forward); returns each request's first sampled id."""
        first = [0] * len(prompts)
        for piece in prefill_chunks([len(p) for p in prompts], chunk_tokens):
            ids = self.step([prompts[i][a:b] for i, a, b in piece], [i for i, _, _ in piece])
            for (i, _, b), t in zip(piece, ids):
                if b == len(prompts[i]):
                    first[i] = t
        return first

    def free(self) -> None:
        """Return the batch's KV slots and request rows to the runner's pools."""
        import torch

        if self.slots:
            self.runner.allocator.free(torch.cat(self.slots))
        self.runner.req_to_token_pool.free(self.rows)
        self.slots = []


def _timed(runner, fn):
    _barrier(runner)
    _sync(runner)
    t0 = time.perf_counter()
    out = fn()
    _sync(runner)
    return time.perf_counter() - t0, out


def run_latency(runner, bs: int, input_len: int, output_len: int, seed: int,
                chunk_tokens: Optional[int] = None) -> dict:
    """Prefill (in forwards of at most ``chunk_tokens`` tokens, see :func:`prefill_chunks`) + ``output_len - 1``
    decode steps of a random static batch; timings in seconds."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    vocab = runner.model_config.vocab_size
    prompts = torch.randint(0, vocab, (bs, input_len), generator=gen).tolist()
    batch = StaticBatch(runner, prompts, output_len)
    try:
        prefill_s, ids = _timed(runner, lambda: batch.prefill(prompts, chunk_tokens))
        decode_s = []
        for _ in range(output_len - 1):
            dt, ids = _timed(runner, lambda: batch.step([[t] for t in ids]))
            decode_s.append(dt)
    finally:
        batch.free()
    return {"prefill_latency": prefill_s, "decode_latencies": decode_s,
            "first_tokens": [r.output_ids[:8] for r in batch.reqs[:2]]}


def run_profile(runner, switch, tokens: int, repeats: int, seed: int) -> dict:
    """Median latency (s) of one prefill forward of ``tokens`` tokens, with and without communication."""
    import torch

    gen = torch.Generator().manual_seed(seed + tokens)
    prompt = torch.randint(0, runner.model_config.vocab_size, (1, tokens), generator=gen).tolist()
    out = {}
    for mode in ("comm", "nocomm"):
        switch.use_real = mode == "comm"
        times = []
        for _ in range(repeats + 1):  # first one is a warmup
            batch = StaticBatch(runner, prompt, 1)
            try:
                dt, _ = _timed(runner, lambda: batch.step(prompt))
            finally:
                batch.free()
            times.append(dt)
        out[mode] = statistics.median(times[1:])
    switch.use_real = True
    return out


def _emit(line: str, label: str) -> None:
    sys.stdout.write(f"{label}{line}\n")
    sys.stdout.flush()


def bench_communicator(ps, server_args, bench: BenchArgs):
    """The communicator a benchmark rank runs with: the no-communication counterfactual under
    ``--debug-nocomm``, else exactly the server's choice (``--comm-backend``; with ``--enable-tokenweave``
    tw-comm's communicator by default, see :func:`~sglang.srt.deployment.communicator.build_communicator`).
    ``ps``: the rank's ParallelState (None at TP 1)."""
    from sglang.srt.deployment.communicator import build_communicator
    from sglang.srt.distributed.communicator import create_communicator

    if bench.debug_nocomm:
        return create_communicator(ps, "nocomm")
    return build_communicator(ps, server_args)


def _rank_main(tp_rank: int, server_args, bench: BenchArgs, init_method: Optional[str], pipe) -> None:
    """One rank: build the runner, run everything, rank 0 reports (also the entry of spawned ranks)."""
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.distributed.communicator import NOCOMM_LABEL, NoCommCommunicator, SwitchCommunicator
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.utils.common import configure_logger

    for k, v in NVLS_OFF_ENV.items():
        os.environ.setdefault(k, v)
    tp = server_args.tp_size
    configure_logger(server_args.log_level if tp_rank == 0 else "warning", f"TP{tp_rank}")
    try:
        device = server_args.resolved_device
        mc = ModelConfig.from_path(server_args.model_path, server_args.context_length, server_args.dtype, device)
        ps = None
        if tp > 1:
            from sglang.srt.distributed.parallel_state import DistConfig, init_parallel_state, validate_tp_config

            validate_tp_config(mc, tp, server_args.ep_size, 1)
            ps = init_parallel_state(DistConfig(tp_rank=tp_rank, tp_size=tp, init_method=init_method, device=device,
                                                ep_size=server_args.ep_size))
            if device == "cuda":
                device = str(ps.torch_device())
        comm = bench_communicator(ps, server_args, bench)
        switch = None
        if bench.profile_comm:
            switch = SwitchCommunicator(comm, NoCommCommunicator.create(ps))
            comm = switch
        runner = ModelRunner(mc, server_args, device, tp_rank=tp_rank, tp_size=tp, parallel_state=ps, comm=comm)
        label = f"[{NOCOMM_LABEL}] " if bench.debug_nocomm else ""
        lead = tp_rank == 0
        results = []
        for bs, il, ol in itertools.product(bench.batch_size, bench.input_len, bench.output_len):
            r = run_latency(runner, bs, il, ol, bench.seed, chunk_size(server_args))
            pre, dec = r["prefill_latency"], r["decode_latencies"]
            med = statistics.median(dec) if dec else 0.0
            total = pre + sum(dec)
            rec = {"run_name": bench.run_name, "batch_size": bs, "input_len": il, "output_len": ol,
                   "tp_size": tp, "device": str(runner.device), "dtype": str(mc.dtype).replace("torch.", ""),
                   "model_path": server_args.model_path, "load_format": server_args.load_format,
                   "communicator": comm.describe() if not bench.profile_comm else "switch",
                   "debug_nocomm": bench.debug_nocomm, "label": NOCOMM_LABEL if bench.debug_nocomm else "",
                   "prefill_latency": pre, "prefill_throughput": bs * il / pre,
                   "median_decode_latency": med, "median_decode_throughput": bs / med if med else 0.0,
                   "overall_latency": total, "overall_throughput": bs * (il + ol) / total}
            results.append(rec)
            if lead:
                _emit(f"Prefill. latency: {pre:.5f} s, throughput: {bs * il / pre:9.2f} token/s", label)
                for i, d in enumerate(dec[:5]):
                    _emit(f"Decode {i}. Batch size: {bs}, latency: {d:.5f} s, throughput: {bs / d:9.2f} token/s", label)
                if dec:
                    _emit(f"Decode.  median latency: {med:.5f} s, median throughput: {bs / med:9.2f} token/s", label)
                _emit(f"Total. latency: {total:.3f} s, throughput: {bs * (il + ol) / total:9.2f} token/s", label)
        if bench.profile_comm:
            for t in bench.profile_tokens:
                p = run_profile(runner, switch, t, bench.profile_repeats, bench.seed)
                share = max(0.0, 1.0 - p["nocomm"] / p["comm"]) if p["comm"] > 0 else 0.0
                rec = {"run_name": bench.run_name, "mode": "profile_comm", "tp_size": tp, "tokens": t,
                       "device": str(runner.device), "dtype": str(mc.dtype).replace("torch.", ""),
                       "model_path": server_args.model_path, "communicator": comm.describe(),
                       "latency_comm_s": p["comm"], "latency_nocomm_s": p["nocomm"], "comm_share": share,
                       "note": f"nocomm = {NOCOMM_LABEL}"}
                results.append(rec)
                if lead:
                    _emit(f"Profile-comm. TP {tp}, tokens {t}: forward with comm {p['comm'] * 1e3:.3f} ms, "
                          f"without comm {p['nocomm'] * 1e3:.3f} ms [{NOCOMM_LABEL}], comm share {share:.1%}", "")
        if lead and bench.result_filename:
            with open(bench.result_filename, "a") as f:
                for rec in results:
                    f.write(json.dumps(rec) + "\n")
        if pipe is not None:
            pipe.send({"status": "ok", "results": results if lead else []})
    except BaseException as e:
        logger.exception("bench rank %d failed", tp_rank)
        if pipe is not None:
            pipe.send({"status": "error", "message": f"TP rank {tp_rank}: {type(e).__name__}: {e}"})
        raise
    finally:
        from sglang.srt.distributed.parallel_state import destroy_parallel_state

        destroy_parallel_state()


def _free_port() -> int:
    from sglang.srt.utils.common import free_tcp_ports

    return free_tcp_ports(1)[0]


def run(server_args, bench: BenchArgs, timeout_s: float = 3600.0) -> list[dict]:
    """Run the benchmark in this process (tp 1) or in ``tp_size`` spawned ranks; returns rank 0's records.

    Raises:
        RuntimeError: a rank failed or died (its message is included), or the run exceeded ``timeout_s``.
    """
    tp = server_args.tp_size
    if tp == 1:
        reader, writer = mp.Pipe(duplex=False)
        _rank_main(0, server_args, bench, None, writer)
        return reader.recv()["results"]
    for k, v in NVLS_OFF_ENV.items():
        os.environ.setdefault(k, v)
    ctx = mp.get_context("spawn")
    init = f"tcp://127.0.0.1:{_free_port()}"
    procs, pipes = [], []
    for rank in range(tp):
        reader, writer = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_rank_main, args=(rank, server_args, bench, init, writer), daemon=True,
                        name=f"bench_TP{rank}")
        p.start()
        procs.append(p)
        pipes.append(reader)
    deadline = time.monotonic() + timeout_s
    replies: dict[int, dict] = {}
    try:
        while len(replies) < tp:
            if time.monotonic() > deadline:
                raise RuntimeError(f"bench_one_batch did not finish within {timeout_s:.0f} s")
            for rank, (p, r) in enumerate(zip(procs, pipes)):
                if rank in replies:
                    continue
                if r.poll(0.2):
                    try:
                        replies[rank] = r.recv()
                    except EOFError:
                        replies[rank] = {"status": "error", "message": f"TP rank {rank} died (exit code {p.exitcode})"}
                elif not p.is_alive():
                    replies[rank] = {"status": "error", "message": f"TP rank {rank} died (exit code {p.exitcode})"}
                if replies.get(rank, {}).get("status") == "error":
                    raise RuntimeError(f"bench_one_batch failed: {replies[rank]['message']}")
    finally:
        for p in procs:
            p.join(10 if not replies or all(v.get("status") == "ok" for v in replies.values()) else 0.1)
            if p.is_alive():
                p.kill()
                p.join(1)
    return replies[0]["results"]


def parse_args(argv: list[str]):
    """(ServerArgs, BenchArgs) from the command line (all launch_server flags are accepted)."""
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(prog="python -m sglang.bench_one_batch")
    ServerArgs.add_cli_args(parser)
    parser.add_argument("--batch-size", type=int, nargs="+", default=[1])
    parser.add_argument("--input-len", type=int, nargs="+", default=[1024])
    parser.add_argument("--output-len", type=int, nargs="+", default=[16])
    parser.add_argument("--result-filename", default="result.jsonl")
    parser.add_argument("--run-name", default="default")
    parser.add_argument("--debug-nocomm", action="store_true",
                        help="Skip every TP collective (benchmark-only counterfactual; outputs are wrong).")
    parser.add_argument("--profile-comm", action="store_true",
                        help="Per-forward prefill latency with vs without communication at --profile-tokens.")
    parser.add_argument("--profile-tokens", type=int, nargs="+", default=list(DEFAULT_PROFILE_TOKENS))
    parser.add_argument("--profile-repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    ns = parser.parse_args(argv)
    server_args = ServerArgs.from_cli_args(ns)
    bench = BenchArgs(tuple(ns.batch_size), tuple(ns.input_len), tuple(ns.output_len), ns.result_filename,
                      ns.run_name, ns.debug_nocomm, ns.profile_comm, tuple(ns.profile_tokens), ns.profile_repeats,
                      ns.seed)
    need = max(max(bench.input_len) + max(bench.output_len), max(bench.profile_tokens) if bench.profile_comm else 0)
    if server_args.context_length is None:
        pass  # the model's max_position_embeddings
    elif server_args.context_length < need:
        raise ValueError(f"--context-length={server_args.context_length} is below the {need} tokens this run needs")
    return server_args, bench


def main(argv: Optional[list[str]] = None) -> int:
    """CLI entry: parse the arguments and run the benchmark; returns 0, or 1 after logging a ValueError/RuntimeError."""
    from sglang.srt.utils.common import configure_logger

    configure_logger("info", "bench")
    try:
        server_args, bench = parse_args(sys.argv[1:] if argv is None else argv)
        run(server_args, bench)
    except (ValueError, RuntimeError) as e:
        logger.error("%s", e)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
