"""CPU gloo multi-process: RS -> residual+RMSNorm on 1/N tokens -> AG equals AR -> add -> RMSNorm (the identity the
two-shot kernels rely on, TokenWeave section 3.3), and the tw-comm workspace API's CPU path equals a
single-process reference of all ranks' inputs. 2 and 4 ranks; token counts not divisible by the world size."""

import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parents[2]
PATHS = [str(REPO / "sgl-kernel" / "python"), str(REPO / "python")]
sys.path[:0] = PATHS

TOKENS = (1, 3, 7, 13, 64, 131)
HIDDEN = 64
EPS = 1e-6


def _inputs(seed, tokens, world, dtype):
    """Every rank's x, the shared residual and weight, from one seed (identical on all ranks)."""
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(tokens, HIDDEN, generator=g).to(dtype) for _ in range(world)]
    residual = (torch.randn(tokens, HIDDEN, generator=g) * 2).to(dtype)
    weight = (torch.rand(HIDDEN, generator=g) + 0.5).to(dtype)
    return xs, residual, weight


def _worker(rank, world, init_file):
    sys.path[:0] = PATHS
    from sgl_kernel.tw_comm.reference import allreduce_add_rmsnorm_ref, ar_norm_dist, rs_norm_ag_dist
    from sglang.srt.distributed.tw_comm import TwBackend, TwCommWorkspace, allreduce, allreduce_rmsnorm

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        ws = TwCommWorkspace(None, torch.device("cpu"))
        for i, tokens in enumerate(TOKENS):
            dtype = torch.bfloat16 if i % 2 == 0 else torch.float16
            xs, residual, weight = _inputs(100 + i, tokens, world, dtype)
            x = xs[rank]
            res_ar, out_ar = ar_norm_dist(x, residual, weight, EPS)
            res_rs, out_rs = rs_norm_ag_dist(x, residual, weight, EPS)
            torch.testing.assert_close(res_rs.float(), res_ar.float(), rtol=1e-2, atol=1e-2)
            torch.testing.assert_close(out_rs.float(), out_ar.float(), rtol=1e-2, atol=1e-2)
            exp_res, exp_out = allreduce_add_rmsnorm_ref(xs, residual, weight, EPS)
            torch.testing.assert_close(res_rs.float(), exp_res.float(), rtol=1e-2, atol=1e-2)
            torch.testing.assert_close(out_rs.float(), exp_out.float(), rtol=1e-2, atol=1e-2)
            # rows are not all equal: a permutation of the RS/AG ranges would be caught
            assert not torch.allclose(out_rs[:1].float(), out_rs[-1:].float()) or tokens == 1
            # workspace API (CPU -> torch backend)
            assert ws.select(tokens, HIDDEN) == TwBackend.TORCH
            r = residual.clone()
            out = allreduce_rmsnorm(ws, x, r, weight, EPS)
            torch.testing.assert_close(r.float(), exp_res.float(), rtol=1e-2, atol=1e-2)
            torch.testing.assert_close(out.float(), exp_out.float(), rtol=1e-2, atol=1e-2)
            summed = allreduce(ws, x)
            torch.testing.assert_close(summed.float(), sum(t.float() for t in xs), rtol=1e-2, atol=1e-2)
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4])
def test_rs_norm_ag_equals_ar_norm_gloo(world, tmp_path):
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    mp.spawn(_worker, args=(world, str(tmp_path / "store")), nprocs=world, join=True)
