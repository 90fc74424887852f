"""Shared pytest setup: the GPU markers (skipped without CUDA; ``gpu`` is the one-GPU smoke selection, ``gpu_extended``
the long rest, see test/README.md), GPU memory released after every in-process GPU test, shared data paths."""

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
    """Import the benchmark module ``benchmark.<name>`` (e.g. ``"comm.bench_allreduce_rmsnorm"``: a subject folder and a
    file of it); the repository root is on ``sys.path`` (above), so the ``benchmark`` package resolves from here."""
    import importlib

    return importlib.import_module(f"benchmark.{name}")


GPU_MARKERS = ("gpu", "gpu_extended")
"""Markers of tests that need CUDA. ``gpu``: the smoke selection (every GPU code path once; ``pytest -m gpu`` on one
GPU stays under 8 minutes); ``gpu_extended``: the long rest (more shapes, more worlds, whole flows;
``pytest -m gpu_extended``). A test carries exactly one of them."""


def gpu_tiered(values, smoke=1, ids=None) -> list:
    """``values`` of a ``parametrize`` as ``pytest.param`` entries marked ``gpu`` (the smoke selection) or
    ``gpu_extended``: ``smoke`` is how many leading values are smoke (an int) or their indices (a collection). A tuple
    value is unpacked into the parameters; ``ids`` (a list) names the entries."""
    chosen = set(range(smoke)) if isinstance(smoke, int) else set(smoke)
    out = []
    for i, v in enumerate(values):
        mark = pytest.mark.gpu if i in chosen else pytest.mark.gpu_extended
        args = v if isinstance(v, tuple) else (v,)
        out.append(pytest.param(*args, marks=mark, id=None if ids is None else ids[i]))
    return out


@pytest.hookimpl(tryfirst=True, optionalhook=True)  # optional: a hook of pytest-xdist, absent without it
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadfile`` runs files (and the groups of files that must not overlap) heaviest first: see
    ``test/parallel_plan.py``."""
    if config.getvalue("dist") != "loadfile":
        return None
    import parallel_plan

    return parallel_plan.make_scheduler(config, log)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    if hasattr(config, "workerinput"):  # a pytest-xdist worker: the heaviest files first (test/parallel_plan.py)
        import parallel_plan

        parallel_plan.heavy_first(items)
    try:
        import torch

        has_gpu = torch.cuda.is_available()
    except Exception:
        has_gpu = False
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        tiers = [m for m in GPU_MARKERS if item.get_closest_marker(m) is not None]
        if len(tiers) > 1:
            raise pytest.UsageError(f"{item.nodeid} is marked both gpu and gpu_extended; a GPU test is in one tier")
        if tiers == ["gpu"]:
            item.add_marker(pytest.mark.gpu_smoke)  # -m gpu_smoke is the same selection as -m gpu
        if tiers and not has_gpu:
            item.add_marker(skip)


def release_gpu_memory() -> None:
    """Free what in-process GPU tests left on the device: drop the frames a failed test's traceback keeps alive
    (``sys.last_traceback``, set by pytest, holds the test's locals), collect garbage (a ModelRunner, its KV pool and
    CUDA graphs live in reference cycles until then) and return PyTorch's cached blocks to the driver. Without this, a
    later test that starts a server (which sizes its KV pool from the device's free memory) finds the memory still
    held by this pytest process. A no-op when this process never initialised CUDA."""
    import sys

    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return
    import gc
    import traceback

    if getattr(sys, "last_traceback", None) is not None:
        traceback.clear_frames(sys.last_traceback)
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


@pytest.fixture(autouse=True)
def _release_gpu_memory_after_gpu_test(request):
    yield
    if any(request.node.get_closest_marker(m) is not None for m in GPU_MARKERS):
        release_gpu_memory()


@pytest.fixture(autouse=True, scope="module")
def _release_gpu_memory_after_module():
    yield  # torn down after the module's own fixtures (e.g. GPU layers held for all its tests)
    release_gpu_memory()
