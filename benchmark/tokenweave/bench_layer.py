"""TokenWeave benchmark: one decoder layer of a real model shape at TP 2/4/8, and end-to-end throughput.

Layer mode (default): every rank builds the model from a real ``config.json`` cut to ``--layers`` decoder
layers with dummy weights, and times a prefill forward of T tokens (1K..16K) under each variant, in the
same run:

* ``nocomm``      every collective skipped: the no-communication counterfactual (TokenWeave sec. 2; outputs
                  are wrong, it bounds what hiding communication can win);
* ``nccl``        NCCL AllReduce + fused residual add + RMSNorm (today's path);
* ``nccl_symm``   NCCL >= 2.27 symmetric kernels on a window-registered buffer (copy in, reduce, copy out) +
                  fused add + RMSNorm: the strongest non-multicast NCCL baseline (``benchmark/comm/nccl_symm.py``);
* ``custom``      our symmetric-memory one/two-shot all-reduce (never multicast) + fused add + RMSNorm;
* ``tokenweave``  two wave-aware splits, tw-comm's fused AllReduce-RMSNorm on a second stream, the server's default
                  sharded residual (each rank keeps only its rows of the split's residual; the comm gathers only
                  the normed rows; TokenWeave sec. 3-4);
* ``split_nocomm`` TokenWeave's split executor (two splits, two streams, events) with every collective skipped:
                  ``split_nocomm - nocomm`` is the cost of splitting (half-size GEMMs, twice the launches),
                  ``tokenweave - split_nocomm`` the communication left unhidden (not in the default set);
* ``tokenweave_nocarve`` TokenWeave with the split forward's GEMMs on every SM (no SM carveout for the
                  communication kernel, :mod:`sglang.srt.tokenweave.carveout`; not in the default set);
* ``tokenweave_oldcomm`` TokenWeave on tw-comm without the bulk-copy two-shot (the pre-bulk comm; ``tokenweave``
                  uses the server's default choice, on H200 the bulk kernel; ``benchmark/tokenweave/layer_variants.py``).
* ``tokenweave_full`` TokenWeave with ``--tokenweave-full-residual`` (every rank keeps every residual row; not in
                  the default set).
* ``tokenweave_oldsplit`` TokenWeave with the legacy unbounded split planner (``set_split_skew(None)``; measured: it
                  cut 4096 tokens 384 + 3712 on 116 SMs; not in the default set).
* ``tokenweave_selcarve`` TokenWeave with the GEMM SM carveout only on the GEMMs beside a comm
                  (``set_carveout_scope("overlap")``; not in the default set).

``--overlap-tokens T``: one profiled forward per variant at T; a table of how much of the communication kernels'
time ran concurrently with compute kernels (``benchmark/tokenweave/layer_profile.py``), and per TokenWeave variant the
kernel timeline CSV of rank 0 in ``--profile-dir``; with ``--cuda-graph`` also one profiled graph replay per variant
(rows ``<variant> (graph replay)``: no host launch gaps) and its CSV ``tokenweave_graph_timeline_<variant>_T<T>.csv``
(``benchmark/tokenweave/overlap_timeline.py`` reads both). A table of TokenWeave / NCCL against the TokenWeave targets
includes ``nocomm / nccl``, the bound no overlap can beat.

A second table splits each forward into GPU time (CUDA events) and host enqueue time (``perf_counter`` until
the forward returned, before any sync) with the kernel launches of one profiled forward (``--profile-tokens``);
a third gives the auto-off decision per T (TokenWeave on only where it beats ``nccl`` and ``nccl_symm``).
``--cuda-graph``: every (variant, T) forward also captured as one CUDA graph and replayed (a second table);
``--host-profile T``: cProfile of rank 0 over one forward per variant (``benchmark/tokenweave/layer_graph.py``).

It prints one table (median ms per forward and ratios against ``nccl`` and ``nocomm`` of the same run) and
writes ``benchmark/results/tokenweave/<date>_tokenweave_<mode>.md`` (date, hardware, command; layer mode also a ``.json``
of the timings: ``benchmark/tokenweave/layer_report.py --layer-fit`` fits the fixed per-forward cost over --layers; ``--record-dir DIR``
also writes the project's JSON record + markdown under ``DIR/tokenweave/``, headline TokenWeave vs NCCL). NVLink
multicast stays off in every process. End-to-end mode (``--e2e``) runs ``sglang.bench_offline_throughput`` and
``sglang.bench_serving`` (against ``sglang.launch_server`` started here) with TokenWeave off and on alternated
(off, on, off, on for ``--rounds 2``), same dataset, and reports the median of each side and the on/off ratios.
Every baseline (``nocomm``, ``nccl``, ``nccl_symm``, ``custom``) runs the same fused add-RMSNorm kernel as
``tokenweave``; ``--layers`` defaults to 4, ``--warmup`` to 5 forwards, times are medians of CUDA events.

Examples::

    python benchmark/tokenweave/bench_layer.py --model-path ../shared/data/configs/meta-llama--Llama-3.3-70B-Instruct \\
        ../shared/data/configs/Qwen--Qwen2.5-72B ../shared/data/configs/mistralai--Mixtral-8x22B-v0.1 \\
        --tp 2 4 8 --tokens 1024 2048 4096 8192 16384       # the issue's sweep: one table
    python benchmark/tokenweave/bench_layer.py --smoke          # CPU, gloo, a shrunk shape (tests use this)
    python benchmark/tokenweave/bench_layer.py --model-path ../shared/data/configs/meta-llama--Llama-3.3-70B-Instruct \
        --tp 2 --tokens 4096 8192 --variants tp tdist     # --enable-tdist-overlap vs plain TP
    python benchmark/tokenweave/bench_layer.py --e2e --model-path CONFIG --tokenizer-path TOK --tp 8
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "python"), str(ROOT / "sgl-kernel" / "python"), str(ROOT)]
from sglang.srt.utils.nvls_env import NVLS_OFF_ENV  # noqa: E402  (pure Python)
from benchmark.tokenweave.layer_graph import graph_and_profile, report_sections  # noqa: E402
from benchmark.tokenweave.layer_profile import overlap_table, profile_forward, profile_overlap  # noqa: E402
from benchmark.tokenweave.layer_report import auto_off_decision, host_table, targets_table, write_layer_record, write_cases_json  # noqa: E402
from benchmark.tokenweave.layer_variants import (FULL, OLDCOMM, OLDSPLIT, SELCARVE, ratio_pairs, tune_executor,  # noqa: E402
                                 variant_comm)

os.environ.update(NVLS_OFF_ENV)
VARIANTS = ("nocomm", "nccl", "nccl_symm", "custom", "tokenweave")
# Extra rows (not in the default set): ``split_nocomm`` the TokenWeave split with no collectives (measured: the
# cost of splitting itself); ``tp`` the plain TP forward (the server's default communicator, no overlap) and
# ``tdist`` the same with ``--enable-tdist-overlap`` (sequence-parallel residual, AG-GEMM / GEMM-RS by
# decomposition with the NCCL fallback); the table adds ``tdist / tp``.
# ``tokenweave_nocarve`` TokenWeave with the GEMMs on every SM (no SM carveout for the communication kernel: the
# earlier behaviour, where persistent GEMMs and the communication kernel serialized).
# OLDCOMM, FULL, OLDSPLIT, SELCARVE: benchmark/tokenweave/layer_variants.py
EXTRA_VARIANTS = ("split_nocomm", "tokenweave_nocarve", "tp", "tdist", OLDCOMM, FULL, OLDSPLIT, SELCARVE)
TW_VARIANTS = ("tokenweave", "split_nocomm", "tokenweave_nocarve", OLDCOMM, FULL, OLDSPLIT, SELCARVE)


def _shrunk_config(src: str, layers: int, smoke: bool) -> str:
    """A temp model folder whose config.json is ``src``'s with ``layers`` layers (and tiny sizes in smoke)."""
    cfg = json.loads((Path(src) / "config.json").read_text()) if src else {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 512, "rms_norm_eps": 1e-5,
        "max_position_embeddings": 4096, "rope_theta": 10000.0, "torch_dtype": "float32"}
    cfg["num_hidden_layers"] = layers
    if smoke:
        cfg.update(hidden_size=128, intermediate_size=256, num_attention_heads=8, num_key_value_heads=4,
                   head_dim=16, vocab_size=512, torch_dtype="float32")
        for k in ("moe_intermediate_size",):
            if k in cfg:
                cfg[k] = 64
    d = tempfile.mkdtemp(prefix="tw-bench-")
    (Path(d) / "config.json").write_text(json.dumps(cfg))
    return d


def _time_forward(runner, mwb, dev, ps, warmup: int, iters: int) -> list[tuple[float, float]]:
    """(GPU ms, host ms) of ``iters`` prefill forwards after ``warmup`` untimed ones. GPU: CUDA events around
    each forward (ranks aligned by a barrier before each); host: ``perf_counter`` from before the forward is
    issued until ``run`` returns (the launch/enqueue time; a forward whose host ms reaches its GPU ms is
    launch-bound). CPU: ``perf_counter`` for both."""
    import torch
    import torch.distributed as dist

    from sglang.srt.forward_batch_info import ForwardBatch

    times = []
    with torch.inference_mode():
        for i in range(warmup + iters):
            fb = ForwardBatch.init_new(mwb, dev, runner.req_to_token_pool, runner.token_to_kv_pool,
                                       runner.attn_backend)
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            dist.barrier(group=ps.cpu_group)
            if dev.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                t0 = time.perf_counter()
                start.record()
                runner.executor.run(runner.model, fb)
                end.record()
                host = (time.perf_counter() - t0) * 1e3
                end.synchronize()
                ms = start.elapsed_time(end)
            else:
                t0 = time.perf_counter()
                runner.executor.run(runner.model, fb)
                ms = host = (time.perf_counter() - t0) * 1e3
            if i >= warmup:
                times.append((ms, host))
    return times


def _rank_body(ps, path: str, tokens: list[int], variants: list[str], iters: int, min_tokens: int,
               comm_sms, device: str, warmup: int = 5, profile_tokens: int = 0, profile_dir: str = "",
               overlap_tokens: tuple = (), extra: dict = None) -> dict:
    """Per rank: build each variant's runner, time a prefill forward of every token count (median ms of CUDA
    events); with ``profile_tokens``, rank 0 also writes a torch-profiler summary of one TokenWeave forward; at
    every T in ``overlap_tokens`` one profiled forward per variant gives the communication/compute overlap
    (:func:`benchmark.tokenweave.layer_profile.overlap_stats`; rank 0 writes the TokenWeave kernel timeline CSV); ``extra``: the
    ``--cuda-graph`` / ``--host-profile`` options (:func:`benchmark.tokenweave.layer_graph.graph_and_profile`)."""
    import torch

    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.forward_batch_info import ForwardMode, ModelWorkerBatch
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.server_args import ServerArgs

    dev = ps.torch_device() if device == "cuda" else torch.device("cpu")
    mc = ModelConfig.from_path(path, None, "bfloat16" if device == "cuda" else "float32", device)
    out: dict = {}
    notes: set = set()
    overlap: list = []
    host_profiles, extra = [], dict(extra or {}, refs={}, graph_overlap=[])  # refs: nccl's logits per T
    for variant in variants:
        args = ServerArgs(model_path=path, load_format="dummy", device=device, max_total_tokens=max(tokens) + 64,
                          max_running_requests=4, disable_cuda_graph=True,
                          enable_tokenweave=variant in TW_VARIANTS,
                          enable_tdist_overlap=variant == "tdist",
                          tokenweave_min_tokens=min_tokens, tokenweave_comm_sms=comm_sms,
                          tokenweave_sharded_residual=False if variant == FULL else None,
                          comm_backend="custom" if variant == "custom" and device == "cuda" else "auto")
        comm = variant_comm(variant, ps, mc, tokens, device, notes, comm_sms)
        if comm is False:
            continue
        runner = ModelRunner(mc, args, str(dev), tp_rank=ps.tp_rank, tp_size=ps.tp_size, parallel_state=ps, comm=comm)
        tune_executor(variant, runner.executor)
        for t in tokens:
            row = runner.kv_cache.alloc_req_slot()
            loc = runner.kv_cache.alloc_extend([row], [0], [t], [-1])
            mwb = ModelWorkerBatch(forward_mode=ForwardMode.EXTEND, input_ids=[(7 * i) % mc.vocab_size for i in range(t)],
                                   positions=list(range(t)), out_cache_loc=loc, req_pool_indices=[row],
                                   prefix_lens=[0], extend_lens=[t], seq_lens=[t], sample=[True])
            timed = _time_forward(runner, mwb, dev, ps, warmup, iters)
            out[(variant, t)] = statistics.median(g for g, _ in timed)
            out[("host", variant, t)] = statistics.median(h for _, h in timed)
            if ps.tp_rank == 0:  # CLI progress: a run cut short by a timeout still shows what it measured
                print(f"[partial] rank 0: {variant} T={t} {out[(variant, t)]:.3f} ms (host "
                      f"{out[('host', variant, t)]:.3f} ms)", file=sys.stderr, flush=True)
            tl = {o: str(Path(profile_dir) / f"tokenweave_graph_timeline_{variant}_T{o}.csv")
                  if ps.tp_rank == 0 and profile_dir and variant in TW_VARIANTS else "" for o in overlap_tokens}
            graph_and_profile(runner, mwb, dev, ps, variant, t, dict(extra, warmup=warmup, iters=iters,
                                                                     graph_timeline=tl), out, notes, host_profiles)
            if t == profile_tokens and profile_dir and variant in ("tokenweave", "nccl", "split_nocomm", FULL):
                keep = ps.tp_rank == 0 and variant == "tokenweave"
                out[("launches", variant, t)], out[("allocs", variant, t)] = profile_forward(
                    runner, mwb, dev, str(Path(profile_dir) / f"tokenweave_profile_T{t}.txt") if keep else "")
            if t in overlap_tokens:  # all ranks (collective forward); on CPU the table has no kernels
                csv = (str(Path(profile_dir) / f"tokenweave_timeline_{variant}_T{t}.csv")
                       if ps.tp_rank == 0 and profile_dir and variant in TW_VARIANTS else "")
                overlap.append((variant, t, profile_overlap(runner, mwb, dev, csv)))
            runner.kv_cache.free_slots(loc)
            runner.kv_cache.free_req_slot(row)
        del runner
    res = {"|".join(map(str, k)): ms for k, ms in out.items()}
    res["notes"], res["overlap"], res["host_profile"] = sorted(notes), overlap + extra["graph_overlap"], host_profiles
    return res


def _table(cases: list[tuple[str, int, dict]], tokens: list[int], variants: list[str]) -> list[str]:
    """Markdown rows, one table for every (model, TP) case of the run: per token count, every variant's ms and
    TokenWeave's ratio to each baseline measured in the same case."""
    pairs = ratio_pairs(variants)
    lines = ["| model | TP | tokens | " + " | ".join(f"{v} ms" for v in variants) + " | "
             + " | ".join(f"{a} / {b}" for a, b in pairs) + " |",
             "|---|---:|---:|" + "---:|" * (len(variants) + len(pairs))]
    ratio = lambda a, b: f"{a / b:.3f}" if a and b else "n/a"  # noqa: E731
    for model, tp, results in cases:
        for t in tokens:
            ms = {v: results.get(f"{v}|{t}") for v in variants}
            lines.append(f"| {model} | {tp} | {t} | "
                         + " | ".join(f"{ms[v]:.3f}" if ms[v] else "n/a" for v in variants) + " | "
                         + " | ".join(ratio(ms.get(a), ms[b]) for a, b in pairs) + " |")
    return lines


def run_layer_mode(a) -> Path:
    """For every ``--model-path`` and every ``--tp``: spawn the ranks and time every variant; print and write one
    table; returns the results file."""
    from sglang.test.spawn_ranks import spawn_ranks

    device = "cpu" if a.smoke or a.device == "cpu" else "cuda"
    variants = [v for v in a.variants if not ((device == "cpu" or a.share_gpu) and v in ("custom", "nccl_symm"))]
    cases, notes, overlap_rows, host_profiles = [], [], [], []
    for model_path in a.model_paths:
        path = _shrunk_config(model_path, a.layers, a.smoke)
        for tp in a.tps:
            per_rank = spawn_ranks(_rank_body, tp, path, a.tokens, variants, a.iters, a.min_tokens, a.comm_sms,
                                   device, a.warmup, a.profile_tokens, a.profile_dir, tuple(a.overlap_tokens),
                                   dict(cuda_graph=a.cuda_graph, host_profile=a.host_profile),
                                   timeout=a.timeout, device=device,
                                   share_gpu=a.share_gpu)
            notes += [n for n in per_rank[0].get("notes", []) if n not in notes]
            host_profiles += per_rank[0].get("host_profile", [])
            res = {k: max(r[k] for r in per_rank) for k in per_rank[0]
                   if k not in ("notes", "overlap", "host_profile")}  # slowest rank
            cases.append((Path(model_path).name or "synthetic", tp, res))
            overlap_rows += per_rank[0].get("overlap", [])  # rank 0's profile
    hw = _hardware(device)
    lines = [f"# TokenWeave layer benchmark ({'smoke, ' if a.smoke else ''}{device})", "",
             f"- date: {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}",
             f"- hardware: {hw}", f"- command: `{' '.join([sys.executable] + sys.argv)}`",
             f"- models: {', '.join(p or 'synthetic' for p in a.model_paths)} cut to {a.layers} layer(s), TP "
             f"{', '.join(map(str, a.tps))}, min tokens {a.min_tokens}, comm SMs {a.comm_sms or 'default'}",
             *(["- SHARED-GPU SMOKE MODE: all ranks on one GPU, the `nccl` column is gloo; times mean nothing"]
               if a.share_gpu else []),
             "- baselines: `nccl` (NCCL AllReduce), `nccl_symm` (NCCL symmetric window, copy in/out), `nocomm` "
             "(no collectives), each with the fused add-RMSNorm kernel TokenWeave uses; same run and case", 
             f"- timing: {a.warmup} warm-up forwards, then the median of {a.iters} "
             f"{'CUDA-event' if device == 'cuda' else 'perf_counter'} timings per forward, slowest rank", "",
             *_table(cases, a.tokens, variants), "", "## host vs GPU time per forward", "",
             *host_table(cases, a.tokens, variants), "", "## auto-off decision (TokenWeave vs the best baseline)", "",
             *[ln for model, tp, res in cases for ln in [f"- {model} TP{tp}:"] + auto_off_decision(res, a.tokens)[0]],
             "", "## against the TokenWeave targets (TokenWeave / NCCL)", "", *targets_table(cases, a.tokens),
             *(["", "## communication / compute overlap (one profiled forward, rank 0, torch profiler kernel times)",
                "", *overlap_table(overlap_rows)] if overlap_rows else []),
             *report_sections(cases, a.tokens, variants, host_profiles, a.cuda_graph and device == "cuda"),
             *([""] + [f"- note: {n}" for n in notes] if notes else [])]
    print("\n".join(lines))
    out = _results_path(a, "layer")
    out.write_text("\n".join(lines) + "\n")
    write_cases_json(out.with_suffix(".json"), a.layers, a.tokens, variants, cases)  # benchmark/tokenweave/layer_report.py --layer-fit
    if a.record_dir:  # the parent holds every rank's results: one writer
        print(f"record: {write_layer_record(cases, a, variants, device)}")
    return out


def _server_flags(a) -> list[str]:
    """Flags shared by the offline engine and the server of the end-to-end mode (model, TP, device, weights)."""
    flags = ["--model-path", a.model_path, "--tp", str(a.tp)]
    if a.tokenizer_path:
        flags += ["--tokenizer-path", a.tokenizer_path]
    if a.smoke or a.device == "cpu":
        flags += ["--device", "cpu"]
    else:
        flags += ["--load-format", "dummy", "--dtype", "bfloat16"]
    return flags


def _child_env() -> dict:
    return dict(os.environ, **NVLS_OFF_ENV, PYTHONUNBUFFERED="1",
                PYTHONPATH=os.pathsep.join([str(ROOT / "python"), str(ROOT / "sgl-kernel" / "python")]))


def _offline_run(a, tw_flags: list[str]) -> dict:
    """One ``sglang.bench_offline_throughput`` run; its last JSONL record."""
    cmd = [sys.executable, "-m", "sglang.bench_offline_throughput", *_server_flags(a), "--dataset-name",
           a.dataset_name, "--num-prompts", str(a.num_prompts), "--random-input-len", str(a.input_len),
           "--random-output-len", str(a.output_len)]
    if a.dataset_path:
        cmd += ["--dataset-path", a.dataset_path]
    with tempfile.TemporaryDirectory() as d:
        res_file = str(Path(d) / "offline.jsonl")
        subprocess.run(cmd + tw_flags + ["--result-filename", res_file], check=True, env=_child_env(),
                       timeout=a.timeout)
        return json.loads(Path(res_file).read_text().strip().splitlines()[-1])


def _serving_run(a, tw_flags: list[str]) -> dict:
    """Start ``sglang.launch_server`` (TokenWeave flags ``tw_flags``), run ``sglang.bench_serving`` against it
    (same dataset and lengths as the offline run, all requests at once), stop the server; the bench's record.

    Raises:
        RuntimeError: the server exited or was not healthy within ``--timeout``, or bench_serving failed
            (the message carries the log tail).
    """
    from benchmark.serving.server_bench import _free_port, _stop

    port = _free_port()
    with tempfile.TemporaryDirectory() as d:
        log_path, jsonl = Path(d) / "server.log", Path(d) / "serving.jsonl"
        with open(log_path, "w") as log:
            proc = subprocess.Popen([sys.executable, "-m", "sglang.launch_server", *_server_flags(a), *tw_flags,
                                     "--port", str(port)], stdout=log, stderr=subprocess.STDOUT, env=_child_env(),
                                    start_new_session=True)
        try:
            deadline = time.monotonic() + a.timeout
            while True:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the server {'exited' if proc.poll() is not None else 'is not healthy'}:\n"
                                       + log_path.read_text()[-3000:])
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                        if r.status == 200:
                            break
                except OSError:
                    time.sleep(1)
            cmd = [sys.executable, "-m", "sglang.bench_serving", "--backend", "sglang", "--port", str(port),
                   "--dataset-name", a.dataset_name, "--num-prompts", str(a.num_prompts), "--random-input-len",
                   str(a.input_len), "--random-output-len", str(a.output_len), "--disable-tqdm", "--output-file",
                   str(jsonl)]
            if a.dataset_path:
                cmd += ["--dataset-path", a.dataset_path]
            if a.tokenizer_path:
                cmd += ["--tokenizer", a.tokenizer_path]
            p = subprocess.run(cmd, capture_output=True, text=True, env=_child_env(), timeout=a.timeout)
            if p.returncode != 0 or not jsonl.exists():
                raise RuntimeError(f"bench_serving exited with code {p.returncode}:\n{(p.stdout + p.stderr)[-3000:]}")
            return json.loads([ln for ln in jsonl.read_text().splitlines() if ln.strip()][-1])
        finally:
            _stop(proc)


def _alternate(a, tw: list[str]) -> dict:
    """``--rounds`` off/on pairs in alternating order (off, on, off, on, ...), so compile and warm-up costs fall
    on both sides; per side and mode (offline, serving) the list of records."""
    runs: dict = {name: {"offline": [], "serving": []} for name in ("off", "on")}
    for _ in range(a.rounds):
        for name, flags in (("off", []), ("on", tw)):
            runs[name]["offline"].append(_offline_run(a, flags))
            if not a.skip_serving:
                runs[name]["serving"].append(_serving_run(a, flags))
    return runs


def run_e2e_mode(a) -> Path:
    """TokenWeave off and on, alternated ``--rounds`` times, same flags and dataset: ``bench_offline_throughput``
    (the engine in-process) and ``bench_serving`` against ``launch_server``; one table of the median throughputs
    and on/off ratios of the medians."""
    tw = ["--enable-tokenweave"] + (["--tokenweave-min-tokens", str(a.min_tokens)] if a.min_tokens else [])
    if a.comm_sms:
        tw += ["--tokenweave-comm-sms", str(a.comm_sms)]
    runs = _alternate(a, tw)
    key = "output_throughput" if "output_throughput" in runs["off"]["offline"][0] else "total_throughput"
    cols = [("offline", key, f"offline {key} (tok/s)")]
    if not a.skip_serving:
        cols += [("serving", "output_throughput", "serving output_throughput (tok/s)"),
                 ("serving", "mean_ttft_ms", "serving mean TTFT (ms)")]
    med = {(n, m, k): statistics.median(r[k] for r in runs[n][m]) for n in ("off", "on") for m, k, _ in cols}
    fmt = lambda v: f"{v:.2f}"  # noqa: E731
    lines = ["# TokenWeave end-to-end (bench_offline_throughput, bench_serving)", "",
             f"- date: {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}",
             f"- hardware: {_hardware('cpu' if a.smoke or a.device == 'cpu' else 'cuda')}",
             f"- command: `{' '.join([sys.executable] + sys.argv)}`",
             f"- model: {a.model_path}, TP {a.tp}, dataset {a.dataset_name}, {a.num_prompts} prompts, input "
             f"{a.input_len}, output {a.output_len}; TokenWeave flags: `{' '.join(tw)}`",
             f"- order: off, on alternated {a.rounds} time(s); each cell is the median over the rounds; per-round "
             "offline values: " + "; ".join(f"{n} " + ", ".join(fmt(r[key]) for r in runs[n]["offline"])
                                            for n in ("off", "on")), "",
             "| TokenWeave | " + " | ".join(c[2] for c in cols) + " |", "|---|" + "---:|" * len(cols)]
    for name in ("off", "on"):
        lines.append(f"| {name} | " + " | ".join(fmt(med[name, m, k]) for m, k, _ in cols) + " |")
    lines.append("| on / off | " + " | ".join(f"{med['on', m, k] / med['off', m, k]:.3f}" if med["off", m, k]
                                             else "n/a" for m, k, _ in cols) + " |")
    print("\n".join(lines))
    out = _results_path(a, "e2e")
    out.write_text("\n".join(lines) + "\n")
    return out


def _hardware(device: str) -> str:
    if device == "cuda":
        import torch

        return f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    return f"CPU {platform.processor() or platform.machine()} ({os.cpu_count()} cores)"


def _results_path(a, mode: str) -> Path:
    d = Path(a.results_dir)
    d.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d_%H%M")
    return d / f"{stamp}_tokenweave_{mode}{'_smoke' if a.smoke else ''}.md"


def parse_args(argv=None):
    """The benchmark's flags (see the module docstring); ValueError-style exits for bad values."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-path", nargs="+", default=[""],
                   help="folder(s) with a real config.json (weights are dummy); layer mode: one table over all; "
                        "end-to-end mode: exactly one")
    p.add_argument("--tokenizer-path", default="")
    p.add_argument("--tp", type=int, nargs="+", default=[8], help="TP size(s); end-to-end mode: exactly one")
    p.add_argument("--layers", type=int, default=4, help="decoder layers (>= 4 amortizes the per-forward costs)")
    p.add_argument("--tokens", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS + EXTRA_VARIANTS)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=5, help="untimed forwards before the timed ones (>= 5 on GPU)")
    p.add_argument("--profile-tokens", type=int, default=0,
                   help="layer mode: rank 0 writes a torch-profiler summary of one TokenWeave forward at this T")
    p.add_argument("--overlap-tokens", type=int, nargs="*", default=[],
                   help="layer mode (GPU): per variant one profiled forward at these T, its comm/compute overlap")
    p.add_argument("--cuda-graph", action="store_true",
                   help="layer mode (GPU): also time every (variant, T) forward captured as one CUDA graph")
    p.add_argument("--host-profile", type=int, default=0, metavar="T",
                   help="layer mode: cProfile of rank 0 over one forward per variant at T (top 25 cumulative)")
    p.add_argument("--profile-dir", default="", help="where the profile summary goes (default: --results-dir)")
    p.add_argument("--min-tokens", type=int, default=None,
                   help="--tokenweave-min-tokens (layer mode default 1024, so every T splits; end-to-end default: "
                        "the server's auto-off per TP size)")
    p.add_argument("--comm-sms", type=int, default=None)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--e2e", action="store_true",
                   help="end-to-end mode (bench_offline_throughput and bench_serving, TokenWeave off vs on)")
    p.add_argument("--skip-serving", action="store_true", help="end-to-end mode without the bench_serving part")
    p.add_argument("--rounds", type=int, default=2,
                   help="end-to-end mode: off/on pairs run alternately (off, on, off, on, ...); medians reported")
    p.add_argument("--dataset-name", default="random")
    p.add_argument("--dataset-path", default="")
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--smoke", action="store_true", help="CPU gloo, TP 2, shrunk shapes, few tokens (for tests)")
    p.add_argument("--share-gpu", action="store_true",
                   help="one-GPU smoke: all ranks on cuda:0, gloo device group (checks the script, not speed)")
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--results-dir", default=str(ROOT / "benchmark" / "results" / "tokenweave"))
    from benchmark.common.records import add_record_dir_argument
    add_record_dir_argument(p, "tokenweave", "layer mode: ")
    a = p.parse_args(argv)
    a.model_paths, a.tps = a.model_path, a.tp
    if a.e2e and (len(a.model_paths) > 1 or len(a.tps) > 1):
        p.error("--e2e takes one --model-path and one --tp")
    a.model_path, a.tp = a.model_paths[0], a.tps[0]
    if a.share_gpu:
        a.iters, a.warmup = min(a.iters, 3), min(a.warmup, 2)
    if a.smoke:
        a.tp, a.tps, a.device, a.iters, a.min_tokens, a.warmup, a.rounds = 2, [2], "cpu", 2, 8, 1, 1
        if not a.e2e:
            a.tokens = [t for t in a.tokens if t <= 256] or [64, 200]
    if min(a.tps) < 1 or a.layers < 1 or a.iters < 1 or a.rounds < 1 or any(t < 2 for t in a.tokens):
        p.error("--tp, --layers, --iters, --rounds must be >= 1 and every --tokens value >= 2")
    if a.warmup < 0:
        p.error(f"--warmup={a.warmup} must be >= 0")
    a.profile_dir = a.profile_dir or a.results_dir
    if a.min_tokens is None and not a.e2e:
        a.min_tokens = 1024
    if not a.smoke and not a.model_path:
        p.error("--model-path is required (a folder with config.json), or use --smoke")
    return a


def main(argv=None) -> Path:
    """Run the chosen mode; returns the results file written."""
    a = parse_args(argv)
    return run_e2e_mode(a) if a.e2e else run_layer_mode(a)


if __name__ == "__main__":
    main()
