"""``sgl.Engine`` (in-process, no HTTP) against a real CPU server on stories260K: same greedy
outputs (single, batch, streaming, async, logprobs, constrained), control calls, and shutdown
without orphan processes (context manager and interpreter exit)."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import textwrap
import time

import psutil
import pytest
import requests

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from conftest import shared_path  # noqa: E402
from server_utils import ENV, ServerProcess  # noqa: E402

PROMPTS = ["Once upon a time", "The little dog", "Lily and Tom went to the park. They", "One day, a bird"]
GREEDY = {"temperature": 0, "max_new_tokens": 40}
REGEX = r"(Lily|Tom|Ben) (ran|sat|jumped)( [a-z]+){1,5}\."


@pytest.fixture(scope="module")
def model_path():
    return shared_path("models", "stories260K")


@pytest.fixture(scope="module")
def server(model_path):
    with ServerProcess(["--model-path", model_path, "--device", "cpu"]) as s:
        yield s


@pytest.fixture(scope="module")
def engine(model_path):
    from sglang.srt.entrypoints.engine import Engine

    with Engine(model_path=model_path, device="cpu") as e:
        yield e


def post(server, payload):
    r = requests.post(server.url + "/generate", json=payload, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def strip(out):
    return out["text"], out["output_ids"], out["meta_info"]["finish_reason"]


def test_sgl_engine_export():
    import sglang as sgl
    from sglang.srt.entrypoints.engine import Engine

    assert sgl.Engine is Engine


def test_greedy_single_and_batch_equal_server(server, engine):
    for p in PROMPTS:
        assert strip(engine.generate(p, GREEDY)) == strip(post(server, {"text": p, "sampling_params": GREEDY}))
    batch = engine.generate(PROMPTS, GREEDY)
    ref = post(server, {"text": PROMPTS, "sampling_params": GREEDY})
    assert isinstance(batch, list) and [strip(o) for o in batch] == [strip(o) for o in ref]
    per_prompt = [dict(GREEDY, max_new_tokens=n) for n in (5, 10, 15, 20)]
    assert [strip(o) for o in engine.generate(PROMPTS, per_prompt)] == [
        strip(o) for o in post(server, {"text": PROMPTS, "sampling_params": per_prompt})]


def test_input_ids_logprobs_and_seeded_sampling_equal_server(server, engine):
    ids = [1, 403, 407, 261, 378]
    kw = dict(return_logprob=True, logprob_start_len=0, top_logprobs_num=2)
    got = engine.generate(input_ids=ids, sampling_params=GREEDY, **kw)
    ref = post(server, {"input_ids": ids, "sampling_params": GREEDY, **kw})
    assert got["output_ids"] == ref["output_ids"]
    for key in ("input_token_logprobs", "output_token_logprobs"):
        g, r = got["meta_info"][key], ref["meta_info"][key]
        assert [e[1] for e in g] == [e[1] for e in r] and len(g) == len(r) > 0
        assert [e[0] for e in g] == pytest.approx([e[0] for e in r], abs=1e-5)
    g, r = got["meta_info"]["output_top_logprobs"], ref["meta_info"]["output_top_logprobs"]
    assert [[t[1] for t in row] for row in g] == [[t[1] for t in row] for row in r]
    sp = {"temperature": 0.9, "top_p": 0.9, "seed": 11, "max_new_tokens": 30}
    assert strip(engine.generate(PROMPTS[1], sp)) == strip(post(server, {"text": PROMPTS[1], "sampling_params": sp}))


def test_streaming_single_and_batch(engine):
    full = engine.generate(PROMPTS[0], GREEDY)
    chunks = list(engine.generate(PROMPTS[0], GREEDY, stream=True))
    assert len(chunks) > 1
    assert all(chunks[i]["text"].startswith(chunks[i - 1]["text"]) for i in range(1, len(chunks)))
    assert strip(chunks[-1]) == strip(full)
    finals = {}
    for c in engine.generate(PROMPTS[:3], GREEDY, stream=True):
        finals[c["index"]] = c
    assert [strip(finals[i]) for i in range(3)] == [strip(o) for o in engine.generate(PROMPTS[:3], GREEDY)]


def test_breaking_out_of_a_stream_aborts_it(engine):
    it = engine.generate(PROMPTS[0], {"temperature": 0, "max_new_tokens": 400, "ignore_eos": True}, stream=True)
    first = next(it)
    assert first["text"]
    it.close()
    deadline = time.time() + 10
    while engine.tokenizer_manager.num_inflight and time.time() < deadline:
        time.sleep(0.05)
    assert engine.tokenizer_manager.num_inflight == 0


def test_async_generate(engine):
    ref = [strip(o) for o in engine.generate(PROMPTS, GREEDY)]

    async def main():
        outs = await asyncio.gather(*(engine.async_generate(p, GREEDY) for p in PROMPTS))
        chunks = [c async for c in await engine.async_generate(PROMPTS[0], GREEDY, stream=True)]
        batch = await engine.async_generate(PROMPTS, GREEDY)
        return outs, chunks, batch

    outs, chunks, batch = asyncio.run(main())
    assert [strip(o) for o in outs] == ref and [strip(o) for o in batch] == ref
    assert len(chunks) > 1 and strip(chunks[-1]) == ref[0]


def test_constrained_generation_equals_server(server, engine):
    sp = {"regex": REGEX, "temperature": 1.0, "seed": 4, "max_new_tokens": 80}
    got = engine.generate(PROMPTS[0], sp)
    assert re.fullmatch(REGEX, got["text"])
    assert strip(got) == strip(post(server, {"text": PROMPTS[0], "sampling_params": sp}))


def test_bad_input_raises_value_error(engine):
    with pytest.raises(ValueError, match="parenthesis"):
        engine.generate("Hi", {"regex": "(abc"})
    with pytest.raises(ValueError, match="temperature"):
        engine.generate("Hi", {"temperature": -1})
    with pytest.raises(ValueError, match="unknown sampling parameter"):
        engine.generate("Hi", {"temprature": 0})
    with pytest.raises(ValueError, match="temperature must be a finite number"):
        engine.generate("Hi", {"temperature": float("nan")})
    with pytest.raises(ValueError, match="image_data"):  # SGLang's 4th positional argument
        engine.generate("Hi", GREEDY, None, ["img.png"])
    with pytest.raises(TypeError):  # arguments after image_data are keyword-only
        engine.generate("Hi", GREEDY, None, None, True)

    async def bad():
        await engine.async_generate("Hi", {"json_schema": '{"type": "foo"}'})

    with pytest.raises(ValueError, match="Unsupported type"):
        asyncio.run(bad())


def test_out_of_vocab_ids_raise_value_error_naming_the_field(engine):
    for params, field in (({"stop_token_ids": [-1]}, "stop_token_ids"), ({"stop_token_ids": [2 ** 70]}, "stop_token_ids"),
                          ({"logit_bias": {str(2 ** 70): 1.0}}, "logit_bias")):
        with pytest.raises(ValueError, match=f"^{field}"):
            engine.generate("Hi", params)


def test_engine_score_matches_server(server, engine):
    body = {"query": "Once upon a time", "items": [" there", " a"], "label_token_ids": [278, 263], "apply_softmax": True}
    ref = requests.post(server.url + "/v1/score", json=body, timeout=120).json()["scores"]
    got = engine.score(**body)
    assert len(got) == 2 and all(sum(r) == pytest.approx(1.0, abs=1e-6) for r in got)
    for a, b in zip(got, ref):
        assert a == pytest.approx(b, rel=1e-5)
    with pytest.raises(ValueError, match="Token ID 999999 is out of vocabulary"):
        engine.score(query="q", items=["a"], label_token_ids=[999999])


def test_unknown_engine_argument_is_named():
    from sglang.srt.entrypoints.engine import Engine

    with pytest.raises(ValueError, match="max_totl_tokens"):
        Engine(model_path="unused", max_totl_tokens=5)


def test_flush_cache_and_server_info(engine, model_path):
    engine.generate(PROMPTS[0], GREEDY)
    assert engine.flush_cache().success
    info = engine.get_server_info()
    assert info["model_path"] == model_path and info["device"] == "cpu"
    # raw server args as SGLang has them, and the values the scheduler resolved at startup beside them
    assert info["kv_cache_layout"] == "auto" and info["kv_cache_layout_resolved"] == "layer_major"
    assert "tokenweave_sharded_residual" in info and info["tokenweave_sharded_residual_resolved"] is False
    st = info["internal_states"][0]
    assert st["num_running_reqs"] == 0 and st["evictable_tokens"] == 0 and st["max_total_tokens"] > 0
    assert st["used_req_slots"] == 0  # the request's row went back


def test_context_manager_shutdown_leaves_no_orphans(engine):
    """Runs last among the engine tests: leaves the shared engine shut down."""
    pids = [engine._procs.scheduler.pid, engine._procs.detokenizer.pid]
    assert all(psutil.pid_exists(p) for p in pids)
    engine.__exit__(None, None, None)
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids)
    assert not engine._thread.is_alive()
    with pytest.raises(RuntimeError, match="shut down"):
        engine.generate("Hi", GREEDY)
    engine.shutdown()  # idempotent


def test_interpreter_exit_shuts_the_engine_down(model_path):
    script = textwrap.dedent(f"""
        import psutil
        from sglang.srt.entrypoints.engine import Engine

        if __name__ == "__main__":
            e = Engine(model_path={model_path!r}, device="cpu")
            print(e.generate("Once upon a time", {{"temperature": 0, "max_new_tokens": 4}})["text"])
            kids = [p.pid for p in psutil.Process().children(recursive=True)
                    if "resource_tracker" not in " ".join(p.cmdline())]
            print("PIDS", *kids, flush=True)
            # no shutdown(): atexit must stop the scheduler and detokenizer
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=240, env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("PIDS")][0]
    pids = [int(x) for x in line.split()[1:]]
    assert len(pids) >= 2 and proc.stdout.startswith(", there")
    time.sleep(1.0)
    assert not [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
