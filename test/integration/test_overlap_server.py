"""Overlap scheduling end to end on CPU: servers on stories260K with overlap forced on (the
``SGLANG_ENABLE_OVERLAP_SCHEDULE=1`` environment variable; CPU's default is off) give the same greedy
tokens as HF, and the same tokens, finish reasons and logprobs as a server with
``--disable-overlap-schedule`` for concurrent mixed requests (chunked prefill, stop strings, seeded
sampling, streaming); with ``--tp 2`` the ranks stay in lockstep."""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import sys

import pytest
import requests

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
import server_utils  # noqa: E402
from conftest import shared_path  # noqa: E402
from server_utils import ServerProcess  # noqa: E402
from test_server_e2e import PROMPTS, hf_greedy, kv_back_to_zero  # noqa: E402

from sglang.srt.model_executor.overlap_worker import OVERLAP_ENV  # noqa: E402

N_NEW = 32


def start(args: list[str], overlap: bool) -> ServerProcess:
    """A CPU server; ``overlap`` sets the environment variable for its processes only."""
    if overlap:
        server_utils.ENV[OVERLAP_ENV] = "1"
    try:
        return ServerProcess(["--device", "cpu", *args])
    finally:
        server_utils.ENV.pop(OVERLAP_ENV, None)


@pytest.fixture(scope="module")
def servers():
    path = shared_path("models", "stories260K")
    common = ["--model-path", path, "--chunked-prefill-size", "24"]
    on = start(common, overlap=True)
    try:
        off = start(common + ["--disable-overlap-schedule"], overlap=False)
    except BaseException:
        on.stop()
        raise
    on.model_path = off.model_path = path
    try:
        yield on, off
        kv_back_to_zero(on)
        kv_back_to_zero(off)
    finally:
        on.stop()
        off.stop()


def generate(server, payload: dict):
    r = requests.post(server.url + "/generate", json=payload, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def stream(server, payload: dict) -> tuple[list[int], dict]:
    ids, meta = [], None
    with requests.post(server.url + "/generate", json={**payload, "stream": True}, stream=True, timeout=120) as r:
        assert r.status_code == 200, r.text
        for line in r.iter_lines():
            if line.startswith(b"data:") and line != b"data: [DONE]":
                chunk = json.loads(line[5:])
                ids = chunk["output_ids"]  # cumulative
                meta = chunk["meta_info"]
    assert len(ids) == meta["completion_tokens"]
    return ids, meta["finish_reason"]


def test_modes_are_what_the_test_asks_for(servers):
    on, off = servers
    assert on.internal_state()["overlap_schedule"] is True
    assert off.internal_state()["overlap_schedule"] is False


def test_greedy_equals_hf_with_overlap(servers):
    on, _ = servers
    for p in PROMPTS:
        out = generate(on, {"text": p, "sampling_params": {"temperature": 0, "max_new_tokens": N_NEW}})
        assert out["output_ids"] == hf_greedy(on.model_path, p, N_NEW), p


def _workload() -> list[dict]:
    jobs = []
    for i, p in enumerate(PROMPTS * 3):
        sp = {"temperature": 0, "max_new_tokens": 8 + 7 * i}
        if i % 3 == 1:
            sp.update(temperature=0.9, top_p=0.95, seed=100 + i)
        if i % 4 == 2:
            sp.update(stop=[" the", "."])
        job = {"text": p + " " * (i % 2), "sampling_params": sp}
        if i % 5 == 0:
            job.update(return_logprob=True, logprob_start_len=0, top_logprobs_num=2)
        jobs.append(job)
    return jobs


def _run_concurrently(server, jobs: list[dict]) -> list:
    def one(job):
        if job.get("return_logprob"):
            out = generate(server, job)
            mi = out["meta_info"]
            return (out["output_ids"], mi["finish_reason"], mi["input_token_logprobs"], mi["output_token_logprobs"])
        return stream(server, job)

    with cf.ThreadPoolExecutor(len(jobs)) as pool:
        return list(pool.map(one, jobs))


def _close(a, b) -> bool:
    """Logprob lists equal up to float rounding: [(logprob, token_id, text), ...]."""
    return len(a) == len(b) and all(
        x[1] == y[1] and ((x[0] is None and y[0] is None) or abs(x[0] - y[0]) < 1e-4) for x, y in zip(a, b))


def test_concurrent_mixed_requests_equal_overlap_off(servers):
    on, off = servers
    jobs = _workload()
    got_on, got_off = _run_concurrently(on, jobs), _run_concurrently(off, jobs)
    assert any(r[1]["type"] == "stop" for r in got_off)  # stop strings really fired
    for job, a, b in zip(jobs, got_on, got_off):
        assert a[0] == b[0] and a[1] == b[1], job
        if len(a) == 4:
            assert _close(a[2], b[2]) and _close(a[3], b[3]), job


def test_tp2_with_overlap_matches_tp1(servers):
    """Two ranks run the same overlapped schedule (their own control group beside the gloo model
    group) and give TP=1's tokens."""
    _, off = servers
    params = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}
    ref = [o["output_ids"] for o in generate(off, {"text": PROMPTS, "sampling_params": params})]
    with start(["--model-path", off.model_path, "--tp", "2", "--chunked-prefill-size", "16"], overlap=True) as s:
        assert s.internal_state()["overlap_schedule"] is True
        for _ in range(2):
            outs = generate(s, {"text": PROMPTS, "sampling_params": params})
            assert [o["output_ids"] for o in outs] == ref
            assert all(len(r) == 24 for r in ref)
