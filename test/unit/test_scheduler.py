"""Scheduler tests with a fake model runner that checks the KV bookkeeping.

The fake "KV cache" stores, at each KV slot, the token id whose KV it holds.
Before every step it checks that each request's ``req_to_token`` row points
at slots holding exactly that request's tokens (so a wrong prefix share, a
chunk boundary bug or a retraction that loses KV is caught), and it "samples"
a deterministic function of the sequence, so outputs are checkable.

Every scenario runs with overlap scheduling off and on (``overlap`` fixture): with overlap the
fake runner is called on the overlap worker's thread while the scheduler already builds the next
batch, so it checks each batch against a snapshot taken when the batch was built (the request's
prompt and its ``req_to_token`` row) and against the request's true sequence (prompt + the fake
model's greedy continuation), never against live scheduler state.
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass
from typing import Optional

import pytest
import torch

from sglang.srt.disaggregation.connector import FinishRequest, KVConnector, QueueRequest, StartDecode
from sglang.srt.managers.io_struct import AbortReq, TokenizedGenerateReqInput
from sglang.srt.managers.schedule_batch import ScheduleBatch
from sglang.srt.managers.scheduler import Scheduler
from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
from sglang.srt.mem_cache.kv_cache import KVCache
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
from sglang.srt.forward_batch_info import ForwardMode
from sglang.srt.server_args import ServerArgs

VOCAB = 97


def next_token(seq: list[int]) -> int:
    """The fake model's greedy choice: a hash of the whole sequence (depends on every token)."""
    h = 7
    for t in seq:
        h = (h * 31 + t) % 1_000_003
    return h % (VOCAB - 3) + 3  # never 0..2 (2 is EOS)


@dataclass
class _ModelConfig:
    context_len: int = 256
    vocab_size: int = VOCAB
    eos_token_ids: tuple = (2,)


@dataclass
class _SampleOut:
    next_token_ids: torch.Tensor
    logprobs: Optional[torch.Tensor] = None
    top_logprobs: Optional[list] = None


@dataclass
class _LogitsOut:
    input_token_logprobs: Optional[list] = None
    input_top_logprobs: Optional[list] = None


@functools.lru_cache(maxsize=None)
def true_sequence(prompt: tuple[int, ...], total: int) -> list[int]:
    """The prompt followed by the fake model's greedy continuation, ``total`` tokens in all."""
    return list(prompt) + expected(list(prompt), max(total - len(prompt), 0))


class FakeRunner:
    def __init__(self, max_total_tokens: int, max_running: int = 64, page_size: int = 1, context_len: int = 256,
                 disable_radix_cache: bool = False):
        self.model_config = _ModelConfig(context_len=context_len)
        self.max_total_tokens = max_total_tokens
        self.max_running_requests = max_running
        self.req_to_token_pool = ReqToTokenPool(max_running + 1, context_len + 8, "cpu")
        self.allocator = TokenToKVPoolAllocator(max_total_tokens, page_size, "cpu")
        self.kv_cache = KVCache(self.req_to_token_pool, None, self.allocator, disable_radix_cache)
        self.device, self.tp_size, self.parallel_state = torch.device("cpu"), 1, None
        self.kv = torch.full((max_total_tokens + 2 * page_size,), -1, dtype=torch.int64)
        self.batches: list = []

    def make_sampling_info(self, reqs):
        return None

    def forward(self, batch):
        self.batches.append(batch)
        total = self.model_config.context_len + 8
        off = 0
        out = []
        for i, row in enumerate(batch.req_pool_indices):
            truth = true_sequence(batch.fake_prompts[i], total)
            r2t_row = batch.fake_rows[i]
            pre, ext = batch.prefix_lens[i], batch.extend_lens[i]
            # every prefix slot must hold the request's own earlier tokens
            held = self.kv[r2t_row[:pre]].tolist()
            assert held == truth[:pre], f"row {row}: prefix KV holds {held[:8]}.. expected {truth[:8]}.."
            new = batch.input_ids[off:off + ext]
            assert new == truth[pre:pre + ext], f"row {row}: inputs {new} expected {truth[pre:pre + ext]}"
            assert batch.positions[off:off + ext] == list(range(pre, pre + ext))
            locs = batch.out_cache_loc[off:off + ext]
            assert torch.equal(r2t_row[pre:pre + ext], locs.long())
            self.kv[locs] = torch.tensor(new)
            out.append(next_token(held + new))
            off += ext
        assert off == len(batch.input_ids)
        return _LogitsOut(), _SampleOut(torch.tensor(out))


@pytest.fixture(autouse=True, params=[False, True], ids=["sync", "overlap"])
def overlap(request, monkeypatch):
    """Run the test with overlap scheduling off and on; tag each worker batch with its snapshot."""
    orig = ScheduleBatch.to_model_worker_batch

    def tagged(self):
        mwb = orig(self)
        mwb.fake_prompts = [tuple(r.origin_input_ids) for r in self.reqs]
        mwb.fake_rows = [self.fake_r2t[r.req_pool_idx, :n].long().clone() for r, n in zip(self.reqs, mwb.seq_lens)]
        return mwb

    monkeypatch.setattr(ScheduleBatch, "to_model_worker_batch", tagged)
    _MODE["overlap"] = request.param
    schedulers: list = []
    _MODE["made"] = schedulers
    yield request.param
    for s in schedulers:
        s.close()


_MODE: dict = {"overlap": False, "made": []}


def make(max_total_tokens=4096, **kw) -> tuple[Scheduler, FakeRunner]:
    runner_kw = {k: kw.pop(k) for k in ("max_running", "context_len") if k in kw}
    args = ServerArgs(**kw)
    runner = FakeRunner(max_total_tokens, page_size=args.page_size, disable_radix_cache=args.disable_radix_cache,
                        **runner_kw)
    s = Scheduler(args, runner, tokenizer=None, overlap=_MODE["overlap"])
    _MODE["made"].append(s)
    orig = s.get_next_batch

    def get_next_batch():  # lets the snapshot read req_to_token
        b = orig()
        if b is not None:
            b.fake_r2t = runner.req_to_token_pool.req_to_token
        return b

    s.get_next_batch = get_next_batch
    return s, runner


def submit(s: Scheduler, rid: str, prompt: list[int], max_new_tokens=8, stream=False, **sp):
    params = {"max_new_tokens": max_new_tokens, "temperature": 0.0, **sp}
    return s.add_request(TokenizedGenerateReqInput(rid=rid, input_ids=prompt, sampling_params=params, stream=stream))


def record(results: dict, outs) -> None:
    for out in outs:
        for i, rid in enumerate(out.rids):
            d = results.setdefault(rid, {"ids": [], "finish": None, "cached": 0})
            d["ids"].extend(out.output_ids[i])
            d["finish"] = out.finished_reasons[i]
            d["cached"] = out.cached_tokens[i]


def run_all(s: Scheduler, max_steps=10_000, results=None) -> dict[str, dict]:
    results = {} if results is None else results
    for _ in range(max_steps):
        record(results, s.step())
        if not s.has_work():
            return results
    raise AssertionError("scheduler did not drain")


def expected(prompt: list[int], n: int) -> list[int]:
    seq = list(prompt)
    out = []
    for _ in range(n):
        t = next_token(seq)
        out.append(t)
        seq.append(t)
    return out


def assert_kv_returned(s: Scheduler, runner: FakeRunner):
    s.tree_cache.reset()
    assert runner.allocator.available_size() == runner.max_total_tokens - runner.max_total_tokens % runner.allocator.page_size
    assert runner.req_to_token_pool.available_size() == runner.max_running_requests + 1


def rand_prompt(rng, n):
    return [rng.randrange(3, VOCAB) for _ in range(n)]


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("radix", [True, False])
def test_many_requests_exact_outputs(page_size, radix):
    rng = random.Random(page_size * 10 + radix)
    s, runner = make(page_size=page_size, disable_radix_cache=not radix)
    shared = rand_prompt(rng, 40)
    prompts = {f"r{i}": (shared[: rng.randrange(0, 40)] + rand_prompt(rng, rng.randrange(1, 30))) for i in range(20)}
    for rid, p in prompts.items():
        submit(s, rid, p, max_new_tokens=rng.randrange(1, 12))
    res = run_all(s)
    for rid, p in prompts.items():
        n = len(res[rid]["ids"])
        assert res[rid]["finish"]["type"] == "length"
        assert res[rid]["ids"] == expected(p, n)
    assert_kv_returned(s, runner)


def test_prefix_cache_hit_reported():
    s, runner = make()
    p = list(range(3, 50))
    submit(s, "a", p, max_new_tokens=3)
    run_all(s)
    submit(s, "b", p + [5, 6], max_new_tokens=3)
    res = run_all(s)
    assert res["b"]["cached"] >= len(p) - 1
    assert res["b"]["ids"] == expected(p + [5, 6], 3)
    assert_kv_returned(s, runner)


def test_chunked_prefill_splits_and_matches():
    s, runner = make(chunked_prefill_size=16)
    p = list(range(3, 90))
    submit(s, "long", p, max_new_tokens=5)
    submit(s, "short", [5, 6, 7], max_new_tokens=5)
    res = run_all(s)
    extends = [b.extend_lens for b in runner.batches]
    assert all(sum(e) <= 16 for e in extends), extends
    assert sum(1 for b in runner.batches if b.forward_mode != ForwardMode.DECODE) >= 5
    assert res["long"]["ids"] == expected(p, 5)
    assert res["short"]["ids"] == expected([5, 6, 7], 5)
    assert_kv_returned(s, runner)


def test_mixed_batches_happen():
    s, runner = make(chunked_prefill_size=32)
    submit(s, "a", [3, 4, 5], max_new_tokens=20)
    res: dict = {}
    record(res, s.step())
    record(res, s.step())
    submit(s, "b", list(range(3, 40)), max_new_tokens=4)
    res = run_all(s, results=res)
    assert any(b.forward_mode == ForwardMode.MIXED for b in runner.batches)
    assert res["a"]["ids"] == expected([3, 4, 5], 20)
    assert_kv_returned(s, runner)


def test_retraction_when_kv_runs_out():
    # 6 requests x (10 prompt + 40 output) need 300 slots; the pool has 128.
    s, runner = make(max_total_tokens=128, chunked_prefill_size=-1)
    prompts = {f"r{i}": [3 + i] * 10 for i in range(6)}
    for rid, p in prompts.items():
        submit(s, rid, p, max_new_tokens=40)
    res = run_all(s)
    for rid, p in prompts.items():
        assert res[rid]["ids"] == expected(p, 40), rid
    assert_kv_returned(s, runner)


def test_retraction_counted():
    s, runner = make(max_total_tokens=96, chunked_prefill_size=-1)
    reqs = [submit(s, f"r{i}", [10 + i] * 8, max_new_tokens=30) for i in range(5)]
    res = run_all(s)
    assert sum(r.num_retractions for r in reqs) > 0
    for i, r in enumerate(reqs):
        assert res[r.rid]["ids"] == expected([10 + i] * 8, 30)
    assert_kv_returned(s, runner)


def test_abort_frees_kv_immediately():
    s, runner = make()
    submit(s, "a", list(range(3, 30)), max_new_tokens=100)
    submit(s, "b", list(range(3, 20)), max_new_tokens=100)
    submit(s, "c", [4, 5], max_new_tokens=100)
    for _ in range(3):
        s.step()
    s.abort(AbortReq(rid="a"))
    s.abort(AbortReq(rid="c"))
    outs = s.collect_outputs()
    fin = {rid: fr for o in outs for rid, fr in zip(o.rids, o.finished_reasons)}
    assert fin["a"]["type"] == "abort" and fin["c"]["type"] == "abort"
    assert [r.rid for r in s.running] == ["b"]
    s.abort(AbortReq(abort_all=True))
    assert not s.has_work()
    assert_kv_returned(s, runner)


def test_invalid_requests_rejected_without_leak():
    s, runner = make(context_len=64)
    r1 = submit(s, "long", list(range(3, 80)))
    r2 = submit(s, "badtok", [5, VOCAB + 3])
    r3 = submit(s, "empty", [])
    outs = s.collect_outputs()
    fin = {rid: fr for o in outs for rid, fr in zip(o.rids, o.finished_reasons)}
    assert "context length" in fin["long"]["message"] and fin["long"]["status_code"] == 400
    assert "outside" in fin["badtok"]["message"]
    assert "empty" in fin["empty"]["message"]
    assert not s.has_work()
    assert_kv_returned(s, runner)


def test_output_capped_by_context():
    s, runner = make(context_len=40)
    submit(s, "a", list(range(3, 33)), max_new_tokens=100)
    res = run_all(s)
    assert len(res["a"]["ids"]) == 10 and res["a"]["finish"]["type"] == "length"
    assert_kv_returned(s, runner)


def test_stop_token_and_eos():
    s, runner = make()
    p = [3, 4, 5]
    exp = expected(p, 10)
    submit(s, "a", p, max_new_tokens=10, stop_token_ids=[exp[3]])
    res = run_all(s)
    assert res["a"]["ids"] == exp[:4]
    assert res["a"]["finish"] == {"type": "stop", "matched": exp[3]}


def test_lpm_prefers_cached_prefix():
    s, runner = make(schedule_policy="lpm", max_running=1)
    base = list(range(3, 60))
    submit(s, "warm", base, max_new_tokens=1)
    run_all(s)
    submit(s, "cold", list(range(60, 90)), max_new_tokens=1)
    submit(s, "hot", base + [7], max_new_tokens=1)
    s.step()
    s.sync()  # with overlap the batch may still be running
    first = runner.batches[-1]
    # the request sharing the cached prefix is admitted first, extending only its new tokens
    assert first.prefix_lens[0] >= len(base) - 1
    run_all(s)
    assert_kv_returned(s, runner)


def test_streaming_sends_every_token():
    s, runner = make()
    submit(s, "a", [3, 4], max_new_tokens=5, stream=True)
    deltas = []
    while s.has_work():
        for o in s.step():
            deltas.append(o.output_ids[0])
    assert [len(d) for d in deltas] == [1] * 5
    assert sum(deltas, []) == expected([3, 4], 5)


def test_fuzz_random_workload():
    rng = random.Random(1234)
    for trial in range(4):
        s, runner = make(max_total_tokens=rng.choice([80, 160, 400]), page_size=rng.choice([1, 2, 4]),
                         chunked_prefill_size=rng.choice([8, 32, -1]), schedule_policy=rng.choice(["fcfs", "lpm"]))
        shared = rand_prompt(rng, 30)
        prompts, aborted, results = {}, set(), {}
        for step in range(150):
            if rng.random() < 0.2 and len(prompts) < 25:
                rid = f"t{trial}-{len(prompts)}"
                p = shared[: rng.randrange(0, 30)] + rand_prompt(rng, rng.randrange(1, 20))
                prompts[rid] = (p, rng.randrange(1, 25))
                submit(s, rid, p, max_new_tokens=prompts[rid][1])
            if rng.random() < 0.03 and prompts:
                rid = rng.choice(list(prompts))
                aborted.add(rid)
                s.abort(AbortReq(rid=rid))
            record(results, s.step())
        res = run_all(s, results=results)
        for rid, (p, n) in prompts.items():
            if rid in aborted:
                continue
            assert res[rid]["ids"] == expected(p, n), rid
        assert_kv_returned(s, runner)


def test_max_new_tokens_zero_generates_nothing():
    s, runner = make()
    submit(s, "score", [3, 4, 5, 6], max_new_tokens=0)
    res = run_all(s)
    assert res["score"]["ids"] == [] and res["score"]["finish"] == {"type": "length", "length": 0}
    assert_kv_returned(s, runner)


def test_non_stream_reports_first_token_then_final_only():
    s, runner = make()
    submit(s, "a", [3, 4, 5, 6], max_new_tokens=12)
    deliveries = []
    for _ in range(1000):
        for out in s.step():
            for i, rid in enumerate(out.rids):
                deliveries.append((len(out.output_ids[i]), out.finished_reasons[i] is not None))
        if not s.has_work():
            break
    s.sync()
    for out in s.collect_outputs():
        for i, rid in enumerate(out.rids):
            deliveries.append((len(out.output_ids[i]), out.finished_reasons[i] is not None))
    # the first token alone (it times TTFT), then everything else with the finish
    assert deliveries == [(1, False), (11, True)], deliveries
    assert_kv_returned(s, runner)


def test_retracted_request_is_not_readmitted_into_a_thrash():
    # two requests of 10 + 220 tokens in a 400-token pool: one retraction is unavoidable, but the
    # retracted request must not come back (chunk by chunk) before the other has room to finish
    s, runner = make(400, max_running=2, context_len=256, chunked_prefill_size=16, disable_radix_cache=True)
    prompts = {"a": list(range(3, 13)), "b": list(range(20, 30))}
    reqs = [submit(s, rid, p, max_new_tokens=220, ignore_eos=True) for rid, p in prompts.items()]
    res = run_all(s)
    for rid, p in prompts.items():
        assert res[rid]["ids"] == expected(p, 220), rid
    assert sum(r.num_retractions for r in reqs) <= 1, [r.num_retractions for r in reqs]
    assert_kv_returned(s, runner)


# ---- the PD connector contract: the scheduler carries out the connector's decisions ------------------------------
class _ScriptedConnector(KVConnector):
    """A decode-side stand-in: keeps every ``pd-*`` request, and at the next poll "receives" its prompt KV
    (allocates a row and slots and writes the fake KV, as a transfer would) and returns StartDecode; ``fail-*``
    requests fail instead (FinishRequest, no KV); other requests are queued as aggregated ones."""

    def __init__(self, kv, runner):
        self.kv, self.runner, self.held = kv, runner, []

    def intercept(self, req, msg):
        if req.rid.startswith(("pd-", "fail-")):
            self.held.append(req)
            return []
        return [QueueRequest(req)]

    def poll(self):
        out = []
        for req in self.held:
            if req.rid.startswith("fail-"):
                req.finished_reason = {"type": "abort", "message": "KV transfer failed", "status_code": 500}
                out.append(FinishRequest(req))
                continue
            n = len(req.origin_input_ids)
            row = self.kv.alloc_req_slot()
            loc = self.kv.alloc_extend([row], [0], [n], [-1])
            self.runner.kv[loc] = torch.tensor(req.origin_input_ids)
            req.req_pool_idx, req.kv_len, req.admitted_once = row, n, True
            req.output_ids.append(next_token(list(req.origin_input_ids)))
            out.append(StartDecode(req, prompt_tokens=n, cached_tokens=0))
        self.held = []
        return out

    def before_forward(self, batch, mwb):
        pass

    def during_forward(self, forward_done):
        pass

    def hold(self, req):
        return False

    def abort(self, rid):
        return []

    def open_rids(self):
        return [r.rid for r in self.held]

    def has_work(self):
        return bool(self.held)

    def internal_state(self):
        return {}

    def close(self):
        pass


def test_connector_decisions_drive_the_scheduler():
    """Requests whose prompt KV "arrives" through the connector (StartDecode) decode exactly as if prefilled here
    and count their prompt tokens; a failed hand-off (FinishRequest) is reported with its error; aggregated
    requests (QueueRequest) run normally; every KV slot comes back."""
    s, runner = make(max_total_tokens=512)
    s.disagg = _ScriptedConnector(s.kv, runner)
    rng = random.Random(5)
    prompts = {rid: rand_prompt(rng, 9 + i) for i, rid in enumerate(["pd-a", "pd-b", "agg-c", "fail-d"])}
    for rid, p in prompts.items():
        submit(s, rid, p, max_new_tokens=6)
    out = run_all(s)
    for rid in ("pd-a", "pd-b", "agg-c"):
        assert out[rid]["ids"] == expected(prompts[rid], 6), rid
        assert out[rid]["finish"]["type"] == "length"
    assert out["fail-d"]["finish"]["type"] == "abort" and "KV transfer failed" in out["fail-d"]["finish"]["message"]
    assert out["fail-d"]["ids"] == []
    assert s.stats_prompt_tokens >= len(prompts["pd-a"]) + len(prompts["pd-b"])
    assert_kv_returned(s, runner)


def test_unknown_connector_decision_is_refused():
    s, _ = make()
    with pytest.raises(TypeError, match="unknown connector decision"):
        s.apply_connector(["carry on"])
