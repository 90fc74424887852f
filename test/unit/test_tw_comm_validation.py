"""Argument validation, token partition, NVLS environment gate and backend selection of tw-comm (CPU)."""

import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "sgl-kernel" / "python"))
sys.path.insert(0, str(REPO / "python"))

from sgl_kernel.tw_comm.reference import owned_range  # noqa: E402
from sgl_kernel.tw_comm.validate import validate_allreduce, validate_allreduce_rmsnorm  # noqa: E402
from sglang.srt.distributed.tw_comm import (  # noqa: E402
    TwBackend,
    TwCommConfig,
    nvls_env_allows,
    select_backend,
    staging_bytes,
)


def _args(T=5, H=64, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(T * 1000 + H)
    x = torch.randn(T, H, generator=g).to(dtype)
    return x, torch.randn(T, H, generator=g).to(dtype), torch.rand(H, generator=g).to(dtype) + 0.5


def test_valid_arguments_pass():
    for dtype in (torch.bfloat16, torch.float16):
        x, r, w = _args(dtype=dtype)
        validate_allreduce_rmsnorm(x, r, w, torch.empty_like(x))
        validate_allreduce(x, torch.empty_like(x))
    x, r, w = _args(H=16384, T=2)
    validate_allreduce_rmsnorm(x, r, w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.int8, torch.float64])
def test_wrong_dtype_is_named(dtype):
    x, r, w = _args()
    with pytest.raises(ValueError, match=str(dtype)):
        validate_allreduce_rmsnorm(x.to(dtype), r.to(dtype), w.to(dtype))
    with pytest.raises(ValueError, match=str(dtype)):
        validate_allreduce(x.to(dtype))


@pytest.mark.parametrize("hidden", [12, 100, 16392, 20000])
def test_bad_hidden_is_named(hidden):
    x, r, w = _args(T=2, H=hidden)
    with pytest.raises(ValueError, match=f"hidden={hidden}"):
        validate_allreduce_rmsnorm(x, r, w)
    with pytest.raises(ValueError, match=f"hidden={hidden}"):
        validate_allreduce(x)


def test_mismatched_shapes_are_named():
    x, r, w = _args(T=6, H=64)
    with pytest.raises(ValueError, match=r"residual.shape=\(5, 64\)"):
        validate_allreduce_rmsnorm(x, r[:5], w)
    with pytest.raises(ValueError, match=r"out.shape=\(6, 32\)"):
        validate_allreduce_rmsnorm(x, r, w, torch.empty(6, 32, dtype=x.dtype))
    with pytest.raises(ValueError, match=r"weight.shape=\(32,\)"):
        validate_allreduce_rmsnorm(x, r, w[:32])
    with pytest.raises(ValueError, match=r"shape \(384,\)"):
        validate_allreduce_rmsnorm(x.reshape(-1), r, w)
    with pytest.raises(ValueError, match="residual.dtype"):
        validate_allreduce_rmsnorm(x, r.half(), w)
    with pytest.raises(ValueError, match="contiguous"):
        validate_allreduce_rmsnorm(x.t().contiguous().t(), r, w)
    with pytest.raises(ValueError, match="eps=0"):
        validate_allreduce_rmsnorm(x, r, w, eps=0)


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_owned_ranges_partition_every_token_count(world):
    g = torch.Generator().manual_seed(world)
    for tokens in [0, 1, world - 1, world, world + 1] + torch.randint(1, 20000, (20,), generator=g).tolist():
        ranges = [owned_range(tokens, world, q) for q in range(world)]
        assert ranges[0][0] == 0 and ranges[-1][1] == tokens
        for (s0, e0), (s1, e1) in zip(ranges, ranges[1:]):
            assert e0 == s1
        sizes = [e - s for s, e in ranges]
        assert max(sizes) - min(sizes) <= 1 and max(sizes) <= -(-tokens // world)
    with pytest.raises(ValueError, match=f"rank={5 + world}"):
        owned_range(10, world, 5 + world)


def test_nvls_env_gate():
    assert nvls_env_allows({})[0]
    safe = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
    ok, why = nvls_env_allows(safe)
    assert not ok and "NCCL_NVLS_ENABLE=0" in why
    for name, val in safe.items():
        ok, why = nvls_env_allows({name: val})
        assert not ok and name in why
    assert nvls_env_allows({"NCCL_NVLS_ENABLE": "1", "NVSHMEM_DISABLE_NVLS": "0"})[0]


def test_backend_selection():
    cfg = TwCommConfig()
    cap = staging_bytes(16384, 8192, 8)[0]
    sel = lambda T, world=8, **kw: select_backend(T, 8192, world, config=cfg, capacity_bytes=cap, **kw)  # noqa
    # Lamport one-shot for fused non-overlapped calls within its buffer: T*H*2 <= 2 MiB, T <= 128 at H 8192
    for world in (2, 4, 8):
        assert sel(1, world=world) == TwBackend.LAMPORT and sel(128, world=world) == TwBackend.LAMPORT
    assert sel(129, world=2) == TwBackend.ONESHOT and sel(256, world=2) == TwBackend.ONESHOT
    assert sel(257, world=2) == TwBackend.TWOSHOT and sel(129) == TwBackend.TWOSHOT  # 1 MiB one-shot at world 8
    assert sel(65, world=4, fused=False) == TwBackend.TWOSHOT and sel(16384) == TwBackend.TWOSHOT
    # kept paths: plain AllReduce (no Lamport form), overlapped calls, 4-byte elements, lamport_auto off
    assert sel(1, fused=False) == TwBackend.ONESHOT and sel(64, fused=False) == TwBackend.ONESHOT
    assert sel(8, world=2, overlap=True) == TwBackend.ONESHOT
    assert sel(8, world=2, elem=4) == TwBackend.ONESHOT
    no_lamport = TwCommConfig(lamport_auto=False)
    assert select_backend(8, 8192, 2, config=no_lamport, capacity_bytes=cap) == TwBackend.ONESHOT
    assert sel(8, world=2, on_cuda=False) == TwBackend.TORCH and sel(8, world=2, p2p_available=False) == TwBackend.NCCL
    # CE is off by default (slower than NCCL everywhere measured): overlapped calls stay on one/two-shot
    assert sel(4096, overlap=True) == TwBackend.TWOSHOT and sel(8, overlap=True) == TwBackend.ONESHOT
    ce_cfg = TwCommConfig(ce_min_bytes=32 << 20)
    sel_ce = lambda T, **kw: select_backend(T, 8192, 8, config=ce_cfg, capacity_bytes=cap, **kw)  # noqa
    assert sel_ce(4096, overlap=True) == TwBackend.CE and sel_ce(8, overlap=True) == TwBackend.ONESHOT
    assert sel_ce(1024, overlap=True) == TwBackend.TWOSHOT and sel_ce(2048, overlap=True) == TwBackend.CE
    assert sel_ce(4096) == TwBackend.TWOSHOT  # CE only for overlapped calls
    assert sel(16385) == TwBackend.NCCL  # beyond capacity
    assert sel(8, p2p_available=False) == TwBackend.NCCL
    assert sel(8, on_cuda=False) == TwBackend.TORCH
    assert sel(8, world=1) == TwBackend.LOCAL
    assert sel(8, nvls_available=True) == TwBackend.NVLS
    with pytest.raises(ValueError, match="twoshot_sms=0"):
        TwCommConfig(twoshot_sms=0)


def test_bulk_twoshot_replaces_two_shot_picks_only():
    """bulk_twoshot sends fused two-shot / pipelined two-shot picks (rules or calibrated table) to the bulk-copy
    kernel; small calls, plain AllReduce (no bulk form) and the NCCL fallback keep their backends."""
    from sglang.srt.distributed.tw_comm_tuning import Crossovers

    cap = staging_bytes(8192, 8192, 4)[0]
    cfg = TwCommConfig(bulk_twoshot=True)
    sel = lambda T, **kw: select_backend(T, 8192, 4, config=cfg, capacity_bytes=cap, **kw)  # noqa: E731
    assert sel(1024) == TwBackend.BULK and sel(4096, overlap=True) == TwBackend.BULK
    assert sel(1) == TwBackend.LAMPORT and sel(8, overlap=True) == TwBackend.ONESHOT
    assert sel(1024, fused=False) == TwBackend.TWOSHOT and sel(8193) == TwBackend.NCCL
    table = Crossovers(plain=((1 << 62, "p2p_twoshot_pipe", 64),), overlap=((1 << 62, "p2p_twoshot_bulk", 16),))
    assert select_backend(1024, 8192, 4, config=TwCommConfig(crossovers=table), capacity_bytes=cap,
                          overlap=True) == TwBackend.BULK
    assert select_backend(1024, 8192, 4, config=TwCommConfig(crossovers=table, bulk_twoshot=True),
                          capacity_bytes=cap) == TwBackend.BULK
    assert select_backend(1024, 8192, 4, config=TwCommConfig(crossovers=table), capacity_bytes=cap) == TwBackend.PIPE


def test_workspace_sized_from_largest_prefill():
    """TokenWeave's workspace holds the largest prefill chunk (no NCCL fallback inside the model), never less
    than tw-comm's 64 MiB default; overlapped calls default to the bounded overlap SM budget."""
    from sglang.srt.distributed.tw_comm import TwCommConfig
    from sglang.srt.distributed.tw_communicator import workspace_bytes

    assert workspace_bytes(8192, 8192) == 8192 * 8192 * 2
    assert workspace_bytes(16, 64) == 64 << 20
    with pytest.raises(ValueError, match="max_tokens=0"):
        workspace_bytes(0, 8192)
    cap = staging_bytes(8192, 8192, 2)[0]
    cfg = TwCommConfig(max_bytes=workspace_bytes(8192, 8192))
    assert select_backend(4096, 8192, 2, config=cfg, capacity_bytes=cap, overlap=True) == TwBackend.TWOSHOT
    assert select_backend(8192, 8192, 2, config=cfg, capacity_bytes=cap) == TwBackend.TWOSHOT
    assert TwCommConfig().overlap_sms == 16
    with pytest.raises(ValueError, match="overlap_sms=0"):
        TwCommConfig(overlap_sms=0)
