"""AFD decode with the attention worker's step in one CUDA graph (MegaScale-Infer, Zhu et al. 2025,
sec. 4.1 + 5): 1 attention worker on cuda:0, ``--ffn-workers`` FFN worker processes on the next GPUs, M2N over the
device-driven ``cuda_push`` transport (``--transport cuda_push_ll``: its low-latency protocol; one ``STEP`` host
message per step; per layer and micro-batch the dispatch and the results go device to device, see
:mod:`sglang.srt.afd.device_m2n`). The FFN workers serve each step as a CUDA graph of their own from its second
occurrence.

* ``--check``: greedy correctness. The full model on cuda:0 (ModelHarness, Triton attention) gives the reference;
  the AFD attention worker prefills eagerly, then decodes ``--steps`` steps by replaying ONE captured graph with each
  step's inputs copied into it. Prints per step whether the greedy tokens are equal and the largest logit
  difference; exit status 1 on any token difference.
* otherwise, per ``--micro-batches`` x ``--batch``: median decode step (host time of a step ending with the greedy ids
  on the host, as a server step) eager device-driven (``AfdExecutor.run`` per step: every launch from the host, no
  per-layer host round trip) vs graphed (:class:`benchmark.afd.step_graph.StepGraph` replays), and Ta (attention stages of one
  layer and micro-batch, GPU time from the eager steps). Then (unless ``--no-stage-times``) the graphed step's own
  Ta / Tf / Tc and the ``m >= 2(1 + Tc/Tf)`` check (MegaScale-Infer sec. 4.1) from a second capture of the same step
  with :mod:`sglang.srt.afd.step_timing` stamps inside the graph (external timed CUDA events; ``--stage-steps``
  replays, median): Ta = attention stages of one layer and micro-batch, round trip = its dispatch to its results
  combined on the attention stream, Tf = the FFN worker's expert compute per message (its own step graph; the
  slowest worker's median), Tc = (round trip - Tf) / 2 (exact for m = 1; for m > 1 the round trip includes the other
  micro-batches' attention, so Tc is an upper bound). The step-time columns come from the graph without stamps;
  the FFN worker's graph carries its stamps in both. The colocated baseline and the host-path AFD (Ta / Tf / Tc)
  come from ``benchmark/afd/bench.py --setups colocated`` / ``--setups afd`` in the same GPU round
  (the graphed-AFD two-GPU script under ``scripts/gpu/``).

Usage: python benchmark/afd/bench_step_graph.py --model-path P [--load-format dummy] [--check] [--batch 32 128]
       [--micro-batches 1 2] [--steps 8] [--transport cuda_push|cuda_push_ll] [--stage-steps 4] [--no-stage-times]
       [--md-out F] [--record-dir DIR]
``--record-dir DIR`` (timing): also the project's JSON record + markdown (:func:`step_graph_record`) under
``DIR/afd/``; headline: graphed vs eager step at the largest m and batch.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

logger = logging.getLogger("benchmark.afd.bench_step_graph")


def _decode_batch(h, batch: int, input_len: int, vocab: int, ex):
    """Prefill ``batch`` random prompts through ``ex`` (eager); returns the first decode step's prepared batch."""
    gen = torch.Generator().manual_seed(0)
    logits = h.step([(i, torch.randint(3, vocab, (input_len,), generator=gen).tolist()) for i in range(batch)], ex,
                    poison=False)
    return logits


def check_tokens(a, mc, attn, ex, m: int) -> list[str]:
    """Greedy tokens of the graphed AFD decode with ``m`` micro-batches vs the colocated model on cuda:0 (see the
    module docstring)."""
    from benchmark.afd.step_graph import StepGraph

    from sglang.srt.model_loader.loader import load_model
    from sglang.test.model_harness import ModelHarness

    ex.m = m
    b, max_len = a.batch[0], a.input_len + a.steps + 8
    ref_h = ModelHarness(load_model(mc, a.load_format, "cuda:0"), mc, b, max_len, device="cuda:0",
                         attention_backend="triton")
    afd_h = ModelHarness(attn, mc, b, max_len, device="cuda:0", attention_backend="triton")
    ref = _decode_batch(ref_h, b, a.input_len, mc.vocab_size, None)
    out = _decode_batch(afd_h, b, a.input_len, mc.vocab_size, ex)
    lines, bad, graph = [], 0, None
    for step in range(a.steps + 1):
        same = torch.equal(ref.argmax(-1), out.argmax(-1))
        diff = (ref.float() - out.float()).abs().max().item()
        bad += not same
        lines.append(f"| {step} | {'prefill (eager)' if step == 0 else 'graph replay'} | {'yes' if same else 'NO'} | "
                     f"{diff:.3g} |")
        if step == a.steps:
            break
        nxt = ref.argmax(-1).tolist()  # both continue with the reference tokens (a difference is counted above)
        ref = ref_h.step([(i, [t]) for i, t in enumerate(nxt)], None, poison=False)
        fb = afd_h.prepare([(i, [t]) for i, t in enumerate(nxt)])
        if graph is None:
            graph = StepGraph(ex, attn, fb)  # captured on this step's batch; later steps copy their inputs in
        out = graph.replay(fb)
    head = [f"- greedy check, {mc.path}: batch {b}, m={ex.m}, 1 attention + {ex.topo.num_ffn} FFN on "
            f"{torch.cuda.device_count()} GPUs, decode by one captured graph per step",
            "", "| step | path | tokens equal colocated | max logit diff |", "|---|---|---|---|"]
    del graph
    torch.cuda.synchronize()
    return head + lines + ["", f"CHECK {'PASS' if bad == 0 else 'FAIL'} m={m}: {bad} of {a.steps + 1} steps differ", ""]


def _timed_replays(a, ex, attn, fb) -> dict:
    """Ta and round trip (ms, medians over ``--stage-steps`` replays) of a second capture of the step with
    ``afd.step_timing`` stamps inside the graph; ``{"error": why}`` when that capture fails."""
    from benchmark.afd.step_graph import StepGraph

    from sglang.srt.afd.step_timing import StepTimer

    ex.step_timer = StepTimer(torch.device("cuda:0"))
    try:
        g = StepGraph(ex, attn, fb)
        ex.step_timer.reset_samples()
        for _ in range(a.stage_steps):
            g.replay().argmax(-1).tolist()
            ex.step_timer.collect()
        out = ex.step_timer.medians()
        del g
    except Exception as err:  # the timing is an extra: report why it is missing
        logger.exception("timed capture failed")
        out = {"error": f"{type(err).__name__}: {str(err)[:100]}"}
    finally:
        ex.step_timer = None
        torch.cuda.synchronize()
    return out


def time_rows(a, mc, attn, ex) -> list[dict]:
    """Eager device-driven vs graphed step per (m, batch), and the graphed step's Ta / round trip (see the module
    docstring); one dict per row, formatted by :func:`format_rows` once the FFN workers' Tf is in."""
    from benchmark.afd.step_graph import StepGraph

    from sglang.test.model_harness import ModelHarness

    rows = []
    for m in a.micro_batches:
        for b in a.batch:
            ex.m = m
            ex.reset_pipeline_stats()
            h = ModelHarness(attn, mc, b, a.input_len + 8, device="cuda:0", attention_backend="triton")
            _decode_batch(h, b, a.input_len, mc.vocab_size, ex)
            fb = h.prepare([(i, [1]) for i in range(b)])
            eager = []
            with torch.inference_mode():
                for it in range(a.warmup + a.steps):
                    t0 = time.perf_counter()
                    ex.run(attn, fb).next_token_logits.argmax(-1).tolist()
                    if it >= a.warmup:
                        eager.append(time.perf_counter() - t0)
            row = {"m": m, "b": b, "eager": statistics.median(eager), "ta_eager": ex.attention_ms()}
            rows.append(row)
            try:
                g = StepGraph(ex, attn, fb)
            except Exception as err:  # report the eager row and why the graph is missing, then go on
                logger.exception("capture failed at m=%d batch %d", m, b)
                row["error"] = f"{type(err).__name__}: {str(err)[:120]}"
                torch.cuda.synchronize()
                continue
            row["sizes"] = ",".join(map(str, ex.dev.sizes_by_batch.get(b, []))) if ex.dev is not None else ""
            graphed = []
            for it in range(a.warmup + a.steps):
                t0 = time.perf_counter()
                g.replay().argmax(-1).tolist()
                if it >= a.warmup:
                    graphed.append(time.perf_counter() - t0)
            row["graphed"] = statistics.median(graphed)
            del g
            torch.cuda.synchronize()
            if a.stage_times:
                row["stages"] = _timed_replays(a, ex, attn, fb)
            del h
    return rows


def format_rows(rows: list[dict], gpus: int, tf_by_sizes: dict) -> list[str]:
    """Markdown table of :func:`time_rows`'s rows; ``tf_by_sizes``: micro-batch sizes (``"16,16"``) -> Tf samples
    (ms) of the slowest FFN worker. Ta / Tf / Tc cells are ``n/a (why)`` where a piece is missing."""
    from sglang.srt.afd.step_timing import format_check, pipeline_check

    lines = ["- both columns: the FFN worker replays its own step graph from the second step of a configuration; "
             "'eager' is the attention worker launching every kernel from the host (no per-layer host round trip)",
             "- Ta / Tf / Tc (graphed): per layer and micro-batch, from stamps inside a second capture of the step "
             "(Tc = (round trip - Tf) / 2: exact for m = 1, an upper bound for m > 1)",
             "", "| m | batch | eager device-driven step ms | graphed step ms | speed-up | tok/s graphed | "
             "tok/s per GPU graphed | Ta ms (eager) | Ta / Tf / Tc ms (graphed) | m >= 2(1+Tc/Tf) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        m, b, e, ta = r["m"], r["b"], r["eager"], r["ta_eager"]
        ta_cell = ta if ta is None else round(ta, 3)
        if "error" in r:
            lines.append(f"| {m} | {b} | {e * 1e3:.2f} | capture failed: {r['error']} | | | | {ta_cell} | | |")
            continue
        st, tf = r.get("stages") or {}, tf_by_sizes.get(r.get("sizes", ""), [])
        if "error" in st:
            check = f"n/a (timed capture: {st['error']}) | n/a"
        elif "ta" not in st or "rtt" not in st or not tf:
            check = "n/a (no stamps: --no-stage-times, or no FFN Tf for this step) | n/a"
        else:
            check = format_check(pipeline_check(st["ta"], statistics.median(tf), st["rtt"], m))
        gr = r["graphed"]
        lines.append(f"| {m} | {b} | {e * 1e3:.2f} | {gr * 1e3:.2f} | {e / gr:.1f}x | {b / gr:.0f} | "
                     f"{b / gr / gpus:.0f} | {ta_cell} | {check} |")
    return lines


def step_graph_record(a, rows: list[dict], gpus: int, env: dict | None = None, command: str | None = None) -> dict:
    """``--record-dir``: :func:`time_rows`'s rows as a :mod:`benchmark.common.records` record (``what`` =
    ``afd_step_graph``): per (m, batch) the eager device-driven step (the same-run baseline) and the graphed step in
    ms, ``eager_over_graphed`` (> 1: the graph faster), graphed tok/s (per GPU) and Ta (eager). Headline: graphed vs
    eager step at the largest batch of the largest m that captured."""
    from benchmark.common import records

    out = [{"m": r["m"], "batch": r["b"], "eager_step_ms": r["eager"] * 1e3,
            "graphed_step_ms": r["graphed"] * 1e3 if r.get("graphed") else None,
            "tok_s_graphed": r["b"] / r["graphed"] if r.get("graphed") else None,
            "tok_s_per_gpu_graphed": r["b"] / r["graphed"] / gpus if r.get("graphed") else None,
            "ta_eager_ms": r.get("ta_eager"), "error": r.get("error")} for r in rows]
    out = records.add_ratio(out, "eager_over_graphed", "eager_step_ms", "graphed_step_ms")
    ok = [r for r in out if r["graphed_step_ms"] is not None]
    top = max(ok, key=lambda r: (r["m"], r["batch"]), default=None)
    headline = [] if top is None else [{"label": f"AFD decode step, attention step in one CUDA graph, m={top['m']}, "
                                                 f"batch {top['batch']}, {gpus} GPUs", "unit": "ms",
                                        "value": round(top["graphed_step_ms"], 3),
                                        "baseline": round(top["eager_step_ms"], 3), "ratio": top["eager_over_graphed"]}]
    return records.make_record(
        subject="afd", benchmark="benchmark.afd.bench_step_graph", mode="timing", what="afd_step_graph", rows=out,
        params={k: getattr(a, k) for k in ("model_path", "load_format", "batch", "micro_batches", "ffn_workers",
                                           "input_len", "steps", "warmup", "transport")},
        baselines=["eager_step_ms"] if out else [],
        units={"eager_step_ms": "ms", "graphed_step_ms": "ms", "ta_eager_ms": "ms", "tok_s_graphed": "tok/s",
               "tok_s_per_gpu_graphed": "tok/s"}, headline=headline, gpu_count=gpus, env=env, command=command)


def _ffn_tf(paths: list[str]) -> dict:
    """Micro-batch sizes -> Tf samples (ms) of the slowest FFN worker (largest median), from the workers' files."""
    import json

    best: dict = {}
    for path in paths:
        try:
            with open(path) as f:
                got = json.load(f)
        except (OSError, ValueError):
            logger.warning("no Tf file %s (the FFN worker did not close cleanly)", path)
            continue
        for k, v in got.items():
            if v and (k not in best or statistics.median(v) > statistics.median(best[k])):
                best[k] = v
    return best


def run(a) -> list[str]:
    """Start the FFN workers (processes), build the attention role on cuda:0, check or time; close the group."""
    import torch.multiprocessing as mp

    from benchmark.afd.bench import _ffn_proc

    from sglang.srt.afd.executor import AfdExecutor
    from sglang.srt.afd.protocol import AfdTopology
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_executor.worker_builder import role_spec
    from sglang.srt.model_loader.loader import load_model

    n_e, ngpu = a.ffn_workers, torch.cuda.device_count()
    d = tempfile.mkdtemp(prefix="bench-afd-graph-")
    topo = AfdTopology(1, n_e, tuple(f"ipc://{d}/{i}" for i in range(1 + n_e)),
                       max_rows=max(max(a.batch) * a.input_len, 1024), transport=a.transport, timeout_s=a.timeout)
    ctx = mp.get_context("spawn")
    ready = ctx.Queue()
    tf_paths = [f"{d}/tf{j}.json" if a.stage_times and not a.check else "" for j in range(n_e)]
    procs = [ctx.Process(target=_ffn_proc, args=(a.model_path, a.load_format, f"cuda:{(1 + j) % ngpu}", topo, j,
                                                 ready, tf_paths[j]), daemon=True) for j in range(n_e)]
    for p in procs:
        p.start()
    torch.cuda.set_device(0)
    mc = ModelConfig.from_path(a.model_path, None, "auto", "cuda")
    spec = role_spec("attention")
    attn = load_model(mc, a.load_format, "cuda:0", weight_filter=spec.weight_filter, holds_param=spec.holds_param)
    ex = AfdExecutor(mc, topo, 0, a.micro_batches[0], torch.device("cuda:0"))
    try:
        infos = [ready.get(timeout=a.timeout) for _ in range(n_e)]
        errs = [i["error"] for i in infos if "error" in i]
        if errs:
            raise RuntimeError("; ".join(errs))
        lines = [f"- {i['log']}" for i in infos] + [""]
        if a.check:
            return lines + [x for m in a.micro_batches for x in check_tokens(a, mc, attn, ex, m)]
        rows = a.time_rows = time_rows(a, mc, attn, ex)  # also for --record-dir
    finally:
        ex.ep.close(notify=[topo.ffn_rank(j) for j in range(n_e)])
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    return lines + format_rows(rows, 1 + n_e, _ffn_tf([t for t in tf_paths if t]))


def main(argv=None) -> int:
    """CLI: parse ``argv`` (default ``sys.argv[1:]``), run the check or timing rows on CUDA and print the markdown
    (also to ``--md-out``); exit code 1 when a check row fails, 2 (argparse) on bad arguments or without CUDA."""
    from sglang.srt.utils.nvls_env import apply_nvls_off_env

    apply_nvls_off_env()  # before CUDA; the spawned FFN processes inherit it
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", default=str(ROOT.parent / "shared" / "data" / "models" / "stories260K-moe"))
    p.add_argument("--load-format", default="auto")
    p.add_argument("--check", action="store_true", help="greedy tokens of graphed AFD vs colocated")
    p.add_argument("--batch", type=int, nargs="+", default=[4])
    p.add_argument("--micro-batches", type=int, nargs="+", default=[1])
    p.add_argument("--ffn-workers", type=int, default=1)
    p.add_argument("--input-len", type=int, default=8)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--timeout", type=float, default=60)
    p.add_argument("--transport", default="cuda_push", choices=["cuda_push", "cuda_push_ll"],
                   help="device-driven M2N transport (cuda_push_ll: the low-latency protocol)")
    p.add_argument("--stage-steps", type=int, default=4, help="replays of the stamped capture (Ta / Tf / Tc)")
    p.add_argument("--no-stage-times", dest="stage_times", action="store_false",
                   help="skip the stamped capture (no Ta / Tf / Tc of the graphed step)")
    p.add_argument("--md-out", default="")
    from benchmark.common.records import add_record_dir_argument
    add_record_dir_argument(p, "afd", "timing: ")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs CUDA (the CPU check of this path is test/unit/test_afd_device_step.py)")
    if min(*a.batch, *a.micro_batches, a.ffn_workers, a.input_len, a.steps, a.stage_steps) < 1 or a.warmup < 0:
        p.error("--batch, --micro-batches, --ffn-workers, --input-len, --steps, --stage-steps must be >= 1 and "
                "--warmup >= 0")
    logging.basicConfig(level=logging.INFO, format="[%(processName)s] %(message)s")
    head = [f"## AFD decode, attention step in one CUDA graph ({'check' if a.check else 'timing'})", "",
            f"- {torch.cuda.get_device_name(0)} x {torch.cuda.device_count()}; model {a.model_path} ({a.load_format}); "
            f"transport {a.transport}; "
            f"command: `python benchmark/afd/bench_step_graph.py {' '.join(argv or sys.argv[1:])}`"]
    text = "\n".join(head + run(a))
    print(text)
    if a.md_out:
        Path(a.md_out).write_text(text + "\n")
    if a.record_dir and getattr(a, "time_rows", None):  # this process is the one writer
        from benchmark.common.records import write_record

        rec = step_graph_record(a, a.time_rows, 1 + a.ffn_workers)
        print(f"record: {write_record(rec, Path(a.record_dir))[0]}")
    return 1 if "CHECK FAIL" in text else 0


if __name__ == "__main__":
    sys.exit(main())
