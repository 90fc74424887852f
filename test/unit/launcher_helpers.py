"""Spawn targets for test_worker_launcher (module-level so that ``spawn`` can pickle them)."""

from __future__ import annotations

import json
import os
import sys
import time


def record_env(path: str, device: str, parent_watch=None) -> None:
    """Write what the worker sees (NVLS variables, device, pid) to ``path``."""
    keys = ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS", "SGLANG_TEST_EXTRA")
    with open(path, "w") as f:
        json.dump({"env": {k: os.environ.get(k) for k in keys}, "device": device, "pid": os.getpid(),
                   "alive": parent_watch.parent_alive()}, f)


def wait_for_parent(path: str, parent_watch=None) -> None:
    """Write our pid, then poll the launcher's liveness every 0.1 s; exit 0 when it is gone (max 60 s)."""
    with open(path, "w") as f:
        f.write(str(os.getpid()))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if not parent_watch.parent_alive():
            sys.exit(0)
        time.sleep(0.1)
    sys.exit(3)


def middle_launcher(path: str) -> None:
    """A launcher process: start one worker that watches us, then sleep until killed."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from sglang.srt.entrypoints.worker_launcher import MultiprocessingLauncher, ProcessSpec

    launcher = MultiprocessingLauncher()
    launcher.launch(ProcessSpec(name="grandchild", target=wait_for_parent, args=(path,)))
    time.sleep(120)


def role_allreduce(world_rank: int, init: str, roles, out_path: str) -> None:
    """Join a multi-role job on gloo and all-reduce (world_rank + 1) inside this rank's role group."""
    import torch
    import torch.distributed as dist

    from sglang.srt.distributed.parallel_state import init_role_parallel_state

    torch.set_num_threads(1)
    ps = init_role_parallel_state(world_rank, roles, init, timeout_s=60)
    x = torch.tensor([float(world_rank + 1)])
    dist.all_reduce(x, group=ps.device_group)
    with open(out_path, "w") as f:
        json.dump({"role": ps.role, "tp_rank": ps.tp_rank, "tp_size": ps.tp_size, "sum": float(x)}, f)
    dist.destroy_process_group()
