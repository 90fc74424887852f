"""Helpers for the CPU tensor-parallel tests: spawn N gloo ranks, run a function in each, collect results.

``spawn_ranks(fn, world, *args)`` starts ``world`` spawned processes that join one gloo group on a free
local port (through :func:`sglang.srt.distributed.parallel_state.init_parallel_state`) and call
``fn(parallel_state, *args)``; it returns the per-rank results (picklable) in rank order, and raises
RuntimeError with the failing rank's traceback, or on timeout (all ranks are killed: no hang).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import socket
import sys
import time
import traceback
from types import SimpleNamespace

import torch

HERE = os.path.dirname(os.path.abspath(__file__))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, init: str, fn, args, pipe, ep_size: int, device: str = "cpu",
           share_gpu: bool = False) -> None:
    sys.path.insert(0, HERE)
    torch.set_num_threads(1)
    from sglang.srt.distributed.parallel_state import DistConfig, destroy_parallel_state, init_parallel_state

    try:
        ps = init_parallel_state(DistConfig(tp_rank=rank, tp_size=world, init_method=init, device=device,
                                            ep_size=ep_size, timeout_s=120,
                                            device_index=0 if share_gpu else None,
                                            device_backend="gloo" if share_gpu else None))
        result = ("ok", fn(ps, *args))
    except BaseException:
        result = ("error", traceback.format_exc())
    finally:
        destroy_parallel_state()
    # plain pickle: tensors travel as bytes (multiprocessing's pickler would share them through a
    # file descriptor server that dies with this process)
    pipe.send_bytes(pickle.dumps(result))


def spawn_ranks(fn, world: int, *args, timeout: float = 180.0, ep_size: int = 1, device: str = "cpu",
                share_gpu: bool = False) -> list:
    """Run ``fn(parallel_state, *args)`` on ``world`` ranks (gloo on CPU, NCCL with ``device="cuda"``;
    ``share_gpu=True``: every rank on cuda:0 with a gloo device group, the ``--tp-ranks-share-gpu`` test mode);
    results in rank order (see module doc)."""
    ctx = mp.get_context("spawn")
    init = f"tcp://127.0.0.1:{free_port()}"
    procs, pipes = [], []
    for rank in range(world):
        reader, writer = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_entry, args=(rank, world, init, fn, args, writer, ep_size, device, share_gpu),
                        daemon=True)
        p.start()
        procs.append(p)
        pipes.append(reader)
    results: dict[int, object] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world:
            if time.monotonic() > deadline:
                raise RuntimeError(f"ranks did not finish within {timeout} s")
            for rank, (p, r) in enumerate(zip(procs, pipes)):
                if rank in results:
                    continue
                if r.poll(0.05):
                    status, value = pickle.loads(r.recv_bytes())
                    if status != "ok":
                        raise RuntimeError(f"rank {rank} failed:\n{value}")
                    results[rank] = value
                elif not p.is_alive():
                    raise RuntimeError(f"rank {rank} died with exit code {p.exitcode}")
    finally:
        for p in procs:
            p.join(5 if len(results) == world else 0)
            if p.is_alive():
                p.kill()
                p.join(2)
    return [results[r] for r in range(world)]


def harness_for(model, config, tp_size: int, seed: int = 0, device: str = "cpu"):
    """A :class:`model_harness.ModelHarness` whose KV pool holds this rank's local KV heads."""
    from model_harness import ModelHarness

    from sglang.srt.distributed.parallel_state import local_kv_heads

    shim = SimpleNamespace(num_hidden_layers=config.num_hidden_layers, head_dim=config.head_dim,
                           dtype=config.dtype, num_key_value_heads=local_kv_heads(config.num_key_value_heads, tp_size))
    return ModelHarness(model, shim, seed=seed, device=device)


# Steps every model test runs: two prompts, a mixed step (one decodes, one new prompt), two decodes.
STEPS = [
    [("a", [3, 17, 5, 9, 22, 41, 7]), ("b", [8, 1, 60, 2])],
    [("a", [11]), ("c", [4, 4, 90, 13, 5])],
    [("a", [12]), ("b", [30]), ("c", [6])],
    [("a", [77]), ("b", [31]), ("c", [2])],
]


def run_steps(model, config, tp_size: int) -> list[torch.Tensor]:
    """Next-token logits ``[bs, vocab]`` fp32 of each of :data:`STEPS`."""
    h = harness_for(model, config, tp_size)
    return [h.step(items).clone() for items in STEPS]


def tp_model_logits(ps, path: str, ep_size: int = 1) -> list[torch.Tensor]:
    """Rank body: load the checkpoint at ``path`` sharded for this rank and return :func:`run_steps` logits."""
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.distributed.communicator import create_communicator
    from sglang.srt.model_loader.loader import load_model

    config = ModelConfig.from_path(path)
    comm = create_communicator(ps, "auto")
    model = load_model(config, "auto", "cpu", tp_rank=ps.tp_rank, tp_size=ps.tp_size, comm=comm, ep_size=ep_size)
    return run_steps(model, config, ps.tp_size)


def tp_models_logits(ps, jobs: list[tuple[str, int]]) -> list[list[torch.Tensor]]:
    """Rank body: :func:`tp_model_logits` for every ``(checkpoint path, ep_size)`` job."""
    return [tp_model_logits(ps, path, ep) for path, ep in jobs]


def tokenweave_logits(ps, path: str, dtype: str = "auto") -> list[list[torch.Tensor]]:
    """Rank body: the checkpoint sharded for this rank with the tw-comm communicator (RS -> add+RMSNorm -> AG
    on gloo; on a GPU rank tw-comm's fused kernels over CUDA IPC and the executor's two streams) and
    TokenWeave's executor forced to cut each of :data:`STEPS` at every token boundary; returns, per step, the
    fp32 CPU logits of every cut."""
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.distributed.tw_communicator import TwCommunicator
    from sglang.srt.model_loader.loader import load_model
    from sglang.srt.tokenweave import gemm_widths_of
    from sglang.srt.tokenweave.executor import TokenWeaveConfig, TokenWeaveExecutor

    class ForcedCut(TokenWeaveExecutor):
        cut = 1

        def plan(self, fb):
            return list(fb.split_tokens(self.cut))

    dev = ps.torch_device()
    config = ModelConfig.from_path(path, None, dtype, dev.type)
    comm = TwCommunicator(ps)
    model = load_model(config, "auto", str(dev), tp_rank=ps.tp_rank, tp_size=ps.tp_size, comm=comm)
    ex = ForcedCut(TokenWeaveConfig(min_tokens=2, gemm_widths=gemm_widths_of(config, ps.tp_size)), dev)
    h = harness_for(model, config, ps.tp_size, device=str(dev))
    out = []
    for items in STEPS:
        fb = h.prepare(items)
        per_cut = []
        for cut in range(1, fb.num_tokens):
            ex.cut = cut
            per_cut.append(h.run(fb, ex).float().cpu().clone())
        out.append(per_cut)
    if comm.ws is not None:
        comm.ws.close()
    return out


def tokenweave_logits_many(ps, paths: list[str], dtype: str = "auto") -> list[list[list[torch.Tensor]]]:
    """Rank body: :func:`tokenweave_logits` for every checkpoint in ``paths`` (one process group for all)."""
    return [tokenweave_logits(ps, path, dtype) for path in paths]
