"""The steady-state decode step of the serving path (the :class:`~sglang.srt.managers.scheduler.Scheduler`
loop the server runs, with its overlap worker, the runner and its CUDA graphs) against the memory floor, in the
process that measured the floor (called by ``benchmark/decode/step_ab.py --serving``).

Modes, all on the same runner, graphs and prompts, order alternated between repetitions:

* ``plain``: overlap off (``--disable-overlap-schedule``): schedule, forward, wait, process, one after another;
* ``overlap-host``: the overlap scheduler with host futures (before device-side future tokens): the worker waits
  for batch i's ids on the host before it prepares and launches batch i+1;
* ``overlap``: the overlap scheduler as served now on CUDA (device futures): batch i+1 is launched behind batch i,
  its placeholder ids resolved on the device; the scheduler reads tokens one step late.

Per batch size ``bs``: ``bs`` requests of ``context`` random token ids (greedy, ``ignore_eos``) are added at once;
once all of them decode (no prefill left) and ``--serving-warmup`` more steps have run, the wall time between
successive ``Scheduler.step()`` returns is recorded for ``--serving-steps`` steps. In the overlap modes a step's
interval is the pipeline's period, i.e. the decode step the server delivers. Reported: median step, the memory
floor at the step's mean context ((weights + KV of every running request) / copy bandwidth), step / floor.
Not included: the ZMQ send of each step's outputs to the detokenizer (a few tens of us per step, overlapped with the
forward in the overlap modes). The first repetition prefills; later ones hit the radix cache for the same prompts,
which leaves the decode batches unchanged.
"""

from __future__ import annotations

import statistics
import time

import torch

from benchmark.common.floors import kv_bytes, memory_floor_s

MODES = ("plain", "overlap-host", "overlap")


PREFILL_MARGIN = 64  # extra new tokens per request: the first requests decode while later ones still prefill


def _scheduler(runner, mode: str, model_path: str, chunked_prefill_size=None):
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.server_args import ServerArgs

    args = ServerArgs(model_path=model_path, load_format="dummy", dtype="bfloat16", device="cuda",
                      chunked_prefill_size=chunked_prefill_size)
    return Scheduler(args, runner, None, overlap=mode != "plain", device_futures=mode == "overlap")


def _steady(s, bs: int) -> bool:
    """All ``bs`` requests decode: none waiting or chunked, each has its first token."""
    return (not s.waiting and s.chunked_req is None and len(s.running) == bs
            and all(r.output_ids for r in s.running))


def run_mode(runner, mode: str, prompts: list[list[int]], warmup: int, steps: int, bw: float,
             weight_bytes: int, tag: str, model_path: str, max_steps: int = 2000,
             chunked_prefill_size=None) -> dict:
    """Serve ``prompts`` (``bs`` lists of token ids) through a fresh Scheduler in ``mode`` (server defaults of
    ``model_path``'s ServerArgs, ``chunked_prefill_size`` None = the default); intervals of ``steps`` steady decode
    steps after ``warmup`` steps, then every request is aborted and the scheduler drained.

    Returns ``{"step_s": [...], "floor_s": [...], "ctx": [...]}`` (per timed step: wall seconds between
    ``step()`` returns, memory floor in seconds, mean running context in tokens).
    Raises:
        RuntimeError: the batch never reached a steady all-decode state within ``max_steps`` steps.
    """
    from sglang.srt.managers.io_struct import AbortReq, TokenizedGenerateReqInput

    mc = runner.model_config
    bs = len(prompts)
    s = _scheduler(runner, mode, model_path, chunked_prefill_size)
    out = {"step_s": [], "floor_s": [], "ctx": []}
    try:
        params = {"max_new_tokens": warmup + steps + 8 + PREFILL_MARGIN, "temperature": 0.0, "ignore_eos": True}
        for i, p in enumerate(prompts):
            s.add_request(TokenizedGenerateReqInput(rid=f"{tag}-{i}", input_ids=p, sampling_params=params))
        k, seen, last, aborted = 0, 0, None, False
        while s.has_work() and k < max_steps:
            k += 1
            s.step()
            now = time.perf_counter()
            if aborted or (seen == 0 and not _steady(s, bs)):
                continue
            seen += 1
            if seen > warmup + 1:
                ctx = sum(r.kv_len for r in s.running) / max(len(s.running), 1)
                out["step_s"].append(now - last)
                out["ctx"].append(ctx)
                out["floor_s"].append(memory_floor_s(weight_bytes, kv_bytes(bs * ctx, mc.num_hidden_layers,
                                                                            runner.num_kv_heads, mc.head_dim,
                                                                            mc.dtype.itemsize), bw))
            last = now
            if len(out["step_s"]) == steps:
                s.abort(AbortReq(abort_all=True))  # the rest of the outputs is not needed; drain
                aborted = True
        if len(out["step_s"]) < steps:
            raise RuntimeError(f"{mode} bs {bs}: {len(out['step_s'])} of {steps} steady decode steps in {k} steps")
    finally:
        s.close()
    return out


def serving_rows(runner, batches: list[int], cfg, bw: float, weight_bytes: int) -> list[dict]:
    """For each batch size, every mode of ``cfg.serving_modes`` (default :data:`MODES`; order alternated over
    ``cfg.serving_reps``); one row per (batch, mode) with the median step, floor and ratio. Prompts: ``cfg.context``
    random ids, seeded."""
    modes = tuple(getattr(cfg, "serving_modes", None) or MODES)
    rows = []
    for bs in batches:
        gen = torch.Generator().manual_seed(cfg.seed + 1000 + bs)
        prompts = torch.randint(3, runner.model_config.vocab_size, (bs, cfg.context), generator=gen).tolist()
        acc = {m: {"step_s": [], "floor_s": [], "ctx": []} for m in modes}
        for rep in range(cfg.serving_reps):
            for mode in (modes if rep % 2 == 0 else modes[::-1]):
                got = run_mode(runner, mode, prompts, cfg.serving_warmup, cfg.serving_steps, bw, weight_bytes,
                               f"{mode}-{bs}-{rep}", cfg.model_path,
                               chunked_prefill_size=getattr(cfg, "chunked_prefill_size", None))
                for key in acc[mode]:
                    acc[mode][key] += got[key]
        runner.kv_cache.prefix_cache.reset()  # the next batch size starts from an empty cache
        for mode in modes:
            a = acc[mode]
            step, floor = statistics.median(a["step_s"]), statistics.median(a["floor_s"])
            rows.append({"batch": bs, "mode": mode, "step_ms": step * 1e3, "floor_ms": floor * 1e3,
                         "ratio": step / floor, "ctx": statistics.median(a["ctx"]), "steps": len(a["step_s"]),
                         "p90_ms": sorted(a["step_s"])[int(0.9 * (len(a["step_s"]) - 1))] * 1e3})
    return rows


def render_rows(rows: list[dict]) -> list[str]:
    """Markdown table lines of :func:`serving_rows`."""
    out = ["## Decode step of the serving path (Scheduler loop + runner + CUDA graphs), one process, order "
           "alternated", "", "| batch | mode | step (ms) | p90 (ms) | floor (ms) | step/floor | context | steps |",
           "|---:|---|---:|---:|---:|---:|---:|---:|"]
    out += [f"| {r['batch']} | {r['mode']} | {r['step_ms']:.3f} | {r['p90_ms']:.3f} | {r['floor_ms']:.3f} | "
            f"{r['ratio']:.3f} | {r['ctx']:.0f} | {r['steps']} |" for r in rows]
    return out
