"""The offline serving workload through the real :class:`~sglang.srt.managers.scheduler.Scheduler` on CPU, with a
cost model of the GPU in place of the model: which scheduling settings should pay, before a GPU is at hand.

The scheduler (admission, new-token ratio, chunked prefill, mixed or separate prefill batches, retraction, the radix
cache) runs unchanged over a KV pool of the size a server would get; a fake runner charges each forward a modelled
device time (roofline: Williams et al., "Roofline", CACM 2009):

* decode rows: ``(weight bytes + KV tokens read x KV bytes per token) / bandwidth x decode_eff`` (measured served
  decode steps of Llama-3.1-8B on one H100 are 1.19-1.24x this floor), plus ``eager_ms`` for a decode batch above the
  largest CUDA graph;
* prefill tokens: ``2 x matmul parameters`` FLOP per token at ``gemm_tflops`` plus causal attention FLOP
  (``4 x extend x (prefix + extend / 2) x head_dim x heads x layers``) at ``attn_tflops`` (one H100: an 8K prefill
  takes 237 ms, 556 TFLOP/s overall; the extend attention kernel 1.57 ms per layer at 8K, ~350 TFLOP/s);
* a host gap of ``host_ms + host_row_ms x rows`` whenever overlap scheduling has to wait for the previous result
  before building the next batch (a non-final prefill chunk when chunks are cached at result time; a full KV pool).

It prints one line per case: modelled seconds, output tok/s, decode batch sizes, steps above the graph size,
retractions, prefill share. The numbers are a model's, to rank settings; only GPU runs are results.

Usage: python benchmark/serving/sched_sim.py --cases "base|pool=418000,graph=160,chunk_cache=0" \\
    "new|pool=437000,graph=256" [--num-prompts 500] [--seed 0]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass, replace
from types import SimpleNamespace

import torch

from sglang.srt.managers.io_struct import TokenizedGenerateReqInput
from sglang.srt.managers.scheduler import Scheduler
from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
from sglang.srt.mem_cache.kv_cache import KVCache
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
from sglang.srt.server_args import ServerArgs


@dataclass(frozen=True)
class CostModel:
    """Device-time model of one forward (Llama-3.1-8B bf16 on one H100 by default; see the module docstring)."""

    bw: float = 3.0e12  # bytes/s
    weight_bytes: float = 16.06e9
    kv_bytes: float = 131072.0  # per token, all layers
    matmul_params: float = 7.0e9  # parameters in per-token matmuls (embedding lookup and unsampled lm_head rows out)
    gemm_tflops: float = 615.0
    attn_tflops: float = 350.0
    attn_flop_unit: float = 128 * 32 * 32  # head_dim x query heads x layers
    decode_eff: float = 1.2
    eager_ms: float = 2.0
    host_ms: float = 4.0
    host_row_ms: float = 0.02

    def forward_ms(self, batch, graph_max_bs: int) -> float:
        """Modelled device time of a ModelWorkerBatch."""
        dec_kv = 0
        pre_tok = 0
        attn = 0.0
        n_dec = 0
        for p, e, s in zip(batch.prefix_lens, batch.extend_lens, batch.seq_lens):
            if e == 1:
                n_dec += 1
                dec_kv += s
            else:
                pre_tok += e
                attn += 4.0 * e * (p + e / 2) * self.attn_flop_unit
        dec_attn_ms = dec_kv * self.kv_bytes / self.bw * 1e3 * self.decode_eff
        if pre_tok == 0:
            ms = (self.weight_bytes / self.bw * 1e3) * self.decode_eff + dec_attn_ms
            return ms + (self.eager_ms if n_dec > graph_max_bs else 0.0)
        gemm_ms = 2 * self.matmul_params * (pre_tok + n_dec) / (self.gemm_tflops * 1e12) * 1e3
        return gemm_ms + attn / (self.attn_tflops * 1e12) * 1e3 + dec_attn_ms


class SimRunner:
    """What the Scheduler needs of a ModelRunner, on CPU: the KV bookkeeping (no KV values), a sampled token per
    row, and a virtual clock advanced by :class:`CostModel` per forward (plus host gaps, see ``note_sync``)."""

    def __init__(self, pool_tokens: int, max_running: int, context: int, cost: CostModel, graph_max_bs: int):
        self.model_config = SimpleNamespace(context_len=context, vocab_size=128256, eos_token_ids=(128001,))
        self.device = torch.device("cpu")
        self.max_total_tokens = pool_tokens
        self.max_running_requests = max_running
        self.req_to_token_pool = ReqToTokenPool(max_running + 2, context + 8, "cpu")
        self.allocator = TokenToKVPoolAllocator(pool_tokens, 1, "cpu")
        self.kv_cache = KVCache(self.req_to_token_pool, None, self.allocator)
        self.tp_size, self.parallel_state, self.cuda_graph_runner = 1, None, None
        self.cost, self.graph_max_bs = cost, graph_max_bs
        self.clock_ms = 0.0
        self.prefill_ms = 0.0
        self.decode_bs: list[int] = []
        self.eager_steps = 0

    def make_sampling_info(self, reqs):
        return None

    def forward(self, batch):
        ms = self.cost.forward_ms(batch, self.graph_max_bs)
        self.clock_ms += ms
        if any(e > 1 for e in batch.extend_lens):
            self.prefill_ms += ms
        else:
            self.decode_bs.append(len(batch.extend_lens))
            self.eager_steps += len(batch.extend_lens) > self.graph_max_bs
        ids = torch.full((len(batch.extend_lens),), 100, dtype=torch.int64)
        return SimpleNamespace(input_token_logprobs=None), SimpleNamespace(next_token_ids=ids, logprobs=None)


def workload(n: int, in_len: int, out_len: int, seed: int) -> list[tuple[list[int], int]]:
    """SGLang's random dataset lengths (range ratio 0: uniform in [1, len]) with distinct random prompt ids."""
    rng = random.Random(seed)
    ins = [rng.randint(1, in_len) for _ in range(n)]
    outs = [rng.randint(1, out_len) for _ in range(n)]
    return [([rng.randrange(1000, 120000) for _ in range(i)], o) for i, o in zip(ins, outs)]


def run_case(opts: dict, reqs, cost: CostModel) -> dict:
    """Simulate one case. ``opts``: pool (KV tokens), graph (largest CUDA graph), mixed (0/1), chunk_cache (1: chunks
    cached at launch, 0: overlap waits for each non-final chunk's result), cons (--schedule-conservativeness),
    chunk (--chunked-prefill-size), policy (--schedule-policy), running (max running requests)."""
    chunk_cache = bool(int(opts.get("chunk_cache", 1)))
    runner = SimRunner(int(opts.get("pool", 418000)), int(opts.get("running", 1024)), 8192, cost,
                       int(opts.get("graph", 256)))
    args = ServerArgs(model_path="sim", enable_mixed_chunk=bool(int(opts.get("mixed", 1))),
                      chunked_prefill_size=int(opts.get("chunk", 8192)),
                      schedule_conservativeness=float(opts.get("cons", 1.0)),
                      schedule_policy=opts.get("policy", "fcfs"))
    # the forward runs inline (overlap off); overlap's waits are charged as host gaps: a non-final prefill chunk
    # when chunks are cached at result time, and every step that retracted (retraction needs nothing in flight)
    s = Scheduler(args, runner, None, grammar_backend=None, overlap=False)
    launched = []
    orig_launch = s._launch

    def launch(batch):
        launched.append(batch)
        orig_launch(batch)

    s._launch = launch
    for i, (ids, out) in enumerate(reqs):
        s.add_request(TokenizedGenerateReqInput(rid=f"r{i}", input_ids=ids, sampling_params={
            "max_new_tokens": out, "ignore_eos": True, "temperature": 0.0}))
    t0 = time.perf_counter()
    waits = 0
    drain_t, drain_gen = None, 0  # modelled ms and tokens generated when nothing waits any more
    while s.has_work():
        launched.clear()
        r0 = s.tracer.retractions
        s.step()
        if drain_t is None and not s.waiting and s.chunked_req is None:
            drain_t, drain_gen = runner.clock_ms, s.stats_gen_tokens
        chunk_wait = not chunk_cache and any(not x for b in launched for x in b.sample)
        if chunk_wait or s.tracer.retractions > r0:
            waits += 1
            runner.clock_ms += cost.host_ms + cost.host_row_ms * len(s.running)
    secs = runner.clock_ms / 1e3
    gen = sum(o for _, o in reqs)
    dbs = runner.decode_bs or [0]
    return {"s": secs, "tok_s": gen / secs, "bs_median": statistics.median(dbs), "bs_mean": statistics.fmean(dbs),
            "eager": runner.eager_steps, "retract": s.tracer.retractions, "waits": waits,
            "prefill_share": runner.prefill_ms / runner.clock_ms, "cpu_s": time.perf_counter() - t0,
            "drain_s": (runner.clock_ms - (drain_t or runner.clock_ms)) / 1e3,
            "drain_tok": s.stats_gen_tokens - drain_gen}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", nargs="+", default=["base|pool=418000,graph=160,chunk_cache=0",
                                                  "new|pool=437000,graph=256"])
    p.add_argument("--num-prompts", type=int, default=500)
    p.add_argument("--input-len", type=int, default=4096)
    p.add_argument("--output-len", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--decode-eff", type=float, default=CostModel.decode_eff)
    a = p.parse_args(argv)
    cost = replace(CostModel(), decode_eff=a.decode_eff)
    reqs = workload(a.num_prompts, a.input_len, a.output_len, a.seed)
    print(f"{len(reqs)} requests, {sum(len(i) for i, _ in reqs)} prompt tokens, {sum(o for _, o in reqs)} output tokens")
    print("| case | modelled s | output tok/s | decode bs median / mean | eager steps | retractions | waits | "
          "prefill share | drain s (tokens) |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for spec in a.cases:
        name, _, body = spec.partition("|")
        opts = dict(kv.split("=", 1) for kv in body.split(",") if kv)
        r = run_case(opts, reqs, cost)
        print(f"| {name} | {r['s']:.1f} | {r['tok_s']:.0f} | {r['bs_median']:.0f} / {r['bs_mean']:.0f} | "
              f"{r['eager']} | {r['retract']} | {r['waits']} | {r['prefill_share']:.2f} | "
              f"{r['drain_s']:.1f} ({r['drain_tok']}) |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
