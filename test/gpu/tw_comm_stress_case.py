"""tw-comm back-to-back stress: ``--calls`` fused AllReduce + residual + RMSNorm calls per variant with 2 ranks
as processes on ONE GPU (CUDA IPC within the device; ``--tp-ranks-share-gpu`` style), no host sync between
calls, then one check of the last call against a torch reference. A hang is caught by the parent's timeout.
Prints calls per second per variant (meaningless as speed: the two processes time-slice one GPU).

Usage (repo root): python test/gpu/tw_comm_stress_case.py [--calls 100000] [--timeout 540]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO / "sgl-kernel" / "python"), str(REPO / "python"), str(REPO / "test" / "unit")]


def _rank(ps, calls: int):
    import torch
    import torch.distributed as dist
    from sgl_kernel.tw_comm.reference import add_rmsnorm_fp32

    from sglang.srt.distributed.tw_comm import TwBackend, TwCommWorkspace, allreduce_rmsnorm

    dev = ps.torch_device()
    ws = TwCommWorkspace(ps.device_group, dev)
    report = {}
    for name, backend, tokens in (("oneshot", TwBackend.ONESHOT, 8), ("twoshot", TwBackend.TWOSHOT, 256),
                                  ("ce", TwBackend.CE, 512)):
        g = torch.Generator().manual_seed(tokens)
        residual0 = torch.randn(tokens, 1024, generator=g).to(torch.bfloat16)
        weight = (torch.rand(1024, generator=g) + 0.5).to(torch.bfloat16).to(dev)
        g.manual_seed(7 * tokens + ps.tp_rank)
        x0 = torch.randn(tokens, 1024, generator=g).to(torch.bfloat16)
        x, res = x0.to(dev), residual0.to(dev)
        dist.barrier(group=ps.cpu_group)
        t0 = time.perf_counter()
        for i in range(calls - 1):  # the residual accumulates; values are not checked until the last call
            allreduce_rmsnorm(ws, x, res, weight, 1e-5, backend=backend)
        xl, r = x0.to(dev), residual0.to(dev)  # the last call starts from the original inputs
        out = allreduce_rmsnorm(ws, xl, r, weight, 1e-5, backend=backend)
        torch.cuda.synchronize(dev)
        dt = time.perf_counter() - t0
        total = x0.float().clone()
        dist.all_reduce(total, group=ps.cpu_group)
        res_ref, out_ref = add_rmsnorm_fp32(total, residual0, weight.cpu(), 1e-5)
        err = max((out.float().cpu() - out_ref.float()).abs().max().item(),
                  (r.float().cpu() - res_ref.float()).abs().max().item())
        report[name] = (calls / dt, err)
    ws.close()
    return report


def main() -> int:
    from sglang.srt.utils.nvls_env import apply_nvls_off_env
    from tp_worker import spawn_ranks

    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=100_000)
    ap.add_argument("--timeout", type=float, default=540)
    a = ap.parse_args()
    apply_nvls_off_env()
    reports = spawn_ranks(_rank, 2, a.calls, timeout=a.timeout, device="cuda", share_gpu=True)
    ok = True
    for rank, rep in enumerate(reports):
        for name, (rate, err) in rep.items():
            good = err < 0.1
            ok &= good
            print(f"rank {rank} {name}: {a.calls} back-to-back calls, {rate:.0f} calls/s, last-call max err {err:.4f}"
                  f" {'OK' if good else 'WRONG'}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
