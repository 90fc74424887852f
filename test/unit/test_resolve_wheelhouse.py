"""scripts/resolve_wheelhouse.py: the METADATA-driven resolver, against a local fake index (no network)."""

from __future__ import annotations

import importlib.util
import os
import random
import zipfile

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
spec = importlib.util.spec_from_file_location("resolve_wheelhouse", os.path.join(REPO, "scripts", "resolve_wheelhouse.py"))
rw = importlib.util.module_from_spec(spec)
spec.loader.exec_module(rw)


def _write_wheel(dest: str, name: str, version: str, requires: list[str]) -> None:
    fn = f"{name.replace('-', '_')}-{version}-py3-none-any.whl"
    meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n" + "".join(
        f"Requires-Dist: {r}\n" for r in requires)
    with zipfile.ZipFile(os.path.join(dest, fn), "w") as z:
        z.writestr(f"{name.replace('-', '_')}-{version}.dist-info/METADATA", meta)


def _fake_pip(index: dict, calls: list):
    def pip_download(spec_str, dest, pyver, tags):
        req = Requirement(spec_str)
        versions = [v for v in index[rw.canonicalize_name(req.name)] if req.specifier.contains(Version(v))]
        assert versions, f"fake index has no {spec_str}"
        best = max(versions, key=Version)
        calls.append(spec_str)
        _write_wheel(dest, req.name, best, index[rw.canonicalize_name(req.name)][best])
    return pip_download


def test_resolves_recursively_with_markers_extras_present_and_replacement(tmp_path, monkeypatch):
    index = {
        "a": {"2.0": ["c", "d; extra == 'x'", "e; python_version < '3.10'", "f"]},
        "b": {"1.0": ["c<2", "a[x]"]},
        "c": {"1.0": [], "1.6": ["g>=3"], "2.5": []},
        "d": {"0.1": []}, "e": {"1.0": []}, "f": {"1.0": ["h"]}, "h": {"1.0": []},
        "g": {"2.0": [], "3.1": []},
    }
    calls: list = []
    monkeypatch.setattr(rw, "pip_download", _fake_pip(index, calls))
    top = ["a>=1", "b"]
    random.shuffle(top)
    done = rw.resolve(top, str(tmp_path), present={"f"}, pyver="3.12", tags=rw.platform_tags(35))
    versions = {n: str(rw.wheel_name_version(fn)[1]) for n, fn in done.items()}
    assert versions == {"a": "2.0", "b": "1.0", "c": "1.6", "d": "0.1", "g": "3.1"}
    assert sorted(os.listdir(tmp_path)) == sorted(done.values()), "a replaced wheel must be deleted"
    assert not any(c.startswith(("e", "f", "h")) for c in calls)


def test_read_present_accepts_freeze_and_plain_names(tmp_path):
    p = tmp_path / "present.txt"
    p.write_text("# comment\nTorch==2.13.0\ntyping_extensions @ file:///x\n-e git+https://x#egg=y\nNumPy\n\n")
    assert rw.read_present(str(p)) == {"torch", "typing-extensions", "numpy"}


def test_marker_env_is_the_target_python():
    env = rw.target_env("3.12")
    assert rw.marker_ok(Requirement("x; python_version >= '3.12' and sys_platform == 'linux'"), env, set())
    assert not rw.marker_ok(Requirement("x; python_version < '3.12'"), env, set())
    assert rw.marker_ok(Requirement("x; extra == 'y'"), env, {"y"})
    assert not rw.marker_ok(Requirement("x; extra == 'y'"), env, set())
    tags = rw.platform_tags(35)
    assert tags[0] == "manylinux_2_35_x86_64" and "manylinux_2_17_x86_64" in tags and "manylinux2014_x86_64" in tags


def test_unknown_extra_is_an_error(tmp_path):
    p = tmp_path / "pyproject.toml"
    p.write_text('[project]\nname = "z"\ndependencies = ["q"]\n[project.optional-dependencies]\nt = ["r"]\n')
    assert rw.read_pyproject_requirements(str(p), ["t"]) == ["q", "r"]
    with pytest.raises(SystemExit, match="extra 'nope'"):
        rw.read_pyproject_requirements(str(p), ["nope"])
