"""Every tw-comm CUDA source compiles with nvcc for sm_90a; the NVLS kernel's PTX holds multimem instructions;
no source calls the multicast object API (safety: NVLink multicast is forbidden on our hosts)."""

import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "sgl-kernel" / "python"))

from sgl_kernel.tw_comm.build import BuildConfig, compile_command, cuda_sources, find_nvcc  # noqa: E402

TW = REPO / "tw-comm"


def test_sources_exist_and_never_create_multicast_objects():
    srcs = cuda_sources(TW)
    names = {s.name for s in srcs}
    assert {"workspace.cu", "oneshot.cu", "twoshot.cu", "copy_engine.cu", "nvls.cu"} <= names
    pattern = re.compile(r"\bcu(Multicast\w*|MemMap\w*)\s*\(")
    for f in list(srcs) + list((TW / "csrc").rglob("*.cuh")) + list((TW / "include").rglob("*.h")):
        hits = pattern.findall(f.read_text())
        assert not hits, f"{f.name} calls {hits}: tw-comm must not create multicast mappings"


def _ptx(cfg, tmp_path, kernel: str) -> str:
    """The PTX nvcc emits for ``tw-comm/csrc/allreduce_rmsnorm/<kernel>.cu`` at ``cfg``'s gencode (asserts it compiles)."""
    ptx = tmp_path / f"{kernel}.ptx"
    proc = subprocess.run(
        [cfg.nvcc, "-std=c++17", f"-gencode={cfg.gencode}", f"-I{TW / 'include'}", "-ptx",
         str(TW / "csrc" / "allreduce_rmsnorm" / f"{kernel}.cu"), "-o", str(ptx)],
        capture_output=True, text=True,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return ptx.read_text()


@pytest.mark.skipif(find_nvcc() is None, reason="nvcc not on PATH / CUDA_HOME: CUDA compile check skipped")
def test_every_source_compiles_for_sm90a(tmp_path):
    cfg = BuildConfig(source_dir=TW, nvcc=find_nvcc(), extra_flags=("-std=c++17",))
    srcs = cuda_sources(TW)

    def compile_one(src):
        cmd = compile_command(cfg, src, tmp_path / (src.stem + ".o"))
        return src.name, subprocess.run(cmd, capture_output=True, text=True)

    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(compile_one, srcs))
    for name, proc in results:
        assert proc.returncode == 0, f"{name} failed to compile:\n{proc.stderr[-3000:]}"
        assert "warning" not in proc.stderr.lower(), f"{name} compiled with warnings:\n{proc.stderr[-3000:]}"
        assert (tmp_path / name.replace(".cu", ".o")).stat().st_size > 0

    text = _ptx(cfg, tmp_path, "nvls")
    assert "multimem.ld_reduce.relaxed.sys.global.add.v4.bf16x2" in text
    assert "multimem.ld_reduce.relaxed.sys.global.add.v4.f16x2" in text
    assert "multimem.st.relaxed.sys.global.v4.f32" in text


@pytest.mark.skipif(find_nvcc() is None, reason="nvcc not on PATH / CUDA_HOME: CUDA compile check skipped")
def test_bulk_twoshot_ptx_uses_bulk_async_copies(tmp_path):
    """p2p_twoshot_bulk moves its NVLink data with cp.async.bulk (global -> shared with an mbarrier, shared ->
    global in bulk groups), not per-thread loads: the point of the variant (few CTAs, many bytes in flight)."""
    text = _ptx(BuildConfig(source_dir=TW, nvcc=find_nvcc()), tmp_path, "twoshot_bulk")
    assert "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes" in text
    assert "cp.async.bulk.global.shared::cta.bulk_group" in text
    assert "cp.async.bulk.wait_group.read 1" in text and "mbarrier.try_wait.parity" in text
    assert "multimem" not in text
