"""Rank bodies of the expert-parallel all-to-all tests (imported by spawned ranks; see tp_worker.spawn_ranks).

:func:`dispatcher_cases` runs every (backend, mode, routing) case inside ONE process group, so a world size costs one
spawn: every rank builds the same random inputs of every rank from a shared seed, dispatches its own tokens,
runs its local experts on what it received, combines, and compares with the all-reduce expert parallelism of
``layers/moe/fused_moe.py`` (every rank computes its experts' partial sum of every source's tokens, all-reduced).
"""

from __future__ import annotations

import os
from typing import Optional

import torch


def _routing(kind: str, t: int, e: int, k: int, e_loc: int, g: torch.Generator) -> torch.Tensor:
    """[t, k] distinct global expert ids: ``random``, ``rank0`` (all on rank 0's experts), ``last`` (all on the last
    rank's experts) or ``spread`` (slot j on rank j)."""
    if kind == "random":
        return torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]) if t else torch.empty(0, k).long()
    if kind in ("rank0", "last"):
        base = 0 if kind == "rank0" else e - e_loc
        return torch.stack([base + torch.randperm(e_loc, generator=g)[:k] for _ in range(t)]) if t else \
            torch.empty(0, k).long()
    if kind == "spread":
        ranks = e // e_loc
        return torch.stack([torch.tensor([((j % ranks) * e_loc + int(torch.randint(e_loc, (1,), generator=g)))
                                          for j in range(k)]) for _ in range(t)]) if t else torch.empty(0, k).long()
    raise ValueError(kind)


def make_case(seed: int, world: int, e: int, k: int, h: int, token_counts: list[int], kind: str,
              dtype: torch.dtype) -> dict:
    """Every rank's inputs and the full expert weights, identical on every rank (seeded)."""
    g = torch.Generator().manual_seed(seed)
    e_loc = e // world
    inter = 24
    w13 = (torch.randn(e, 2 * inter, h, generator=g) * 0.2).to(dtype)
    w2 = (torch.randn(e, h, inter, generator=g) * 0.2).to(dtype)
    xs, ids, ws = [], [], []
    for r in range(world):
        t = token_counts[r]
        xs.append(torch.randn(t, h, generator=g).to(dtype))
        ids.append(_routing(kind, t, e, k, e_loc, g))
        w = torch.rand(t, k, generator=g) + 0.05
        ws.append((w / w.sum(-1, keepdim=True)).float())
    return dict(w13=w13, w2=w2, xs=xs, ids=ids, ws=ws)


def run_local_experts(recv_x: torch.Tensor, recv_ids: torch.Tensor, w13_loc: torch.Tensor,
                      w2_loc: torch.Tensor) -> torch.Tensor:
    """Unweighted local expert outputs of received rows (padding rows, id -1: zeros)."""
    from sglang.srt.ops_ref import fused_moe_ref

    valid = recv_ids >= 0
    return fused_moe_ref(recv_x, w13_loc, w2_loc, valid.float().unsqueeze(1), recv_ids.clamp(min=0).unsqueeze(1))


def allreduce_ep_reference(ps, case: dict, world: int, e: int, k: int, h: int) -> list[torch.Tensor]:
    """The all-reduce EP output of every source rank's tokens: each rank runs :class:`FusedMoE`'s ``compute`` (its
    experts, other ranks' experts weighted 0) and the partial sums are all-reduced over the group."""
    import torch.distributed as dist

    from sglang.srt.layers.moe.fused_moe import FusedMoE

    dt = case["w13"].dtype
    moe = FusedMoE(e, k, h, case["w2"].shape[2], params_dtype=dt, tp_rank=ps.tp_rank, tp_size=world, ep_size=world)
    lo = moe.expert_start
    with torch.no_grad():
        moe.w13_weight.copy_(case["w13"][lo:lo + moe.num_local_experts])
        moe.w2_weight.copy_(case["w2"][lo:lo + moe.num_local_experts])
    outs = []
    for x, ids, w in zip(case["xs"], case["ids"], case["ws"]):
        part = moe.compute(x, w, ids) if x.shape[0] else torch.zeros(0, h, dtype=dt)
        part = part.float()
        dist.all_reduce(part, group=ps.device_group)
        outs.append(part)
    return outs


CASES = [  # (name, token counts per rank as a function of world, routing kind)
    ("random_uneven", lambda w: [min(8, 2 + 3 * r) for r in range(w)], "random"),
    ("all_to_rank0", lambda w: [6] * w, "rank0"),
    ("all_to_last_some_idle", lambda w: [0 if r % 2 else 7 for r in range(w)], "last"),
    ("spread_one_idle", lambda w: [0] + [4] * (w - 1), "spread"),
    ("all_idle", lambda w: [0] * w, "random"),
    ("full_capacity", lambda w: [8] * w, "random"),
]


def dispatcher_cases(ps, backends: list[str], seeds: list[int], e_per_rank: int = 2, k: int = 2, h: int = 32,
                     dtypes: tuple = ("float32",), capacity: int = 8) -> list[dict]:
    """Rank body: every backend x mode x dtype x case x seed; returns one record per check (name, max abs error,
    whether the handle's grouping invariants held)."""
    if any(b.startswith("tdist") for b in backends):
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from sglang.srt.layers.moe.token_dispatcher import DispatcherConfig, DispatchMode, create_token_dispatcher

    world, rank = ps.tp_size, ps.tp_rank
    e = e_per_rank * world
    group = ps.ep_group if ps.ep_group is not None else ps.device_group
    out = []
    for variant in backends:
        backend, _, rounds = variant.partition(":")  # "tdist:3": NORMAL rounds of at most 3 rows per pair
        for dname in dtypes:
            dt = getattr(torch, dname)
            cfg = DispatcherConfig(num_experts=e, top_k=k, hidden_size=h, ep_size=world, ep_rank=rank,
                                   max_tokens_normal=64, max_tokens_low_latency=capacity, dtype=dt, device="cpu")
            disp = create_token_dispatcher(backend, cfg, group)
            if rounds:
                disp.normal_cap = int(rounds)  # below the buffers' capacity: more rounds, same buffers
            try:
                for seed in seeds:
                    for name, counts_of, kind in CASES:
                        case = make_case(seed, world, e, k, h, counts_of(world), kind, dt)
                        ref = allreduce_ep_reference(ps, case, world, e, k, h)
                        for mode in (DispatchMode.NORMAL, DispatchMode.LOW_LATENCY):
                            got, inv = _one(disp, case, rank, mode, cfg)
                            err = float((got.float() - ref[rank]).abs().max()) if got.numel() else 0.0
                            out.append(dict(name=f"{variant}/{dname}/{mode.value}/{name}/seed{seed}", err=err,
                                            invariants=inv, shape=tuple(got.shape)))
            finally:
                disp.close()
    return out


def _one(disp, case: dict, rank: int, mode, cfg) -> tuple[torch.Tensor, Optional[str]]:
    """Dispatch this rank's tokens, run the local experts, combine; returns (output, invariant violation or None)."""
    x, ids, w = case["xs"][rank], case["ids"][rank], case["ws"][rank]
    lo = cfg.expert_start
    h = disp.dispatch(x, ids, w, mode)
    h.wait()
    problem = _check_grouping(h, case, rank, cfg)
    y = run_local_experts(h.recv_x, h.recv_expert_ids, case["w13"][lo:lo + cfg.num_local_experts],
                          case["w2"][lo:lo + cfg.num_local_experts])
    return disp.combine(y, h).wait(), problem


def _check_grouping(h, case: dict, rank: int, cfg) -> Optional[str]:
    """The handle's rows are grouped by local expert, counts match, and the multiset of received (expert, weight)
    pairs equals what the sources routed here."""
    ids = h.recv_expert_ids
    valid = ids >= 0
    n = int(valid.sum())
    if h.num_recv is not None and h.num_recv != n:
        return f"num_recv {h.num_recv} != valid rows {n}"
    if not bool(valid[:n].all()) or bool(valid[n:].any()):
        return "padding rows are not last"
    if n and not bool((ids[:n][1:] >= ids[:n][:-1]).all()):
        return "rows not grouped by local expert"
    if h.expert_counts.tolist() != torch.bincount(ids[:n], minlength=cfg.num_local_experts).tolist():
        return f"expert_counts {h.expert_counts.tolist()} wrong"
    want = []
    lo, e_loc = cfg.expert_start, cfg.num_local_experts
    for xs, idss, ws in zip(case["xs"], case["ids"], case["ws"]):
        for t in range(xs.shape[0]):
            for j in range(idss.shape[1]):
                if lo <= int(idss[t, j]) < lo + e_loc:
                    want.append((int(idss[t, j]) - lo, round(float(ws[t, j]), 6), round(float(xs[t].float().sum()), 3)))
    got = [(int(ids[i]), round(float(h.recv_weights[i]), 6), round(float(h.recv_x[i].float().sum()), 3))
           for i in range(n)]
    if sorted(got) != sorted(want):
        return f"received pairs differ: {len(got)} received, {len(want)} routed here"
    return None


# ---- whole-model runs --------------------------------------------------------------------------------------------
JOIN_STEPS = (0, 0, 3, 6)  # requests 0 and 1 prefill together, 2 and 3 join mid-decode (mixed batches)


def greedy_schedule(model, config, prompts: list, n_new: int, tp_size: int, executor=None,
                    joins: tuple = JOIN_STEPS) -> tuple[list, list]:
    """Greedy decoding of ``prompts`` (token id lists) through one harness: request i joins at step ``joins[i]``
    (its prefill batched with the others' decodes) and stops after ``n_new`` tokens. Returns (tokens per request,
    forward mode of every step)."""
    from tp_worker import harness_for

    h = harness_for(model, config, tp_size)
    h.reqs.clear()
    outs: list = [[] for _ in prompts]
    started: set = set()
    modes, step = [], 0
    while any(len(o) < n_new for o in outs):
        items = []
        for i, p in enumerate(prompts):
            if step < joins[i] or len(outs[i]) >= n_new:
                continue
            items.append((i, list(p)) if i not in started else (i, [outs[i][-1]]))
            started.add(i)
        logits = h.step(items, executor)
        modes.append(h.last_mode.name)
        for (i, _), row in zip(items, logits):
            outs[i].append(int(torch.argmax(row)))
        step += 1
    return outs, modes


class _RotatedExperts:
    """Negative control: an :class:`EpA2aMoe` whose experts stage sends each received row to the NEXT local expert
    (a wrong dispatch); the tokens must then differ from TP1's."""

    def __init__(self, inner):
        self.inner, self.scope, self.dispatcher = inner, inner.scope, inner.dispatcher

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def run_experts(self, block, moe):
        h = moe.dispatched
        h.wait()
        ids = h.recv_expert_ids
        rot = torch.where(ids >= 0, (ids + 1) % block.experts.num_local_experts, ids)
        moe.expert_out = block.experts.compute_rows(h.recv_x, rot)


def ep_model_tokens(ps, path: str, prompts: list, jobs: list, n_new: int, negative_control: bool = True) -> dict:
    """Rank body: the checkpoint at ``path`` with EP = TP = world; for every job ``"backend/executor"`` (executor
    ``forward``: the model's own forward; ``micro_batch``: two request micro-batches through the staged path that
    two-batch overlap builds on) the all-to-all backend installed and :func:`greedy_schedule` run, with the
    dispatch-mode counts; plus (``negative_control``) a wrong dispatch (rotated experts) over 8 tokens."""
    backends = sorted({j.split("/")[0] for j in jobs})
    if "tdist" in backends:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        interpreter_patch_once()
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.deployment.plan import MoeA2aSpec
    from sglang.srt.distributed.communicator import create_communicator
    from sglang.srt.expert_parallel.install import install_moe_a2a, moe_blocks
    from sglang.srt.model_executor.executors.split import MicroBatchExecutor
    from sglang.srt.model_loader.loader import load_model
    from sglang.srt.server_args import ServerArgs

    world = ps.tp_size
    config = ModelConfig.from_path(path)
    comm = create_communicator(ps, "auto")
    model = load_model(config, "auto", "cpu", tp_rank=ps.tp_rank, tp_size=world, comm=comm, ep_size=world)
    out: dict = {}
    for backend in backends:
        args = ServerArgs(model_path=path, device="cpu", tp_size=world, ep_size=world, moe_a2a_backend=backend,
                          chunked_prefill_size=64, cuda_graph_max_bs=8)
        disp = install_moe_a2a(model, MoeA2aSpec(backend), ps, args, torch.device("cpu"), max_running=8)
        try:
            for job in jobs:
                if not job.startswith(backend + "/"):
                    continue
                ex = MicroBatchExecutor(2) if job.endswith("/micro_batch") else None
                before = dict(disp.calls)
                toks, modes = greedy_schedule(model, config, prompts, n_new, world, ex)
                calls = {m: disp.calls[m] - before[m] for m in disp.calls}
                out[job] = dict(tokens=toks, modes=modes, calls=calls)
            if negative_control and backend == backends[0]:
                good = moe_blocks(model)[0].a2a
                for b in moe_blocks(model):
                    b.a2a = _RotatedExperts(good)
                out["rotated_experts"] = dict(tokens=greedy_schedule(model, config, prompts, 8, world)[0])
        finally:
            disp.close()
            for b in moe_blocks(model):
                b.a2a = None
    return out


def interpreter_patch_once() -> bool:
    """Test speed only (CPU, ``TRITON_INTERPRET=1``): the Triton interpreter re-patches ``triton.language`` on every
    nested ``@triton.jit`` call (a few ms each: ``inspect.getmembers`` of the language modules), although the
    kernel launch around it has patched the same modules already and restores them at its end. Make nested calls
    reuse the launch's patch. The kernels' semantics are unchanged (the same patched builtins are in effect).
    Returns False (nothing changed) when this Triton's interpreter does not look as expected."""
    try:
        from triton.runtime import interpreter as interp
    except ImportError:
        return False
    orig = getattr(interp, "_patch_lang", None)
    if orig is None or getattr(orig, "patch_once", False):
        return orig is not None
    import inspect

    import triton.language as tl

    patched: set = set()  # ids of the language modules the current launch patched

    class _Noop:
        def restore(self) -> None:
            pass

    def langs(fn) -> set:
        return {id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core)}

    def patch_lang(fn):
        mine = langs(fn)
        if patched and mine <= patched:
            return _Noop()
        scope = orig(fn)
        first = not patched
        patched.update(mine)
        if first:  # the launch's own patch: forget everything when it is restored
            inner = scope.restore

            def restore() -> None:
                patched.clear()
                inner()

            scope.restore = restore
        return scope

    patch_lang.patch_once = True
    interp._patch_lang = patch_lang
    return True


def ep_world(ps, plan: dict) -> dict:
    """Rank body of one process group for everything a world size checks (one spawn per world size): ``plan`` keys
    ``property`` (kwargs of :func:`dispatcher_cases`), ``model`` / ``model_short`` (kwargs of
    :func:`ep_model_tokens`) and ``big`` (kwargs of :func:`big_moe_configs`); returns the results under the same
    keys."""
    out = {}
    if "property" in plan:
        out["property"] = dispatcher_cases(ps, **plan["property"])
    for key in ("model", "model_short"):
        if key in plan:
            out[key] = ep_model_tokens(ps, **plan[key])
    if "big" in plan:
        out["big"] = big_moe_configs(ps, **plan["big"])
    return out


def tp1_greedy_tokens(path: str, prompt_ids: list, n_new: int) -> list:
    """TP1 greedy tokens of one prompt from our engine in this process, one request alone (the reference)."""
    from model_harness import ModelHarness

    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_loader.loader import load_model

    config = ModelConfig.from_path(path)
    h = ModelHarness(load_model(config, "auto", "cpu"), config, max_reqs=1, max_len=len(prompt_ids) + n_new + 1)
    out, new = [], list(prompt_ids)
    for _ in range(n_new):
        tok = int(torch.argmax(h.step([("r", new)])[0]))
        out.append(tok)
        new = [tok]
    return out


def shrunk_config(cfg_dir: str, layers: int, out_dir: str) -> str:
    """A copy of ``cfg_dir``'s config.json with ``num_hidden_layers = layers`` in ``out_dir`` (every other size
    real); returns ``out_dir``."""
    import json

    cfg = json.load(open(os.path.join(cfg_dir, "config.json")))
    cfg["num_hidden_layers"] = layers
    cfg.pop("mlp_only_layers", None)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f)
    return out_dir


def forced_logits(model, config, tp_size: int, steps: int = 3) -> list:
    """Logits of a prefill of two prompts, then ``steps`` decode steps with fixed (teacher-forced) tokens, and a
    third request joining at step 1 (a mixed batch): ``[bs, vocab]`` fp32 per step."""
    from tp_worker import harness_for

    h = harness_for(model, config, tp_size)
    out = [h.step([("a", [11, 57, 902, 4, 33, 7]), ("b", [5, 77, 21])]).float().clone()]
    for i in range(steps):
        items = [("a", [100 + i]), ("b", [200 + i])] + ([("c", [9, 8, 7, 6])] if i == 0 else
                                                        [("c", [300 + i])])
        out.append(h.step(items).float().clone())
    return out


def big_moe_configs(ps, jobs: list, tmp: str) -> dict:
    """Rank body: for every ``(name, config dir, layers, backend)`` the config shrunk to ``layers`` decoder layers,
    dummy bf16 weights, EP = TP = world: :func:`forced_logits` with the all-reduce EP and with the all-to-all
    backend installed on the same weights (expert down projections scaled up so the routed experts dominate), and
    with a wrong dispatch (rotated experts); returns per name the max |a2a - all-reduce|, the max |wrong -
    all-reduce|, the logit scale, finiteness, the dispatch-mode counts and the MoE block count."""
    if any(j[3] == "tdist" for j in jobs):
        os.environ.setdefault("TRITON_INTERPRET", "1")
        interpreter_patch_once()
    import gc

    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.deployment.plan import MoeA2aSpec
    from sglang.srt.distributed.communicator import create_communicator
    from sglang.srt.expert_parallel.install import install_moe_a2a, moe_blocks
    from sglang.srt.model_loader.loader import load_model
    from sglang.srt.server_args import ServerArgs

    world = ps.tp_size
    comm = create_communicator(ps, "auto")
    out = {}
    for name, cfg_dir, layers, backend in jobs:
        path = shrunk_config(cfg_dir, layers, os.path.join(tmp, f"{name}-r{ps.tp_rank}"))
        config = ModelConfig.from_path(path, 512, "bfloat16", "cpu")
        model = load_model(config, "dummy", "cpu", tp_rank=ps.tp_rank, tp_size=world, comm=comm, ep_size=world)
        with torch.no_grad():  # dummy weights are uniform in +-1e-3: make the routed experts dominate the output,
            for b in moe_blocks(model):  # so that a wrong dispatch shows in the logits (negative control below)
                b.experts.w2_weight.mul_(100.0)
        ref = forced_logits(model, config, world)
        args = ServerArgs(model_path=path, device="cpu", tp_size=world, ep_size=world, moe_a2a_backend=backend,
                          chunked_prefill_size=64, cuda_graph_max_bs=8, load_format="dummy")
        disp = install_moe_a2a(model, MoeA2aSpec(backend), ps, args, torch.device("cpu"), max_running=8)
        try:
            got = forced_logits(model, config, world)
            calls = dict(disp.calls)
            good = moe_blocks(model)[0].a2a
            for b in moe_blocks(model):
                b.a2a = _RotatedExperts(good)
            wrong = forced_logits(model, config, world, steps=1)
        finally:
            disp.close()
        diff = max(float((g - r).abs().max()) for g, r in zip(got, ref))
        wrong_diff = max(float((g - r).abs().max()) for g, r in zip(wrong, ref))
        scale = max(float(r.abs().max()) for r in ref)
        finite = all(bool(torch.isfinite(g).all()) for g in got)
        out[name] = dict(diff=diff, wrong_diff=wrong_diff, scale=scale, finite=finite, calls=calls,
                         blocks=len(moe_blocks(model)))
        del model, ref, got
        gc.collect()
    return out
