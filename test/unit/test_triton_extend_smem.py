"""The extend-attention config chosen for Hopper fits the H100's shared memory (the fp32 qwen3
GPU test once hit ``OutOfResources: Required 295936, limit 232448`` with the 128 x 128 x 3-stage tiles).

The chosen config of every head dim of the GPU test models (qwen3: 128, fp32) and of real Llama/Qwen models (64, 80,
96, 128, 256 in bf16) is compiled ahead of time for sm_90a on this CPU machine (Triton + ptxas, no GPU) in one
subprocess with TRITON_INTERPRET unset, and its compiled shared memory is compared with the limit and the estimate.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)

REPO = Path(__file__).resolve().parents[2]
H100_SMEM = 232448  # cudaDevAttrMaxSharedMemoryPerBlockOptin of the H100 (227 KB)
CASES = {"bf16": (64, 80, 96, 128, 256), "fp32": (128,)}


def _aot(dtype, head_dims):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "sgl-kernel" / "python"), str(REPO / "python"),
                                         env.get("PYTHONPATH", "")])
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    r = subprocess.run([sys.executable, "-m", "sgl_kernel.triton.aot", "extend", "90", dtype,
                        *map(str, head_dims)], env=env, capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        pytest.fail(f"AOT compile process failed ({r.returncode}): {r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def aot_extend():
    return {dtype: _aot(dtype, hds) for dtype, hds in CASES.items()}


@pytest.mark.parametrize("dtype,head_dim", [(d, h) for d, hds in CASES.items() for h in hds])
def test_chosen_extend_config_fits_h100_shared_memory(aot_extend, dtype, head_dim):
    from sgl_kernel.triton.extend_attention import extend_smem_bytes

    rep = aot_extend[dtype][str(head_dim)]
    assert not rep["error"], rep
    assert 0 < rep["shared"] <= H100_SMEM, rep
    # the estimate the choice is made with bounds what the compiler allocates
    assert rep["shared"] <= extend_smem_bytes(tuple(rep["config"]), head_dim, 4 if dtype == "fp32" else 2), rep


def test_extend_config_respects_smem_limit():
    from sgl_kernel.triton.extend_attention import extend_config, extend_configs, extend_smem_bytes

    assert extend_config(128, (9, 0)) == (128, 128, 8, 3)  # bf16 keeps the measured-fastest Hopper tiles
    assert extend_config(128, (9, 0), 4) == (128, 64, 8, 2)  # fp32: 128 x 128 x 3 needs more than 227 KB
    assert extend_smem_bytes((128, 128, 8, 3), 128, 4) > H100_SMEM
    for hd in (24, 64, 80, 96, 128, 256):
        for nbytes in (2, 4):
            for arch in ((8, 0), (8, 9), (9, 0), (12, 0)):
                cands = extend_configs(hd, arch, nbytes)
                limit = {(8, 0): 166912, (9, 0): H100_SMEM}.get(arch, 101376)
                assert all(extend_smem_bytes(c, hd, nbytes) <= limit for c in cands), (hd, nbytes, arch, cands)
    assert extend_config(128, (9, 0), 2, smem_limit=100_000) == (128, 64, 8, 2)  # a device's own optin limit


def test_out_of_resources_falls_back_once_per_shape(monkeypatch):
    """A first launch that raises OutOfResources retries with the next candidate, and later calls of the same shape
    start there; a second OutOfResources is raised (no loop)."""
    import torch
    from triton.runtime.errors import OutOfResources

    import sgl_kernel.triton.extend_attention as ea

    cands = ((128, 128, 8, 3), (128, 64, 8, 2))
    launched = []

    def launch(args, config):
        launched.append(config)
        if config == cands[0]:
            raise OutOfResources(295936, 232448, "shared memory")

    monkeypatch.setattr(ea, "extend_configs", lambda *a, **k: cands)
    monkeypatch.setattr(ea, "_launch", launch)
    monkeypatch.setattr(ea, "check_cuda_or_interpret", lambda *a, **k: None)
    monkeypatch.setattr(ea, "_FALLBACK", {})
    q = torch.zeros(4, 2, 24)
    kb = torch.zeros(8, 2, 24)
    i64 = torch.zeros(1, dtype=torch.int64)
    call = lambda: ea.extend_attention_fwd(q, q.clone(), kb, kb.clone(), torch.zeros(1, 8, dtype=torch.int32),  # noqa
                                           i64, i64, i64 + 4, i64, 4, 0.25)
    call()
    call()
    assert launched == [cands[0], cands[1], cands[1]]
    monkeypatch.setattr(ea, "extend_configs", lambda *a, **k: (cands[0], cands[0]))
    monkeypatch.setattr(ea, "_FALLBACK", {})
    with pytest.raises(OutOfResources):
        call()


_AUTO_CHECK = r"""
import json, types, torch
import sgl_kernel.triton.extend_attention as ea
torch.cuda.get_device_capability = lambda i: (9, 0)
torch.cuda.get_device_properties = lambda i: types.SimpleNamespace(shared_memory_per_block_optin=232448,
                                                                   major=9, minor=0)
out = {}
for name, size in (("bf16", 2), ("fp32", 4)):
    q = types.SimpleNamespace(shape=(8, 32, 128), is_cuda=True, device=types.SimpleNamespace(index=0),
                              element_size=lambda size=size: size)
    dev, cands = ea.auto_configs(q)
    out[name] = [dev, [list(c) for c in cands], ea.extend_smem_bytes(cands[0], 128, size)]
print(json.dumps(out))
"""


def test_auto_configs_on_a_cuda_device_fit_its_shared_memory():
    """The CUDA branch of the automatic config choice (the path a GPU prefill takes; the CPU interpreter never
    reaches it) runs with the device queries stubbed as an H100: it returns the device index and candidates whose
    first one fits 232448 B, for bf16 and fp32 (the fp32 OutOfResources case)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "sgl-kernel" / "python"), str(REPO / "python"),
                                         env.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, "-c", _AUTO_CHECK], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    for name in ("bf16", "fp32"):
        dev, cands, smem = res[name]
        assert dev == 0 and cands, res
        assert smem <= H100_SMEM, (name, cands[0], smem)
    assert res["bf16"][1][0] == [128, 128, 8, 3] and res["fp32"][1][0] != [128, 128, 8, 3], res
