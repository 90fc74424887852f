"""Expert parallelism and two-batch overlap: MoE-layer and whole-model timings per token count, same-run baselines.

Models: Qwen3-30B-A3B and Mixtral-8x7B configs (``../shared/data/configs``) cut to ``--layers`` decoder layers,
dummy weights; token counts per rank ``--tokens`` (default 16 .. 8192; up to 256 a decode batch of one token per
request over 32 tokens of KV, above it a prefill of 512-token requests). Two levels: ``layer`` (the MoE half of each
layer: norm + all-reduce, route, dispatch, experts, combine) and ``model`` (embedding, attention, MoE, logits).

Multi-rank mode (``--nproc N`` spawns one process per GPU, or run under ``torchrun --nproc-per-node N``): per
(model, level, tokens) the layouts

* ``tp``: TP without EP (every expert's intermediate dim split over the ranks; the all-reduce is the communication);
* ``ep``: the all-reduce expert parallelism (``--moe-a2a-backend none``), unsplit and with two-batch overlap forced on
  (``tbo``);
* ``a2a_nccl`` / ``a2a_tdist`` (+ ``tbo``): expert parallelism by all-to-all (``--moe-a2a-backend``; each TP rank
  dispatches its slice of the tokens; low-latency mode for decode batches, normal for prefills) -- listed as skipped,
  with the reason, where the token dispatcher is not in the checkout (or tdist on CPU without the interpreter);

every arm also with the no-communication counterfactual (every communicator swapped for one that skips the
collectives, the dispatcher for a local loopback with the same expert rows: wrong outputs, the compute alone),
all arms of a row timed in alternating order (A B, B A, ...) after
warm-ups, medians of CUDA events. Printed beside each ratio: the all-reduce time and the all-to-all time (each
alone, times the calls per forward), the expert time (the fused-MoE kernel alone), the exposed communication
(unsplit minus its no-comm twin) and the fraction of it two-batch overlap hid: ``1 - (tbo - tbo_nocomm) / (seq -
seq_nocomm)``.
The candidate auto-off threshold per (GPU, EP size) is the smallest token count from which TBO won at every larger
measured count (``two_batch_overlap/auto_off.py`` takes it from here).

Single-rank mode (``--nproc 1``, one GPU): the split's overhead at EP 1, TBO forced on vs off (target <= 1.05x),
and the automatic choice (off at EP 1: nothing to hide).

``--smoke``: the tiny MoE model, two token counts, two layers, a few iterations; runs on CPU in seconds (a unit test
runs it so it cannot rot). Writes ``<out>/moe_overlap_<mode>_<gpu>.{json,md}``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any, Optional

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[1] / "python"))

import torch  # noqa: E402

import a2a_layouts as a2a  # noqa: E402
import moe_bench_lib as lib  # noqa: E402

TBO_TARGET = 1.05  # single-rank mode: forced TBO / unsplit at EP 1 must stay within this (or TBO stays auto-off)
A2A_BACKENDS = ("nccl", "tdist")


def _executors():
    from sglang.srt.model_executor.executors import SequentialExecutor
    from sglang.srt.two_batch_overlap.auto_off import Threshold
    from sglang.srt.two_batch_overlap.executor import TboConfig, TwoBatchOverlapExecutor

    return SequentialExecutor(), lambda dev: TwoBatchOverlapExecutor(
        TboConfig(threshold=Threshold(2, False, "forced on by the benchmark")), dev)


def _arm(run, before=None, after=None):
    """An arm: ``run`` timed; ``before`` / ``after`` (e.g. swapping communicators) outside the timed window."""
    return run, before, after


def _expert_ms(model: Any, tokens: int, dev, warmup: int, rounds: int, barrier) -> float:
    """The fused-MoE kernel of the first MoE layer on ``tokens`` random rows (its routing from the gate), in ms."""
    layer = next(l for l in model.decoder_layers if "moe_route" in l.stage_names())
    block = layer.mlp
    x = (torch.randn(tokens, model.config.hidden_size, generator=torch.Generator().manual_seed(1)) * 0.5
         ).to(model.config.dtype).to(dev)
    with torch.inference_mode():
        w, ids = block.experts.route(block.gate(x))
        res = lib.compare_arms({"experts": (lambda: block.experts.compute(x, w, ids), None, None)}, dev, warmup,
                               rounds, barrier)
    return res["experts"]


def _comm_ms(comm: Any, tokens: int, hidden: int, dtype, dev, warmup: int, rounds: int, barrier) -> Optional[float]:
    """One all-reduce of a ``[tokens, hidden]`` tensor, in ms (None on one rank)."""
    if comm is None or getattr(comm, "world_size", 1) == 1:
        return None
    x = torch.ones(tokens, hidden, dtype=dtype, device=dev)
    with torch.inference_mode():
        return lib.compare_arms({"ar": (lambda: comm.all_reduce(x), None, None)}, dev, warmup, rounds, barrier)["ar"]


def run_rank(ps: Any, opts: dict) -> dict:
    """Every rank's body (``ps``: its ParallelState, None on one rank): loads each layout's model, times every arm
    of every (model, level, tokens) in alternating order; returns ``{"rows": [...], "skipped": [...]}``."""
    import torch.distributed as dist

    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.distributed.communicator import NoCommCommunicator, create_communicator
    from sglang.srt.model_loader.loader import load_model

    world, rank = (ps.tp_size, ps.tp_rank) if ps is not None else (1, 0)
    dev = ps.torch_device() if ps is not None else torch.device("cuda:0" if opts["device"] == "cuda" else "cpu")
    if dev.type == "cpu":
        torch.set_num_threads(1)  # CPU smoke runs: no OpenMP spinning between ranks sharing cores
    barrier = (lambda: dist.barrier(group=ps.cpu_group)) if ps is not None else None
    dtype = "bfloat16" if dev.type == "cuda" else "float32"
    warm, rounds = opts["warmup"], opts["rounds"]
    comm = create_communicator(ps, "auto") if ps is not None else None
    nocomm = NoCommCommunicator(rank, world) if world > 1 else None
    seq, make_tbo = _executors()
    rows, skipped, backends = [], [], []
    for b in (opts["a2a"] if world > 1 else ()):
        why = a2a.skip_reason(b, dev)
        (skipped.append({"layout": f"a2a_{b}", "reason": why}) if why else backends.append(b))
    max_decode = max([t for t in opts["tokens"] if t <= lib.DECODE_MAX], default=8)
    for name in opts["models"]:
        path = lib.shrunk_config(name, opts["layers"])
        mc = ModelConfig.from_path(path, None, dtype, dev.type)
        eps = {"ep": 1} if world == 1 else {"tp": 1, "ep": world, **{f"a2a_{b}": world for b in backends}}
        models = {lay: load_model(mc, "dummy", dev, tp_rank=rank, tp_size=world, comm=comm, ep_size=ep)
                  for lay, ep in eps.items()}
        disps = {f"a2a_{b}": a2a.install(models[f"a2a_{b}"], b, ps, dev, max(opts["tokens"]), max_decode, path)
                 for b in backends}
        try:
            for tokens in opts["tokens"]:
                for level in opts["levels"]:
                    rows += _measure(name, level, tokens, models, disps, mc, dev, seq, make_tbo, nocomm, comm,
                                     opts, barrier, rank, world)
        finally:
            for d in disps.values():
                d.close()
        del models, disps
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return {"rows": _with_ratios(rows), "skipped": skipped}


def _measure(name, level, tokens, models, disps, mc, dev, seq, make_tbo, nocomm, comm, opts, barrier, rank,
             world) -> list:
    """Every layout's arms of one (model, level, tokens), timed together in alternating order; their rows."""
    warm, rounds = opts["warmup"], opts["rounds"]
    arms, meta, state = {}, {}, {}
    for lay, model in models.items():
        h, fb, mode = lib.make_batch(model, mc, tokens, dev)
        target = model if level == "model" else lib.MoeLayerModel(model, tokens, dev)
        tbo = make_tbo(dev)

        def go(ex, target=target, fb=fb):
            with torch.inference_mode():
                ex.run(target, fb)

        def swap(m=model, lay=lay):  # the no-communication twin: no collective, no all-to-all
            state["saved"] = lib.swap_comms(m, nocomm)
            if lay in disps:
                runner = a2a.runner_of(m)
                state["disp"] = (runner, runner.dispatcher)
                runner.dispatcher = a2a.loopback_of(runner.dispatcher)

        def undo():
            lib.restore_comms(state.pop("saved"))
            if "disp" in state:
                runner, real = state.pop("disp")
                runner.dispatcher = real

        arms[f"{lay}|seq"] = _arm(lambda go=go: go(seq))
        if lay != "tp":
            arms[f"{lay}|tbo"] = _arm(lambda go=go, tbo=tbo: go(tbo))
        if nocomm is not None:
            arms[f"{lay}|seq_nocomm"] = _arm(lambda go=go: go(seq), swap, undo)
            if lay != "tp":
                arms[f"{lay}|tbo_nocomm"] = _arm(lambda go=go, tbo=tbo: go(tbo), swap, undo)
        meta[lay] = (mode, tbo, h, fb)
    res = lib.compare_arms(arms, dev, warm, rounds, barrier)
    moe_layers = opts["layers"]
    calls = moe_layers * (1 if level == "layer" else 2)  # all-reduces per forward (the norms)
    out = []
    for lay, model in models.items():
        mode, tbo = meta[lay][:2]
        ar = _comm_ms(comm, tokens, mc.hidden_size, model.config.dtype, dev, warm, rounds, barrier)
        if lay in disps:
            experts = a2a.expert_rows_ms(model, tokens, dev, warm, rounds, barrier, lib.compare_arms)
            a2a_t = a2a.a2a_ms(model, tokens, mode == "decode", dev, warm, rounds, barrier, lib.compare_arms)
        else:
            experts, a2a_t = _expert_ms(model, tokens, dev, warm, rounds, barrier), None
        out.append(_row(name, level, tokens, mode, lay, world, res, tbo, experts * moe_layers,
                        None if ar is None else ar * calls, None if a2a_t is None else a2a_t * moe_layers))
    if rank == 0:
        print(f"[moe bench] {name} {level} T={tokens}: " + ", ".join(f"{k} {v:.3f} ms" for k, v in res.items()),
              file=sys.stderr, flush=True)
    return out


def _row(model: str, level: str, tokens: int, mode: str, layout: str, world: int, res: dict, tbo: Any,
         expert_ms: float, comm_ms: Optional[float], a2a_ms: Optional[float] = None) -> dict:
    """One measured case: the layout's arms, its communication (all-reduce, all-to-all) / expert / exposed / hidden
    figures."""
    get = lambda arm: res.get(f"{layout}|{arm}")  # noqa: E731
    seq, t, seq_n, t_n = get("seq"), get("tbo"), get("seq_nocomm"), get("tbo_nocomm")
    exposed = None if seq_n is None else seq - seq_n
    hidden = None
    if t is not None and t_n is not None and exposed is not None and exposed > 0.01 * seq:
        hidden = 1.0 - (t - t_n) / exposed
    split = tbo.last_split
    return {"model": model, "level": level, "tokens": tokens, "mode": mode, "layout": layout, "ep_size":
            world if layout != "tp" else 1, "seq_ms": seq, "tbo_ms": t, "seq_nocomm_ms": seq_n, "tbo_nocomm_ms": t_n,
            "comm_ms": comm_ms, "a2a_ms": a2a_ms, "expert_ms": expert_ms, "exposed_comm_ms": exposed,
            "hidden_frac": hidden,
            "tbo_vs_seq": None if t is None else t / seq,
            "split_overhead": None if t_n is None or not seq_n else t_n / seq_n,
            "tbo_split": split.describe() if split is not None else None}


def _with_ratios(rows: list) -> list:
    """Add each row's ratios to the same-run baselines of its (model, level, tokens): the all-reduce EP unsplit
    (``vs_ep_seq``) and TP without EP (``vs_tp``), for the row's best arm (TBO where it ran)."""
    base = {}
    for r in rows:
        base.setdefault((r["model"], r["level"], r["tokens"]), {})[r["layout"]] = r["seq_ms"]
    for r in rows:
        b = base[(r["model"], r["level"], r["tokens"])]
        best = min(v for v in (r["seq_ms"], r["tbo_ms"]) if v is not None)
        r["vs_ep_seq"] = best / b["ep"] if b.get("ep") else None
        r["vs_tp"] = best / b["tp"] if b.get("tp") else None
    return rows


def candidates(rows: list, gpu: str) -> list:
    """Per (model, level, layout with TBO): the smallest measured token count from which TBO beat the unsplit
    forward at every larger measured count (``min_tokens`` of the auto-off table), or None (it never did)."""
    out = []
    groups: dict = {}
    for r in rows:
        if r["tbo_ms"] is not None:
            groups.setdefault((r["model"], r["level"], r["layout"], r["ep_size"]), []).append(r)
    for (model, level, layout, ep), rs in sorted(groups.items()):
        rs = sorted(rs, key=lambda r: r["tokens"])
        cand = None
        for r in reversed(rs):
            if r["tbo_ms"] < r["seq_ms"]:
                cand = r["tokens"]
            else:
                break
        out.append({"gpu": gpu, "ep_size": ep, "model": model, "level": level, "comm": layout, "min_tokens": cand})
    return out


def single_rank_verdicts(rows: list) -> list:
    """Single-rank mode: per row, forced TBO / unsplit against :data:`TBO_TARGET`, and the automatic choice."""
    from sglang.srt.two_batch_overlap.auto_off import TBO_OFF, auto_threshold

    auto = auto_threshold(1, "", "cuda")
    out = []
    for r in rows:
        ratio = r["tbo_vs_seq"]
        off = auto.min_tokens >= TBO_OFF or r["tokens"] < auto.min_tokens
        out.append({**r, "target": TBO_TARGET, "within_target": ratio is not None and ratio <= TBO_TARGET,
                    "auto_choice": "off (EP 1)" if off else "on",
                    "verdict": "ok" if (ratio is not None and ratio <= TBO_TARGET) or off else "FAIL"})
    return out


def render(record: dict) -> str:
    """The markdown tables of a record."""
    lines = [f"# MoE expert parallelism / two-batch overlap ({record['mode']})", "",
             f"{record['gpu']['count']} x {record['gpu']['model']}, torch {record['versions']['torch']}, NCCL "
             f"{record['versions']['nccl']}, commit {record['git_commit'][:12]}, {record['date']}", "",
             f"`{record['command']}`", "",
             "| model | level | T | mode | layout | seq ms | tbo ms | tbo/seq | vs ep | vs tp | all-reduce ms | "
             "all-to-all ms | expert ms | exposed comm ms | hidden | split overhead | split |", "|" + "---|" * 17]
    for r in record["rows"]:
        lines.append("| " + " | ".join(lib.fmt(r.get(k)) for k in (
            "model", "level", "tokens", "mode", "layout", "seq_ms", "tbo_ms", "tbo_vs_seq", "vs_ep_seq", "vs_tp",
            "comm_ms", "a2a_ms", "expert_ms", "exposed_comm_ms", "hidden_frac", "split_overhead", "tbo_split"))
                     + " |")
    for s in record.get("skipped", []):
        lines.append(f"\nskipped {s['layout']}: {s['reason']}")
    if record.get("candidates"):
        lines += ["", "Candidate auto-off thresholds (smallest T from which TBO won at every larger T):", "",
                  "| GPU | EP | model | level | comm | min tokens |", "|---|---|---|---|---|---|"]
        lines += [f"| {c['gpu']} | {c['ep_size']} | {c['model']} | {c['level']} | {c['comm']} | "
                  f"{c['min_tokens'] if c['min_tokens'] is not None else 'off (never won)'} |"
                  for c in record["candidates"]]
    if record.get("verdicts"):
        lines += ["", f"Single-rank split overhead (target tbo/seq <= {TBO_TARGET}, or auto-off):", "",
                  "| model | level | T | tbo/seq | auto choice | verdict |", "|---|---|---|---|---|---|"]
        lines += [f"| {v['model']} | {v['level']} | {v['tokens']} | {lib.fmt(v['tbo_vs_seq'])} | {v['auto_choice']} "
                  f"| {v['verdict']} |" for v in record["verdicts"]]
    lines += [""] + [f"note: {n}" for n in record.get("notes", [])]
    return "\n".join(lines) + "\n"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=None, help="ranks to spawn, one per GPU (default: WORLD_SIZE under "
                   "torchrun, else 1: the single-rank mode)")
    p.add_argument("--models", nargs="+", default=["qwen3-30b-a3b", "mixtral-8x7b"], choices=sorted(lib.MODEL_CONFIGS))
    p.add_argument("--tokens", nargs="+", type=int, default=[16, 64, 256, 1024, 4096, 8192])
    p.add_argument("--levels", nargs="+", default=["layer", "model"], choices=["layer", "model"])
    p.add_argument("--a2a", nargs="*", default=list(A2A_BACKENDS), choices=list(A2A_BACKENDS),
                   help="all-to-all layouts (multi-rank; skipped with the reason where they cannot run)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=10, help="timed rounds per arm (alternating order)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    p.add_argument("--out", default=str(HERE.parents[0] / "results" / "moe"))
    p.add_argument("--smoke", action="store_true", help="tiny model, 2 token counts, 2 layers, 2 rounds (CPU ok)")
    a = p.parse_args(argv)
    if a.smoke:
        a.models, a.tokens, a.layers, a.warmup, a.rounds = ["tiny-moe"], [8, 300], 2, 1, 2
        # tdist on CPU without the Triton interpreter is listed as skipped, with its reason (a2a_layouts.py)
    if min(a.tokens) < 2 or a.layers < 1 or a.rounds < 1 or a.warmup < 0:
        p.error("--tokens must be >= 2, --layers and --rounds >= 1, --warmup >= 0")
    return a


def _torchrun_body(opts: dict) -> dict:
    """Under ``torchrun``: join its job (rank 0's store one port above ``MASTER_PORT``, which torchrun's agent
    holds) and run :func:`run_rank`."""
    from sglang.srt.distributed.parallel_state import DistConfig, destroy_parallel_state, init_parallel_state

    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    init = f"tcp://{os.environ.get('MASTER_ADDR', '127.0.0.1')}:{int(os.environ['MASTER_PORT']) + 1}"
    ps = init_parallel_state(DistConfig(tp_rank=rank, tp_size=world, init_method=init, device=opts["device"],
                                        ep_size=world, timeout_s=600))  # the EP group the all-to-all layouts use
    try:
        return run_rank(ps, opts)
    finally:
        destroy_parallel_state()


def main(argv=None) -> Optional[Path]:
    """Run the benchmark; rank 0 writes the record and prints the markdown. Returns the JSON path (rank 0)."""
    a = parse_args(argv)
    from sglang.srt.utils.nvls_env import apply_nvls_off_env

    apply_nvls_off_env()
    opts = {k: getattr(a, k) for k in ("models", "tokens", "levels", "layers", "warmup", "rounds", "device", "a2a")}
    if "WORLD_SIZE" in os.environ and a.nproc is None:
        world = int(os.environ["WORLD_SIZE"])
        result = _torchrun_body(opts)
        if int(os.environ["RANK"]) != 0:
            return None
    else:
        world = a.nproc or 1
        if world == 1:
            result = run_rank(None, opts)
        else:
            from sglang.test.spawn_ranks import spawn_ranks

            result = spawn_ranks(run_rank, world, opts, timeout=3000, device=a.device, ep_size=world,
                                 sys_path=(str(HERE),))[0]
    dev = torch.device("cuda:0" if a.device == "cuda" else "cpu")
    env = lib.environment(dev, world)
    mode = "single-rank" if world == 1 else "multi-rank"
    extra = {"skipped": result["skipped"]}
    if world > 1:
        extra["candidates"] = candidates(result["rows"], env["gpu"]["model"])
    else:
        extra["verdicts"] = single_rank_verdicts(result["rows"])
    record = lib.make_record(
        benchmark="benchmark/moe/bench_moe_overlap.py", mode=mode + (" smoke" if a.smoke else ""),
        what=f"moe_overlap_{mode.replace('-', '_')}{'_smoke' if a.smoke else ''}", rows=result["rows"], env=env,
        command=lib.command_line(), params=opts, baselines=["seq_ms", "seq_nocomm_ms"] if world > 1 else ["seq_ms"],
        units={k: "ms" for k in ("seq_ms", "tbo_ms", "seq_nocomm_ms", "tbo_nocomm_ms", "comm_ms", "a2a_ms",
                                 "expert_ms", "exposed_comm_ms")},
        notes=["TBO forced on (--tbo-min-tokens 2) in every tbo arm; nocomm arms skip every collective "
               "(wrong outputs by design: the compute alone)",
               "all-reduce ms: one all-reduce of [T, H] alone x the all-reduces per forward (norms); all-to-all ms: "
               "one dispatch + combine of this rank's share alone x the MoE layers; expert ms: the fused-MoE kernel "
               "alone x the MoE layers (all-to-all layouts: on the rows a balanced routing sends this rank)",
               "a2a nocomm arms: the dispatcher swapped for a local loopback (same expert rows, no all-to-all)",
               "vs_ep_seq / vs_tp: the row's best arm (TBO where it ran) over the same run's all-reduce EP unsplit / "
               "TP without EP"], **extra)
    j, m = lib.write_record(record, Path(a.out), render(record))
    print(m.read_text())
    print(f"wrote {j} and {m}", file=sys.stderr)
    return j


if __name__ == "__main__":
    main()
