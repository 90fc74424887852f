"""Helpers for the CPU tensor-parallel tests: per-rank bodies over the shared model checkpoints.

``spawn_ranks(fn, world, *args)`` (from :mod:`sglang.test.spawn_ranks`, with this folder on each rank's
``sys.path``) runs ``fn(parallel_state, *args)`` on ``world`` gloo ranks and returns the results in rank order.
"""

from __future__ import annotations

import os
from types import SimpleNamespace
from typing import Optional

import torch

from sglang.test.spawn_ranks import spawn_ranks as _spawn_ranks

HERE = os.path.dirname(os.path.abspath(__file__))


def spawn_ranks(fn, world: int, *args, **kw) -> list:
    """:func:`sglang.test.spawn_ranks.spawn_ranks` with this folder on each rank's ``sys.path``."""
    return _spawn_ranks(fn, world, *args, sys_path=(HERE,), **kw)


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


def tp_greedy_tokens(ps, jobs: list[tuple[str, int, Optional[str], list[list[int]]]],
                     n_new: int) -> list[list[list[int]]]:
    """Rank body: for every ``(checkpoint path, ep_size, --quantization, prompts' token ids)`` job, load the checkpoint
    sharded for this rank (an FP8 checkpoint's ``quantization_config`` is detected as the server does) and greedily
    decode ``n_new`` tokens (EOS ignored) after each prompt, one request at a time; returns ``[job][prompt] -> token
    ids``."""
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.distributed.communicator import create_communicator
    from sglang.srt.model_loader.loader import load_model

    comm = create_communicator(ps, "auto")
    out = []
    for path, ep_size, quantization, prompts in jobs:
        config = ModelConfig.from_path(path)
        model = load_model(config, "auto", "cpu", tp_rank=ps.tp_rank, tp_size=ps.tp_size, comm=comm,
                           ep_size=ep_size, quantization=quantization)
        per_prompt = []
        for ids in prompts:
            h = harness_for(model, config, ps.tp_size)
            toks, new = [], list(ids)
            for _ in range(n_new):
                tok = int(torch.argmax(h.step([("r", new)])[0]))
                toks.append(tok)
                new = [tok]
            per_prompt.append(toks)
        out.append(per_prompt)
    return out


def tokenweave_logits(ps, path: str, dtype: str = "auto", sharded: bool = True,
                      stats: Optional[dict] = None) -> list[list[torch.Tensor]]:
    """Rank body: the checkpoint sharded for this rank with the tw-comm communicator (RS -> add+RMSNorm -> AG
    on gloo; on a GPU rank tw-comm's fused kernels over CUDA IPC and the executor's two streams) and
    TokenWeave's executor forced to cut each of :data:`STEPS` at every token boundary; returns, per step, the
    fp32 CPU logits of every cut. ``sharded`` (the default, as the server's; False: ``--tokenweave-full-residual``):
    the sharded residual, with the communicator's residual rows this rank does not own NaN-filled after every
    sharded call (:class:`StaleRowsPoisoned`), so a consumer that reads them poisons the logits;
    ``stats["sharded_calls"]`` (when given) counts those calls."""
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
    comm = stale_rows_poisoned(TwCommunicator)(ps) if sharded else TwCommunicator(ps)
    model = load_model(config, "auto", str(dev), tp_rank=ps.tp_rank, tp_size=ps.tp_size, comm=comm)
    ex = ForcedCut(TokenWeaveConfig(min_tokens=2, gemm_widths=gemm_widths_of(config, ps.tp_size),
                                    sharded_residual=sharded), dev)
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
    if stats is not None:
        stats["sharded_calls"] = stats.get("sharded_calls", 0) + getattr(comm, "sharded_calls", 0)
    return out


def tokenweave_logits_many(ps, paths: list[str], dtype: str = "auto", sharded: bool = True
                           ) -> list[list[list[torch.Tensor]]]:
    """Rank body: :func:`tokenweave_logits` for every checkpoint in ``paths`` (one process group for all)."""
    return [tokenweave_logits(ps, path, dtype, sharded) for path in paths]


def tokenweave_full_and_sharded(ps, paths: list[str], dtype: str = "auto") -> list[tuple[list, list]]:
    """Rank body: per checkpoint, :func:`tokenweave_logits` with the full and with the sharded residual, and the
    number of residual-sharded communicator calls the latter made."""
    out = []
    for p in paths:
        stats: dict = {}
        out.append((tokenweave_logits(ps, p, dtype, False), tokenweave_logits(ps, p, dtype, True, stats),
                    stats.get("sharded_calls", 0)))
    return out


def stale_rows_poisoned(base: type) -> type:
    """``base`` (a communicator class) whose residual-sharded ``all_reduce_add_rmsnorm`` NaN-fills the returned
    residual's rows outside this rank's ``owned_range`` (rows a sharded call leaves stale), counting the calls in
    ``sharded_calls`` (of the instance)."""
    from sgl_kernel.tw_comm.reference import owned_range

    class StaleRowsPoisoned(base):
        def all_reduce_add_rmsnorm(self, x, residual, weight, eps, overlap=False, out=None, residual_sharded=False):
            normed, res = super().all_reduce_add_rmsnorm(x, residual, weight, eps, overlap=overlap, out=out,
                                                         residual_sharded=residual_sharded)
            if residual_sharded and self.world_size > 1:
                self.sharded_calls = getattr(self, "sharded_calls", 0) + 1
                s, e = owned_range(res.shape[0], self.world_size, self.rank)
                res[:s] = float("nan")
                res[e:] = float("nan")
            return normed, res

    return StaleRowsPoisoned


def tokenweave_unsplit_vs_plain(ps, path: str) -> dict:
    """Rank body (unsplit forwards): the checkpoint at ``path`` with the communicator a ``--enable-tokenweave``
    server builds (``build_communicator``) and with the plain server's (``--comm-backend auto`` without TokenWeave).
    Returns the communicator's class names, the :data:`STEPS` logits of TokenWeave's executor with no split
    (``min_tokens`` above every batch) and of the plain model, the logits of a forced split (cut at 2), and per run
    how many calls reached the composed communicator's ``plain`` and ``split`` parts (spies)."""
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.deployment.communicator import build_communicator
    from sglang.srt.model_loader.loader import load_model
    from sglang.srt.server_args import ServerArgs
    from sglang.srt.tokenweave import gemm_widths_of
    from sglang.srt.tokenweave.executor import TokenWeaveConfig, TokenWeaveExecutor

    config = ModelConfig.from_path(path)
    on = ServerArgs(model_path=path, device="cpu", tp_size=ps.tp_size, enable_tokenweave=True)
    comm, plain = build_communicator(ps, on), build_communicator(ps, on.replace(enable_tokenweave=False))
    calls = {"plain": 0, "split": 0}

    def spy(part: str, obj, method: str) -> None:
        real = getattr(obj, method)

        def counted(*a, **k):
            calls[part] += 1
            return real(*a, **k)
        setattr(obj, method, counted)

    for part in ("plain", "split"):
        for method in ("all_reduce", "all_gather", "reduce_scatter", "all_reduce_add_rmsnorm"):
            spy(part, getattr(comm, part), method)
    out = {"types": (type(comm).__name__, type(comm.plain).__name__, type(plain).__name__)}
    widths = gemm_widths_of(config, ps.tp_size)

    def run(model, min_tokens: int, cut: Optional[int] = None) -> list[torch.Tensor]:
        class Cut(TokenWeaveExecutor):
            def plan(self, fb):
                return super().plan(fb) if cut is None else list(fb.split_tokens(cut))
        ex = Cut(TokenWeaveConfig(min_tokens=min_tokens, gemm_widths=widths), torch.device("cpu"))
        h = harness_for(model, config, ps.tp_size)
        return [h.step(items, ex).clone() for items in STEPS[:2]]

    tw_model = load_model(config, "auto", "cpu", tp_rank=ps.tp_rank, tp_size=ps.tp_size, comm=comm)
    out["unsplit"], out["unsplit_calls"] = run(tw_model, 1 << 30), dict(calls)
    calls.update(plain=0, split=0)
    out["split"], out["split_calls"] = run(tw_model, 2, cut=2), dict(calls)
    plain_model = load_model(config, "auto", "cpu", tp_rank=ps.tp_rank, tp_size=ps.tp_size, comm=plain)
    out["plain"] = run(plain_model, 1 << 30)
    return out
