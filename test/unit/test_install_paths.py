"""One install path: the README quickstart's command, scripts/install.sh, the Dockerfile and CI install the same
packages the same way (``sglang`` and ``sgl_kernel`` editable from the checkout), and CI runs the README's line.

The line itself is run verbatim in a fresh venv by scripts/check_quickstart.sh (``.ci/run``, before the suite).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _read(*parts: str) -> str:
    with open(os.path.join(REPO, *parts)) as f:
        return f.read()


def readme_block(marker: str) -> str:
    """The code block after the first README line that starts with ``<!-- marker`` (lines between the fences)."""
    lines = _read("README.md").splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("<!-- " + marker))
    assert lines[start + 1].startswith("```"), f"no code block right after the {marker} marker"
    end = next(i for i in range(start + 2, len(lines)) if lines[i].startswith("```"))
    return "\n".join(lines[start + 2:end])


def pip_install_args(command: str) -> tuple[list[str], dict[str, set[str]]]:
    """``(plain requirements, {editable path: extras})`` of the first ``pip install`` in a shell command
    (``python3 -m pip`` or ``pip``; options such as ``-q`` are ignored)."""
    words = shlex.split(command.replace("\\\n", " ").rstrip().rstrip("\\"))
    i = next(k for k in range(len(words) - 1) if words[k] == "pip" and words[k + 1] == "install")
    plain, editable = [], {}
    k = i + 2
    while k < len(words) and words[k] not in ("&&", "||", ";"):
        w = words[k]
        if w == "-e":
            m = re.fullmatch(r"(.+?)(?:\[([^\]]*)\])?", words[k + 1])
            path = os.path.normpath(m.group(1).replace('"$root"/', "").replace("$root/", ""))
            editable[path] = set(filter(None, (m.group(2) or "").split(",")))
            k += 2
            continue
        if not w.startswith("-"):
            plain.append(w)
        k += 1
    return plain, editable


def test_readme_quickstart_installs_sglang_and_sgl_kernel_then_serves():
    line = readme_block("ci:quickstart ")
    assert "\n" not in line.strip(), "the quickstart is one line"
    assert line.strip().endswith("&& python -m sglang.launch_server")
    plain, editable = pip_install_args(line)
    assert plain == ["torch==2.13.0"]
    assert set(editable) == {"python", "sgl-kernel"} and "test" in editable["python"]


def test_install_sh_and_dockerfile_use_the_quickstart_command():
    _, readme = pip_install_args(readme_block("ci:quickstart "))
    install = [ln for ln in _read("scripts", "install.sh").splitlines() if "pip install" in ln]
    plain, editable = pip_install_args(install[0])
    assert plain == pip_install_args(readme_block("ci:quickstart "))[0]
    assert set(editable) == set(readme) and editable["python"] >= readme["python"]
    for ln in install[1:]:  # later lines add extras to the same two editable packages
        assert set(pip_install_args(ln)[1]) == set(readme), ln
    run = [ln for ln in _read("docker", "Dockerfile").splitlines() if "pip install" in ln]
    assert len(run) == 1 and set(pip_install_args(run[0])[1]) == set(readme)


def test_ci_runs_the_readme_quickstart_before_the_tests():
    steps = [ln.strip() for ln in _read(".ci", "run").splitlines() if ln.strip().startswith("bash ")]
    assert steps[0] == "bash scripts/check_quickstart.sh"
    assert steps[1].startswith("bash scripts/run_tests.sh")
    assert "scripts/install.sh" in _read("scripts", "run_tests.sh")


@pytest.mark.parametrize("marker", ["ci:quickstart ", "ci:quickstart-curl", "ci:quickstart-python"])
def test_check_quickstart_extracts_the_readme_blocks(marker):
    """The script's own extractor (its ``block`` shell function) returns exactly the README's block."""
    script = _read("scripts", "check_quickstart.sh")
    fn = re.search(r"^block\(\) \{.*?^\}$", script, re.S | re.M).group(0)
    out = subprocess.run(["bash", "-c", f'{fn}\nblock "$1"', "_", marker], cwd=REPO, capture_output=True,
                         text=True, timeout=30, check=True).stdout
    assert out.rstrip("\n") == readme_block(marker) and out.strip()


def test_sglang_pins_the_in_repo_sgl_kernel():
    tomllib = pytest.importorskip("tomllib")
    with open(os.path.join(REPO, "python", "pyproject.toml"), "rb") as f:
        deps = tomllib.load(f)["project"]["dependencies"]
    with open(os.path.join(REPO, "sgl-kernel", "pyproject.toml"), "rb") as f:
        version = tomllib.load(f)["project"]["version"]
    assert f"sgl-kernel=={version}" in deps
    assert "+" in version, "a local version label keeps PyPI's (unrelated) sgl-kernel from satisfying the pin"
