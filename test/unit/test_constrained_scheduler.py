"""The scheduler's grammar path with a fake model: random logits per sequence, the real
``ModelRunner.make_sampling_info``, ``SamplingBatchInfo`` and ``Sampler``, and xgrammar on the
stories260K tokenizer."""

from __future__ import annotations

import json
import os
import re
import sys
import threading
from dataclasses import dataclass
from typing import Optional

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from conftest import shared_path  # noqa: E402

from sglang.srt.constrained.xgrammar_backend import XGrammarBackend  # noqa: E402
from sglang.srt.layers.sampler import Sampler  # noqa: E402
from sglang.srt.managers.io_struct import AbortReq, TokenizedGenerateReqInput  # noqa: E402
from sglang.srt.managers.scheduler import Scheduler  # noqa: E402
from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
from sglang.srt.mem_cache.kv_cache import KVCache  # noqa: E402
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool  # noqa: E402
from sglang.srt.model_executor.model_runner import ModelRunner  # noqa: E402
from sglang.srt.server_args import ServerArgs  # noqa: E402

VOCAB = 512
EOS = 2


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
    """[VOCAB] float32 logits that depend on the whole sequence (seeded by its hash)."""
    h = 7
    for t in seq:
        h = (h * 1_000_003 + t) % (1 << 61)
    return torch.randn(VOCAB, generator=torch.Generator().manual_seed(h)) * 3


class FakeRunner:
    """Pools + the real make_sampling_info and Sampler; logits come from :func:`fake_logits`."""

    def __init__(self, max_total_tokens: int = 8192, max_running: int = 32, disable_radix_cache: bool = False):
        self.model_config = _ModelConfig()
        self.device = torch.device("cpu")
        self.max_total_tokens = max_total_tokens
        self.max_running_requests = max_running
        self.req_to_token_pool = ReqToTokenPool(max_running + 1, 520, "cpu")
        self.allocator = TokenToKVPoolAllocator(max_total_tokens, 1, "cpu")
        self.kv_cache = KVCache(self.req_to_token_pool, None, self.allocator, disable_radix_cache)
        self.device, self.tp_size, self.parallel_state = torch.device("cpu"), 1, None
        self.sampler = Sampler(0, "cpu")
        self.batch_sizes: list[int] = []
        self.masked_batches = 0
        self.scheduler: Optional[Scheduler] = None

    make_sampling_info = ModelRunner.make_sampling_info

    def forward(self, batch):
        off, rows = 0, []
        reqs = {r.req_pool_idx: r for r in self._live()}
        for i, idx in enumerate(batch.req_pool_indices):
            r = reqs[idx]
            rows.append(fake_logits(r.fill_ids[: batch.seq_lens[i]]))
            off += batch.extend_lens[i]
        self.batch_sizes.append(len(rows))
        self.masked_batches += batch.sampling_info.vocab_mask is not None
        out = self.sampler.forward(torch.stack(rows), batch.sampling_info)
        return _LogitsOut(), out

    def _live(self):
        s = self.scheduler
        return list(s.running) + ([s.chunked_req] if s.chunked_req else []) + self._admitting

    _admitting: list = []


@pytest.fixture(scope="module")
def tokenizer():
    from sglang.srt.utils.common import get_tokenizer

    return get_tokenizer(shared_path("models", "stories260K"), False)


def make(tokenizer, backend=None, **kw):
    runner = FakeRunner()
    s = Scheduler(ServerArgs(**kw), runner, tokenizer, grammar_backend=backend)
    runner.scheduler = s
    orig = s.get_next_batch

    def get_next_batch():
        b = orig()
        runner._admitting = list(b.reqs) if b else []
        return b

    s.get_next_batch = get_next_batch
    return s, runner


def submit(s, tokenizer, rid, prompt, **sp):
    params = {"max_new_tokens": 60, "temperature": 0.0, **sp}
    return s.add_request(TokenizedGenerateReqInput(rid=rid, input_ids=tokenizer.encode(prompt),
                                                   sampling_params=params))


def run_all(s, results=None, max_steps=5000):
    results = {} if results is None else results
    for _ in range(max_steps):
        for out in s.step():
            for i, rid in enumerate(out.rids):
                d = results.setdefault(rid, {"ids": [], "finish": None})
                d["ids"].extend(out.output_ids[i])
                d["finish"] = out.finished_reasons[i]
        if not s.has_work():
            return results
    raise AssertionError("scheduler did not drain")


def text(tokenizer, ids):
    return tokenizer.decode([t for t in ids if t != EOS], skip_special_tokens=True)


PATTERN = r"(red|blue) (cat|dog) [0-9]{1,2}\."


def test_regex_and_json_requests_match_and_finish_on_eos(tokenizer):
    s, runner = make(tokenizer)
    schema = {"type": "object", "properties": {"k": {"type": "integer", "minimum": 1, "maximum": 50}},
              "required": ["k"], "additionalProperties": False}
    submit(s, tokenizer, "greedy", "Once upon a time", regex=PATTERN)
    for seed in range(3):
        submit(s, tokenizer, f"seed{seed}", "Once upon a time", regex=PATTERN, temperature=1.0, seed=seed)
        submit(s, tokenizer, f"json{seed}", "The dog", json_schema=json.dumps(schema), temperature=1.0,
               seed=seed, max_new_tokens=200)
    res = run_all(s)
    for rid, d in res.items():
        assert d["finish"] == {"type": "stop", "matched": EOS}, (rid, d)
        assert d["ids"][-1] == EOS
        if rid.startswith("json"):
            assert 1 <= json.loads(text(tokenizer, d["ids"]))["k"] <= 50
        else:
            assert re.fullmatch(PATTERN, text(tokenizer, d["ids"])), text(tokenizer, d["ids"])
    assert runner.masked_batches > 0


def test_mixed_batch_leaves_unconstrained_requests_unchanged(tokenizer):
    prompts = ["Once upon a time", "The little dog", "One day, a bird"]
    alone, _ = make(tokenizer)
    for i, p in enumerate(prompts):
        submit(alone, tokenizer, f"u{i}", p, max_new_tokens=30)
        submit(alone, tokenizer, f"s{i}", p, max_new_tokens=30, temperature=1.0, seed=i)
    ref = run_all(alone)
    mixed, runner = make(tokenizer)
    for i, p in enumerate(prompts):
        submit(mixed, tokenizer, f"u{i}", p, max_new_tokens=30)
        submit(mixed, tokenizer, f"s{i}", p, max_new_tokens=30, temperature=1.0, seed=i)
        submit(mixed, tokenizer, f"g{i}", p, regex=PATTERN, temperature=1.0, seed=i)
    got = run_all(mixed)
    for rid in ref:
        assert got[rid]["ids"] == ref[rid]["ids"], rid
    for i in range(len(prompts)):
        assert re.fullmatch(PATTERN, text(tokenizer, got[f"g{i}"]["ids"]))
    assert runner.masked_batches > 0 and max(runner.batch_sizes) >= 7  # they really shared batches


class GatedBackend(XGrammarBackend):
    """Compilation waits for ``gate`` (simulates a slow grammar)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.gate = threading.Event()

    def _compile(self, key):
        assert self.gate.wait(30)
        return super()._compile(key)


def test_slow_compilation_does_not_block_other_requests(tokenizer):
    backend = GatedBackend(tokenizer, VOCAB, [EOS])
    try:
        s, _ = make(tokenizer, backend=backend)
        submit(s, tokenizer, "slow", "Once upon a time", regex=PATTERN)
        submit(s, tokenizer, "plain", "The little dog", max_new_tokens=10, ignore_eos=True)
        res: dict = {}
        for _ in range(200):
            for out in s.step():
                for i, rid in enumerate(out.rids):
                    res.setdefault(rid, []).append(out.finished_reasons[i])
            if "plain" in res and res["plain"][-1] is not None:
                break
        assert res["plain"][-1]["type"] == "length"
        assert "slow" not in res and [r.rid for r in s.grammar_queue] == ["slow"]
        assert s.has_work() and s.internal_state()["num_grammar_queue_reqs"] == 1
        backend.gate.set()
        out = run_all(s)
        assert re.fullmatch(PATTERN, text(tokenizer, out["slow"]["ids"]))
    finally:
        backend.gate.set()
        backend.shutdown()


def test_abort_while_compiling(tokenizer):
    backend = GatedBackend(tokenizer, VOCAB, [EOS])
    try:
        s, _ = make(tokenizer, backend=backend)
        submit(s, tokenizer, "slow", "Once upon a time", regex=PATTERN)
        s.abort(AbortReq(rid="slow"))
        res = run_all(s)
        assert res["slow"]["finish"]["type"] == "abort" and not s.grammar_queue
    finally:
        backend.gate.set()
        backend.shutdown()


def test_invalid_grammar_reaching_the_scheduler_is_a_400(tokenizer):
    s, _ = make(tokenizer)
    submit(s, tokenizer, "bad", "Once upon a time", json_schema='{"type": "nope"}')
    submit(s, tokenizer, "ok", "Once upon a time", max_new_tokens=3, ignore_eos=True)
    res = run_all(s)
    assert res["bad"]["finish"]["status_code"] == 400 and "nope" in res["bad"]["finish"]["message"]
    assert res["ok"]["finish"]["type"] == "length"


def test_grammar_backend_none_rejects_constrained_requests(tokenizer):
    s, _ = make(tokenizer, grammar_backend="none")
    submit(s, tokenizer, "r", "Once upon a time", regex="a+")
    res = run_all(s)
    assert res["r"]["finish"]["status_code"] == 400 and "--grammar-backend" in res["r"]["finish"]["message"]


def test_grammar_wins_over_min_new_tokens_and_ignore_eos(tokenizer):
    s, _ = make(tokenizer)
    submit(s, tokenizer, "m", "Once upon a time", regex="[0-9]", min_new_tokens=5, temperature=1.0, seed=3)
    submit(s, tokenizer, "i", "Once upon a time", regex="(yes|no)", ignore_eos=True)
    res = run_all(s)
    for rid in ("m", "i"):
        assert res[rid]["finish"] == {"type": "stop", "matched": EOS}
    assert re.fullmatch("[0-9]", text(tokenizer, res["m"]["ids"]))
    assert text(tokenizer, res["i"]["ids"]) in ("yes", "no")


def test_length_limit_before_grammar_completes(tokenizer):
    s, _ = make(tokenizer)
    submit(s, tokenizer, "short", "Once upon a time", regex="[a-z ]{40,60}", max_new_tokens=3)
    res = run_all(s)
    assert res["short"]["finish"] == {"type": "length", "length": 3}
    assert re.fullmatch("[a-z ]*", text(tokenizer, res["short"]["ids"]))


def _agree_worker(rank: int, port: int, flags: list[list[bool]], out) -> None:
    import types

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        fake = types.SimpleNamespace(control_group=None, runner=types.SimpleNamespace(
            tp_size=2, parallel_state=types.SimpleNamespace(cpu_group=dist.group.WORLD)))
        out.put((rank, Scheduler._agree_ready(fake, flags[rank])))
    finally:
        dist.destroy_process_group()


def test_tp_ranks_agree_on_ready_grammars():
    """A request leaves the grammar queue only when its grammar is ready on every TP rank."""
    import torch.multiprocessing as tmp

    from sglang.srt.utils.common import free_tcp_ports

    port = free_tcp_ports(1)[0]  # below the ephemeral range: no connect() of a parallel test worker takes it
    flags = [[True, False, True, True], [True, True, False, True]]
    ctx = tmp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_agree_worker, args=(r, port, flags, out)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(30)
    assert results[0] == results[1] == [True, False, False, True]
