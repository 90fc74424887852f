"""Rank body of the MoE layout matrix: the real :class:`Scheduler` and :class:`ModelRunner` of each configuration on
one gloo rank per process, built from the deployment plan exactly as a server worker builds them (``plan_deployment``
-> the rank's ``WorkerSpec`` -> ``ModelRunner(worker=spec, dp_attention=...)`` -> ``Scheduler``), driven by a
scripted request schedule instead of sockets. Every configuration of one world size runs in ONE process group.

A configuration: ``{"name", "dp": bool, "a2a": "none" | "nccl" | "tdist", "tbo": bool, "overlap": bool,
"n_new": int, "kv_tokens": int, "conservativeness": float}`` (``kv_tokens``: the KV pool, default
:data:`KV_TOKENS`; ``conservativeness``: ``--schedule-conservativeness``, below 1 admits more requests than their
decodes will have room for, so they retract). The schedule (:func:`schedule_for`) gives per rank and per step the
requests to submit and the aborts to send:

* phase ``mix``: a long prompt prefilled in chunks of 8 (``--chunked-prefill-size 8``) with a request joining while
  it decodes (mixed prefill + decode batches), a rank with more requests than its small KV pool holds (decodes
  retract and re-prefill), a request aborted in flight, and (DP, world 4) a rank idle until a request joins it late;
* phase ``solo`` (DP only): one request on the last rank, every other rank idle.

Under DP attention each rank submits its own requests (the router's job in a server) and the ranks agree per step;
with TP attention every rank submits all of them (the lockstep scheduler's job in a server) and rank 0's outputs are
compared.
"""

from __future__ import annotations

import os
import time
from typing import Any

N_NEW = 32
KV_TOKENS = 96
CHUNK = 8


def schedule_for(dp: bool, world: int, rank: int, prompts: dict, n_new: int) -> dict:
    """``{"mix": {step: [("submit", rid, ids, max_new) | ("abort", rid)]}, "solo": {...}}`` for this rank.
    ``prompts``: name -> token ids (``P0``..``P3``, ``LONG``); rids name the prompt (``<prompt>@<rank>...``)."""
    def sub(rid: str, name: str, n: int = n_new):
        return ("submit", rid, prompts[name], n)

    victim = 2 * n_new  # admitted first (it fits the pool beside its prompt), aborted at step 8 while it decodes

    mix: dict = {}
    if not dp:  # TP attention: one scheduler state on every rank
        mix = {0: [sub("victim-P0", "P0", victim), sub("LONG", "LONG"), sub("P0", "P0"), sub("P1", "P1"),
                   sub("P2", "P2")],
               5: [sub("P3-late", "P3")], 8: [("abort", "victim-P0")]}
        return {"mix": mix, "solo": {}}
    if rank == 0:  # a chunked prefill, a request joining mid-decode
        mix = {0: [sub("LONG@0", "LONG")], 5: [sub("P3-late@0", "P3")]}
    elif rank == 1:  # more than the KV pool holds (retraction), a request aborted in flight
        mix = {0: [sub("victim-P0@1", "P0", victim)] + [sub(f"{p}@1.{k}", p) for k in (0, 1)
                                                         for p in ("P0", "P1", "P2", "P3")],
               8: [("abort", "victim-P0@1")]}
    elif rank == 2:
        mix = {0: [sub("P2@2", "P2")], 3: [sub("P1-late@2", "P1")]}
    elif rank == 3:  # idle until two requests join late (a decode batch of 2: splittable)
        mix = {4: [sub("P1-late@3", "P1"), sub("P3-late@3", "P3")]}
    solo = {0: [sub(f"P2-solo@{rank}", "P2")]} if rank == world - 1 else {}
    return {"mix": mix, "solo": solo}


def _server_args(path: str, world: int, cfg: dict):
    from sglang.srt.server_args import ServerArgs

    dp = {"dp_size": world, "enable_dp_attention": True} if cfg["dp"] else {}
    tbo = {"enable_two_batch_overlap": True, "tbo_min_tokens": 2} if cfg["tbo"] else {}
    return ServerArgs(model_path=path, device="cpu", tp_size=world, ep_size=world, moe_a2a_backend=cfg["a2a"],
                      chunked_prefill_size=CHUNK, max_total_tokens=cfg.get("kv_tokens", KV_TOKENS),
                      schedule_conservativeness=cfg.get("conservativeness", 1.0), **dp, **tbo)


def _build(ps: Any, path: str, cfg: dict, sync_group: Any):
    """The rank's ``(Scheduler, ModelRunner, WorkerSpec)`` as a server worker builds them (collective: the KV budget
    agreement, the dispatcher install)."""
    import torch

    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.deployment import plan_deployment
    from sglang.srt.distributed.communicator import TorchCommunicator
    from sglang.srt.dp_attention.rank import DpAttentionRank
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.model_executor.model_runner import ModelRunner

    args = _server_args(path, ps.tp_size, cfg)
    spec = plan_deployment(args).workers[ps.tp_rank]
    mc = ModelConfig.from_path(path, None, "auto", "cpu")
    if cfg["dp"]:
        dp = DpAttentionRank(spec.dp_attention, ps, sync_group, TorchCommunicator.create(ps))
        runner = ModelRunner(mc, args, "cpu", worker=spec, dp_attention=dp)
    else:
        runner = ModelRunner(mc, args, "cpu", tp_rank=ps.tp_rank, tp_size=ps.tp_size, parallel_state=ps,
                             worker=spec)
    torch.manual_seed(0)
    return Scheduler(args, runner, tokenizer=None, overlap=cfg["overlap"]), runner, spec


def _instrument(runner: Any) -> dict:
    """Record every forward the runner launches (mode, tokens, the agreed step's fields) and every micro-batch
    split of its executor; returns the live record."""
    rec: dict = {"launched": [], "splits": 0}
    forward = runner.forward

    def recorded(batch):
        step = getattr(batch, "dp_step", None)
        rec["launched"].append((batch.forward_mode.name, len(batch.input_ids),
                                None if step is None else (tuple(step.num_tokens), step.moe_dispatch_mode,
                                                          bool(step.split_all))))
        return forward(batch)

    runner.forward = recorded
    ex = runner.executor
    decide = getattr(ex, "decide", None)
    if decide is not None and getattr(ex, "name", "") == "two_batch_overlap":
        def counted(fb):
            split = decide(fb)
            rec["splits"] += split is not None
            return split

        ex.decide = counted
    return rec


def _run_phase(s: Any, plan: dict, results: dict, reqs: dict, dp: bool, max_steps: int = 3000) -> int:
    """Step ``s`` through ``plan`` (submits and aborts by step index) until every rank is drained; returns the
    steps taken. Under DP every rank stops at the same step: the first agreement (after the last scripted action)
    that saw no work on any rank."""
    from test_scheduler import record, submit

    from sglang.srt.managers.io_struct import AbortReq

    last = max(plan, default=0)
    for i in range(max_steps):
        for action in plan.get(i, []):
            if action[0] == "submit":
                _, rid, ids, n = action
                reqs[rid] = submit(s, rid, list(ids), max_new_tokens=n, ignore_eos=True)
            else:
                s.abort(AbortReq(rid=action[1]))
        record(results, s.step())
        if i >= last and (not s.dp_sync.peers_busy if dp else not s.has_work()):
            return i + 1
    raise AssertionError(f"the scheduler did not drain in {max_steps} steps: waiting "
                         f"{[(r.rid, len(r.origin_input_ids), len(r.output_ids)) for r in s.waiting]}, running "
                         f"{[(r.rid, len(r.output_ids)) for r in s.running]}, KV free {s.kv.available_size()} of "
                         f"{s.kv.max_total_tokens}")


def _kv_returned(s: Any) -> bool:
    """Every request row and KV slot is free again once the prefix cache is flushed."""
    s.tree_cache.reset()
    return s.kv.req_to_token_pool.available_size() == s.req_rows and s.kv.available_size() == s.kv.max_total_tokens


def schedule_world(ps: Any, path: str, prompts: dict, configs: list) -> list:
    """Rank body (see the module docstring): every configuration in order; returns per configuration ``{"name",
    "results": {rid: {"ids", "finish"}}, "retractions", "launched", "splits", "a2a_calls", "idle": {phase: n},
    "steps": {phase: n}, "kv_returned", "scope", "executor", "seconds"}``."""
    import torch.distributed as dist

    if any(c["a2a"] == "tdist" for c in configs):
        os.environ["TRITON_INTERPRET"] = "1"
        from ep_a2a_worker import interpreter_patch_once

        interpreter_patch_once()  # test speed only (see there)
    sync_group = dist.new_group(backend="gloo")  # DP step agreement (a server makes one per DP world)
    out = []
    for cfg in configs:
        t0 = time.perf_counter()
        s, runner, spec = _build(ps, path, cfg, sync_group)
        rec = _instrument(runner)
        plan = schedule_for(cfg["dp"], ps.tp_size, ps.tp_rank, prompts, cfg["n_new"])
        results, reqs, idle, steps = {}, {}, {}, {}
        try:
            for phase in ("mix", "solo"):
                if phase == "solo" and not cfg["dp"]:
                    continue
                before = s.dp_sync.idle_forwards if cfg["dp"] else 0
                steps[phase] = _run_phase(s, plan[phase], results, reqs, cfg["dp"])
                idle[phase] = (s.dp_sync.idle_forwards - before) if cfg["dp"] else 0
            disp = runner.moe_dispatcher
            out.append({
                "name": cfg["name"],
                "results": {k: {"ids": v["ids"], "finish": v["finish"]} for k, v in results.items()},
                "retractions": sum(r.num_retractions for r in reqs.values() if r is not None),
                "launched": rec["launched"], "splits": rec["splits"], "idle": idle, "steps": steps,
                "a2a_calls": dict(disp.calls) if disp is not None else None,
                "scope": None if spec.moe_a2a is None else spec.moe_a2a.token_scope,
                "executor": spec.executor.name, "kv_returned": _kv_returned(s),
                "seconds": round(time.perf_counter() - t0, 1)})
        finally:
            s.close()
            if runner.moe_dispatcher is not None:
                runner.moe_dispatcher.close()
    return out
