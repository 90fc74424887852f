"""Shared pytest setup: the ``gpu`` marker skips without CUDA; shared data paths."""

from __future__ import annotations

import os
import sys

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED_DATA = os.path.join(os.path.dirname(REPO_ROOT), "shared", "data")
if REPO_ROOT not in sys.path:  # the ``benchmark`` package (benchmark/common, benchmark/<subject>) imports from here
    sys.path.insert(0, REPO_ROOT)


def _apply_nvls_off_env() -> None:
    """NVLink multicast is forbidden on our hosts: set the multicast-off environment (defined once, in
    ``sglang/srt/utils/nvls_env.py``, loaded by path so that this file imports no package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "_nvls_env", os.path.join(REPO_ROOT, "python", "sglang", "srt", "utils", "nvls_env.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.apply_nvls_off_env()


_apply_nvls_off_env()


try:  # small reference models: one thread avoids OpenMP spin contention with the servers under test
    import torch

    torch.set_num_threads(1)
except ImportError:
    pass


def shared_path(*parts: str) -> str:
    """Path under ``../shared/data``; skips the calling test when it is absent."""
    p = os.path.join(SHARED_DATA, *parts)
    if not os.path.exists(p):
        pytest.skip(f"shared test data {p} is absent (it lives beside the checkout in ../shared/data)")
    return p


def load_benchmark(name: str):
    """Import ``benchmark/<name>.py`` by path (the folder is not a package), with ``benchmark/`` on ``sys.path`` for
    its sibling imports; registered in ``sys.modules`` (dataclasses look their module up there)."""
    import importlib.util
    import sys

    bench = os.path.join(REPO_ROOT, "benchmark")
    if bench not in sys.path:
        sys.path.insert(0, bench)
    spec = importlib.util.spec_from_file_location(name, os.path.join(bench, f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_gpu = torch.cuda.is_available()
    except Exception:
        has_gpu = False
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(skip)
