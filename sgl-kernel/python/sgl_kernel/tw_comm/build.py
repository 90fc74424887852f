"""JIT build of tw-comm's CUDA library (tw-comm/csrc/allreduce_rmsnorm/*.cu) with nvcc, cached by content hash.

The library has a plain C API (tw-comm/include/tw_comm/tw_comm.h) loaded with ctypes, so the build needs no
torch headers: each .cu compiles in parallel with ``nvcc -gencode=arch=compute_90a,code=sm_90a`` and links with
the shared CUDA runtime (the one torch already loaded). The result lands in ``$TW_COMM_CACHE`` (default
``~/.cache/sgl_kernel``) as ``libtwcomm-<hash>.so``; concurrent ranks serialize on a lock file.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional, Tuple

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BuildConfig:
    """How to build libtwcomm: source dir (tw-comm/), nvcc path, gencode target, extra flags, cache dir."""

    source_dir: Path
    nvcc: str
    gencode: str = "arch=compute_90a,code=sm_90a"
    extra_flags: Tuple[str, ...] = ("-O3", "-std=c++17", "-lineinfo")
    cache_dir: Path = field(default_factory=lambda: Path(os.environ.get("TW_COMM_CACHE", "~/.cache/sgl_kernel")))


def default_source_dir() -> Path:
    """tw-comm's root: ``$TW_COMM_SRC`` if set, else the repo layout (<repo>/tw-comm next to sgl-kernel/)."""
    env = os.environ.get("TW_COMM_SRC")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[4] / "tw-comm"


def find_nvcc() -> Optional[str]:
    """Path of nvcc: ``$CUDA_HOME/bin/nvcc`` if present, else the one on PATH, else None."""
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home and (Path(home) / "bin" / "nvcc").exists():
        return str(Path(home) / "bin" / "nvcc")
    return shutil.which("nvcc")


def default_config() -> BuildConfig:
    """BuildConfig from the environment; raises RuntimeError if nvcc is missing."""
    nvcc = find_nvcc()
    if nvcc is None:
        raise RuntimeError("nvcc not found: set CUDA_HOME or put nvcc on PATH to build tw-comm")
    return BuildConfig(source_dir=default_source_dir(), nvcc=nvcc)


def cuda_sources(source_dir: Path) -> List[Path]:
    """Every tw-comm CUDA source (sorted)."""
    srcs = sorted((source_dir / "csrc" / "allreduce_rmsnorm").glob("*.cu"))
    if not srcs:
        raise RuntimeError(f"no tw-comm sources under {source_dir}; set TW_COMM_SRC to the tw-comm directory")
    return srcs


def compile_command(cfg: BuildConfig, src: Path, obj: Path) -> List[str]:
    """nvcc command line compiling one source to a PIC object."""
    return [
        cfg.nvcc, *cfg.extra_flags, f"-gencode={cfg.gencode}", "-Xcompiler", "-fPIC",
        f"-I{cfg.source_dir / 'include'}", "-c", str(src), "-o", str(obj),
    ]


def _digest(cfg: BuildConfig) -> str:
    h = hashlib.sha256()
    files = cuda_sources(cfg.source_dir) + sorted(cfg.source_dir.glob("include/**/*.h"))
    files += sorted((cfg.source_dir / "csrc" / "allreduce_rmsnorm").glob("*.cuh"))
    files += sorted((cfg.source_dir / "csrc" / "allreduce_rmsnorm").glob("*.h"))
    for f in files:
        h.update(f.name.encode())
        h.update(f.read_bytes())
    h.update(" ".join((cfg.gencode, *cfg.extra_flags)).encode())
    return h.hexdigest()[:16]


def _run(cmd: List[str]) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"command failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr[-4000:]}")


def build_library(cfg: Optional[BuildConfig] = None) -> Path:
    """Build (or reuse the cached) libtwcomm and return its path. Raises RuntimeError on a compile failure."""
    cfg = cfg or default_config()
    cache = cfg.cache_dir.expanduser()
    cache.mkdir(parents=True, exist_ok=True)
    target = cache / f"libtwcomm-{_digest(cfg)}.so"
    if target.exists():
        return target
    with open(cache / "build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.exists():
            return target
        with tempfile.TemporaryDirectory(dir=cache) as tmp:
            srcs = cuda_sources(cfg.source_dir)
            objs = [Path(tmp) / (s.stem + ".o") for s in srcs]
            logger.info("building tw-comm (%d sources) into %s", len(srcs), target)
            with ThreadPoolExecutor(max_workers=len(srcs)) as pool:
                list(pool.map(lambda so: _run(compile_command(cfg, *so)), zip(srcs, objs)))
            lib_tmp = Path(tmp) / target.name
            cuda_lib = Path(cfg.nvcc).resolve().parent.parent / "lib64"
            _run([cfg.nvcc, "-shared", "-cudart", "shared", f"-gencode={cfg.gencode}", *map(str, objs),
                  "-Xlinker", f"-rpath={cuda_lib}", "-o", str(lib_tmp)])
            os.replace(lib_tmp, target)
    return target
