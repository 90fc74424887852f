"""Where AFD overtakes colocated decode: the deployment-plan search (:mod:`sglang.srt.afd.planner.plan`, MegaScale-Infer
sec. 4.2, Algorithm 1; objective tokens/s per GPU) at growing GPU counts, against a measured colocated per-GPU
throughput (``benchmark/afd/bench.py --setups colocated --json-out``: the best batch of the ModelRunner with CUDA graphs;
independent replicas keep the same per-GPU rate at any scale).

Usage::

    python benchmark/afd/crossover.py --model-path ../shared/data/configs/Qwen--Qwen3-30B-A3B --gpu H100 \
        --colocated-json colo.json [--afd-json afd.json] [--totals 4 8 16 32 64] [--tpot-slo-ms 100]

Prints one markdown row per GPU budget (the plan, its modelled Ta/Te/Tc, per-GPU tokens/s, ratio to colocated, the
1.3x AFD target) and the smallest budget meeting the target. The plan's numbers are the planner's datasheet
model (``--avg-seq-len`` sets the KV context; default 32, the benchmark's short contexts), not measurements; with
``--afd-json`` the measured Ta/Tf/Tc of the AFD run are printed beside them. With ``--profile P.json`` (schema of
``sglang.srt.afd.planner.profiler``, e.g. ``benchmark/results/2026-11-27_afd_profile_h200_*.json`` built from measured
Ta / Tf / Tc) the plans use those measured costs instead of the datasheet. ``--record-dir DIR``: also the project's
JSON record + markdown under ``DIR/afd/`` (:func:`crossover_record`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from typing import Optional, Sequence

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if _ROOT not in sys.path:  # run as a file: the repository root makes the benchmark package importable (--record-dir)
    sys.path.insert(0, _ROOT)

TARGET = 1.3


def colocated_per_gpu(path: str) -> tuple[float, int, float]:
    """``(tokens/s per GPU, batch, step ms)`` of the best colocated row in a ``benchmark/afd/bench.py --json-out`` file (colocated
    on one GPU = per GPU of replicas). Raises ValueError when the file has no colocated rows."""
    with open(path) as f:
        rows = json.load(f).get("colocated", {}).get("rows", {})
    if not rows:
        raise ValueError(f"--colocated-json {path}: no colocated rows")
    b, r = max(rows.items(), key=lambda kv: kv[1]["tps"])
    return r["tps"], int(b), r["step_s"] * 1e3


def measured_pipeline(path: str) -> list[str]:
    """Lines with the measured Ta/Tf/Tc per (m, batch) of an AFD ``--json-out`` file (empty when it has none)."""
    with open(path) as f:
        afd = json.load(f).get("afd", {})
    out = []
    for key, r in afd.get("rows", {}).items():
        c = r["constraint"]
        out.append(f"- measured ({afd.get('attention_workers', 1)} attention + {afd.get('ffn_workers', '?')} FFN, "
                   f"m,batch = {key}): Ta {c['ta_ms']:.3f} Tf {c['tf_ms']:.3f} Tc {c['tc_ms']:.3f} ms per layer and "
                   f"micro-batch -> m >= 2(1+Tc/Tf) = {c['m_min']:.2f}")
    return out


def crossover_lines(model_path: str, gpu: str, colo_tps_per_gpu: float, totals: Sequence[int], tpot_slo_ms: float,
                    avg_seq_len: int = 32, max_micro_batch_size: int = 1024,
                    profiles: Sequence[dict] = (), rows_out: Optional[list] = None) -> list[str]:
    """Markdown table: per GPU budget in ``totals`` the best per-GPU plan (datasheet model of ``gpu`` for both roles)
    and its ratio to ``colo_tps_per_gpu`` (the plan's global batch ``B`` is printed: a colocated replica measured
    at a smaller batch per GPU is a weaker baseline than one at ``B / GPUs``); then the smallest budget meeting
    the 1.3x target, or why none does. ``profiles``: loaded planner profiles (``perf_model.load_profile``) replacing
    the datasheet costs of the GPU kind they name. ``rows_out``: a list that gets one flat dict per budget (the plan,
    its modelled times, tokens/s per GPU and the colocated baseline; ``error`` for an infeasible budget), for
    :func:`crossover_record`.
    Raises ValueError for an unknown GPU kind, a dense model or a profile of another model."""
    from sglang.srt.afd.planner.model_spec import MoEModelSpec
    from sglang.srt.afd.planner.plan import PlanInfeasibleError, SearchLimits, best_afd_plan

    model = MoEModelSpec.from_path(model_path)
    src = ("measured profile " + ", ".join(p.get("_path", "?") for p in profiles) if profiles
           else "planner datasheet model")
    tag = "profile" if profiles else "model"
    lines = [f"AFD plans on {gpu} ({src}, TPOT SLO {tpot_slo_ms:g} ms, context {avg_seq_len}) vs "
             f"measured colocated {colo_tps_per_gpu:,.1f} tok/s per GPU", "",
             f"| GPUs | plan (B = global batch) | Ta / Te / Tc ms ({tag}) | m >= 2(1+Tc/Tf) | TPOT ms | "
             "tok/s per GPU | vs colocated | "
             f">= {TARGET}x |", "|---|---|---|---|---|---|---|---|"]
    first = None
    for n in totals:
        lim = SearchLimits(tpot_slo_s=tpot_slo_ms / 1e3, max_total_gpus=n, objective="per-gpu",
                           max_micro_batch_size=max_micro_batch_size)
        try:
            p = best_afd_plan(model, gpu, gpu, lim, seq_len=avg_seq_len, profiles=profiles)
        except PlanInfeasibleError as e:
            lines.append(f"| {n} | infeasible: {str(e).split(': ', 1)[-1][:220]} | | | | | | no |")
            if rows_out is not None:
                rows_out.append({"gpus": n, "error": f"infeasible: {str(e).split(': ', 1)[-1][:220]}",
                                 "colocated_tok_s_per_gpu": colo_tps_per_gpu})
            continue
        ratio = p.tokens_per_s_per_gpu / colo_tps_per_gpu
        tf = max(p.t_a_ms, p.t_e_ms)
        lines.append(f"| {n} | tp_a={p.tp_a} n_a={p.n_a} tp_e={p.tp_e} n_e={p.n_e} m={p.m} b_a={p.micro_batch_size} "
                     f"B={p.global_batch} ({p.global_batch / (p.attention_gpus + p.ffn_gpus):.0f}/GPU) | "
                     f"{p.t_a_ms:.3f} / {p.t_e_ms:.3f} / {p.t_c_ms:.3f} | {2 * (1 + p.t_c_ms / tf):.2f} "
                     f"(m={p.m}: {'ok' if p.m >= 2 * (1 + p.t_c_ms / tf) - 1e-9 else 'NO'}) | "
                     f"{p.tpot_ms:.1f} | {p.tokens_per_s_per_gpu:,.1f} | {ratio:.2f}x | "
                     f"{'yes' if ratio >= TARGET else 'no'} |")
        if rows_out is not None:
            rows_out.append({"gpus": n, "tp_a": p.tp_a, "n_a": p.n_a, "tp_e": p.tp_e, "n_e": p.n_e, "m": p.m,
                             "micro_batch": p.micro_batch_size, "global_batch": p.global_batch,
                             "ta_ms": p.t_a_ms, "te_ms": p.t_e_ms, "tc_ms": p.t_c_ms,
                             "m_min": 2 * (1 + p.t_c_ms / tf), "tpot_ms": p.tpot_ms,
                             "tok_s_per_gpu": p.tokens_per_s_per_gpu, "colocated_tok_s_per_gpu": colo_tps_per_gpu})
        if first is None and ratio >= TARGET:
            first = n
    lines.append("")
    lines.append(f"Crossover: AFD reaches {TARGET}x colocated per GPU from {first} GPUs ({tag})." if first else
                 f"Crossover: none up to {max(totals)} GPUs at this SLO ({tag}).")
    return lines


def crossover_record(rows: Sequence[dict], gpu: str, params: dict, notes: Sequence[str] = (),
                     env: Optional[dict] = None, command: Optional[str] = None) -> dict:
    """``--record-dir``: the rows of :func:`crossover_lines` (``rows_out``) as a :mod:`benchmark.common.records`
    record (subject afd, ``what`` = ``afd_crossover_<gpu>``): per GPU budget the plan's modelled tokens/s per GPU, the
    measured colocated baseline and ``vs_colocated`` (their ratio), ``meets_target`` (>= 1.3x). Headline: the best
    budget's ratio and, when one meets the target, the smallest such budget. The plans are the planner's model (or a
    measured profile), not measurements, and there is no physical floor; the record's GPU count is 0 (no GPU used)."""
    from benchmark.common import records

    rows = records.add_ratio(rows, "vs_colocated", "tok_s_per_gpu", "colocated_tok_s_per_gpu")
    rows = [dict(r, meets_target=r["vs_colocated"] is not None  # unrounded, as the table's column
                 and r["tok_s_per_gpu"] / r["colocated_tok_s_per_gpu"] >= TARGET) for r in rows]
    ok = [r for r in rows if r["vs_colocated"] is not None]
    headline = []
    if ok:
        best = max(ok, key=lambda r: r["vs_colocated"])
        headline.append({"label": f"AFD plan tok/s per GPU on {gpu}, best budget ({best['gpus']} GPUs), vs measured "
                                  "colocated", "value": round(best["tok_s_per_gpu"], 1), "unit": "tok/s",
                         "baseline": round(best["colocated_tok_s_per_gpu"], 1), "ratio": best["vs_colocated"]})
    first = next((r for r in rows if r["meets_target"]), None)
    if first is not None:
        headline.append({"label": f"crossover: fewest GPUs with AFD >= {TARGET}x colocated per GPU",
                         "value": first["gpus"], "unit": "GPUs"})
    notes = [*notes, "Plan columns are modelled (planner datasheet or profile); the colocated baseline is measured."]
    if rows and first is None:
        notes.append(f"Crossover: none up to {max(r['gpus'] for r in rows)} GPUs at this SLO.")
    slug = re.sub(r"[^a-z0-9]+", "-", gpu.lower()).strip("-") or "gpu"
    return records.make_record(
        subject="afd", benchmark="benchmark.afd.crossover", mode="crossover", what=f"afd_crossover_{slug}", rows=rows,
        params=dict(params, gpu=gpu, target=TARGET), baselines=["colocated_tok_s_per_gpu"] if rows else [],
        units={"ta_ms": "ms", "te_ms": "ms", "tc_ms": "ms", "tpot_ms": "ms", "tok_s_per_gpu": "tok/s",
               "colocated_tok_s_per_gpu": "tok/s"},
        headline=headline, notes=notes, gpu_count=0, env=env, command=command)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """CLI (see the module docstring); returns 0, or 2 with a one-line error."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-path", required=True)
    p.add_argument("--gpu", required=True, help="GPU kind for both roles (planner names: H100, H200, ...)")
    p.add_argument("--colocated-json", help="benchmark/afd/bench.py --setups colocated --json-out file")
    p.add_argument("--colocated-tps-per-gpu", type=float, default=0.0, help="instead of --colocated-json")
    p.add_argument("--afd-json", nargs="*", default=[], help="benchmark/afd/bench.py --setups afd --json-out files (measured T's)")
    p.add_argument("--totals", type=int, nargs="+", default=[4, 8, 16, 32, 64, 128])
    p.add_argument("--tpot-slo-ms", type=float, default=100.0)
    p.add_argument("--avg-seq-len", type=int, default=32)
    p.add_argument("--max-micro-batch-size", type=int, default=1024, help="tokens per micro-batch per attention node")
    p.add_argument("--profile", action="append", default=[],
                   help="planner profile JSON (measured costs; repeat per GPU kind) instead of the datasheet model")
    from benchmark.common.records import add_record_dir_argument
    add_record_dir_argument(p, "afd")
    a = p.parse_args(argv)
    try:
        if a.colocated_json:
            tps, b, step = colocated_per_gpu(a.colocated_json)
            head = [f"- colocated (measured): batch {b}, {step:.2f} ms per step, {tps:,.1f} tok/s per GPU"]
        elif a.colocated_tps_per_gpu > 0:
            tps, head = a.colocated_tps_per_gpu, []
        else:
            raise ValueError("give --colocated-json or --colocated-tps-per-gpu > 0")
        for path in a.afd_json:
            head += measured_pipeline(path)
        from sglang.srt.afd.planner.perf_model import load_profile

        profiles = [load_profile(path) for path in a.profile]
        rows: list = []
        lines = head + [""] + crossover_lines(a.model_path, a.gpu, tps, a.totals, a.tpot_slo_ms, a.avg_seq_len,
                                              a.max_micro_batch_size, profiles, rows_out=rows)
    except (ValueError, OSError) as e:
        sys.stderr.write(f"error: {e}\n")
        return 2
    sys.stdout.write("\n".join(lines) + "\n")
    if a.record_dir:
        from pathlib import Path

        from benchmark.common.records import write_record

        params = {k: getattr(a, k) for k in ("model_path", "colocated_json", "colocated_tps_per_gpu", "afd_json",
                                             "totals", "tpot_slo_ms", "avg_seq_len", "max_micro_batch_size", "profile")}
        rec = crossover_record(rows, a.gpu, params, notes=[h.removeprefix("- ") for h in head])
        sys.stdout.write(f"record: {write_record(rec, Path(a.record_dir))[0]}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
