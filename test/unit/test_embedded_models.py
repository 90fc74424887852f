"""The embedded models: the packaged trained stories260K (the default) and the locally built random Llama.

Checks the package data (byte-identical to ../shared/data/models/stories260K, with its MIT LICENSE), that a built
wheel and sdist contain it, how ``--model-path`` names resolve, and errors (the server tests check that the default speaks English).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import zipfile

import pytest

from sglang.srt.configs.default_model import (DEFAULT_MODEL, EMBEDDED_MODELS, STORIES260K_FILES, TINY_RANDOM_MODEL,
                                              embedded_model_path, stories260k_dir)
from sglang.srt.entrypoints.launch import resolve_model
from sglang.srt.entrypoints.preflight import check_model_path
from sglang.srt.server_args import ServerArgs, prepare_server_args

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from conftest import REPO_ROOT, shared_path  # noqa: E402

PACKAGED = os.path.join(REPO_ROOT, "python", "sglang", "data", "stories260K")


def test_default_is_the_packaged_stories260k():
    assert ServerArgs().model_path == DEFAULT_MODEL == "sglang-tw/stories260K"
    assert prepare_server_args([]).model_path == DEFAULT_MODEL
    assert os.path.realpath(stories260k_dir()) == os.path.realpath(PACKAGED)
    args = resolve_model(ServerArgs())
    assert os.path.realpath(args.model_path) == os.path.realpath(PACKAGED)
    assert args.served_model_name == DEFAULT_MODEL and args.resolved_tokenizer_path == args.model_path
    named = resolve_model(ServerArgs(served_model_name="my-model"))
    assert named.served_model_name == "my-model"


def test_packaged_files_are_the_shared_checkpoint_with_its_licence():
    src = shared_path("models", "stories260K")
    assert sorted(os.listdir(src)) == sorted(STORIES260K_FILES)
    for f in STORIES260K_FILES:
        with open(os.path.join(src, f), "rb") as a, open(os.path.join(PACKAGED, f), "rb") as b:
            assert a.read() == b.read(), f
    licence = open(os.path.join(PACKAGED, "LICENSE")).read()
    assert licence.startswith("MIT License") and "Permission is hereby granted" in licence


def test_names_resolve_and_unknown_ones_fail(tmp_path, monkeypatch):
    for name in EMBEDDED_MODELS:
        check_model_path(ServerArgs(model_path=name))  # no error: embedded names are not folders
    monkeypatch.setenv("SGLANG_TW_CACHE", str(tmp_path))
    rnd = resolve_model(ServerArgs(model_path=TINY_RANDOM_MODEL))
    assert rnd.served_model_name == TINY_RANDOM_MODEL and rnd.model_path.startswith(str(tmp_path))
    assert os.path.isfile(os.path.join(rnd.model_path, "model.safetensors"))
    with pytest.raises(ValueError, match="not an embedded model"):
        embedded_model_path("sglang-tw/nope")


def test_missing_package_data_is_a_clear_error(tmp_path, monkeypatch):
    import sglang.srt.configs.default_model as dm

    monkeypatch.setattr(dm, "stories260k_dir", lambda: str(tmp_path))
    with pytest.raises(ValueError, match=r"missing .*model\.safetensors.*reinstall sglang"):
        dm.embedded_model_path(DEFAULT_MODEL)


def _built_python_tree(tmp_path) -> str:
    """A copy of python/ without build leftovers, so building never writes into the checkout."""
    dst = str(tmp_path / "python")
    shutil.copytree(os.path.join(REPO_ROOT, "python"), dst,
                    ignore=shutil.ignore_patterns("__pycache__", "*.egg-info", "build", "dist", "*.so"))
    return dst


def test_wheel_and_sdist_contain_the_model_and_pin_sgl_kernel(tmp_path):
    pytest.importorskip("setuptools")
    src = _built_python_tree(tmp_path)
    out = str(tmp_path / "dist")
    built = []
    for kind in ("wheel", "sdist"):  # one process each: setuptools keeps state between the two builds
        code = f"import sys; from setuptools import build_meta as b; print('BUILT', b.build_{kind}(sys.argv[1]))"
        r = subprocess.run([sys.executable, "-c", code, out], cwd=src, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        built.append(os.path.join(out, [ln for ln in r.stdout.splitlines() if ln.startswith("BUILT ")][-1].split()[1]))
    wheel, sdist = built
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        meta = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    for f in STORIES260K_FILES:
        assert f"sglang/data/stories260K/{f}" in names, f
    kernel_version = _project_version(os.path.join(REPO_ROOT, "sgl-kernel", "pyproject.toml"))
    assert f"Requires-Dist: sgl-kernel=={kernel_version}" in meta
    with tarfile.open(sdist) as t:
        snames = {n.split("/", 1)[1] for n in t.getnames() if "/" in n}
    for f in STORIES260K_FILES:
        assert f"sglang/data/stories260K/{f}" in snames, f


def _project_version(pyproject: str) -> str:
    """``[project].version`` of a pyproject.toml."""
    tomllib = pytest.importorskip("tomllib")
    with open(pyproject, "rb") as f:
        return tomllib.load(f)["project"]["version"]


def test_random_model_is_built_deterministically(tmp_path):
    """``sglang-tw/tiny-random-llama`` (stack tests) is built locally; two builds are byte-identical."""
    from sglang.srt.configs.default_model import ensure_default_model

    a = ensure_default_model(str(tmp_path / "a"))
    b = ensure_default_model(str(tmp_path / "b"))
    for f in ("model.safetensors", "tokenizer.json", "config.json"):
        assert open(os.path.join(a, f), "rb").read() == open(os.path.join(b, f), "rb").read(), f
