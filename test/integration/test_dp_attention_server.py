"""DP attention end to end on CPU (gloo, one process per DP rank): ``--enable-dp-attention --dp-size N --tp-size N
--ep-size N`` servers on ``stories260K-moe8`` (8 distinct experts: a token sent to the wrong expert changes the
logits) give TP1's greedy tokens (32 tokens, the shared prompts), with one request on N ranks (N-1 idle), chunked
prefill, requests joining mid-decode (mixed prefill + decode batches), an abort in flight and retraction.
``/get_server_info`` lists the ranks. A killed DP rank gives every client a 503 within seconds.

The servers: 2 ranks with the all-gather EP (``--moe-a2a-backend none``); 2 ranks with the all-to-all dispatcher
(``--moe-a2a-backend nccl``, each rank dispatching its own tokens); 4 ranks with everything on at once: the all-to-all
dispatcher, forced two-batch overlap (``--enable-two-batch-overlap --tbo-min-tokens 2``: the ranks agree per step
whether to split) and the overlap scheduler, so the killed-rank check also runs with DP + all-to-all + TBO. A dense
model (``stories260K``) serves with DP attention too (independent ranks). The other DP x EP x TBO combinations run
through the real scheduler without HTTP in ``test/unit/test_ep_dp_tbo_schedules.py``.

One server per configuration runs every check (starting ranks is the slow part on CPU)."""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import threading
import time

import pytest
import requests

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "unit"))
from conftest import shared_path  # noqa: E402
from server_utils import ServerProcess  # noqa: E402
from test_tp_cpu import PROMPTS, tokenize, tp1_greedy  # noqa: E402

N_NEW = 32
GREEDY = {"temperature": 0, "max_new_tokens": N_NEW, "ignore_eos": True}
KV_TOKENS = 256  # per rank: eight requests of ~40 tokens cannot all decode at once -> retraction


# (DP ranks, --moe-a2a-backend, two-batch overlap and the overlap scheduler)
SERVERS = [(2, "none", False), (2, "nccl", False), (4, "nccl", True)]


def _server_id(p) -> str:
    return f"dp{p[0]}" + ("" if p[1] == "none" else f"-a2a-{p[1]}") + ("-tbo-overlap" if p[2] else "")


@pytest.fixture(scope="module", params=SERVERS, ids=_server_id)
def dp_server(request):
    n, a2a, tbo = request.param
    path = shared_path("models", "stories260K-moe8")
    args = ["--model-path", path, "--device", "cpu", "--tp", str(n), "--dp-size", str(n), "--ep-size", str(n),
            "--enable-dp-attention", "--chunked-prefill-size", "16", "--max-total-tokens", str(KV_TOKENS)]
    if a2a != "none":  # each rank dispatches its own tokens to the experts' owners (no gather / reduce-scatter)
        args += ["--moe-a2a-backend", a2a]
    if tbo:
        args += ["--enable-two-batch-overlap", "--tbo-min-tokens", "2", "--enable-overlap-schedule"]
    s = ServerProcess(args, timeout=400)
    s.model_path, s.n, s.a2a, s.tbo = path, n, a2a, tbo
    yield s
    s.stop()


def generate(server, payload, timeout=180):
    r = requests.post(server.url + "/generate", json=payload, timeout=timeout)
    assert r.status_code == 200, r.text
    return r.json()


def want(server, prompt: str, n: int = N_NEW) -> list:
    return tp1_greedy(server.model_path, tokenize(server.model_path, prompt), n)


def states(server) -> list:
    info = requests.get(server.url + "/get_server_info", timeout=30).json()
    return info, info["internal_states"]


def test_batch_greedy_tokens_equal_tp1_and_server_info_lists_ranks(dp_server):
    # with two-batch overlap, twice the prompts: two running requests per rank make every decode step splittable
    # (--tbo-min-tokens 2) on every rank at once, so the ranks agree to split whatever the arrival timing (with one
    # request per rank only simultaneous prefills split, which a loaded CI machine may never produce)
    prompts = PROMPTS * 2 if dp_server.tbo else PROMPTS
    outs = generate(dp_server, {"text": prompts, "sampling_params": GREEDY})
    for prompt, out in zip(prompts, outs):
        assert out["output_ids"] == want(dp_server, prompt), prompt
    info, st = states(dp_server)
    assert info["dp_size"] == dp_server.n and info["enable_dp_attention"] and info["dp_attention_lockstep_resolved"]
    assert [s["dp_rank"] for s in st] == list(range(dp_server.n))
    assert all(s["dp_lockstep"] and s["dp_size"] == dp_server.n for s in st)
    assert all(s["forward_ct"] > s["dp_idle_forwards"] for s in st)  # the router spread the batch over every rank
    assert st[0]["overlap_schedule"] == dp_server.tbo
    with open(dp_server.log_path) as f:
        log = f.read()
    if dp_server.a2a != "none":  # the plan's local token scope reached every rank's dispatcher
        assert f"MoE all-to-all ({dp_server.a2a}) on 5 MoE layers" in log
        assert "token scope local" in log and "token scope tp_slice" not in log
    if dp_server.tbo:  # the ranks agreed to split this batch's steps (logged by DP rank 0)
        assert "two-batch overlap on:" in log


def test_one_request_runs_with_the_other_ranks_idle(dp_server):
    _, before = states(dp_server)
    out = generate(dp_server, {"text": PROMPTS[2], "sampling_params": GREEDY})
    assert out["output_ids"] == want(dp_server, PROMPTS[2])
    _, after = states(dp_server)
    idle = [a["dp_idle_forwards"] - b["dp_idle_forwards"] for a, b in zip(after, before)]
    steps = [a["forward_ct"] - b["forward_ct"] for a, b in zip(after, before)]
    assert len(set(steps)) == 1 and steps[0] >= N_NEW, steps  # every rank ran every forward
    assert sorted(idle) == [0] + [steps[0]] * (dp_server.n - 1), idle  # n-1 ranks only idle forwards


def _stream(server, prompt: str, n: int, rid: str, first_tokens: threading.Event, out: dict) -> None:
    payload = {"text": prompt, "rid": rid, "stream": True, "sampling_params": {**GREEDY, "max_new_tokens": n}}
    ids, reason = [], None
    with requests.post(server.url + "/generate", json=payload, stream=True, timeout=180) as r:
        for line in r.iter_lines():
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            ids = chunk.get("output_ids", ids)
            reason = chunk["meta_info"].get("finish_reason")
            if len(ids) >= 4:
                first_tokens.set()
    out[rid] = (ids, reason)


def test_requests_joining_mid_decode_and_chunked_prefill_equal_tp1(dp_server):
    # a long prompt (chunked at 16 tokens) decodes while more requests than ranks arrive: some rank runs a new
    # prefill beside its decodes (mixed batches) while others decode or idle
    long_prompt = "Lily and Tom went to the park. They saw a big red ball and a little dog. The dog"
    started, out = threading.Event(), {}
    t = threading.Thread(target=_stream, args=(dp_server, long_prompt, 48, "dp-long", started, out))
    t.start()
    assert started.wait(120)
    late = PROMPTS[: dp_server.n] + PROMPTS[:1]
    outs = generate(dp_server, {"text": late, "sampling_params": GREEDY})
    t.join(180)
    for prompt, o in zip(late, outs):
        assert o["output_ids"] == want(dp_server, prompt), prompt
    assert out["dp-long"][0] == want(dp_server, long_prompt, 48)


def test_abort_in_flight_returns_partial_output_and_others_are_exact(dp_server):
    rid, started, res = "dp-abort", threading.Event(), {}
    t = threading.Thread(target=_stream, args=(dp_server, PROMPTS[0], 200, rid, started, res))
    t.start()
    others = {}
    t2 = threading.Thread(target=lambda: others.update(r=generate(dp_server, {"text": PROMPTS[1:3],
                                                                              "sampling_params": GREEDY})))
    t2.start()
    assert started.wait(120)  # it decodes: abort it in flight
    assert requests.post(dp_server.url + "/abort_request", json={"rid": rid}, timeout=10).status_code == 200
    t.join(60), t2.join(180)
    ids, reason = res[rid]
    assert reason["type"] == "abort" and 4 <= len(ids) < 200
    assert ids == want(dp_server, PROMPTS[0], len(ids))  # the partial output is the greedy prefix
    for prompt, o in zip(PROMPTS[1:3], others["r"]):
        assert o["output_ids"] == want(dp_server, prompt), prompt
    deadline = time.time() + 30  # every rank's KV comes back (the radix cache keeps only evictable prefixes)
    while time.time() < deadline and any(s["num_running_reqs"] for s in states(dp_server)[1]):
        time.sleep(0.1)
    assert not any(s["num_running_reqs"] or s["used_req_slots"] for s in states(dp_server)[1])


def test_retraction_when_a_rank_runs_out_of_kv(dp_server):
    # 8 requests per rank of ~40 tokens each in a 256-token pool: decodes retract, outputs stay exact
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(8 * dp_server.n)]
    outs = generate(dp_server, {"text": prompts, "sampling_params": GREEDY}, timeout=400)
    for prompt, o in zip(prompts, outs):
        assert o["output_ids"] == want(dp_server, prompt), prompt
    with open(dp_server.log_path) as f:
        assert "KV cache full: retracting" in f.read()


def test_killed_dp_rank_fails_every_client_within_seconds(dp_server):
    """Last for each server: it stops the server."""
    with open(dp_server.log_path) as f:
        pid = int(re.search(r"scheduler DP rank 1 started \(pid (\d+)\)", f.read()).group(1))
    results = {}

    def in_flight(i: int) -> None:
        try:
            r = requests.post(dp_server.url + "/generate", timeout=90, json={
                "text": PROMPTS[i % len(PROMPTS)], "sampling_params": {"max_new_tokens": 200, "ignore_eos": True}})
            results[i] = (r.status_code, r.text, time.time())
        except requests.RequestException as e:
            results[i] = (type(e).__name__, str(e), time.time())

    threads = [threading.Thread(target=in_flight, args=(i,), daemon=True) for i in range(dp_server.n)]
    for t in threads:
        t.start()
    deadline = time.time() + 60
    while time.time() < deadline and sum(s["num_running_reqs"] for s in states(dp_server)[1]) < dp_server.n:
        time.sleep(0.05)
    killed = time.time()
    os.kill(pid, signal.SIGKILL)
    for t in threads:
        t.join(60)
    assert len(results) == dp_server.n
    for status, body, at in results.values():
        assert status == 503 and "scheduler DP rank 1" in body and "exited unexpectedly" in body, (status, body)
        assert at - killed < 15, at - killed  # within seconds, never the collective timeout
    dp_server.proc.wait(timeout=60)
    assert dp_server.proc.returncode not in (0, None)


def test_dense_model_with_dp_attention_equals_tp1():
    path = shared_path("models", "stories260K")
    with ServerProcess(["--model-path", path, "--device", "cpu", "--tp", "2", "--dp-size", "2",
                        "--enable-dp-attention"], timeout=400) as s:
        s.model_path = path
        outs = generate(s, {"text": PROMPTS, "sampling_params": GREEDY})
        for prompt, o in zip(PROMPTS, outs):
            assert o["output_ids"] == want(s, prompt), prompt
        assert outs[0]["text"].startswith(", there was a little girl named Lily")
        info, st = states(s)
        assert not info["dp_attention_lockstep_resolved"]  # no MoE collective: the ranks never wait for each other
        assert [x["dp_rank"] for x in st] == [0, 1] and not any(x["dp_lockstep"] for x in st)
        assert all(x["dp_idle_forwards"] == 0 and x["forward_ct"] > 0 for x in st)
