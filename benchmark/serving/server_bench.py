"""The serving part of ``benchmark/serving/bench_gpu_targets.py``: start ``python -m sglang.launch_server`` with dummy
weights, run ``python -m sglang.bench_serving`` against it, stop it, and summarize its JSONL record
(output tok/s, TTFT/TPOT/ITL). CPU-only imports; the server decides the device.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from benchmark.common.floors import summarize_serving
from sglang.bench_one_batch import NVLS_OFF_ENV

REPO = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child_env() -> dict:
    env = dict(os.environ, **NVLS_OFF_ENV, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO / "python"), env.get("PYTHONPATH")) if p)
    return env


def server_command(cfg, port: int) -> list[str]:
    """argv of ``python -m sglang.launch_server`` with dummy weights on ``port`` for the serving part."""
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", cfg.model_path, "--load-format", "dummy",
           "--tokenizer-path", cfg.tokenizer_path, "--dtype", cfg.dtype, "--device", cfg.device, "--port", str(port)]
    return cmd + (["--attention-backend", cfg.attention_backend] if cfg.attention_backend else [])


def bench_serving_command(cfg, port: int, jsonl: str) -> list[str]:
    """argv of ``python -m sglang.bench_serving`` (random dataset, fixed lengths) writing its JSONL to ``jsonl``."""
    return [sys.executable, "-m", "sglang.bench_serving", "--backend", "sglang", "--port", str(port),
            "--tokenizer", cfg.tokenizer_path, "--dataset-name", "random", "--random-input-len",
            str(cfg.serving_input_len), "--random-output-len", str(cfg.serving_output_len), "--random-range-ratio", "1",
            "--num-prompts", str(cfg.serving_prompts), "--max-concurrency", str(cfg.serving_concurrency),
            "--disable-tqdm", "--output-file", jsonl]


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM the server we started (it stops its own children), then SIGKILL whatever is left of its
    process group (its own session: ``start_new_session=True``, so the group id is its pid)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait(10)


def measure_serving(cfg, stem: Path, deadline: float) -> dict:
    """Start a server, run bench_serving against it, stop it; logs at ``<stem>_server.log`` / ``_bench_serving.log``."""
    port = _free_port()
    jsonl = Path(f"{stem}_bench_serving.jsonl")
    jsonl.unlink(missing_ok=True)
    srv_log = open(f"{stem}_server.log", "w")
    cmd = server_command(cfg, port)
    proc = subprocess.Popen(cmd, stdout=srv_log, stderr=subprocess.STDOUT, env=_child_env(), start_new_session=True)
    try:
        t0 = time.monotonic()
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited with code {proc.returncode} (see {srv_log.name})")
            if time.monotonic() > deadline - 30:
                raise RuntimeError(f"the server was not healthy after {time.monotonic() - t0:.0f} s "
                                   f"(see {srv_log.name})")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            time.sleep(1)
        startup = time.monotonic() - t0
        bcmd = bench_serving_command(cfg, port, str(jsonl))
        with open(f"{stem}_bench_serving.log", "w") as blog:
            rc = subprocess.run(bcmd, stdout=blog, stderr=subprocess.STDOUT, env=_child_env(),
                                timeout=max(10.0, deadline - time.monotonic() - 10)).returncode
        if rc != 0 or not jsonl.exists():
            raise RuntimeError(f"bench_serving exited with code {rc} (see {stem}_bench_serving.log)")
        rec = json.loads([ln for ln in jsonl.read_text().splitlines() if ln.strip()][-1])
        return {"server_startup_s": startup, "server_command": " ".join(cmd[1:]),
                "bench_command": " ".join(bcmd[1:]), **summarize_serving(rec)}
    finally:
        _stop(proc)
        srv_log.close()
