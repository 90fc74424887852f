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
  --record-dir DIR   also write the project's JSON record + markdown under DIR/tdist/ (kernels_record; headline:
                     AG-GEMM and GEMM-RS vs NCCL + cuBLAS at the largest M, worst shape)
NVLink multicast stays off: every rank runs with NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1,
NVSHMEM_DISABLE_NVLS=1.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
from pathlib import Path
from typing import Optional

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
    from benchmark.common.records import add_record_dir_argument
    add_record_dir_argument(p, "tdist")
    a = p.parse_args(argv)
    if a.world < 2 or a.iters < 1 or a.tp_shapes < 1 or any(t < a.world for t in a.tokens):
        p.error("--world must be >= 2, --iters/--tp-shapes >= 1, every --tokens value >= --world")
    if not Path(a.config).is_file():
        p.error(f"--config {a.config} not found (a HF config.json)")
    return a


def kernels_record(per_rank: list, a, share: bool, env: Optional[dict] = None,
                   command: Optional[str] = None) -> dict:
    """``--record-dir``: the ratio table as a :mod:`benchmark.common.records` record (``what`` = ``tdist_kernels``):
    per row the tdist times (max over ranks), ``tdist_ms`` (the auto op where measured, else the best of SM and
    decomposition, as the table), NCCL + cuBLAS (``torch_seq_ms``) and symm-mem fused as same-run baselines,
    ``cublas_only_ms`` (compute alone) as the floor, ratios ``nccl_over_tdist`` / ``symm_over_tdist`` (> 1: tdist
    faster). Headline: AG-GEMM and GEMM-RS vs NCCL + cuBLAS at the largest M, the worst shape."""
    from benchmark.common import records
    from benchmark.tdist.kernels_lib import _mx

    cols = {"tdist_sm": "tdist_sm_ms", "tdist_decomp": "tdist_decomp_ms", "tdist_auto": "tdist_auto_ms",
            "torch_seq": "torch_seq_ms", "symm_fused": "symm_fused_ms", "cublas_only": "cublas_only_ms"}
    rows = []
    for i, row in enumerate(per_rank[0] if per_rank else []):
        r = {"op": row["op"], "kind": row.get("kind"), "shape": row["shape"], "M": row["M"],
             **{c: _mx(per_rank, i, k) for k, c in cols.items()}, "auto_path": row.get("auto_path")}
        r["tdist_ms"] = r["tdist_auto_ms"] if r["tdist_auto_ms"] is not None else min(
            [v for v in (r["tdist_sm_ms"], r["tdist_decomp_ms"]) if v is not None], default=None)
        rows.append(r)
    rows = records.add_ratio(records.add_ratio(rows, "nccl_over_tdist", "torch_seq_ms", "tdist_ms"),
                             "symm_over_tdist", "symm_fused_ms", "tdist_ms")
    headline = []
    for kind in ("ag", "rs"):
        at = [r for r in rows if r["kind"] == kind and r["nccl_over_tdist"] is not None]
        if at:
            m = max(r["M"] for r in at)
            w = min((r for r in at if r["M"] == m), key=lambda r: r["nccl_over_tdist"])
            headline.append({"label": f"{w['op']} vs NCCL + cuBLAS, M={m}, worst shape ({w['shape']}), world "
                                      f"{a.world}", "value": w["tdist_ms"], "unit": "ms",
                             "baseline": w["torch_seq_ms"], "ratio": w["nccl_over_tdist"]})
    present = [c for c in ("torch_seq_ms", "symm_fused_ms") if any(r[c] is not None for r in rows)]
    return records.make_record(
        subject="tdist", benchmark="benchmark.tdist.bench_kernels", mode=",".join(a.variants),
        what="tdist_kernels_share_gpu" if share else "tdist_kernels", rows=rows,
        params={k: getattr(a, k) for k in ("world", "tp_shapes", "tokens", "a2a_tokens", "a2a_hidden", "ops",
                                           "iters", "variants")} | {"config": Path(a.config).parent.name},
        baselines=present, units={c: "ms" for c in [*cols.values(), "tdist_ms"]},
        floor={"column": "cublas_only_ms", "model": "the GEMM alone on the gathered M (no communication)"},
        headline=headline, notes=["ranks time-sliced on one GPU: not a speed measurement"] if share else [],
        gpu_count=1 if share else a.world, env=env, command=command)


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
    if a.record_dir and results and results[0]:  # the parent holds every rank's rows: one writer
        from benchmark.common.records import write_record

        print(f"record: {write_record(kernels_record(results, a, share), Path(a.record_dir))[0]}")
    if problems:
        sys.exit(1)
    return out


if __name__ == "__main__":
    main()
