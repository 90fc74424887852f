"""MegaScale-Infer AFD benchmark: decode throughput per worker (AFD vs colocated on the same resources) and M2N
latency vs a point-to-point baseline (paper Fig. 11-12).

Modes (both by default):

* ``--mode decode``: the model (``--model-path`` config; ``--load-format dummy`` for big shapes) decodes each
  ``--batch`` size for ``--steps`` timed steps (after a prefill of ``--input-len`` tokens and ``--decode-warmup``
  untimed steps) (a) colocated, through the server's ModelRunner with CUDA graphs, and (b) with AFD: the attention
  worker (:class:`~sglang.srt.afd.executor.AfdExecutor`, every m of ``--micro-batches``) and ``--ffn-workers`` FFN
  worker processes holding the experts. Reported per row (:mod:`benchmark.afd.decode_throughput`): median step time, tokens/s, per GPU and
  the per-GPU ratio to colocated, the memory floor and step/floor, Ta/Tf/Tc and the m check. Each of (a) and (b) runs
  in its own process, so neither holds the other's memory; the attention worker constructs no experts.
  ``--json-out`` saves the raw results, ``--merge`` tables saved results of separate runs.
* ``--mode m2n``: two processes; rank 0 sends ``--sizes-kb`` per message to rank 1, which echoes it; one-way
  latency = round trip / 2 (CUDA events on GPU, rank r on cuda:r), median and p99 over ``--iters``.
  M2N (transport ``inline`` on CPU; on GPU ``cuda_push-dev``, the device-driven path with no host message,
  ``cuda_push`` through the host header as AFD uses it, and the host-driven ``cuda_ipc``) vs the baseline
  ``torch.distributed`` send/recv (gloo on CPU, NCCL on GPU) of the same bytes, in the same run; the order of the
  measurements is reversed on every other size (A/B alternation). On GPU also CUDA-graph rows (``--graph-k``):
  each rank captures K echoes of the device path (``-dev``) and, in the same run, K echoes of NCCL send/recv in
  a graph too; both ranks replay in lockstep after a barrier; latency = replay time / (2 K), median over
  ``--graph-replays`` replays. The eager rows are dominated by host launch work per message; the graph rows show
  the transports themselves.

Writes ``benchmark/results/afd/<date>_afd_<mode>[_smoke].md`` with the date, hardware and command. ``--smoke``: CPU,
stories260K-moe-sized shapes, few iterations (for the CPU test; CPU numbers say nothing about GPUs).
``--record-dir DIR``: also the project's JSON record + markdown of each mode's results under ``DIR/afd/``: decode
(:func:`benchmark.afd.decode_throughput.decode_record`; headline: best AFD vs best colocated tok/s per GPU) and M2N
(:func:`benchmark.afd.m2n_latency.m2n_record`; headline: the best M2N transport vs send/recv at the smallest and the
largest size).
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import platform
import sys
import tempfile
import traceback
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # the benchmark package (spawned children inherit sys.path)
    sys.path.insert(0, str(ROOT))


from benchmark.afd.m2n_latency import run_m2n  # noqa: E402  (the M2N latency mode lives in benchmark/afd/m2n_latency.py)


# ---- decode throughput -------------------------------------------------------------------------------------
def _role_log(role: str, index: int, device: str, param_bytes: int, kv_bytes: int) -> str:
    """The per-role start line (as the server's ``role ... holds ...`` line), logged in the worker process."""
    line = (f"role {role} (worker {index}, {device}) holds {param_bytes} parameter bytes ({param_bytes / 2**30:.2f} "
            f"GiB) and {kv_bytes} KV bytes ({kv_bytes / 2**30:.2f} GiB)")
    logging.getLogger("benchmark.afd.bench").info(line)
    return line


def _ffn_proc(path: str, load_format: str, device: str, topo, j: int, ready, timing_out: str = "") -> None:
    """FFN worker ``j`` on ``device``: load its static expert block, report ``{"index", "expert_bytes", "bw",
    "device"}`` (or ``{"index", "error"}``, e.g. CUDA out of memory) on ``ready``, then serve until the group closes.
    ``timing_out``: time the device-driven steps' expert compute (``afd.step_timing``) and write, when the group
    closes, ``{"<sizes comma-separated>": [per-step median Tf ms, ...]}`` there (``benchmark/afd/bench_step_graph.py``)."""
    logging.basicConfig(level=logging.INFO, format=f"[FFN{j}] %(message)s")
    torch.set_num_threads(1)
    try:
        from benchmark.afd.decode_throughput import copy_bandwidth

        from sglang.srt.afd.experts import moe_layer_specs
        from sglang.srt.afd.ffn_worker import FfnServer
        from sglang.srt.afd.load_balance import static_placement
        from sglang.srt.configs.model_config import ModelConfig

        if device.startswith("cuda"):
            torch.cuda.set_device(torch.device(device))  # events/streams of this worker live on its own GPU
        bw = copy_bandwidth(device)  # before the experts fill the GPU
        mc = ModelConfig.from_path(path, None, "auto", device.split(":")[0])
        specs = moe_layer_specs(mc)
        held = static_placement(specs[0].num_experts, topo.num_ffn).worker_experts()[j]
        s = FfnServer(mc, specs, held, load_format, torch.device(device), topo, j)
    except Exception as e:  # reported by the attention side at once instead of a silent timeout
        ready.put({"index": j, "error": f"FFN worker {j} on {device}: {type(e).__name__}: {e}"})
        return
    nbytes = sum(sh.w13.numel() * sh.w13.element_size() + sh.w2.numel() * sh.w2.element_size()
                 for sh in s.shards.values())
    ready.put({"index": j, "expert_bytes": nbytes, "bw": bw, "device": device, "experts": len(held),
               "log": _role_log("ffn", j, device, nbytes, 0)})
    if timing_out:
        from sglang.srt.afd.step_timing import StepTimer

        s.device_steps.timer = StepTimer(torch.device(device))
    try:
        while True:
            s.serve_once(timeout_s=5.0)
    except ConnectionError:
        pass
    finally:
        s.ep.close()
        if timing_out:
            import json

            with open(timing_out, "w") as f:
                json.dump({",".join(map(str, k[1])): v for k, v in s.device_steps.tf_ms.items()}, f)


def _measure(kind: str, a, q) -> None:
    """One measurement in its own process (so colocated and AFD never share memory): ``colocated`` decodes the
    whole model on cuda:0 (:func:`benchmark.afd.decode_throughput.measure_colocated`); ``afd`` runs attention worker 0 on cuda:0 (no
    experts constructed), ``--attention-workers - 1`` more attention processes and ``--ffn-workers`` FFN worker
    processes on the next GPUs. Puts the result dict or ``{"error": ...}`` on ``q``."""
    sys.path.insert(0, str(ROOT))
    logging.basicConfig(level=logging.INFO, format="[%(processName)s] %(message)s")
    try:
        from benchmark.afd.decode_throughput import measure_colocated

        q.put(measure_colocated(a) if kind == "colocated" else _measure_afd(a))
    except Exception as e:  # reported by the parent, with the child's full traceback
        q.put({"error": f"{kind}: {type(e).__name__}: {e}\n--- child traceback ---\n{traceback.format_exc()}"})


def _attention_worker(a, index: int, dev: str, topo, get_ffn_info, barrier) -> dict:
    """Attention worker ``index`` (data parallel: its own requests, ``--batch`` of them) on ``dev``: build the
    attention role (no experts) while the FFN workers start, then ``get_ffn_info()`` (their ready reports), then time
    every (m, batch) with the other attention workers in step (``barrier`` before each configuration);
    :func:`benchmark.afd.decode_throughput.afd_rows`'s dict plus ``peak``, ``kv_bytes`` and its role line."""
    from benchmark.afd.decode_throughput import afd_rows, split_param_bytes

    from sglang.srt.afd.executor import AfdExecutor
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_executor.worker_builder import role_spec
    from sglang.srt.model_loader.loader import load_model

    if dev.startswith("cuda"):
        torch.cuda.set_device(torch.device(dev))
    mc = ModelConfig.from_path(a.model_path, None, "auto", a.device)
    spec = role_spec("attention")
    attn = load_model(mc, a.load_format, dev, weight_filter=spec.weight_filter, holds_param=spec.holds_param)
    ex = AfdExecutor(mc, topo, index, a.micro_batches[0], torch.device(dev))
    try:
        res = afd_rows(a, attn, mc, ex, dev, get_ffn_info(), sync=lambda: barrier.wait(a.timeout))
    except BaseException:
        barrier.abort()  # the other attention workers stop at their next barrier instead of waiting
        raise
    finally:  # the only attention worker tells the FFN workers to stop; with several, _measure_afd stops them
        ex.ep.close(notify=[topo.ffn_rank(j) for j in range(topo.num_ffn)] if topo.num_attention == 1 else ())
    res.update(peak=torch.cuda.max_memory_allocated(dev) if dev.startswith("cuda") else 0, index=index, device=dev)
    res["log"] = _role_log("attention", index, dev, sum(split_param_bytes(attn).values()), res["kv_bytes"])
    return res


def _attention_proc(a, index: int, dev: str, topo, info_q, barrier, out) -> None:
    """:func:`_attention_worker` in a spawned process (the FFN reports, or an error string, come on ``info_q``); its
    result or ``{"error": ...}`` goes to ``out``."""
    sys.path.insert(0, str(ROOT))
    logging.basicConfig(level=logging.INFO, format=f"[ATTN{index}] %(message)s")

    def ffn_info():
        got = info_q.get(timeout=a.timeout)
        if isinstance(got, str):
            raise RuntimeError(got)
        return got

    try:
        out.put(_attention_worker(a, index, dev, topo, ffn_info, barrier))
    except BaseException as e:
        out.put({"index": index, "error": f"attention worker {index}: {type(e).__name__}: {e}\n"
                                          f"{traceback.format_exc()}"})


def _combine(parts: list[dict]) -> dict:
    """One AFD result from the attention workers' (data parallel): per (m, batch) the summed tokens/s, the slowest
    worker's step, the mean Ta/Tf/Tc (``m_min`` recomputed); the worker-0 bandwidth and parameter bytes."""
    out = dict(parts[0], workers=[{k: p[k] for k in ("index", "device", "param_bytes", "kv_bytes", "peak", "log")}
                                  for p in parts])
    rows = {}
    for key, r in parts[0]["rows"].items():
        rs = [p["rows"][key] for p in parts]
        c = {k: float(np.mean([x["constraint"][k] for x in rs])) for k in ("ta_ms", "tf_ms", "tc_ms")}
        c.update(m=key[0], m_min=2 * (1 + c["tc_ms"] / max(c["tf_ms"], 1e-9)))
        rows[key] = dict(r, tps=sum(x["tps"] for x in rs), step_s=max(x["step_s"] for x in rs), constraint=c)
    out["rows"] = rows
    return out


def _measure_afd(a) -> dict:
    """``--attention-workers`` N_A x ``--ffn-workers`` N_E on GPUs 0..N_A+N_E-1 (wrapping when fewer): attention
    worker a on cuda:a (worker 0 in this process), FFN worker j on cuda:(N_A + j). RuntimeError naming the worker
    when one fails to start (e.g. out of memory) or answers nothing within ``--timeout``."""
    import torch.multiprocessing as mp

    from sglang.srt.afd.protocol import AfdTopology

    n_a, n_e = a.attention_workers, a.ffn_workers
    ngpu = max(1, torch.cuda.device_count()) if a.device == "cuda" else 0
    devs = [f"cuda:{i % ngpu}" if ngpu else "cpu" for i in range(n_a + n_e)]
    d = tempfile.mkdtemp(prefix="bench-afd-")
    topo = AfdTopology(n_a, n_e, tuple(f"ipc://{d}/{i}" for i in range(n_a + n_e)),
                       max_rows=max(max(a.batch) * a.input_len, 1024), transport=a.afd_transport, timeout_s=a.timeout)
    ctx = mp.get_context("spawn")
    ready, out, info_q, barrier = ctx.Queue(), ctx.Queue(), ctx.Queue(), ctx.Barrier(n_a)
    procs = [ctx.Process(target=_ffn_proc, args=(a.model_path, a.load_format, devs[n_a + j], topo, j, ready),
                         daemon=True) for j in range(n_e)]
    procs += [ctx.Process(target=_attention_proc, args=(a, i, devs[i], topo, info_q, barrier, out), daemon=True)
              for i in range(1, n_a)]  # all start at once; the attention workers build their role meanwhile
    for p in procs:
        p.start()
    infos: list = []

    def ffn_info() -> list:  # worker 0 collects the FFN reports and hands them to the other attention workers
        try:
            infos.extend(sorted((ready.get(timeout=a.timeout) for _ in range(n_e)), key=lambda i: i["index"]))
        except Exception:
            raise RuntimeError(f"the FFN workers gave no ready report within {a.timeout:.0f} s") from None
        errs = [i["error"] for i in infos if "error" in i]
        for _ in range(n_a - 1):
            info_q.put("; ".join(errs) if errs else infos)
        if errs:
            raise RuntimeError("; ".join(errs))
        return infos

    try:
        parts = [_attention_worker(a, 0, devs[0], topo, ffn_info, barrier)]
        parts += sorted((out.get(timeout=a.timeout) for _ in range(n_a - 1)), key=lambda r: r["index"])
        errs = [r["error"] for r in parts if "error" in r]
        if errs:
            raise RuntimeError("; ".join(errs))
        res = _combine(parts)
        res.update(ffn_info=infos, ffn_workers=n_e, attention_workers=n_a)
        return res
    finally:  # with N_A > 1 the FFN workers got no CLOSE (a peer might still need them): they are stopped here
        for p in procs:
            p.join(10 if n_a == 1 else 2)
            if p.is_alive():
                p.kill()


def _in_process(kind: str, a) -> dict:
    """Run :func:`_measure` ``kind`` in a fresh spawned process; raises RuntimeError on its error or silence."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_measure, args=(kind, a, q))
    p.start()
    try:
        res = q.get(timeout=a.timeout)
    except Exception:
        raise RuntimeError(f"the {kind} measurement gave no result within {a.timeout:.0f} s") from None
    finally:
        p.join(30)
        if p.is_alive():
            p.kill()
    if "error" in res:
        raise RuntimeError(res["error"])
    return res


def run_decode(a) -> list[str]:
    """Colocated vs AFD decode on the same model, each measured in its own process (``--setups`` picks them); the
    table lines (per-step time, tok/s, per-GPU tok/s and ratio to colocated, memory floor, step/floor, and for AFD
    Ta, Tf, Tc and the m >= 2(1+Tc/Tf) check)."""
    from benchmark.afd.decode_throughput import decode_table, dump_results, load_results

    res = load_results(a.merge) if a.merge else {k: _in_process(k, a) for k in a.setups}
    if a.json_out:
        dump_results(res, a.json_out)
    a.decode_results = res  # for --record-dir
    return decode_table(a, res)


def _hardware(device: str) -> str:
    if device == "cuda":
        return f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    return f"CPU {platform.processor() or platform.machine()} ({os.cpu_count()} cores)"


def parse_args(argv=None):
    """The benchmark's flags (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mode", choices=("decode", "m2n", "all"), default="all")
    p.add_argument("--model-path", default=str(ROOT.parent / "shared" / "data" / "models" / "stories260K-moe"))
    p.add_argument("--load-format", default="auto")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--batch", type=int, nargs="+", default=[64], help="decode batch sizes (each timed)")
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--ffn-workers", type=int, default=2)
    p.add_argument("--attention-workers", type=int, default=1,
                   help="AFD attention workers (data parallel, each decodes its own --batch requests; GPU a)")
    p.add_argument("--micro-batches", type=int, nargs="+", default=[2], help="AFD m values (each timed)")
    p.add_argument("--transport", default="", help="M2N payload transports, comma-separated (default on GPU "
                   "cuda_push-dev,cuda_push,cuda_ipc for --mode m2n; inline on CPU); a -dev suffix: device-driven "
                   "send/recv_device. --mode decode uses the first (without -dev) for AFD, default auto")
    p.add_argument("--sizes-kb", type=int, nargs="+", default=[32, 64, 128, 256, 512])
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--graph-k", type=int, default=20, help="m2n on GPU: round trips per captured CUDA graph, for "
                   "the -dev transports and NCCL send/recv alike (0: no graph rows)")
    p.add_argument("--graph-replays", type=int, default=20, help="m2n: timed replays of each graph")
    p.add_argument("--decode-warmup", type=int, default=2, help="untimed decode steps before the timed ones")
    p.add_argument("--setups", default="colocated,afd",
                   help="decode measurements to run, comma-separated: colocated, afd (each in its own process)")
    p.add_argument("--json-out", default="", help="also write the decode results (raw, per setup) to this JSON file")
    p.add_argument("--merge", nargs="+", default=[], metavar="JSON",
                   help="measure nothing: the decode table of earlier --json-out files (e.g. colocated and AFD runs)")
    p.add_argument("--smoke", action="store_true", help="CPU, few iterations (for the CPU test)")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--results-dir", default=str(ROOT / "benchmark" / "results" / "afd"))
    from benchmark.common.records import add_record_dir_argument
    add_record_dir_argument(p, "afd", "each mode run (decode, m2n): ")
    a = p.parse_args(argv)
    if a.smoke:
        a.device, a.iters, a.warmup, a.batch, a.steps, a.input_len = "cpu", 5, 1, [4], 3, 4
        a.decode_warmup = 1
        a.sizes_kb = [32, 512]
    a.setups = [x for x in a.setups.split(",") if x]
    if not a.setups or set(a.setups) - {"colocated", "afd"}:
        p.error(f"--setups={','.join(a.setups)!r}: choose from colocated, afd")
    given = bool(a.transport)
    a.transport = a.transport or ("cuda_push-dev,cuda_push,cuda_ipc" if a.device == "cuda" else "inline")
    a.transports = [t for t in a.transport.split(",") if t]
    # AFD decode: the first named transport, else what --afd-transport auto picks on one node with a GPU per worker
    a.afd_transport = a.transports[0].removesuffix("-dev") if given else ("cuda_ipc" if a.device == "cuda" else "inline")
    if a.decode_warmup < 0:
        p.error(f"--decode-warmup={a.decode_warmup}: must be >= 0")
    if a.graph_k < 0 or a.graph_replays < 1:
        p.error(f"--graph-k={a.graph_k} must be >= 0 and --graph-replays={a.graph_replays} >= 1")
    if min(*a.batch, a.steps, a.input_len, a.ffn_workers, a.attention_workers, *a.micro_batches, a.iters) < 1:
        p.error("--batch, --steps, --input-len, --ffn-workers, --attention-workers, --micro-batches, --iters must be "
                ">= 1")
    return a


def main(argv=None) -> Path:
    """Run the chosen modes, print and write the tables; returns the results file."""
    a = parse_args(argv)
    lines = [f"# AFD benchmark ({a.mode})", "", f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
             f"- hardware: {_hardware(a.device)}", f"- command: `python benchmark/afd/bench.py {' '.join(argv or sys.argv[1:])}`",
             f"- model: {a.model_path} ({a.load_format})", ""]
    if a.mode in ("decode", "all"):
        lines += ["## Decode throughput", ""] + run_decode(a) + [""]
    if a.mode in ("m2n", "all"):
        m2n_lines, a.m2n_rows = run_m2n(a)  # the rows: for --record-dir
        lines += ["## M2N latency (one way)", ""] + m2n_lines + [""]
    text = "\n".join(lines)
    print(text)
    d = Path(a.results_dir)
    d.mkdir(parents=True, exist_ok=True)
    out = d / f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d_%H%M}_afd_{a.mode}{'_smoke' if a.smoke else ''}.md"
    out.write_text(text + "\n")
    if a.record_dir:  # this parent process is the one writer
        from benchmark.afd.decode_throughput import decode_record
        from benchmark.afd.m2n_latency import m2n_record
        from benchmark.common.records import write_record

        if getattr(a, "decode_results", None):
            print(f"record: {write_record(decode_record(a, a.decode_results), Path(a.record_dir))[0]}")
        if getattr(a, "m2n_rows", None):
            gpus = min(2, torch.cuda.device_count()) if a.device == "cuda" else 0
            print(f"record: {write_record(m2n_record(a, a.m2n_rows, gpus), Path(a.record_dir))[0]}")
    return out


if __name__ == "__main__":
    main()
