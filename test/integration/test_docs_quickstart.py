"""docs/quickstart.md, tested as written.

Every code block carries a ``<!-- test: KIND [GROUP] ... -->`` comment right above it:

* ``serve G`` / ``request G``: run on CPU here. For group ``G`` the serve blocks start in order (each in its own
  process group, waiting for ``/health`` on its ``--port``), then each request block runs and must print an English
  answer, then the servers are stopped. The doc's ports (30000, 30001, 8000, 8998) are replaced by free ones; the
  install part of a ``cmd && server`` block must be the README quickstart line (scripts/check_quickstart.sh runs
  that verbatim) and only the server part runs here.
* ``gpu``: not run; its ``python -m sglang.launch_server`` lines are parsed by the real CLI (as are all others).
* ``same-as docs/ray.md NAME``: byte-identical to that docs/ray.md example, which test_ray_cluster.py runs.
* ``skip (reason)``: not run (downloads, cluster setup), for the reason given.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time

import pytest
import requests

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from conftest import REPO_ROOT, shared_path  # noqa: E402
from server_utils import ENV, free_port  # noqa: E402

DOC = os.path.join(REPO_ROOT, "docs", "quickstart.md")
DOC_PORTS = ("30000", "30001", "8000", "8998")
GROUPS = ("cpu", "real", "tp", "pd", "afd")
KINDS = ("serve", "request", "gpu", "same-as", "skip")


def blocks(path: str = DOC) -> list[dict]:
    """The fenced code blocks of ``path``: ``{"marker", "kind", "group", "lang", "code", "line"}`` (marker: the
    ``<!-- test: ... -->`` text right above the fence, or None)."""
    lines = open(path).read().splitlines()
    out, i = [], 0
    while i < len(lines):
        m = re.match(r"^```(\w*)\s*$", lines[i])
        if not m or not m.group(1):
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        prev = lines[i - 1] if i else ""
        mk = re.fullmatch(r"<!-- test: (.*) -->", prev)
        words = mk.group(1).split() if mk else [None, None]
        out.append({"marker": mk.group(1) if mk else None, "kind": words[0], "group": words[1] if len(words) > 1
                    else None, "lang": m.group(1), "code": "\n".join(lines[i + 1:end]), "line": i + 1})
        i = end + 1
    return out


def commands(code: str) -> list[str]:
    """Shell commands of a bash block as written, one per logical line (continuations and quoted newlines joined,
    comment lines dropped)."""
    out, acc = [], ""
    for ln in re.sub(r"\\\n\s*", " ", code).splitlines():
        if not acc and (not ln.strip() or ln.lstrip().startswith("#")):
            continue
        acc = f"{acc}\n{ln}" if acc else ln
        try:
            shlex.split(acc, comments=True)
        except ValueError:  # a quote still open: the command goes on
            continue
        out.append(acc)
        acc = ""
    assert not acc, f"unclosed quote in {code!r}"
    return out


def readme_quickstart() -> str:
    """The README's quickstart line (the block after its ``<!-- ci:quickstart `` marker)."""
    text = open(os.path.join(REPO_ROOT, "README.md")).read()
    return re.search(r"<!-- ci:quickstart .*?-->\n```bash\n(.*?)\n```", text, re.S).group(1)


def test_every_block_is_marked_and_groups_are_complete():
    bs = blocks()
    assert bs, "docs/quickstart.md has no code blocks"
    for b in bs:
        assert b["kind"] in KINDS, f"docs/quickstart.md:{b['line']}: block without a valid '<!-- test: -->' marker"
        if b["kind"] in ("serve", "request"):
            assert b["group"] in GROUPS, f"docs/quickstart.md:{b['line']}: group {b['group']!r} not in {GROUPS}"
    for g in GROUPS:
        kinds = [b["kind"] for b in bs if b["group"] == g and b["kind"] in ("serve", "request")]
        assert "serve" in kinds and "request" in kinds, g


def _launch_argv(cmd: str):
    """The launch_server arguments of a shell command, or None when it starts no server."""
    words = shlex.split(cmd, comments=True)
    for k in range(len(words) - 2):
        if words[k].startswith("python") and words[k + 1:k + 3] == ["-m", "sglang.launch_server"]:
            rest = words[k + 3:]
            return rest[:rest.index("&&")] if "&&" in rest else rest
    return None


def test_every_launch_command_matches_the_cli():
    """All launch_server lines (CPU, GPU, Ray) use real flags with valid values."""
    from sglang.srt.server_args import prepare_server_args

    seen = 0
    for b in blocks():
        if b["lang"] != "bash":
            continue
        for cmd in commands(b["code"]):
            argv = _launch_argv(cmd)
            if argv is None:
                continue
            seen += 1
            try:
                prepare_server_args(argv)
            except (SystemExit, ValueError) as e:
                pytest.fail(f"docs/quickstart.md:{b['line']}: {cmd!r} is refused by the CLI: {e!r}")
    assert seen >= 9, seen


def test_install_line_is_the_readme_quickstart_and_same_as_blocks_match():
    bs = blocks()
    installs = [b for b in bs if b["kind"] == "serve" and "&&" in b["code"]]
    assert [b["code"] for b in installs] == [readme_quickstart()]
    for b in bs:
        if b["kind"] == "same-as":
            _, doc, name = b["marker"].split()[:3]
            text = open(os.path.join(REPO_ROOT, doc)).read()
            m = re.search(rf"<!-- example: {re.escape(name)} -->\s*```bash\n(.*?)\n```", text, re.S)
            assert m and m.group(1) == b["code"], f"docs/quickstart.md:{b['line']} differs from {doc} {name}"


# ------------------------------------------------------------------------------------------------ run on CPU
def _answer_text(out: str) -> str:
    """The generated text in a request's output: a /generate or OpenAI JSON answer, or plain printed text."""
    try:
        obj = json.loads(out)
    except ValueError:
        return out
    assert isinstance(obj, dict) and "error" not in obj, out
    if "text" in obj:
        return obj["text"]
    choice = obj["choices"][0]
    return choice.get("text") or choice["message"]["content"]


def _with_ports(code: str, ports: dict) -> str:
    for doc_port, port in ports.items():
        code = re.sub(rf"(?<![0-9]){doc_port}(?![0-9])", str(port), code)
    return code


class _Group:
    """The running processes of one group; :meth:`stop` ends each process group and reports survivors."""

    def __init__(self, tmp_path, env: dict, cwd: str):
        self.tmp, self.env, self.cwd, self.procs = tmp_path, env, cwd, []

    def serve(self, cmd: str, timeout: float = 240.0) -> None:
        log = self.tmp / f"server{len(self.procs)}.log"
        with open(log, "w") as f:
            proc = subprocess.Popen(["bash", "-c", cmd], stdout=f, stderr=subprocess.STDOUT, env=self.env,
                                    cwd=self.cwd, start_new_session=True)
        self.procs.append((proc, log))
        port = re.search(r"--port (\d+)", cmd).group(1)
        deadline = time.time() + timeout
        while time.time() < deadline:
            assert proc.poll() is None, f"{cmd!r} exited with {proc.returncode}:\n{log.read_text()[-3000:]}"
            try:
                if requests.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.5)
        pytest.fail(f"{cmd!r} not healthy within {timeout} s:\n{log.read_text()[-3000:]}")

    def stop(self) -> list:
        left = []
        for proc, log in reversed(self.procs):
            for sig, wait in ((signal.SIGTERM, 60), (signal.SIGKILL, 10)):
                if proc.poll() is None:
                    try:
                        os.killpg(proc.pid, sig)
                    except ProcessLookupError:
                        pass
                    try:
                        proc.wait(wait)
                    except subprocess.TimeoutExpired:
                        left.append(str(log))
        return left


@pytest.mark.slow
@pytest.mark.parametrize("group", GROUPS)
def test_cpu_group_runs_as_written(group, tmp_path):
    cwd = REPO_ROOT
    if group == "real":  # a local stand-in for the downloaded folder: the doc's command serves it by that name
        cwd = str(tmp_path)
        os.symlink(shared_path("models", "stories260K"), tmp_path / "Qwen2.5-0.5B-Instruct")
    if group == "afd":
        shared_path("models", "stories260K-moe")
    bindir = tmp_path / "bin"  # `python` in the doc is this interpreter
    bindir.mkdir()
    os.symlink(sys.executable, bindir / "python")
    env = {**ENV, "PATH": f"{bindir}{os.pathsep}{ENV.get('PATH', '')}"}
    ports = {p: free_port() for p in DOC_PORTS}
    run = _Group(tmp_path, env, cwd)
    try:
        for b in [b for b in blocks() if b["group"] == group and b["kind"] == "serve"]:
            for cmd in commands(b["code"]):
                if "&&" in cmd:  # `install && serve`: the install is scripts/check_quickstart.sh's
                    cmd = cmd.rsplit("&&", 1)[1].strip()
                if _launch_argv(cmd) is not None and "--port" not in cmd:
                    cmd += " --port 30000"
                run.serve(_with_ports(cmd, ports))
        for b in [b for b in blocks() if b["group"] == group and b["kind"] == "request"]:
            code = _with_ports(b["code"], ports)
            argv = ["bash", "-c", code] if b["lang"] == "bash" else [sys.executable, "-c", code]
            r = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=cwd, timeout=180)
            assert r.returncode == 0, f"docs/quickstart.md:{b['line']}: {r.stderr[-2000:]}"
            text = _answer_text(r.stdout)
            assert text.isascii() and re.search(r"[A-Za-z]+(\W+[A-Za-z]+){7}", text), (b["line"], r.stdout)
    finally:
        assert run.stop() == [], "processes survived SIGKILL"
