"""DP attention's step agreement inside real :class:`Scheduler` s (one thread per DP rank, the fake KV-checking runner
of ``test_scheduler.py``, the agreement's all-gather over a thread barrier): every rank launches a forward at every
step where any rank has tokens (an idle batch when it has none), never otherwise; every rank sees the same agreed
steps; chunked prefill, mixed batches, requests joining mid-decode, retraction and aborts stay per rank and exact;
with overlap scheduling too."""

from __future__ import annotations

import threading

import pytest
import torch

from sglang.srt.dp_attention.step_sync import DpStepSync
from sglang.srt.forward_batch_info import ForwardMode
from sglang.srt.managers.io_struct import AbortReq
from sglang.srt.managers.schedule_batch import ScheduleBatch
from sglang.srt.managers.scheduler import Scheduler
from sglang.srt.server_args import ServerArgs
from test_scheduler import FakeRunner, _LogitsOut, _SampleOut, assert_kv_returned, expected, record, submit


class ThreadExchange:
    """The agreement's all-gather between threads: each rank's triple, in rank order, to every rank."""

    def __init__(self, n: int):
        self.slots: list = [None] * n
        self.barrier = threading.Barrier(n, timeout=60)

    def for_rank(self, r: int):
        def exchange(mine: list) -> list:
            self.slots[r] = list(mine)
            self.barrier.wait()
            out = [list(s) for s in self.slots]
            self.barrier.wait()  # nobody overwrites a slot before everyone read
            return out

        return exchange


class FakeDpRank:
    """The scheduler's view of a DP rank (``runner.dp_attention``): lockstep, and a step sync over the exchange."""

    def __init__(self, rank: int, size: int, exchange):
        self.dp_rank, self.dp_size, self.lockstep, self._exchange = rank, size, True, exchange

    def step_sync(self, graph_size, low_latency_capacity=None):
        return DpStepSync(self.dp_rank, self.dp_size, exchange=self._exchange, graph_size=graph_size,
                          low_latency_capacity=low_latency_capacity)


class DpFakeRunner(FakeRunner):
    """FakeRunner that accepts idle batches and records every launched batch's mode and agreed step."""

    def __init__(self, *a, dp=None, **kw):
        super().__init__(*a, **kw)
        self.dp_attention, self.cuda_graph_runner = dp, None
        self.launched: list = []

    def forward(self, batch):
        self.launched.append((batch.forward_mode, len(batch.input_ids), batch.dp_step))
        if batch.forward_mode == ForwardMode.IDLE:
            assert batch.batch_size == 0 and batch.dp_step is not None and batch.dp_step.runs_forward
            return _LogitsOut(), _SampleOut(torch.empty(0, dtype=torch.int64))
        return super().forward(batch)


@pytest.fixture(params=[False, True], ids=["sync", "overlap"])
def overlap(request, monkeypatch):
    orig = ScheduleBatch.to_model_worker_batch

    def tagged(self):  # the snapshot FakeRunner checks each batch against (see test_scheduler.py)
        mwb = orig(self)
        mwb.fake_prompts = [tuple(r.origin_input_ids) for r in self.reqs]
        mwb.fake_rows = [self.fake_r2t[r.req_pool_idx, :n].long().clone() for r, n in zip(self.reqs, mwb.seq_lens)]
        return mwb

    monkeypatch.setattr(ScheduleBatch, "to_model_worker_batch", tagged)
    return request.param


def make_ranks(n: int, overlap: bool, kv_tokens=(4096,), **kw):
    ex = ThreadExchange(n)
    ranks = []
    for r in range(n):
        runner = DpFakeRunner(kv_tokens[r % len(kv_tokens)], dp=FakeDpRank(r, n, ex.for_rank(r)),
                              **{k: kw.pop(k) for k in ("max_running",) if k in kw})
        s = Scheduler(ServerArgs(**kw), runner, tokenizer=None, overlap=overlap)
        orig = s.get_next_batch

        def get_next_batch(orig=orig, runner=runner):
            b = orig()
            if b is not None:
                b.fake_r2t = runner.req_to_token_pool.req_to_token
            return b

        s.get_next_batch = get_next_batch
        ranks.append((s, runner))
    return ranks


def run_ranks(ranks, before_step=None, max_steps=5000) -> list:
    """Step every rank in its own thread until an agreement says nobody has work; ``before_step(rank, i, s)`` runs
    on rank's thread before its i-th step (submits, aborts). Returns per rank ``{rid: result}``."""
    results = [dict() for _ in ranks]
    errors = []

    def loop(r: int) -> None:
        s, _ = ranks[r]
        try:
            for i in range(max_steps):
                if before_step is not None:
                    before_step(r, i, s)
                record(results[r], s.step())
                if i > 0 and not s.dp_sync.peers_busy:
                    return
            raise AssertionError(f"rank {r} did not drain")
        except BaseException as e:  # noqa: BLE001 - reported below (a failed rank breaks the others' barrier)
            errors.append((r, e))

    threads = [threading.Thread(target=loop, args=(r,), daemon=True) for r in range(len(ranks))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert not any(t.is_alive() for t in threads), "a rank hung"
    for s, _ in ranks:
        s.close()
    return results


def check_lockstep(ranks) -> None:
    """Every rank launched the same number of forwards, each with the same agreed step, its own token count in it,
    and an idle batch exactly where it had no tokens."""
    launched = [runner.launched for _, runner in ranks]
    assert len({len(x) for x in launched}) == 1, [len(x) for x in launched]
    for step_i in range(len(launched[0])):
        steps = {x[step_i][2] for x in launched}
        assert len(steps) == 1, steps
        step = steps.pop()
        for r, x in enumerate(launched):
            mode, tokens, _ = x[step_i]
            assert tokens == step.num_tokens[r]
            assert (mode == ForwardMode.IDLE) == (tokens == 0)


def test_one_request_on_four_ranks_three_idle(overlap):
    ranks = make_ranks(4, overlap)
    submit(ranks[2][0], "only", [5, 6, 7, 8], max_new_tokens=12)
    res = run_ranks(ranks)
    assert res[2]["only"]["ids"] == expected([5, 6, 7, 8], 12)
    check_lockstep(ranks)
    for r in (0, 1, 3):
        modes = [m for m, _, _ in ranks[r][1].launched]
        assert modes and set(modes) == {ForwardMode.IDLE}
        assert ranks[r][0].dp_sync.idle_forwards == len(modes)
    for s, runner in ranks:
        assert_kv_returned(s, runner)


def test_mixed_chunked_joining_retraction_and_abort_per_rank(overlap):
    # rank 0: chunked prefill (16), a request joins mid-decode (a mixed batch); rank 1: a KV pool so small that it
    # retracts; rank 1 also aborts a request in flight. Outputs exact, every forward matched.
    ranks = make_ranks(2, overlap, kv_tokens=(4096, 96), chunked_prefill_size=16)
    long_p, late_p = list(range(3, 60)), [7, 8, 9]
    small = {f"s{i}": [10 + i] * 8 for i in range(5)}
    reqs: dict = {}

    def before(r, i, s):
        if r == 0 and i == 0:
            submit(s, "long", long_p, max_new_tokens=30)
        if r == 0 and i == 8:
            submit(s, "late", late_p, max_new_tokens=10)
        if r == 1 and i == 0:
            for rid, p in small.items():
                reqs[rid] = submit(s, rid, p, max_new_tokens=30)
            submit(s, "victim", [4, 4, 4], max_new_tokens=200)
        if r == 1 and i == 6:
            s.abort(AbortReq(rid="victim"))

    res = run_ranks(ranks, before)
    assert res[0]["long"]["ids"] == expected(long_p, 30) and res[0]["late"]["ids"] == expected(late_p, 10)
    assert any(m == ForwardMode.MIXED for m, _, _ in ranks[0][1].launched)
    for rid, p in small.items():
        assert res[1][rid]["ids"] == expected(p, 30), rid
    assert sum(req.num_retractions for req in reqs.values()) > 0  # 5 x (8 + 30) tokens in a 96-token pool
    assert res[1]["victim"]["finish"]["type"] == "abort"
    assert len(res[1]["victim"]["ids"]) < 200
    check_lockstep(ranks)
    for s, runner in ranks:
        assert_kv_returned(s, runner)


def test_nobody_with_work_means_no_forward_and_the_loops_may_block(overlap):
    ranks = make_ranks(2, overlap)
    res = run_ranks(ranks)
    assert res == [{}, {}]
    for s, runner in ranks:
        assert runner.launched == [] and s.dp_sync.steps >= 1 and s.may_block()
