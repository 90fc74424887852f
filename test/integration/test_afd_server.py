"""MegaScale-Infer attention/FFN disaggregation through HTTP on stories260K-moe: greedy tokens equal the
colocated engine's with 1 attention + 2 FFN workers for m = 1, 2, 3 (m = 3 also rebalances experts live, with
redundant copies, every few steps), with 1 attention + 3 FFN (uneven expert blocks 2/1/1), and with
``--afd-transport nixl``; 2 attention + 2 FFN workers under concurrent load, then ``/flush_cache`` empties both
workers' caches; an FFN worker SIGKILLed with plain and streamed requests in flight -> every client gets an error
(HTTP 503, or an error event after the greedy tokens it already streamed) within seconds, /health answers 503,
nothing hangs, and the attention workers (which stay up) fail what they held and free every KV slot; a dense model is
refused.

GPU (``scripts/gpu/afd_kill_4gpu.sh``): ``SGLANG_AFD_TEST_DEVICE=cuda`` runs the same tests
with one worker per GPU (attention worker a, TP rank r on ``cuda:a*tp+r``, FFN worker j on ``cuda:N_A*tp+j``:
``sglang.srt.afd.deploy.workers``; checked from the workers' logs), fp32 with the torch_native attention backend so
greedy tokens equal the CPU reference; a test needing more GPUs than visible skips. ``SGLANG_AFD_TEST_TRANSPORT``
(cuda_ipc | cuda_push | cuda_push_ll | nccl | inline) sets ``--afd-transport`` (default auto: cuda_ipc on GPU, inline
on CPU); with a device-driven one (cuda_push, cuda_push_ll) and no rebalancing the steps go device to device (no
host-timed Ta / Tf / Tc, so no pipeline estimate)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
import requests

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "unit"))
from conftest import shared_path  # noqa: E402
from server_utils import ENV, ServerProcess  # noqa: E402
from test_tp_cpu import tokenize, tp1_greedy  # noqa: E402

N_NEW = 12  # tokens per request (the CI machine is small; every token crosses 5 MoE layers x m micro-batches)
DEVICE = os.environ.get("SGLANG_AFD_TEST_DEVICE", "cpu")
TRANSPORT = os.environ.get("SGLANG_AFD_TEST_TRANSPORT", "")
_DEVICE_ARGS = (["--device", "cuda", "--dtype", "float32", "--attention-backend", "torch_native",
                 "--max-total-tokens", "8192"] if DEVICE == "cuda" else ["--device", DEVICE])
_TRANSPORT_ARGS = ["--afd-transport", TRANSPORT] if TRANSPORT else []
DEVICE_DRIVEN = TRANSPORT in ("cuda_push", "cuda_push_ll")  # sglang.srt.afd.protocol.DEVICE_TRANSPORTS
# the kill test's --afd-timeout-s (room for the FFN workers' first Triton compiles on a GPU) and the slack past it
# within which every client must have its error (a CPU shared by many processes schedules the workers late)
KILL_TIMEOUT_S, KILL_SLACK_S = 15.0, (5.0 if DEVICE == "cuda" else 15.0)


def generate(server, payload):
    r = requests.post(server.url + "/generate", json=payload, timeout=600)
    assert r.status_code == 200, r.text
    return r.json()

PROMPTS = ["Once upon a time", "The little dog", "Lily wanted to"]


def _afd_args(path: str, n_a: int, n_e: int, m: int, *extra: str, tp: int = 1) -> list[str]:
    """launch_server flags of an AFD server with ``n_a`` attention workers (``tp`` ranks each) and ``n_e`` FFN
    workers on SGLANG_AFD_TEST_DEVICE; skips the test when CUDA has fewer GPUs than workers (one per GPU)."""
    if DEVICE == "cuda":
        import torch

        if torch.cuda.device_count() < n_a * tp + n_e:
            pytest.skip(f"{n_a} x TP {tp} attention + {n_e} FFN workers need {n_a * tp + n_e} GPUs (one each); "
                        f"{torch.cuda.device_count()} visible")
    return ["--model-path", path, *_DEVICE_ARGS, "--enable-afd", "--afd-attention-workers", str(n_a),
            "--afd-ffn-workers", str(n_e), "--afd-micro-batches", str(m), "--chunked-prefill-size", "16",
            *_TRANSPORT_ARGS, *(["--tp", str(tp)] if tp > 1 else []), *extra]


def _check_one_worker_per_gpu(server, n_workers: int) -> None:
    """On CUDA: the workers' start-up lines name ``n_workers`` distinct GPUs (attention ranks' "model ... loaded on
    cuda:i", FFN workers' "serving experts ... on cuda:j"). With SGLANG_AFD_TEST_TRANSPORT: the server uses it."""
    log = open(server.log_path).read()
    if TRANSPORT:
        assert f"M2N transport {TRANSPORT}" in log, "SGLANG_AFD_TEST_TRANSPORT did not reach the server"
    if DEVICE != "cuda":
        return
    devs = re.findall(r"model \S+ loaded on (cuda:\d+)", log) + re.findall(r"serving experts .* on (cuda:\d+)", log)
    assert len(devs) == n_workers and len(set(devs)) == n_workers, f"workers not one per GPU: {devs}"


@pytest.mark.parametrize("m", [1, 2, 3])
def test_afd_1_attention_2_ffn_greedy_equals_colocated(m):
    path = shared_path("models", "stories260K-moe")
    extra = ["--afd-redundant-experts", "2", "--afd-rebalance-interval", "3"] if m == 3 else []
    with ServerProcess(_afd_args(path, 1, 2, m, *extra)) as s:
        _check_one_worker_per_gpu(s, 3)
        out = generate(s, {"text": PROMPTS, "sampling_params": {"temperature": 0, "max_new_tokens": N_NEW,
                                                                "ignore_eos": True}})
        for p, o in zip(PROMPTS, out):
            assert o["output_ids"] == tp1_greedy(path, tokenize(path, p), N_NEW), (m, p)
        afd = s.internal_state()["afd"]
        assert afd["micro_batches"] == m
        if DEVICE_DRIVEN and not extra:  # device-driven steps (rebalancing turns them off): no per-message headers,
            # so no host-timed Ta / Tf / Tc
            assert afd["pipeline"] is None, afd
        else:
            assert afd["pipeline"]["m_min"] >= 2.0
            assert re.search(r"AFD ping-pong: Ta=.* -> m >= 2\(1\+Tc/Tf\) = ", s.log_tail(400))
        if m == 3:  # the placement changed between steps in the running system and tokens stayed equal
            assert afd["placement_version"] >= 1, afd
            assert len(afd["placement"]) == 2 and {e for w in afd["placement"] for e in w} == {0, 1, 2, 3}
            assert "placement v1" in s.log_tail(400)


def test_afd_1_attention_3_ffn_uneven_experts_greedy_equals_colocated():
    """3 FFN workers for 4 experts (the 1 + 3 layout on 4 GPUs): static blocks 2 / 1 / 1; each FFN worker
    logs its expert bytes and 0 KV bytes; greedy tokens equal the colocated engine's."""
    path = shared_path("models", "stories260K-moe")
    with ServerProcess(_afd_args(path, 1, 3, 2)) as s:
        _check_one_worker_per_gpu(s, 4)
        out = generate(s, {"text": PROMPTS, "sampling_params": {"temperature": 0, "max_new_tokens": N_NEW,
                                                                "ignore_eos": True}})
        for p, o in zip(PROMPTS, out):
            assert o["output_ids"] == tp1_greedy(path, tokenize(path, p), N_NEW), p
        assert s.internal_state()["afd"]["placement"] == [[0, 1], [2], [3]]
        held = [int(b) for b in re.findall(r"role ffn holds (\d+) parameter bytes .* and 0 KV bytes", s.log_tail(800))]
        assert len(held) == 3 and min(held) > 0 and sorted(held) == [min(held), min(held), 2 * min(held)], held


def test_afd_nixl_transport_greedy_equals_colocated():
    """``--afd-transport nixl``: every M2N payload is a NIXL READ (UCX, host memory) from the sender's ring."""
    from sglang.srt.disaggregation.transfer.base import nixl_available

    ok, why = nixl_available()
    if not ok:
        pytest.skip(f"nixl does not import ({why}); pip install 'sglang[pd]'")
    path = shared_path("models", "stories260K-moe")
    with ServerProcess(_afd_args(path, 1, 2, 2, "--afd-transport", "nixl")) as s:
        out = generate(s, {"text": PROMPTS, "sampling_params": {"temperature": 0, "max_new_tokens": N_NEW,
                                                                "ignore_eos": True}})
        for p, o in zip(PROMPTS, out):
            assert o["output_ids"] == tp1_greedy(path, tokenize(path, p), N_NEW), p
        assert "M2N transport nixl" in s.log_tail(400)


def test_afd_tp2_attention_worker_greedy_equals_colocated():
    """``--tp 2`` inside the attention worker: only TP rank 0 talks to the FFN workers."""
    path = shared_path("models", "stories260K-moe")
    with ServerProcess(_afd_args(path, 1, 2, 2, tp=2)) as s:
        _check_one_worker_per_gpu(s, 4)
        out = generate(s, {"text": PROMPTS[:2], "sampling_params": {"temperature": 0, "max_new_tokens": N_NEW,
                                                                    "ignore_eos": True}})
        for p, o in zip(PROMPTS, out):
            assert o["output_ids"] == tp1_greedy(path, tokenize(path, p), N_NEW), p


LONG = 480  # tokens of each request in flight at the kill (prompt + LONG < the 512 positions): seconds of decode


def _long_request(url: str, prompt: str, stream: bool, started: threading.Event, out: dict) -> None:
    """POST /generate for LONG greedy tokens; ``out`` gets status, error message (HTTP error body or the stream's
    error event; None when it finished), the output ids seen (a stream's cumulative ids) and the monotonic end time.
    ``started`` is set once a stream has 2 tokens (plain requests set it at once)."""
    body = {"text": prompt, "sampling_params": {"temperature": 0, "max_new_tokens": LONG, "ignore_eos": True},
            "stream": stream}
    if not stream:
        started.set()
    code, err, ids = None, None, []
    try:
        r = requests.post(url + "/generate", json=body, stream=stream, timeout=300)
        code = r.status_code
        if code != 200:
            err = r.text
        elif not stream:
            ids = r.json()["output_ids"]
        else:
            for line in r.iter_lines(decode_unicode=True):
                if not line or not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    err = chunk["error"]["message"]
                    continue
                ids = chunk["output_ids"]
                if len(ids) >= 2:
                    started.set()
    except Exception as e:  # reported by the test (no answer at all)
        err = f"client exception {e!r}"
    finally:
        started.set()  # never leave the test waiting on a request that failed early
    out.update(code=code, err=err, ids=ids, end=time.monotonic())


def _concurrent_greedy_then_flush(s, path: str) -> None:
    """8 concurrent greedy requests equal the CPU reference; per-worker states; /flush_cache reaches both workers."""
    results, errors = {}, []

    def one(i: int) -> None:
        p = PROMPTS[i % len(PROMPTS)]
        try:
            r = requests.post(s.url + "/generate", json={"text": p, "sampling_params": {
                "temperature": 0, "max_new_tokens": N_NEW, "ignore_eos": True}}, timeout=600)
            results[i] = (p, r.status_code, r.json())
        except Exception as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    assert not errors and len(results) == 8
    for p, code, body in results.values():
        assert code == 200, body
        assert body["output_ids"] == tp1_greedy(path, tokenize(path, p), N_NEW), p
    states = requests.get(s.url + "/get_server_info", timeout=30).json()["internal_states"]
    assert len(states) == 2 and all(st["afd"]["placement"] == [[0, 1], [2, 3]] for st in states)  # one per worker

    # /flush_cache reaches both attention workers: a prompt cached on both misses on both after it
    def cached_tokens() -> int:
        return generate(s, {"text": PROMPTS[0] * 3, "sampling_params": {"max_new_tokens": 1}}
                        )["meta_info"]["cached_tokens"]

    before = [cached_tokens() for _ in range(4)]  # one after another: round robin, two on each worker
    assert min(before[2:]) > 0, before
    r = requests.post(s.url + "/flush_cache", timeout=60)
    assert r.status_code == 200 and r.json()["success"], r.text
    assert [cached_tokens(), cached_tokens()] == [0, 0]


def _kill_ffn_worker_in_flight(s, path: str) -> None:
    """2 plain + 2 streamed LONG requests in flight (both streams have tokens), SIGKILL FFN worker 1: every client
    gets its error within KILL_TIMEOUT_S + KILL_SLACK_S, the streamed tokens before it are the greedy reference's,
    /health and new requests answer 503. Prints one ``[afd-kill]`` line with the seconds each client took."""
    pid = int(re.search(r"FFN worker 1 \(pid (\d+)\)", open(s.log_path).read()).group(1))
    kinds = [False, False, True, True]  # plain requests first: they are running once the streams have tokens
    outs = [{} for _ in kinds]
    started = [threading.Event() for _ in kinds]
    threads = [threading.Thread(target=_long_request, args=(s.url, PROMPTS[i % 2], st, started[i], outs[i]))
               for i, st in enumerate(kinds)]
    for t in threads:
        t.start()
    for e in started:
        assert e.wait(180), "a streamed request got no tokens before the kill"
    t_kill = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    for t in threads:
        t.join(KILL_TIMEOUT_S + KILL_SLACK_S + 60)
    assert not any(t.is_alive() for t in threads), "an in-flight request hung after the FFN worker died"
    took = [o["end"] - t_kill for o in outs]
    t_health = time.monotonic()
    h = requests.get(s.url + "/health", timeout=10)
    t_health = time.monotonic() - t_health
    print(f"[afd-kill] device {DEVICE} transport {TRANSPORT or 'auto'}: FFN worker 1 SIGKILLed with {len(outs)} "
          f"requests in flight (2 plain, 2 streamed); clients' errors after "
          f"{', '.join(f'{t:.2f}' for t in took)} s (max {max(took):.2f} s, --afd-timeout-s {KILL_TIMEOUT_S:g}); "
          f"statuses {[o['code'] for o in outs]}; streamed tokens before the error "
          f"{[len(o['ids']) for o, st in zip(outs, kinds) if st]}; /health {h.status_code} in {t_health:.2f} s",
          flush=True)
    for i, (o, st) in enumerate(zip(outs, kinds)):
        assert o["err"] is not None and "FFN worker 1" in o["err"], (i, o["code"], str(o["err"])[:300])
        assert o["code"] == (200 if st else 503), (i, o["code"], str(o["err"])[:300])  # a stream errs after its 200
        assert len(o["ids"]) < LONG, (i, "a request finished although an FFN worker died under it")
        if st:  # the tokens a stream delivered before its error are the greedy reference's
            assert o["ids"] == tp1_greedy(path, tokenize(path, PROMPTS[i % 2]), len(o["ids"])), i
    assert max(took) <= KILL_TIMEOUT_S + KILL_SLACK_S, f"errors took {took} s after the kill"
    assert h.status_code == 503 and "FFN worker" in h.text
    r = requests.post(s.url + "/generate", json={"text": "x", "sampling_params": {"max_new_tokens": 2}}, timeout=30)
    assert r.status_code == 503
    _attention_side_freed(s, t_kill)


def _attention_side_freed(s, t_kill: float) -> None:
    """After the FFN kill: every attention worker gives up on its forward (``--afd-timeout-s``), fails what it held
    and frees every KV slot (``/get_server_info``: no running or waiting request, ``available_tokens`` ==
    ``max_total_tokens``, every request row free, nothing cached or locked); then ``/flush_cache`` answers at once and a
    new request still gets a 503 naming the FFN worker at once. Prints one ``[afd-kill]`` line with the seconds the
    workers took."""
    end = time.monotonic() + KILL_TIMEOUT_S + KILL_SLACK_S + 30
    states: list = []
    while time.monotonic() < end:
        try:
            r = requests.get(s.url + "/get_server_info", timeout=10)
            states = r.json()["internal_states"] if r.status_code == 200 else []
        except (requests.RequestException, ValueError, KeyError):
            states = []
        if len(states) == 2 and all(st["num_running_reqs"] == 0 and st["num_waiting_reqs"] == 0
                                    and st["available_tokens"] == st["max_total_tokens"]
                                    and st["evictable_tokens"] == 0 and st["protected_tokens"] == 0
                                    and st["used_req_slots"] == 0 for st in states):
            break
        time.sleep(0.5)
    else:
        raise AssertionError(f"the attention workers did not free their KV after the FFN kill: {states}")
    t_free = time.monotonic() - t_kill
    t0 = time.monotonic()
    f = requests.post(s.url + "/flush_cache", timeout=30)
    t_flush = time.monotonic() - t0
    t0 = time.monotonic()
    r = requests.post(s.url + "/generate", json={"text": "x", "sampling_params": {"max_new_tokens": 2}}, timeout=30)
    t_gen = time.monotonic() - t0
    print(f"[afd-kill] attention workers freed every KV slot ({[st['max_total_tokens'] for st in states]} tokens "
          f"free) {t_free:.2f} s after the kill (--afd-timeout-s {KILL_TIMEOUT_S:g}); then /flush_cache "
          f"{f.status_code} in {t_flush:.2f} s, /generate {r.status_code} in {t_gen:.2f} s", flush=True)
    assert f.status_code == 200 and f.json()["success"] and t_flush < 10.0, (f.status_code, f.text[:300], t_flush)
    assert r.status_code == 503 and t_gen < 10.0, (r.status_code, t_gen)
    assert "FFN worker" in r.text, r.text[:300]  # a clear 503: it names the dead worker


def test_afd_2_attention_2_ffn_concurrent_load_then_ffn_killed():
    path = shared_path("models", "stories260K-moe")
    with ServerProcess(_afd_args(path, 2, 2, 2, "--afd-timeout-s", f"{KILL_TIMEOUT_S:g}")) as s:
        _check_one_worker_per_gpu(s, 4)
        _concurrent_greedy_then_flush(s, path)
        _kill_ffn_worker_in_flight(s, path)
        assert s.stop() == [], "workers outlived the server"


def test_afd_refuses_a_dense_model():
    path = shared_path("models", "stories260K")
    r = subprocess.run([sys.executable, "-m", "sglang.launch_server", "--model-path", path, "--device", "cpu",
                        "--enable-afd", "--afd-ffn-workers", "2"], env=ENV, capture_output=True, text=True,
                       timeout=180)
    assert r.returncode != 0
    assert "--enable-afd needs a MoE model" in r.stderr + r.stdout


def test_afd_sgl_engine_greedy_equals_colocated_and_refuses_dense():
    from sglang.srt.entrypoints.engine import Engine

    path = shared_path("models", "stories260K-moe")
    with Engine(model_path=path, device="cpu", enable_afd=True, afd_ffn_workers=2, afd_micro_batches=2,
                chunked_prefill_size=16) as e:
        outs = e.generate(PROMPTS[:2], {"temperature": 0, "max_new_tokens": N_NEW, "ignore_eos": True})
        for p, o in zip(PROMPTS, outs):
            assert o["output_ids"] == tp1_greedy(path, tokenize(path, p), N_NEW), p
    with pytest.raises(ValueError, match="needs a MoE model"):
        Engine(model_path=shared_path("models", "stories260K"), device="cpu", enable_afd=True)
