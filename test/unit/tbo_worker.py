"""Rank bodies of the two-batch overlap tests: greedy generation over a schedule of requests that join, prefill in
chunks and decode together (mixed prefill + decode batches, requests joining mid-decode), with a given executor, on
one gloo rank per process.

``run_schedule(h, executor, prompts, n_new, joins, chunk)`` is the driver (also used in-process for the TP1
reference); ``tbo_greedy_many`` is the rank body that runs every configuration in one process group.
"""

from __future__ import annotations

import functools
from typing import Optional, Sequence

import torch

# the shared prompts of the EP / TP tests
PROMPTS = ("Once upon a time", "The little dog", "Lily and Tom went to the park. They", "One day, a bird")
N_NEW = 32
# request i joins at step JOINS[i]: two prompts prefill together, a third joins while they decode (a mixed batch),
# the fourth joins later and prefills in chunks beside three decoding requests
JOINS = (0, 0, 3, 6)


def run_schedule(h, executor, prompts: Sequence[Sequence[int]], n_new: int, joins: Sequence[int] = JOINS,
                 chunk: Optional[int] = None, on_step=None) -> list[list[int]]:
    """Greedy tokens ``[n_new]`` per prompt, generated through the harness ``h`` (a ``ModelHarness``) with
    ``executor`` (None: the model's own forward). Request ``i`` joins at step ``joins[i]``; a prompt prefills in chunks
    of ``chunk`` tokens (None: whole) in the same batches as the decodes of the others; a request leaves once it has
    ``n_new`` tokens. ``on_step(executor)`` is called after every step (statistics)."""
    n = len(prompts)
    done = [0] * n  # prompt tokens prefilled
    outs: list[list[int]] = [[] for _ in range(n)]
    step = 0
    while any(len(o) < n_new for o in outs):
        items, rows = [], []
        for i in range(n):
            if joins[i] > step or len(outs[i]) >= n_new:
                continue
            if done[i] < len(prompts[i]):
                take = len(prompts[i]) - done[i] if chunk is None else min(chunk, len(prompts[i]) - done[i])
                items.append((i, list(prompts[i][done[i]:done[i] + take])))
                done[i] += take
            else:
                items.append((i, [outs[i][-1]]))
            rows.append(i)
        step += 1
        if not items:
            continue
        logits = h.step(items, executor)
        if on_step is not None:
            on_step(executor)
        for r, i in enumerate(rows):
            if done[i] == len(prompts[i]):
                outs[i].append(int(torch.argmax(logits[r])))
    return outs


def _split_stats(stats: dict):
    """An ``on_step`` callback counting the executor's splits by kind into ``stats``."""
    def on_step(ex) -> None:
        s = getattr(ex, "last_split", None)
        key = "unsplit" if s is None else f"by_{s.by}"
        stats[key] = stats.get(key, 0) + 1
        if s is not None and s.straddling is not None:
            stats["straddling"] = stats.get("straddling", 0) + 1
    return on_step


def tbo_greedy_many(ps, path: str, prompts: list[list[int]], n_new: int, configs: list[dict]) -> list[dict]:
    """Rank body: load ``path`` sharded for this rank (EP = TP = the group size; on the rank's device: CPU with gloo,
    or its GPU with NCCL) and, per configuration ``{"executor": "sequential" | "tbo", "threshold": float,
    "chunk": int | None, "a2a": None | "nccl" | "tdist"}``, generate ``n_new`` greedy tokens for every prompt with
    :func:`run_schedule`. ``a2a`` None: the all-reduce expert parallelism; a backend: expert parallelism by
    all-to-all, its token dispatcher installed for the configuration (the group must have been started with
    ``ep_size`` = its size; tdist runs under the Triton interpreter on CPU). Returns per configuration
    ``{"tokens": [[...] per prompt], "stats": {"by_requests": k, "by_tokens": k, "unsplit": k, "straddling": k},
    "a2a_calls": {...} or None}``."""
    import os

    if any(c.get("a2a") == "tdist" for c in configs):
        os.environ.setdefault("TRITON_INTERPRET", "1")
        try:  # the all-to-all tests' interpreter speed-up (test speed only; kernel semantics unchanged)
            from ep_a2a_worker import interpreter_patch_once

            interpreter_patch_once()
        except ImportError:
            pass
    from tp_worker import harness_for

    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.distributed.communicator import create_communicator
    from sglang.srt.model_loader.loader import load_model
    from sglang.srt.two_batch_overlap.auto_off import Threshold
    from sglang.srt.two_batch_overlap.executor import TboConfig, TwoBatchOverlapExecutor

    dev = ps.torch_device()  # cpu (gloo), or this rank's GPU (NCCL; the overlap then runs on two streams)
    config = ModelConfig.from_path(path, None, "auto", dev.type)
    comm = create_communicator(ps, "auto")
    model = load_model(config, "auto", str(dev), tp_rank=ps.tp_rank, tp_size=ps.tp_size, comm=comm,
                       ep_size=ps.tp_size)
    results = []
    for cfg in configs:
        ex = None
        if cfg["executor"] == "tbo":
            ex = TwoBatchOverlapExecutor(TboConfig(token_distribution_threshold=cfg.get("threshold", 0.48),
                                                   threshold=Threshold(2, False, "forced on by the test")), dev)
        stats: dict = {}
        disp = _install_a2a(model, ps, path, cfg.get("a2a"), dev)
        try:
            before = dict(getattr(disp, "calls", {}) or {})
            h = harness_for(model, config, ps.tp_size, device=str(dev))
            tokens = run_schedule(h, ex, prompts, n_new, chunk=cfg.get("chunk"), on_step=_split_stats(stats))
            calls = None if disp is None else {m: disp.calls[m] - before.get(m, 0) for m in getattr(disp, "calls", {})}
        finally:
            _uninstall_a2a(model, disp)
        results.append({"tokens": tokens, "stats": stats, "a2a_calls": calls})
    return results


def _install_a2a(model, ps, path: str, backend, dev):
    """Expert parallelism by all-to-all with ``backend`` on every MoE block of ``model`` (None: nothing); returns the
    dispatcher."""
    if backend is None:
        return None
    from sglang.srt.deployment.plan import MoeA2aSpec
    from sglang.srt.expert_parallel.install import install_moe_a2a
    from sglang.srt.server_args import ServerArgs

    args = ServerArgs(model_path=path, device=dev.type, tp_size=ps.tp_size, ep_size=ps.tp_size,
                      moe_a2a_backend=backend, chunked_prefill_size=64, cuda_graph_max_bs=8)
    return install_moe_a2a(model, MoeA2aSpec(backend), ps, args, dev, max_running=8)


def _uninstall_a2a(model, disp) -> None:
    """Back to the all-reduce expert parallelism; closes the dispatcher."""
    if disp is None:
        return
    from sglang.srt.expert_parallel.install import moe_blocks

    disp.close()
    for b in moe_blocks(model):
        b.a2a = None


@functools.lru_cache(maxsize=None)
def prompt_ids(path: str) -> tuple:
    """The token ids of :data:`PROMPTS` with the checkpoint's tokenizer (BOS included, as the server encodes)."""
    from sglang.srt.utils.common import get_tokenizer

    tok = get_tokenizer(path)
    return tuple(tuple(tok.encode(p)) for p in PROMPTS)


@functools.lru_cache(maxsize=None)
def tp1_greedy(path: str, n_new: int = N_NEW) -> tuple:
    """TP1 greedy tokens ``[n_new]`` of every prompt of :data:`PROMPTS`, each run alone through our engine in this
    process (EOS ignored): the reference every distributed configuration must reproduce."""
    from model_harness import ModelHarness

    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_loader.loader import load_model

    config = ModelConfig.from_path(path)
    model = load_model(config, "auto", "cpu")
    return tuple(tuple(run_schedule(ModelHarness(model, config, max_reqs=1), None, [list(p)], n_new, joins=(0,))[0])
                 for p in prompt_ids(path))
