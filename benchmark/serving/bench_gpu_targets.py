"""The one-GPU targets: every measurement beside a floor measured in the same run.

Parts (``--only`` picks a subset, ``--skip-serving`` drops the server):
  floors     HBM bandwidth = (bytes read + bytes written) / time of a large device-to-device copy
             (median of CUDA-event timings, ``bench_triton_attention.hbm_bandwidth``); bf16 matmul rate =
             2 n^3 / time of an n x n x n GEMM (n = 8192, ``bench_triton_attention.matmul_rate``).
  attention  Triton paged decode attention, batch 64 x 4K context, Llama-3-8B heads: KV bytes read / kernel
             time vs the HBM bandwidth (``bench_triton_attention.bench_decode``, all three KV layouts).
  decode     a static batch (1, 32, 128 requests x 1K context) is prefilled, then decode steps are timed
             through ``ModelRunner.forward`` (``sglang.bench_one_batch.run_latency``: model + sampling, device
             synchronized, CUDA graphs when the runner has them); median step vs the memory floor
             (weight bytes read per step + KV bytes read per step) / HBM bandwidth. Weight bytes read =
             all parameters except the input-embedding table, of which a decode step gathers only B rows
             (with tied embeddings the table is the LM head and is counted). KV bytes = B * mean context *
             2 (K, V) * layers * kv_heads * head_dim * itemsize.
  prefill    one request of 8K tokens; achieved FLOP/s = FLOPs / median latency, vs the matmul rate.
             FLOPs = 2 * T * P_layers + 2 * P_head + 4 * L * H * d * T (T + 1) / 2, where P_layers = the
             matrix parameters of the decoder layers (embedding and LM head excluded: the embedding is a
             gather and the LM head projects only the last token), P_head = LM-head parameters, and the last
             term is causal attention (QK^T and PV, 2 FLOPs per multiply-add, T (T + 1) / 2 visible pairs).
  serving    ``python -m sglang.launch_server`` (8B config, dummy bf16 weights) started here, then
             ``python -m sglang.bench_serving`` random 1024-in / 256-out (``--random-range-ratio 1``) at
             concurrency 64; output tok/s, TTFT and ITL (mean / median / p99) from its JSONL line.

Usage (repo root, GPU host):
  python benchmark/serving/bench_gpu_targets.py [--only decode,prefill] [--skip-serving] [--smoke] [--out DIR]
CPU smoke of the timing path:
  python benchmark/serving/bench_gpu_targets.py --device cpu --dtype float32 --smoke --only floors,decode,prefill \\
      --model-path ../shared/data/models/stories260K
Writes <out>/<date>_gpu_targets.{md,json} after every part, so a failing part loses nothing else.
``--record-dir DIR`` also writes a :mod:`benchmark.common.records` record (``what`` = ``gpu_targets``) under
``DIR/serving/`` at the end: one row per measured target with its same-run floor, ratio, target and verdict.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import importlib
import json
import logging
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[2]
for _path in (REPO / "python", REPO):  # the sglang package; the benchmark package
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))
del _path

from sglang.bench_one_batch import NVLS_OFF_ENV, run_latency  # noqa: E402
from benchmark.common.floors import (  # noqa: E402,F401  (re-exported)
    SERVING_KEYS, ParamStats, TargetRow, attention_flops, copy_bandwidth, format_table, kv_bytes, matmul_flops,
    mean_decode_context, memory_floor_s, model_param_stats, param_stats, parse_attention_rows, prefill_flops, si,
    summarize_serving,
)
from benchmark.serving.server_bench import bench_serving_command, measure_serving, server_command  # noqa: E402,F401

logger = logging.getLogger("bench_gpu_targets")

PARTS = ("floors", "attention", "decode", "prefill", "serving")
DATA = REPO.parent / "shared" / "data"
DEFAULT_MODEL = DATA / "configs" / "meta-llama--Meta-Llama-3.1-8B"
DEFAULT_TOKENIZER = DATA / "tokenizers" / "llama3"
DECODE_TARGET, PREFILL_TARGET, ATTENTION_TARGET = 1.3, 0.60, 0.70
# sizes: (full run, --smoke)
SIZES = {
    "decode_batches": ("1,32,128", "1,4"), "decode_context": (1024, 48), "decode_steps": (32, 4),
    "prefill_tokens": (8192, 128), "prefill_reps": (3, 2), "attn_batch": (64, 4), "attn_context": (4096, 256),
    "hbm_gib": (4.0, 1 / 16), "matmul_n": (8192, 256), "serving_prompts": (256, 8), "serving_concurrency": (64, 4),
    "serving_input_len": (1024, 64), "serving_output_len": (256, 8),
}


# ----------------------------------------------------------------------------- configuration
@dataclasses.dataclass(frozen=True)
class TargetsConfig:
    """What to run; sizes in tokens/requests (see the module docstring)."""

    model_path: str
    tokenizer_path: str
    device: str
    dtype: str
    attention_backend: Optional[str]
    parts: tuple[str, ...]
    decode_batches: tuple[int, ...]
    decode_context: int
    decode_steps: int
    prefill_tokens: int
    prefill_reps: int
    attn_batch: int
    attn_context: int
    hbm_gib: float
    matmul_n: int
    serving_prompts: int
    serving_concurrency: int
    serving_input_len: int
    serving_output_len: int
    out_dir: str
    time_budget_s: float
    seed: int = 0
    record_dir: Optional[str] = None

    def __post_init__(self) -> None:
        bad = [p for p in self.parts if p not in PARTS]
        if bad or not self.parts:
            raise ValueError(f"--only={','.join(self.parts)!r} is invalid: use a comma list of {','.join(PARTS)}")
        if self.device not in ("cuda", "cpu"):
            raise ValueError(f"--device={self.device!r} is invalid: use cuda or cpu")
        for name in ("decode_context", "decode_steps", "prefill_tokens", "prefill_reps", "attn_batch", "attn_context",
                     "matmul_n", "serving_prompts", "serving_concurrency", "serving_input_len", "serving_output_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')}={getattr(self, name)} must be >= 1")
        if not self.decode_batches or min(self.decode_batches) < 1:
            raise ValueError(f"--decode-batches={self.decode_batches} must be positive integers")
        if self.hbm_gib <= 0:
            raise ValueError(f"--hbm-gib={self.hbm_gib} must be positive")

    @property
    def context_length(self) -> int:
        """Per-request token limit of the in-process runner."""
        return max(self.prefill_tokens + 1, self.decode_context + self.decode_steps + 1) + 8

    @property
    def kv_pool_tokens(self) -> int:
        """KV pool size of the in-process runner (sized explicitly so activations keep room)."""
        return max(max(self.decode_batches) * (self.decode_context + self.decode_steps + 2),
                   self.prefill_tokens + 2) + 1024


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser of this script (sizes default to None: :data:`SIZES` fills them in)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default=str(DEFAULT_MODEL))
    p.add_argument("--tokenizer-path", default=str(DEFAULT_TOKENIZER))
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--attention-backend", default=None, choices=("torch_native", "triton", "flashinfer"),
                   help="default: the engine's default for the device (triton on cuda)")
    p.add_argument("--only", default=",".join(PARTS), help=f"comma list of {','.join(PARTS)}")
    p.add_argument("--skip-serving", action="store_true")
    p.add_argument("--smoke", action="store_true", help="tiny sizes (pipeline check, numbers meaningless)")
    for name, (full, _) in SIZES.items():
        p.add_argument("--" + name.replace("_", "-"), type=type(full), default=None, help=f"default {full}")
    p.add_argument("--out", default=str(REPO / "benchmark" / "results" / "serving"))
    p.add_argument("--time-budget-s", type=float, default=330.0,
                   help="serving timeouts shrink so the whole run ends within this many seconds")
    from benchmark.common.records import add_record_dir_argument
    add_record_dir_argument(p, "serving")
    return p


def parse_args(argv: list[str]) -> TargetsConfig:
    """TargetsConfig from the command line. Raises ValueError on bad values."""
    ns = build_parser().parse_args(argv)
    size = {k: (getattr(ns, k) if getattr(ns, k) is not None else v[1 if ns.smoke else 0]) for k, v in SIZES.items()}
    try:
        batches = tuple(int(b) for b in str(size.pop("decode_batches")).split(",") if b.strip())
    except ValueError:
        raise ValueError("--decode-batches must be a comma list of integers, e.g. 1,32,128") from None
    parts = tuple(p.strip() for p in ns.only.split(",") if p.strip())
    if ns.skip_serving:
        parts = tuple(p for p in parts if p != "serving")
    return TargetsConfig(model_path=ns.model_path, tokenizer_path=ns.tokenizer_path, device=ns.device, dtype=ns.dtype,
                         attention_backend=ns.attention_backend, parts=parts, decode_batches=batches, out_dir=ns.out,
                         time_budget_s=ns.time_budget_s, record_dir=ns.record_dir, **size)


# ----------------------------------------------------------------------------- measurements
def _triton_attention():
    """:mod:`benchmark.attention.bench_triton_attention`, imported on first use (it imports torch and Triton)."""
    return importlib.import_module("benchmark.attention.bench_triton_attention")


def _cpu_seconds(fn, reps: int = 5) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_floors(cfg: TargetsConfig) -> dict:
    """{"hbm_bytes_per_s", "matmul_flops_per_s"} on ``cfg.device`` (CUDA: bench_triton_attention's timers)."""
    import torch

    if cfg.device == "cuda":
        bta = _triton_attention()
        return {"hbm_bytes_per_s": bta.hbm_bandwidth(cfg.hbm_gib), "matmul_flops_per_s": bta.matmul_rate(cfg.matmul_n)}
    n = int(cfg.hbm_gib * 2**30)
    src = torch.randint(0, 255, (n,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    bw = copy_bandwidth(n, _cpu_seconds(lambda: dst.copy_(src)))
    dt = getattr(torch, cfg.dtype)
    a, b = torch.randn(cfg.matmul_n, cfg.matmul_n, dtype=dt), torch.randn(cfg.matmul_n, cfg.matmul_n, dtype=dt)
    return {"hbm_bytes_per_s": bw, "matmul_flops_per_s": matmul_flops(cfg.matmul_n) / _cpu_seconds(lambda: a @ b)}


def measure_attention(cfg: TargetsConfig, bw: float) -> dict:
    """Triton paged decode attention (bench_triton_attention.bench_decode) at attn_batch x attn_context."""
    if cfg.device != "cuda":
        raise RuntimeError("the Triton decode-attention benchmark needs --device cuda")
    bta = _triton_attention()
    args = argparse.Namespace(batch=cfg.attn_batch, context=cfg.attn_context, heads=32, kv_heads=8, head_dim=128,
                              sweep=False)
    main_rows, _ = bta.bench_decode(args, bw or 1.0)  # its own ratio column is not used
    kvb = kv_bytes(cfg.attn_batch * cfg.attn_context, 1, 8, 128, 2)
    rows = [dict(r, kv_bytes=kvb, kv_bytes_per_s=kvb / (r["time_us"] * 1e-6)) for r in parse_attention_rows(main_rows)]
    if not rows:
        raise RuntimeError(f"no rows parsed from bench_decode's table: {main_rows}")
    return {"layouts": rows}


def build_runner(cfg: TargetsConfig):
    """A ModelRunner with dummy weights (tp 1) sized for the decode/prefill parts."""
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.server_args import ServerArgs

    sa = ServerArgs(model_path=cfg.model_path, load_format="dummy", dtype=cfg.dtype, device=cfg.device,
                    context_length=cfg.context_length, max_total_tokens=cfg.kv_pool_tokens,
                    attention_backend=cfg.attention_backend, random_seed=cfg.seed)
    mc = ModelConfig.from_path(sa.model_path, sa.context_length, sa.dtype, cfg.device)
    return ModelRunner(mc, sa, cfg.device)


def runner_facts(runner) -> dict:
    """Attention backend, CUDA-graph use and parameter statistics of a loaded runner, for the report."""
    stats = model_param_stats(runner.model)
    return {"attention_backend": getattr(runner, "attention_backend_name", type(runner.attn_backend).__name__),
            "cuda_graphs": getattr(runner, "cuda_graph_runner", None) is not None,
            "param_bytes": stats.total_bytes, "decode_weight_bytes": stats.decode_weight_bytes,
            "layer_matmul_params": stats.layer_matmul_params, "lm_head_params": stats.lm_head_params,
            "tied_embeddings": stats.tied}


def measure_decode(runner, cfg: TargetsConfig, bw: Optional[float]) -> dict:
    """Median decode step per batch size (bench_one_batch.run_latency) vs the memory floor."""
    mc = runner.model_config
    stats = model_param_stats(runner.model)
    itemsize = mc.dtype.itemsize
    out = []
    for bs in cfg.decode_batches:
        r = run_latency(runner, bs, cfg.decode_context, cfg.decode_steps + 1, cfg.seed + bs)
        med = statistics.median(r["decode_latencies"])
        kvr = kv_bytes(bs * mean_decode_context(cfg.decode_context, cfg.decode_steps), mc.num_hidden_layers,
                       runner.num_kv_heads, mc.head_dim, itemsize)
        floor = memory_floor_s(stats.decode_weight_bytes, kvr, bw) if bw else None
        out.append({"batch": bs, "context": cfg.decode_context, "steps": cfg.decode_steps, "median_step_s": med,
                    "min_step_s": min(r["decode_latencies"]), "step_latencies_s": r["decode_latencies"],
                    "weight_bytes": stats.decode_weight_bytes,
                    "kv_read_bytes": kvr, "floor_s": floor, "ratio": med / floor if floor else None})
        logger.info("decode bs=%d: median step %.3f ms (floor %s ms)", bs, med * 1e3,
                    f"{floor * 1e3:.3f}" if floor else "n/a")
    return {"batches": out}


def measure_prefill(runner, cfg: TargetsConfig, mm: Optional[float]) -> dict:
    """Median latency of a ``prefill_tokens``-token prefill (one request, after one warmup) in FLOP/s."""
    mc = runner.model_config
    lat = [run_latency(runner, 1, cfg.prefill_tokens, 1, cfg.seed + 1000 + i)["prefill_latency"]
           for i in range(cfg.prefill_reps + 1)][1:]
    med = statistics.median(lat)
    flops = prefill_flops(cfg.prefill_tokens, model_param_stats(runner.model), mc.num_hidden_layers,
                          mc.num_attention_heads, mc.head_dim)
    rate = flops / med
    return {"tokens": cfg.prefill_tokens, "median_latency_s": med, "latencies_s": lat, "flops": flops,
            "flops_per_s": rate, "ratio": rate / mm if mm else None}


# ----------------------------------------------------------------------------- report
def table_rows(res: dict) -> list[TargetRow]:
    """The ratio table from the parts' results (missing parts give no rows)."""
    parts, rows = res["parts"], []
    fl = parts.get("floors", {})
    bw, mm = fl.get("hbm_bytes_per_s"), fl.get("matmul_flops_per_s")
    if bw:
        rows.append(TargetRow("HBM bandwidth (D2D copy, floor)", "-", si(bw, "B/s"), None, "", None))
    n = res["config"]["matmul_n"]
    if mm:
        rows.append(TargetRow(f"{res['config']['dtype']} {n}^3 matmul rate (floor)", "-", si(mm, "FLOP/s"), None,
                              "", None))
    for d in parts.get("decode", {}).get("batches", []):
        floor = f"{d['floor_s'] * 1e3:.3f} ms" if d["floor_s"] else "n/a"
        rows.append(TargetRow(f"decode step, batch {d['batch']} x {d['context']} ctx", floor,
                              f"{d['median_step_s'] * 1e3:.3f} ms", d["ratio"], "<=", DECODE_TARGET))
    p = parts.get("prefill", {})
    if "flops_per_s" in p:
        rows.append(TargetRow(f"prefill {p['tokens']} tokens", si(mm, "FLOP/s") if mm else "n/a",
                              f"{si(p['flops_per_s'], 'FLOP/s')} ({p['median_latency_s'] * 1e3:.1f} ms)",
                              p["ratio"], ">=", PREFILL_TARGET))
    for a in parts.get("attention", {}).get("layouts", []):
        rows.append(TargetRow(f"Triton decode attn {res['config']['attn_batch']}x{res['config']['attn_context']}, "
                              f"{a['name']}", si(bw, "B/s") if bw else "n/a",
                              f"{si(a['kv_bytes_per_s'], 'B/s')} ({a['time_us']:.1f} us)",
                              a["kv_bytes_per_s"] / bw if bw else None, ">=", ATTENTION_TARGET))
    s = parts.get("serving", {})
    if "output_throughput" in s:
        c = res["config"]
        rows.append(TargetRow(f"bench_serving random {c['serving_input_len']}/{c['serving_output_len']} @ "
                              f"{c['serving_concurrency']}", "-",
                              f"{s['output_throughput']:.0f} out tok/s; TTFT mean/med/p99 {s['mean_ttft_ms']:.0f}/"
                              f"{s['median_ttft_ms']:.0f}/{s['p99_ttft_ms']:.0f} ms; ITL {s['mean_itl_ms']:.1f}/"
                              f"{s['median_itl_ms']:.1f}/{s['p99_itl_ms']:.1f} ms", None, "", None))
    return rows


def hardware() -> str:
    """One line describing the GPU (nvidia-smi and torch), torch/CUDA versions and the host."""
    import torch

    parts = []
    try:
        q = ["nvidia-smi", "--query-gpu=name,memory.total,clocks.max.sm,driver_version", "--format=csv,noheader"]
        parts.append(subprocess.run(q, capture_output=True, text=True, timeout=20).stdout.strip())
    except (OSError, subprocess.SubprocessError):
        pass
    if torch.cuda.is_available():
        pr = torch.cuda.get_device_properties(0)
        parts.append(f"{pr.name}, {pr.multi_processor_count} SMs, {pr.total_memory / 2**30:.0f} GiB")
    parts.append(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {platform.node()}, {platform.processor()}")
    return "; ".join(p for p in parts if p)


def render_markdown(res: dict) -> str:
    """The results file: date, hardware, command, formulas, the ratio table, per-part status."""
    lines = [f"# One-GPU targets ({res['date']})", "", f"- hardware: {res['hardware']}",
             f"- command: `{res['command']}`", f"- env: {' '.join(f'{k}={v}' for k, v in NVLS_OFF_ENV.items())}",
             f"- model: {res['config']['model_path']} (dummy {res['config']['dtype']} weights), attention backend "
             f"{res.get('runner', {}).get('attention_backend', 'n/a')}, CUDA graphs "
             f"{res.get('runner', {}).get('cuda_graphs', 'n/a')}",
             "- decode floor = (weight bytes read per step [all parameters but the input-embedding table] + "
             "KV bytes read per step) / HBM copy bandwidth; ratio = measured / floor",
             "- prefill FLOPs = 2*T*P_layers + 2*P_lm_head + 4*L*H*d*T(T+1)/2; ratio = achieved / matmul rate",
             "- attention: KV bytes read / kernel time; ratio = achieved / HBM copy bandwidth", "",
             format_table(table_rows(res)), "", "## Parts", ""]
    for name, part in res["parts"].items():
        lines.append(f"- {name}: {part.get('status')} ({part.get('seconds', 0):.1f} s)"
                     + (f" -- {part['error']}" if part.get("error") else ""))
    srv = res["parts"].get("serving", {})
    if "bench_command" in srv:
        lines += ["", f"- server (up in {srv['server_startup_s']:.0f} s): `python {srv['server_command']}`",
                  f"- client: `python {srv['bench_command']}`",
                  f"- {srv['completed']} completed, {srv['failed']} failed in {srv['duration']:.1f} s; TPOT mean/median/"
                  f"p99 {srv['mean_tpot_ms']:.1f}/{srv['median_tpot_ms']:.1f}/{srv['p99_tpot_ms']:.1f} ms"]
    return "\n".join(lines) + "\n"


def write_results(res: dict, stem: Path) -> None:
    """Write ``res`` to ``<stem>.json`` and its markdown rendering to ``<stem>.md``."""
    Path(f"{stem}.json").write_text(json.dumps(res, indent=1, default=str))
    Path(f"{stem}.md").write_text(render_markdown(res))


def run(cfg: TargetsConfig, command: str) -> dict:
    """Run the selected parts in order, recording each one's result or error; returns the results dict."""
    os.environ.update(NVLS_OFF_ENV)  # before CUDA/NCCL initialise; children inherit it
    start = time.monotonic()
    deadline = start + cfg.time_budget_s
    import torch

    out_dir = Path(cfg.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    date = datetime.date.today().isoformat()
    stem = out_dir / f"{date}_gpu_targets"
    res = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "hardware": hardware(), "command": command,
           "config": dataclasses.asdict(cfg), "parts": {}}

    def part(name, fn, always: bool = False):
        """Run one part (if selected or ``always``), store its result or error under ``res['parts']``, write the files;
        returns its result or None."""
        if name not in cfg.parts and not always:
            return None
        logger.info("=== %s ===", name)
        t0 = time.monotonic()
        try:
            val = fn()
            res["parts"][name] = {"status": "ok", **val}
        except Exception as e:  # one part failing must not lose the others
            logger.exception("part %s failed", name)
            res["parts"][name] = {"status": "error", "error": f"{type(e).__name__}: {e}"}
            val = None
        res["parts"][name]["seconds"] = time.monotonic() - t0
        write_results(res, stem)
        return val

    fl = part("floors", lambda: measure_floors(cfg)) or {}
    bw, mm = fl.get("hbm_bytes_per_s"), fl.get("matmul_flops_per_s")
    part("attention", lambda: measure_attention(cfg, bw))
    if {"decode", "prefill"} & set(cfg.parts):
        holder = {}

        def load():
            """Build the runner into ``holder`` and return its facts."""
            holder["r"] = build_runner(cfg)
            return runner_facts(holder["r"])

        part("runner", load, always=True)
        if "r" in holder:
            res["runner"] = res["parts"]["runner"]
            part("decode", lambda: measure_decode(holder["r"], cfg, bw))
            part("prefill", lambda: measure_prefill(holder["r"], cfg, mm))
        holder.clear()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    part("serving", lambda: measure_serving(cfg, stem, deadline))
    res["total_seconds"] = time.monotonic() - start
    write_results(res, stem)
    return res


def main(argv: Optional[list[str]] = None) -> int:
    """CLI entry: prints the ratio table; returns 0 when every selected part ran (targets may be unmet)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    # SIGTERM (e.g. an outer `timeout`) unwinds like an exception, so the server child is stopped
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    argv = sys.argv[1:] if argv is None else argv
    try:
        cfg = parse_args(argv)
    except ValueError as e:
        logger.error("%s", e)
        return 2
    cfg = dataclasses.replace(cfg, parts=tuple(p for p in PARTS if p in cfg.parts))
    res = run(cfg, "python benchmark/serving/bench_gpu_targets.py " + " ".join(argv))
    sys.stdout.write(format_table(table_rows(res)) + "\n")
    if cfg.record_dir:
        from benchmark.common import records
        from benchmark.serving.gpu_targets_record import make_targets_record

        goals = {"decode": DECODE_TARGET, "prefill": PREFILL_TARGET, "attention": ATTENTION_TARGET}
        js, _ = records.write_record(make_targets_record(res, cfg, goals), Path(cfg.record_dir))
        sys.stdout.write(f"record: {js}\n")
    failed = [n for n, p in res["parts"].items() if p["status"] != "ok"]
    if failed:
        logger.error("parts failed: %s", failed)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
