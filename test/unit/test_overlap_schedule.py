"""Overlap scheduling: the future-token ring, the on/off policy, the worker thread, and the scheduler
with the real ``make_sampling_info`` / ``Sampler`` on random logits (seeded sampling, min_new_tokens,
stop tokens, output and input logprobs, penalties, grammars) giving identical results with overlap
on and off. The fake runner reads only what its batch carries (KV contents it wrote itself and the
batch's inputs), so it is safe on the worker thread."""

from __future__ import annotations

import os
import random
import re
import sys
import threading
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Optional

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from conftest import shared_path  # noqa: E402

from sglang.srt.layers.sampler import Sampler  # noqa: E402
from sglang.srt.managers.io_struct import AbortReq, TokenizedGenerateReqInput  # noqa: E402
from sglang.srt.managers.scheduler import Scheduler  # noqa: E402
from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
from sglang.srt.mem_cache.kv_cache import KVCache  # noqa: E402
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool  # noqa: E402
from sglang.srt.model_executor.model_runner import ModelRunner  # noqa: E402
from sglang.srt.model_executor.overlap_worker import (  # noqa: E402
    OVERLAP_ENV,
    FutureTokenRing,
    OverlapWorker,
    overlap_schedule_enabled,
    placeholder_id,
)
from sglang.srt.server_args import ServerArgs  # noqa: E402

VOCAB = 512
EOS = 2


# ---- pieces ------------------------------------------------------------------------------------
def test_ring_resolves_placeholders_and_keeps_real_ids():
    rng = random.Random(5)
    ring = FutureTokenRing(16)
    slots = rng.sample(range(16), 6)
    toks = [rng.randrange(VOCAB) for _ in slots]
    ring.store(slots + [-1], toks + [999])  # -1: a row without a future token
    real = [rng.randrange(VOCAB) for _ in range(4)]
    ids = [real[0], placeholder_id(slots[2]), real[1], placeholder_id(slots[0]), real[2], real[3]]
    assert ring.resolve(ids) == [real[0], toks[2], real[1], toks[0], real[2], real[3]]
    assert ring.resolve(real) is real  # nothing to do
    assert all(placeholder_id(s) < 0 for s in range(16))
    with pytest.raises(ValueError, match="size"):
        FutureTokenRing(0)


def test_policy(monkeypatch):
    monkeypatch.delenv(OVERLAP_ENV, raising=False)
    on, off = ServerArgs(), ServerArgs(disable_overlap_schedule=True)
    assert overlap_schedule_enabled(on, "cuda") and not overlap_schedule_enabled(on, "cpu")
    assert not overlap_schedule_enabled(off, "cuda")
    assert overlap_schedule_enabled(off, "cpu", override=True) and not overlap_schedule_enabled(on, "cuda", False)
    monkeypatch.setenv(OVERLAP_ENV, "1")
    assert overlap_schedule_enabled(on, "cpu") and not overlap_schedule_enabled(off, "cpu")


class _Gated:
    """A runner whose forward waits for a gate; records the order of forwards."""

    def __init__(self):
        self.device = "cpu"
        self.gate = threading.Event()
        self.seen: list[list[int]] = []

    def forward(self, batch):
        assert self.gate.wait(30)
        self.seen.append(list(batch.input_ids))
        if batch.input_ids == [90]:
            raise RuntimeError("boom")
        return None, SimpleNamespace(next_token_ids=torch.tensor([t * 10 for t in batch.input_ids]))


def test_worker_runs_in_order_resolves_and_propagates_errors():
    runner = _Gated()
    w = OverlapWorker(runner, ring_size=8)
    try:
        f1 = w.submit(SimpleNamespace(input_ids=[3, 4]), [5, -1])
        f2 = w.submit(SimpleNamespace(input_ids=[placeholder_id(5), 9]), [-1, 6])
        assert not f1.done()  # submit returns while the forward waits
        runner.gate.set()
        assert f1.result(30)[1].next_token_ids.tolist() == [30, 40]
        assert f2.result(30)[1].next_token_ids.tolist() == [300, 90]  # 30 came through ring slot 5
        assert runner.seen == [[3, 4], [30, 9]]
        f3 = w.submit(SimpleNamespace(input_ids=[-7]), [-1])  # slot 6 exists; the runner raises
        f4 = w.submit(SimpleNamespace(input_ids=[1]), [-1])
        with pytest.raises(RuntimeError, match="boom"):
            f3.result(30)
        with pytest.raises(RuntimeError, match="earlier forward failed"):
            f4.result(30)
    finally:
        runner.gate.set()
        w.close()


# ---- scheduler with the real sampler -------------------------------------------------------------
@dataclass
class _ModelConfig:
    context_len: int = 512
    vocab_size: int = VOCAB
    eos_token_ids: tuple = (EOS,)


@dataclass
class _LogitsOut:
    input_token_logprobs: Optional[list] = None
    input_top_logprobs: Optional[list] = None


def fake_logits(seq: list[int]) -> torch.Tensor:
    """[VOCAB] float32 logits that depend on the whole sequence (seeded by its hash) and favour
    repeating the last token (so penalties, which read the output tokens, change the outputs)."""
    h = 7
    for t in seq:
        h = (h * 1_000_003 + t) % (1 << 61)
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(h)) * 3
    logits[seq[-1]] += 6.0
    return logits


class FakeRunner:
    """KV pool that stores token ids; logits from :func:`fake_logits` of the sequence rebuilt from
    the KV the batch reads plus its inputs; the real ``make_sampling_info`` and ``Sampler``."""

    def __init__(self, max_total_tokens: int = 8192, max_running: int = 32, page_size: int = 1,
                 disable_radix_cache: bool = False):
        self.model_config = _ModelConfig()
        self.device = torch.device("cpu")
        self.max_total_tokens = max_total_tokens
        self.max_running_requests = max_running
        self.req_to_token_pool = ReqToTokenPool(max_running + 1, 520, "cpu")
        self.allocator = TokenToKVPoolAllocator(max_total_tokens, page_size, "cpu")
        self.kv_cache = KVCache(self.req_to_token_pool, None, self.allocator, disable_radix_cache)
        self.device, self.tp_size, self.parallel_state = torch.device("cpu"), 1, None
        self.kv = torch.full((max_total_tokens + 2 * page_size,), -1, dtype=torch.int64)
        self.sampler = Sampler(0, "cpu")
        self.num_batches = 0

    make_sampling_info = ModelRunner.make_sampling_info

    def forward(self, batch):
        r2t = self.req_to_token_pool.req_to_token
        off, rows, in_lps, in_tops = 0, [], [], []
        for i, row in enumerate(batch.req_pool_indices):
            pre, ext = batch.prefix_lens[i], batch.extend_lens[i]
            new = batch.input_ids[off:off + ext]
            assert min(new) >= 0, "a placeholder reached the runner"
            locs = batch.out_cache_loc[off:off + ext]
            self.kv[locs] = torch.tensor(new)
            seq = self.kv[r2t[row, :pre].long()].tolist() + new
            rows.append(fake_logits(seq))
            k = batch.top_logprobs_nums[i]
            lp, top = [], []
            for j, t in zip(batch.input_logprob_indices[i], batch.input_logprob_token_ids[i]):
                row_lp = torch.log_softmax(fake_logits(seq[:pre + j + 1]), -1)
                lp.append(float(row_lp[t]))
                v, ix = row_lp.topk(k)
                top.append(list(zip(v.tolist(), ix.tolist())))
            in_lps.append(lp)
            in_tops.append(top)
            off += ext
        self.num_batches += 1
        out = self.sampler.forward(torch.stack(rows), batch.sampling_info, batch.return_logprob,
                                   batch.top_logprobs_nums)
        if not batch.return_logprob:
            return _LogitsOut(), out
        return _LogitsOut(input_token_logprobs=in_lps, input_top_logprobs=in_tops), out


def make(overlap: bool, tokenizer=None, max_total_tokens=8192, **kw):
    runner = FakeRunner(max_total_tokens=max_total_tokens, page_size=kw.get("page_size", 1),
                        disable_radix_cache=kw.get("disable_radix_cache", False))
    grammar_backend = None
    if tokenizer is not None:
        from sglang.srt.constrained.xgrammar_backend import XGrammarBackend

        grammar_backend = XGrammarBackend(tokenizer, VOCAB, [EOS])
    s = Scheduler(ServerArgs(**kw), runner, tokenizer, grammar_backend=grammar_backend, overlap=overlap)
    return s, runner


def submit(s, rid, prompt, return_logprob=False, logprob_start_len=-1, top_logprobs_num=0, **sp):
    params = {"max_new_tokens": 40, "temperature": 0.0, **sp}
    s.add_request(TokenizedGenerateReqInput(rid=rid, input_ids=list(prompt), sampling_params=params,
                                            return_logprob=return_logprob, logprob_start_len=logprob_start_len,
                                            top_logprobs_num=top_logprobs_num))


def run_all(s, results=None, max_steps=5000, on_step=None):
    results = {} if results is None else results
    for k in range(max_steps):
        if on_step is not None:
            on_step(k)
        for out in s.step():
            for i, rid in enumerate(out.rids):
                d = results.setdefault(rid, {"ids": [], "finish": None, "lps": [], "in_lps": None})
                d["ids"].extend(out.output_ids[i])
                d["cached"] = out.cached_tokens[i]
                d["finish"] = out.finished_reasons[i]
                if out.output_token_logprobs is not None and out.output_token_logprobs[i]:
                    d["lps"].extend(out.output_token_logprobs[i])
                if out.input_token_logprobs is not None and out.input_token_logprobs[i]:
                    d["in_lps"] = out.input_token_logprobs[i]
        if not s.has_work():
            return results
    raise AssertionError("scheduler did not drain")


def kv_all_returned(s, runner) -> bool:
    s.tree_cache.reset()
    return (runner.allocator.available_size() == runner.allocator.size
            and runner.req_to_token_pool.available_size() == runner.max_running_requests + 1)


def workload(rng: random.Random, s, n: int) -> None:
    shared = [rng.randrange(3, VOCAB) for _ in range(30)]
    for i in range(n):
        prompt = shared[: rng.randrange(0, 30)] + [rng.randrange(3, VOCAB) for _ in range(rng.randrange(1, 25))]
        kind = i % 6
        sp = {"max_new_tokens": rng.randrange(1, 30)}
        if kind == 1:
            sp.update(temperature=1.0, top_p=0.9, seed=rng.randrange(1000), min_new_tokens=min(rng.randrange(0, 6), sp["max_new_tokens"]))
        elif kind == 2:
            sp.update(temperature=0.8, seed=rng.randrange(1000), stop_token_ids=list(range(3, 200)))
        elif kind == 3:
            sp.update(frequency_penalty=1.5, presence_penalty=0.5, repetition_penalty=1.3)
        elif kind == 4:
            sp.update(max_new_tokens=rng.choice([0, 3]))
        lp = dict(return_logprob=True, logprob_start_len=rng.randrange(0, len(prompt)), top_logprobs_num=2) \
            if kind in (1, 4) else {}
        submit(s, f"q{i}", prompt, **lp, **sp)


@pytest.mark.parametrize("seed,page_size,cps", [(1, 1, 16), (2, 4, 64), (3, 2, -1)])
def test_overlap_on_equals_off_with_real_sampler(seed, page_size, cps):
    results = {}
    for overlap in (False, True):
        s, runner = make(overlap, page_size=page_size, chunked_prefill_size=cps, max_total_tokens=1024)
        try:
            workload(random.Random(seed), s, 24)
            results[overlap] = run_all(s)
            assert kv_all_returned(s, runner)
        finally:
            s.close()
    off, on = results[False], results[True]
    assert off.keys() == on.keys() and len(off) == 24
    for rid in off:
        assert on[rid]["ids"] == off[rid]["ids"], rid
        assert on[rid]["finish"] == off[rid]["finish"], rid
        assert [t for _, t in on[rid]["lps"]] == [t for _, t in off[rid]["lps"]], rid
        assert [lp for lp, _ in on[rid]["lps"]] == pytest.approx([lp for lp, _ in off[rid]["lps"]]), rid
        assert on[rid]["in_lps"] == off[rid]["in_lps"], rid
    assert any(d["finish"]["type"] == "stop" for d in off.values())  # stop tokens really fired


def test_overlap_retraction_and_aborts_match():
    """A pool too small for the workload (retraction) plus aborts at fixed steps."""
    results = {}
    for overlap in (False, True):
        s, runner = make(overlap, max_total_tokens=160, chunked_prefill_size=-1)
        try:
            for i in range(6):
                submit(s, f"r{i}", [5 + i] * 12, max_new_tokens=45, ignore_eos=True)
            submit(s, "gone", [9, 9, 9], max_new_tokens=45, ignore_eos=True)
            res = run_all(s, on_step=lambda k: k == 6 and s.abort(AbortReq(rid="gone")))
            results[overlap] = res
            assert kv_all_returned(s, runner)
        finally:
            s.close()
    for rid in results[False]:
        if rid != "gone":
            assert results[True][rid] == results[False][rid], rid
            assert len(results[False][rid]["ids"]) == 45
    assert results[True]["gone"]["finish"]["type"] == "abort"


@pytest.mark.parametrize("page_size", [1, 4])
def test_finished_requests_leave_the_same_cache(page_size):
    """A request that stops on a stop token was already decoded once more by the next batch; that
    token's KV is dropped, so the prefix cache holds exactly what it holds without overlap (same tree
    size, same later cache hit)."""
    prompt = [7 + i for i in range(21)]
    s, _ = make(False)
    submit(s, "x", prompt, max_new_tokens=30, ignore_eos=True)
    free_run = run_all(s)
    s.close()
    ids = free_run["x"]["ids"]
    stop_at = next(i for i in range(6, 30) if ids[i] not in ids[:i])
    seen = {}
    for overlap in (False, True):
        s, runner = make(overlap, page_size=page_size)
        try:
            submit(s, "a", prompt, stop_token_ids=[ids[stop_at]], ignore_eos=True)
            first = run_all(s)
            size = s.tree_cache.total_size()
            submit(s, "b", prompt + first["a"]["ids"] + [11], max_new_tokens=3, ignore_eos=True)
            second = run_all(s)
            seen[overlap] = (first["a"]["ids"], first["a"]["finish"], size, second["b"]["cached"], second["b"]["ids"])
            assert kv_all_returned(s, runner)
        finally:
            s.close()
    assert seen[True] == seen[False]
    assert seen[False][0] == ids[:stop_at + 1] and seen[False][1]["type"] == "stop"
    assert seen[False][2] == (21 + stop_at) // page_size * page_size  # the stop token has no KV


def test_step_returns_before_the_forward_finishes():
    """The point of overlap: step() launches and returns; the forward runs meanwhile."""

    class Slow(FakeRunner):
        gate = threading.Event()

        def forward(self, batch):
            assert self.gate.wait(30)
            return super().forward(batch)

    runner = Slow()
    s = Scheduler(ServerArgs(), runner, None, overlap=True)
    try:
        submit(s, "a", [5, 6, 7], max_new_tokens=4, ignore_eos=True)
        assert s.step() == [] and s.inflight is not None and runner.num_batches == 0
        runner.gate.set()
        res = run_all(s)
        assert len(res["a"]["ids"]) == 4 and runner.num_batches == 4
    finally:
        runner.gate.set()
        s.close()


@pytest.fixture(scope="module")
def tokenizer():
    from sglang.srt.utils.common import get_tokenizer

    return get_tokenizer(shared_path("models", "stories260K"), False)


def test_grammar_requests_fall_back_and_match(tokenizer):
    pattern = r"(red|blue) (cat|dog) [0-9]{1,2}\."
    results = {}
    for overlap in (False, True):
        s, _ = make(overlap, tokenizer=tokenizer)
        try:
            for i, p in enumerate(["Once upon a time", "The little dog", "One day, a bird"]):
                ids = tokenizer.encode(p)
                submit(s, f"u{i}", ids, max_new_tokens=25)
                submit(s, f"s{i}", ids, max_new_tokens=25, temperature=1.0, seed=i, stop=["."])
                submit(s, f"g{i}", ids, regex=pattern, temperature=1.0, seed=i)
            results[overlap] = run_all(s)
        finally:
            s.close()
            s.grammar_backend.shutdown()
    for rid, d in results[False].items():  # (cache hits depend on when each grammar compiled)
        assert (results[True][rid]["ids"], results[True][rid]["finish"]) == (d["ids"], d["finish"]), rid
    for i in range(3):
        text = tokenizer.decode([t for t in results[True][f"g{i}"]["ids"] if t != EOS], skip_special_tokens=True)
        assert re.fullmatch(pattern, text), text
