"""Triton-distributed kernels vs torch: AG-GEMM and GEMM-RS vs NCCL + cuBLAS in sequence and vs PyTorch's
symmetric-memory ``fused_all_gather_matmul`` / ``fused_matmul_reduce_scatter``; low-latency all-to-all vs NCCL
``all_to_all_single``. Shapes: one Llama layer at TP ``--tp-shapes`` (default 8) from a HF config (default
Llama-3.3-70B-Instruct in ../shared/data/configs). Prints a ratio table (baseline ms / tdist ms, measured in the same
run) and writes ``benchmark/results/tdist/<date>_tdist[_share_gpu].md`` with date, hardware and command.

Paper: Zheng et al., "Triton-distributed" (2025), sec. 3.2-3.3 (AG-GEMM 1.42x, GEMM-RS 1.28x on 8 H800); our
targets on 8 H200: AG-GEMM >= 1.3x and GEMM-RS >= 1.2x the torch sequence.

Usage:
  python benchmark/tdist/bench_kernels.py --world 8                      # one GPU per rank (8 GPUs)
  python benchmark/tdist/bench_kernels.py --world 2 --share-gpu          # one-GPU smoke: ranks as processes on cuda:0;
                                                                 # NCCL baselines are unavailable there (said so)
NVLink multicast stays off: every rank runs with NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1,
NVSHMEM_DISABLE_NVLS=1.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
for p in (str(ROOT), str(ROOT / "sgl-kernel" / "python"), str(ROOT / "python")):
    if p not in sys.path:
        sys.path.insert(0, p)
os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "sgl-kernel" / "python"),
                                            str(ROOT / "python"), os.environ.get("PYTHONPATH", "")])
from sglang.srt.utils.nvls_env import NVLS_OFF_ENV  # noqa: E402

os.environ.update(NVLS_OFF_ENV)
os.environ.pop("TRITON_INTERPRET", None)

DEFAULT_CONFIG = ROOT.parent / "shared" / "data" / "configs" / "meta-llama--Llama-3.3-70B-Instruct" / "config.json"


def parse_args(argv=None):
    """CLI flags (see module docstring); argparse errors for bad values."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world", type=int, default=8, help="ranks (processes)")
    p.add_argument("--share-gpu", action="store_true", help="all ranks on one GPU (smoke; no NCCL baselines)")
    p.add_argument("--config", default=str(DEFAULT_CONFIG), help="HF config.json for the GEMM shapes")
    p.add_argument("--tp-shapes", type=int, default=8, help="TP degree the per-rank shapes are cut for")
    p.add_argument("--tokens", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    p.add_argument("--a2a-tokens", type=int, nargs="*", default=[128, 1024, 4096],
                   help="all-to-all token counts (none: no all-to-all rows)")
    p.add_argument("--a2a-hidden", type=int, default=7168)
    p.add_argument("--ops", nargs="+", default=["qkv", "gate_up", "o_proj", "down"])
    p.add_argument("--iters", type=int, default=30, help="timed calls per variant (after 1 first call + 20 "
                   "warm-ups); the median of per-call CUDA-event times is reported")
    p.add_argument("--variants", nargs="+", default=["sm", "decomp"],
                   choices=["sm", "decomp", "pieces", "graph", "auto", "profile"],
                   help="tdist variants: sm (Triton kernels), decomp (cuBLAS + copy engine decomposition), pieces "
                        "(with decomp: also every other piece count, in the notes column), graph (the all-to-all "
                        "also as CUDA-graph replays, tdist and NCCL), auto (with decomp: AutoAgGemm / AutoGemmRs "
                        "with the table calibrated on the row's own timings, timed after them; then NCCL + cuBLAS "
                        "again), profile (with decomp, at the largest M: torch-profiler timeline summary of one "
                        "decomposition call on rank 0: host enqueue, GEMM, copy, overlap, idle ms)")
    p.add_argument("--heap-mib", type=int, default=0, help="heap data MiB per rank (default: sized from shapes)")
    p.add_argument("--timeout", type=float, default=1500)
    p.add_argument("--results-dir", default=str(ROOT / "benchmark" / "results" / "tdist"))
    a = p.parse_args(argv)
    if a.world < 2 or a.iters < 1 or a.tp_shapes < 1 or any(t < a.world for t in a.tokens):
        p.error("--world must be >= 2, --iters/--tp-shapes >= 1, every --tokens value >= --world")
    if not Path(a.config).is_file():
        p.error(f"--config {a.config} not found (a HF config.json)")
    return a


def main(argv=None) -> Path:
    """Run the benchmark; returns the results file."""
    a = parse_args(argv)
    import torch

    from sgl_kernel.tdist.layout import HeapConfig, split_rows
    from sgl_kernel.tdist.spawn import run_ranks
    from benchmark.tdist.kernels_lib import calibration, llama_shapes, partial_rows, rank_body, table

    if not torch.cuda.is_available():
        sys.exit("benchmark/tdist/bench_kernels.py needs CUDA GPUs")
    ngpu = torch.cuda.device_count()
    share = a.share_gpu or ngpu < a.world
    if not a.share_gpu and ngpu < a.world:
        print(f"only {ngpu} GPU(s) for {a.world} ranks: running shared-GPU smoke mode")
    shapes = {k: v for k, v in llama_shapes(a.config, a.tp_shapes).items() if k in a.ops}
    m = max(a.tokens)
    need = 0
    for kind, k, n in shapes.values():  # one buffer per variant and op
        need += (m * k if kind == "ag" else a.world * max(split_rows(m, a.world)) * n) * 2 * len(a.variants)
    need += sum(a.world * t * a.a2a_hidden * 2 * 6 for t in a.a2a_tokens)  # default, 2 CTA counts, 2 blocks
    heap_mib = a.heap_mib or (need >> 20) + 64
    cfg = HeapConfig(data_bytes=heap_mib << 20, signal_slots=4096)
    got: dict = {}  # rows as each rank finishes them (kept when a later row fails or the run times out)
    results, problems = run_ranks(a.world, rank_body, (shapes, a.tokens, a.iters, a.a2a_hidden, a.a2a_tokens,
                                                       tuple(a.variants)),
                                  heap_config=cfg, timeout=a.timeout, with_nccl=not share, env=NVLS_OFF_ENV,
                                  on_result=lambda r, key, row: got.setdefault(r, {}).__setitem__(key, row))
    hw = f"{ngpu} x {torch.cuda.get_device_name(0)}"
    lines = [f"# tdist benchmark ({'shared-GPU smoke' if share else 'one GPU per rank'})", "",
             f"- date: {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}",
             f"- hardware: {hw}; ranks: {a.world}"
             f"{' on one GPU (time-sliced: not a speed measurement)' if share else ''}",
             f"- command: python {' '.join(sys.argv)}",
             f"- shapes: {a.config} at TP {a.tp_shapes}; heap {heap_mib} MiB/rank; iters {a.iters}",
             "- times: median of per-call CUDA events on each rank (1 first call, timed apart as 'first call s', "
             "then 20 warm-ups, then the timed calls), max over ranks; ratios: baseline ms / best tdist ms "
             "(> 1: tdist faster); variants of a row run in alternating order", ""]
    if share:
        lines.append("- NCCL + cuBLAS and symmetric-memory baselines: unavailable with ranks sharing one GPU "
                     "(NCCL refuses duplicate GPUs); 'cuBLAS only' is the compute-only lower bound.")
        lines.append("")
    if not all(r is not None for r in results):
        lines.append("**run failed**: " + " | ".join(problems) + "; rows finished by every rank before that:")
        results = partial_rows(got, a.world)
    if results and results[0]:
        lines += table(results)
        lines += ["", f"calibration (break-even M per shape, sgl_kernel.tdist.auto.CalibrationTable): "
                  f"`{calibration(results).to_json()}`"]
        if any(r.get("profile") for r in results[0]):
            from benchmark.tdist.call_profile import profile_lines

            lines += ["", "## one decomposition call, rank 0 (torch profiler; ms; overlap = GEMM and copy at once; "
                      "idle = no GPU work inside the span; host enqueue = time for the call to return, no sync)", "",
                      *profile_lines(results[0])]
    if problems:
        lines += ["", "problems:", *[f"- {p}" for p in problems]]
    text = "\n".join(lines) + "\n"
    print(text)
    d = Path(a.results_dir)
    d.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d_%H%M")
    out = d / f"{stamp}_tdist{'_share_gpu' if share else ''}.md"
    out.write_text(text)
    print(f"wrote {out}")
    if problems:
        sys.exit(1)
    return out


if __name__ == "__main__":
    main()
