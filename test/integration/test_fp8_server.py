"""FP8 weights end to end on CPU: FP8 checkpoints (detected from config.json) served at TP 1 and at TP 2 x EP 2
give the greedy tokens of the same model run in this process (TP 1); every FP8 scheme (online ``--quantization fp8``,
per-tensor static, 128 x 128 and 2 x 2 block-wise, dense and MoE) sharded over TP 2 gloo ranks (one per process) gives
the TP 1 tokens; unsupported flags and checkpoints are refused before any worker starts, naming the field.
``--quantization fp8`` served at TP 1 (together with ``--kv-cache-dtype fp8_e4m3``) is checked by
``test_fp8_kv_server.py``.

Cost: two servers, started side by side, and one pair of rank processes for the four TP 2 schemes (the server stack
is the same for every scheme; what differs is the sharding of the weights and scales, which the ranks run); the
refusals run ``launch_server.main`` in this process with worker spawning replaced by a failure, i.e. the launcher's
own checks up to the point where workers would start.

Exactness under TP: the per-tensor checkpoint's static activation scales and the block checkpoint's per-token 1 x
``block_k`` groups (each group inside one rank's columns) quantize every activation as TP 1 does, so TP 2 differs from
TP 1 only by the all-reduce's summation order. Online ``--quantization fp8`` scales a row-parallel layer's input per
token over the rank's own columns (as SGLang does), so TP 2 is not exact by construction; on these prompts it gives
the TP 1 tokens as well (checked, deterministic).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import sys
import time

import pytest
import requests

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), os.path.join(os.path.dirname(HERE), "unit")]
from conftest import shared_path  # noqa: E402
from server_utils import free_port, start_all, stop_all  # noqa: E402

pytestmark = pytest.mark.timeout(600)

# the shared prompts, and two on which FP8 changes the fp32 model's greedy continuation
PROMPTS = ["Once upon a time", "The little dog", "Lily and Tom went to the park. They", "One day, a bird",
           "The sun was hot and", "Once there was a big"]
N_NEW = 16


@functools.lru_cache(maxsize=None)
def in_process_greedy(path: str, quantization, text: str) -> list[int]:
    """Greedy tokens (EOS ignored) of the model at ``path`` in this process, TP 1."""
    import torch

    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.utils.common import get_tokenizer
    from sglang.test.model_harness import ModelHarness

    mc = ModelConfig.from_path(path)
    ids = get_tokenizer(path).encode(text)
    h = ModelHarness(_model(path, quantization), mc, max_reqs=1, max_len=len(ids) + N_NEW + 1)
    out, new = [], list(ids)
    for _ in range(N_NEW):
        tok = int(torch.argmax(h.step([("r", new)])[0]))
        out.append(tok)
        new = [tok]
    return out


@functools.lru_cache(maxsize=None)
def _model(path: str, quantization):
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_loader.loader import load_model

    return load_model(ModelConfig.from_path(path), "auto", "cpu", quantization=quantization)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """FP8 checkpoints written from the shared stories260K models (module docstring of fp8_checkpoint)."""
    import torch

    from sglang.srt.layers.quantization.fp8_checkpoint import write_fp8_checkpoint

    root = tmp_path_factory.mktemp("fp8ckpt")
    dense, moe = shared_path("models", "stories260K"), shared_path("models", "stories260K-moe8")
    out = {"dense": dense, "moe": moe}
    for key, src, scheme, act, block in (("dense-static", dense, "per-tensor", "static", None),
                                         ("dense-block128", dense, "block", "dynamic", (128, 128)),
                                         ("dense-block2", dense, "block", "dynamic", (2, 2)),
                                         ("moe-block2", moe, "block", "dynamic", (2, 2)),
                                         ("moe-static", moe, "per-tensor", "static", None)):
        out[key] = str(root / key)
        write_fp8_checkpoint(src, out[key], scheme, act, block or (128, 128), torch.bfloat16)
    return out


SERVERS = {  # id -> (checkpoint key, extra flags)
    "block128-tp1": ("dense-block128", []),
    "moe-static-tp2-ep2": ("moe-static", ["--tp", "2", "--ep-size", "2"]),
}
TP2_JOBS = {  # id -> (checkpoint key, ep_size, --quantization): run on two gloo ranks
    "online-tp2": ("dense", 1, "fp8"),
    "static-tp2": ("dense-static", 1, None),
    "block2-tp2": ("dense-block2", 1, None),
    "moe-block2-tp2": ("moe-block2", 1, None),
}


@pytest.fixture(scope="module")
def servers(ckpts):
    """Both servers of :data:`SERVERS`, started side by side (all stopped if one fails)."""
    started = start_all({k: ["--model-path", ckpts[key], "--device", "cpu", "--chunked-prefill-size", "16", *flags]
                         for k, (key, flags) in SERVERS.items()})
    try:
        yield started
    finally:
        stop_all(started.values())


@pytest.mark.parametrize("name", sorted(SERVERS))
def test_fp8_server_gives_the_in_process_tokens(servers, ckpts, name):
    """A batch of the prompts (chunked prefill of 16 tokens) gives each prompt's TP 1 in-process greedy tokens; the
    checkpoint's scheme was detected without ``--quantization``."""
    server, path = servers[name], ckpts[SERVERS[name][0]]
    params = {"temperature": 0, "max_new_tokens": N_NEW, "ignore_eos": True}
    r = requests.post(server.url + "/generate", json={"text": PROMPTS, "sampling_params": params}, timeout=300)
    assert r.status_code == 200, r.text
    for prompt, out in zip(PROMPTS, r.json()):
        assert out["output_ids"] == in_process_greedy(path, None, prompt), (name, prompt)
    info = requests.get(server.url + "/get_server_info", timeout=30).json()
    assert info["quantization"] is None


def test_every_fp8_scheme_at_tp2_gives_the_tp1_tokens(ckpts):
    """Online (``--quantization fp8``), per-tensor static, 2 x 2 block-wise dense and MoE checkpoints, each sharded
    over two gloo ranks (one process each): every rank's greedy tokens equal the TP 1 in-process tokens."""
    from sglang.srt.utils.common import get_tokenizer
    from tp_worker import spawn_ranks, tp_greedy_tokens

    names = sorted(TP2_JOBS)
    jobs = []
    for n in names:
        key, ep, quant = TP2_JOBS[n]
        tok = get_tokenizer(ckpts[key])
        jobs.append((ckpts[key], ep, quant, [tok.encode(p) for p in PROMPTS]))
    results = spawn_ranks(tp_greedy_tokens, 2, jobs, N_NEW, timeout=300)
    for rank, per_rank in enumerate(results):
        for name, (path, _, quant, _), got in zip(names, jobs, per_rank):
            for prompt, toks in zip(PROMPTS, got):
                assert toks == in_process_greedy(path, quant, prompt), (name, rank, prompt)


def test_fp8_tokens_differ_from_the_model_dtype_somewhere(ckpts):
    """The checks above would pass vacuously if the FP8 path never ran: on these prompts the FP8 models' greedy
    continuations are not all those of the fp32 model."""
    for key, quant in (("dense", "fp8"), ("dense-block128", None), ("dense-static", None)):
        fp8 = [in_process_greedy(ckpts[key], quant, p) for p in PROMPTS]
        fp32 = [in_process_greedy(ckpts["dense"], None, p) for p in PROMPTS]
        assert fp8 != fp32, key
        assert sum(a == b for a, b in zip(fp8, fp32)) >= 3, key  # and most prompts agree


def _launch_in_process(args: list[str], monkeypatch, caplog) -> tuple[int, str]:
    """``python -m sglang.launch_server`` run in this process (its ``main``) with worker spawning replaced by a failure
    (a check that let the launch reach its workers fails the test instead of starting them); returns (exit code,
    logged text)."""
    import sglang.srt.entrypoints.launch as launch
    from sglang import launch_server

    def no_worker(*_a, **_k):
        raise AssertionError("a worker was started")

    monkeypatch.setattr(launch, "_start_local", no_worker)
    monkeypatch.setattr(launch, "launch_ray_workers", no_worker, raising=False)
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)  # main() reconfigures the root logger (basicConfig(force=True))
    log = logging.getLogger("sglang.launch_server")
    log.addHandler(caplog.handler)
    try:
        code = launch_server.main(["--device", "cpu", "--port", str(free_port()), *args])
    finally:
        log.removeHandler(caplog.handler)
        for h in list(root.handlers):
            root.removeHandler(h)
        for h in saved[0]:
            root.addHandler(h)
        root.setLevel(saved[1])
    return code, caplog.text


def _copy_with_config(src: str, dst, edit) -> str:
    os.makedirs(dst, exist_ok=True)
    for f in os.listdir(src):
        with open(os.path.join(src, f), "rb") as fh:
            data = fh.read()
        with open(os.path.join(dst, f), "wb") as fh:
            fh.write(data)
    with open(os.path.join(dst, "config.json")) as fh:
        cfg = json.load(fh)
    edit(cfg)
    with open(os.path.join(dst, "config.json"), "w") as fh:
        json.dump(cfg, fh)
    return str(dst)


@pytest.mark.parametrize("case", ["flag", "quant_method", "weight_block_size", "block_cut"])
def test_unsupported_quantization_fails_before_any_worker(case, ckpts, tmp_path, monkeypatch, caplog):
    """Exit code 2 (a bad flag) or 1 (the checkpoint / TP layout) within seconds, one message naming the flag or
    field and the fix, no worker started."""
    code = 1
    if case == "flag":
        args, want, code = ["--model-path", ckpts["dense"], "--quantization", "int8"], "--quantization='int8'", 2
    elif case == "quant_method":
        path = _copy_with_config(ckpts["dense-block128"], tmp_path / "awq",
                                 lambda c: c["quantization_config"].update(quant_method="awq"))
        args, want = ["--model-path", path], "quantization_config.quant_method='awq'"
    elif case == "weight_block_size":
        path = _copy_with_config(ckpts["dense-block128"], tmp_path / "bad",
                                 lambda c: c["quantization_config"].update(weight_block_size=[128]))
        args, want = ["--model-path", path], "quantization_config.weight_block_size"
    else:  # 128-row blocks, and TP 2 gives each rank 32 query rows
        args, want = ["--model-path", ckpts["dense-block128"], "--tp", "2"], "--tp-size"
    t0 = time.time()
    got, text = _launch_in_process(args, monkeypatch, caplog)
    assert got == code, text[-2000:]
    assert want in text, text[-2000:]
    assert "Traceback" not in text
    assert time.time() - t0 < 60
