"""FP8 weights end to end on CPU: ``--quantization fp8`` and FP8 checkpoints (detected from config.json) serve the
greedy tokens of the same model run in this process (TP 1), also with ``--tp 2`` (gloo ranks, one per process) and
expert parallelism; unsupported flags and checkpoints are refused before any worker starts, naming the field.

Exactness under TP: the per-tensor checkpoint's static activation scales and the block checkpoint's per-token 1 x
``block_k`` groups (each group inside one rank's columns) quantize every activation as TP 1 does, so TP 2 differs from
TP 1 only by the all-reduce's summation order. Online ``--quantization fp8`` scales a row-parallel layer's input per
token over the rank's own columns (as SGLang does), so TP 2 is not exact by construction; on these prompts it gives
the TP 1 tokens as well (checked, deterministic).
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import time

import pytest
import requests

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
from conftest import shared_path  # noqa: E402
from server_utils import ENV, ServerProcess  # noqa: E402

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


SERVERS = {  # id -> (checkpoint key, extra flags, --quantization for the in-process reference)
    "online-tp1": ("dense", ["--quantization", "fp8"], "fp8"),
    "block128-tp1": ("dense-block128", [], None),
    "online-tp2": ("dense", ["--quantization", "fp8", "--tp", "2"], "fp8"),
    "static-tp2": ("dense-static", ["--tp", "2"], None),
    "block2-tp2": ("dense-block2", ["--tp", "2"], None),
    "moe-block2-tp2": ("moe-block2", ["--tp", "2"], None),
    "moe-static-tp2-ep2": ("moe-static", ["--tp", "2", "--ep-size", "2"], None),
}


@pytest.fixture(scope="module", params=sorted(SERVERS))
def server(request, ckpts):
    key, flags, quant = SERVERS[request.param]
    path = ckpts[key]
    with ServerProcess(["--model-path", path, "--device", "cpu", "--chunked-prefill-size", "16", *flags]) as s:
        s.model_path, s.quantization, s.name = path, quant, request.param
        yield s


def test_fp8_server_gives_the_in_process_tokens(server):
    params = {"temperature": 0, "max_new_tokens": N_NEW, "ignore_eos": True}
    r = requests.post(server.url + "/generate", json={"text": PROMPTS, "sampling_params": params}, timeout=300)
    assert r.status_code == 200, r.text
    for prompt, out in zip(PROMPTS, r.json()):
        assert out["output_ids"] == in_process_greedy(server.model_path, server.quantization, prompt), \
            (server.name, prompt)
    info = requests.get(server.url + "/get_server_info", timeout=30).json()
    assert info["quantization"] == server.quantization


def test_fp8_tokens_differ_from_the_model_dtype_somewhere(ckpts):
    """The checks above would pass vacuously if the FP8 path never ran: on these prompts the FP8 models' greedy
    continuations are not all those of the fp32 model."""
    for key, quant in (("dense", "fp8"), ("dense-block128", None), ("dense-static", None)):
        fp8 = [in_process_greedy(ckpts[key], quant, p) for p in PROMPTS]
        fp32 = [in_process_greedy(ckpts["dense"], None, p) for p in PROMPTS]
        assert fp8 != fp32, key
        assert sum(a == b for a, b in zip(fp8, fp32)) >= 3, key  # and most prompts agree


def _launch(args, timeout=120):
    return subprocess.run([sys.executable, "-m", "sglang.launch_server", "--device", "cpu", "--port", "1", *args],
                          capture_output=True, text=True, timeout=timeout, env=ENV)


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
def test_unsupported_quantization_fails_before_any_worker(case, ckpts, tmp_path):
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
    p = _launch(args)
    assert p.returncode == code, p.stderr[-2000:]
    assert want in p.stderr, p.stderr[-2000:]
    assert "started (pid" not in p.stderr and "Traceback" not in p.stderr
    assert time.time() - t0 < 60
