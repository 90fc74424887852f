"""docs/quickstart.md's GPU blocks (one GPU, TP on two GPUs, PD on two GPUs, AFD), run as written on a GPU host.

The downloaded checkpoints the doc names are replaced by local stand-ins of the same (dense / MoE) kind, served
under the doc's folder names: ``Qwen2.5-0.5B-Instruct`` -> stories260K, ``Qwen1.5-MoE-A2.7B`` -> stories260K-moe
(from ../shared/data; the test skips without them). Each block's servers start on free ports (its ``export``
line is the multicast-off environment every test process already has), then the README's request goes to the
last one started (the router for PD) and must be answered with English text; then everything is stopped.
Run: ``python3 -m pytest test/gpu/test_docs_quickstart_gpu.py`` (``scripts/gpu/two_gpu.sh quickstart_docs``).
"""

from __future__ import annotations

import os
import re
import sys

import pytest
import requests
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "integration"))
from conftest import shared_path  # noqa: E402
from server_utils import ENV, free_port  # noqa: E402
from test_docs_quickstart import DOC_PORTS, _Group, _launch_argv, _with_ports, blocks, commands  # noqa: E402

from sglang.srt.utils.nvls_env import NVLS_OFF_ENV  # noqa: E402

# A docs check: the one-GPU server path it runs is smoke-tested by test_gpu_correctness.py.
pytestmark = pytest.mark.gpu_extended
STANDINS = {"Qwen2.5-0.5B-Instruct": "stories260K", "Qwen1.5-MoE-A2.7B": "stories260K-moe"}
GPU_BLOCKS = [b for b in blocks() if b["kind"] == "gpu"]


def _gpus_needed(code: str) -> int:
    """GPUs a block's commands use: TP 2, or two servers / AFD workers on GPUs 0 and 1."""
    return 2 if re.search(r"--tp 2|--base-gpu-id 1|--enable-afd", code) else 1


@pytest.mark.parametrize("block", GPU_BLOCKS, ids=[f"line{b['line']}" for b in GPU_BLOCKS])
def test_gpu_block_serves_english(block, tmp_path):
    need = _gpus_needed(block["code"])
    if torch.cuda.device_count() < need:
        pytest.skip(f"needs {need} GPUs")
    for name, standin in STANDINS.items():
        if name in block["code"]:
            os.symlink(shared_path("models", standin), tmp_path / name)
    env = {**ENV, **NVLS_OFF_ENV}
    ports = {p: free_port() for p in DOC_PORTS}
    run = _Group(tmp_path, env, str(tmp_path))
    try:
        last = None
        for cmd in commands(block["code"]):
            if cmd.startswith("export "):
                assert all(f"{k}={v}" in cmd for k, v in NVLS_OFF_ENV.items()), cmd
                continue
            assert _launch_argv(cmd) is not None or "mini_lb" in cmd, cmd
            cmd = _with_ports(cmd.replace("python -m", f"{sys.executable} -m", 1), ports)
            run.serve(cmd, timeout=420)
            last = re.search(r"--port (\d+)", cmd).group(1)
        body = {"text": "Once upon a time", "sampling_params": {"temperature": 0, "max_new_tokens": 32}}
        r = requests.post(f"http://127.0.0.1:{last}/generate", json=body, timeout=180)
        assert r.status_code == 200, r.text
        text = r.json()["text"]
        assert text.isascii() and re.search(r"[A-Za-z]+(\W+[A-Za-z]+){7}", text), text
    finally:
        assert run.stop() == [], "processes survived SIGKILL"
