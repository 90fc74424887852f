"""Overlap scheduling with device futures: the worker launches batch i+1 before batch i's ids reach the
host, and the runner resolves placeholders from a device ring. On CPU the same code path runs with a CPU "device"
ring, so these tests check the logic: placeholder resolution against the host ring, worker order and error
propagation, the scheduler's outputs equal to the plain loop's on the fake runner's mixed workload, and token
equality overlap (device futures, host futures) vs no overlap on the real stories260K checkpoint."""

from __future__ import annotations

import os
import random
import sys
import threading
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from conftest import shared_path  # noqa: E402
from test_overlap_schedule import FakeRunner, kv_all_returned, run_all, submit, workload  # noqa: E402

from sglang.srt.managers.scheduler import Scheduler  # noqa: E402
from sglang.srt.model_executor.overlap_worker import (  # noqa: E402
    DEVICE_FUTURES_ENV,
    FutureTokenRing,
    OverlapWorker,
    device_futures_enabled,
    placeholder_id,
    resolve_future_ids,
)
from sglang.srt.server_args import ServerArgs  # noqa: E402


def test_device_resolution_equals_host_ring():
    rng = random.Random(11)
    for _ in range(20):
        size = rng.randrange(1, 64)
        toks = [rng.randrange(32000) for _ in range(size)]
        host = FutureTokenRing(size)
        host.store(list(range(size)), toks)
        ids = [placeholder_id(rng.randrange(size)) if rng.random() < 0.5 else rng.randrange(32000)
               for _ in range(rng.randrange(1, 40))]
        got = resolve_future_ids(torch.tensor(ids), torch.tensor(toks))
        assert got.dtype == torch.int64 and got.tolist() == host.resolve(ids)


def test_device_futures_policy(monkeypatch):
    monkeypatch.delenv(DEVICE_FUTURES_ENV, raising=False)
    assert device_futures_enabled("cuda") and not device_futures_enabled("cpu")
    assert device_futures_enabled("cpu", True) and not device_futures_enabled("cuda", False)
    monkeypatch.setenv(DEVICE_FUTURES_ENV, "0")
    assert not device_futures_enabled("cuda") and device_futures_enabled("cuda", True)
    monkeypatch.setenv(DEVICE_FUTURES_ENV, "1")
    assert device_futures_enabled("cpu") and not device_futures_enabled("cpu", False)


class _Gated:
    """Resolves device futures like ModelRunner.forward; waits for a gate; ``[90]`` raises."""

    def __init__(self):
        self.device = "cpu"
        self.gate = threading.Event()
        self.seen: list[list[int]] = []

    def forward(self, batch):
        assert self.gate.wait(30)
        ids = torch.tensor(batch.input_ids)
        if getattr(batch, "future_token_ids", None) is not None:
            ids = resolve_future_ids(ids, batch.future_token_ids)
        assert int(ids.min()) >= 0
        self.seen.append(ids.tolist())
        if ids.tolist() == [90]:
            raise RuntimeError("boom")
        return None, SimpleNamespace(next_token_ids=ids * 10)


def test_device_future_worker_order_rows_and_errors():
    runner = _Gated()
    w = OverlapWorker(runner, ring_size=8, device_futures=True)
    try:
        assert w.dev_ring is not None and w.dev_ring.shape == (8,)
        f1 = w.submit(SimpleNamespace(input_ids=[3, 4, 2]), [5, -1, 1])  # row 1 samples into no slot
        f2 = w.submit(SimpleNamespace(input_ids=[placeholder_id(5), 9, placeholder_id(1)]), [-1, 6, -1])
        assert not f1.done()
        runner.gate.set()
        assert f1.result(30)[1].next_token_ids.tolist() == [30, 40, 20]
        assert f2.result(30)[1].next_token_ids.tolist() == [300, 90, 200]
        assert runner.seen == [[3, 4, 2], [30, 9, 20]]
        f3 = w.submit(SimpleNamespace(input_ids=[placeholder_id(6)]), [-1])  # slot 6 holds 90: the runner raises
        f4 = w.submit(SimpleNamespace(input_ids=[1]), [-1])
        with pytest.raises(RuntimeError, match="boom"):
            f3.result(30)
        with pytest.raises(RuntimeError, match="earlier forward failed"):
            f4.result(30)
    finally:
        runner.gate.set()
        w.close()
    assert not w._thread.is_alive() and not w._completer.is_alive()


class _DeviceFutureFake(FakeRunner):
    """The fake runner of test_overlap_schedule, resolving device futures as ModelRunner.forward does."""

    def forward(self, batch):
        ring = getattr(batch, "future_token_ids", None)
        if ring is not None:
            batch.input_ids = resolve_future_ids(torch.tensor(batch.input_ids), ring).tolist()
        return super().forward(batch)


@pytest.mark.parametrize("seed,page_size,cps", [(1, 1, 16), (4, 4, 64)])
def test_device_futures_equal_plain_loop_on_mixed_workload(seed, page_size, cps):
    """Seeded sampling, stop tokens, logprobs, penalties (fallback), zero-length requests, chunked prefill."""
    results = {}
    for overlap in (False, True):
        runner = _DeviceFutureFake(max_total_tokens=1024, page_size=page_size)
        s = Scheduler(ServerArgs(page_size=page_size, chunked_prefill_size=cps), runner, None, overlap=overlap,
                      device_futures=True)
        try:
            assert (s.worker is not None and s.worker.device_futures) == overlap
            workload(random.Random(seed), s, 24)
            results[overlap] = run_all(s)
            assert kv_all_returned(s, runner)
        finally:
            s.close()
    off, on = results[False], results[True]
    assert off.keys() == on.keys() and len(off) == 24
    for rid in off:
        assert (on[rid]["ids"], on[rid]["finish"]) == (off[rid]["ids"], off[rid]["finish"]), rid
        assert [t for _, t in on[rid]["lps"]] == [t for _, t in off[rid]["lps"]], rid


@pytest.fixture(scope="module")
def stories_runner():
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_executor.model_runner import ModelRunner

    path = shared_path("models", "stories260K")
    args = ServerArgs(model_path=path, device="cpu", max_total_tokens=4096, random_seed=3)
    return ModelRunner(ModelConfig.from_path(path), args, "cpu"), args


def serve_three_ways(runner, args) -> dict:
    """``{"off" | "device" | "host": {rid: {"ids", "finish", ...}}}``: the same 10 requests (greedy and seeded
    sampling, 4 arriving while 6 decode, so batches are mixed and of varying size) served by the plain loop and by
    the overlap scheduler with device and with host futures. Checks the KV pool is fully returned each time."""
    rng = random.Random(7)
    prompts = [[1] + [rng.randrange(3, 512) for _ in range(rng.randrange(4, 40))] for _ in range(10)]
    results = {}
    for mode in ("off", "device", "host"):
        s = Scheduler(args, runner, None, overlap=mode != "off", device_futures=mode == "device")
        try:
            assert mode == "off" or s.worker.device_futures == (mode == "device")
            for i, p in enumerate(prompts[:6]):
                sp = {"temperature": 0.8, "seed": i} if i % 2 else {}
                submit(s, f"r{i}", p, max_new_tokens=24 + i, ignore_eos=True, **sp)

            def late(k):  # more requests join while the first ones decode
                if k == 3:
                    for i, p in enumerate(prompts[6:], 6):
                        submit(s, f"r{i}", p, max_new_tokens=20, ignore_eos=i % 2 == 0)

            results[mode] = run_all(s, on_step=late)
            assert kv_all_returned(s, runner)
        finally:
            s.close()
    return results


def assert_three_ways_equal(results: dict) -> None:
    """Overlap (device and host futures) gave the plain loop's tokens and finish reasons."""
    for mode in ("device", "host"):
        for rid, d in results["off"].items():
            assert (results[mode][rid]["ids"], results[mode][rid]["finish"]) == (d["ids"], d["finish"]), (mode, rid)
    assert len(results["off"]) == 10 and len(results["off"]["r5"]["ids"]) == 29


def test_stories260k_tokens_equal_overlap_device_host_and_off(stories_runner):
    """Greedy and seeded sampling on the real checkpoint (CPU): overlap with device futures, overlap with host
    futures and the plain loop produce the same tokens."""
    assert_three_ways_equal(serve_three_ways(*stories_runner))
