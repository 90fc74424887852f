"""Shared pytest setup: the ``gpu`` marker skips without CUDA; shared data paths."""

from __future__ import annotations

import os

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED_DATA = os.path.join(os.path.dirname(REPO_ROOT), "shared", "data")

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")


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
