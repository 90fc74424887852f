"""Shared pieces of the ``--use-ray`` tests: the single-process reference, HTTP helpers, the README example."""

from __future__ import annotations

import os
import re
import time

import requests

from server_utils import ServerProcess  # noqa: E402

PROMPTS = ["Once upon a time", "The little dog", "Lily and Tom went to the park. They"]
N_NEW = 24
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def generate(url: str, payload: dict, timeout: float = 120.0) -> list:
    r = requests.post(url + "/generate", json=payload, timeout=timeout)
    assert r.status_code == 200, r.text
    return r.json()


def greedy_payload() -> dict:
    return {"text": PROMPTS, "sampling_params": {"temperature": 0, "max_new_tokens": N_NEW}}


def loaded_ray(pid: int) -> bool:
    """True when process ``pid`` has Ray's core library mapped (i.e. imported ``ray``)."""
    try:
        with open(f"/proc/{pid}/maps") as f:
            return "_raylet" in f.read()
    except OSError:
        return False


def single_process_reference(model_path: str) -> list[list[int]]:
    """Greedy output ids of :data:`PROMPTS` from the plain single-process server (no Ray, TP 1); also checks
    that neither it nor its children imported ``ray`` (the server without ``--use-ray`` never does)."""
    import psutil

    with ServerProcess(["--model-path", model_path, "--device", "cpu"], timeout=180) as srv:
        outs = [o["output_ids"] for o in generate(srv.url, greedy_payload())]
        pids = [srv.proc.pid] + [c.pid for c in psutil.Process(srv.proc.pid).children(recursive=True)]
        assert len(pids) >= 3 and not any(loaded_ray(p) for p in pids), "the plain server imported ray"
        return outs


def wait_healthy(url: str, timeout: float, alive=lambda: True, log=lambda: "") -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if not alive():
            raise RuntimeError(f"the server exited before it was healthy:\n{log()}")
        try:
            if requests.get(url + "/health", timeout=2).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"server not healthy after {timeout} s:\n{log()}")


def readme_example(name: str) -> str:
    """The shell command of the ``<!-- example: name -->`` block in docs/ray.md (continuations joined)."""
    text = open(os.path.join(REPO, "docs", "ray.md")).read()
    m = re.search(rf"<!-- example: {re.escape(name)} -->\s*```(?:bash|sh)?\n(.*?)```", text, re.S)
    assert m, f"docs/ray.md has no example block {name!r}"
    lines = [ln for ln in m.group(1).splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    return " ".join(ln.rstrip().rstrip("\\").strip() for ln in lines)
