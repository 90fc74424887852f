#!/usr/bin/env bash
# TokenWeave on ONE GPU: the GPU tests (two-stream executor vs unsplit on random shapes, the batch's KV slots
# NaN-poisoned before every run so a suffix split reading KV before the prefix split wrote it fails; tw-comm with 2
# ranks on one GPU incl. CUDA-graph capture + replay of the fused call; TP ranks sharing the GPU through the engine and
# the HTTP server), compute-sanitizer racecheck on a small 2-rank case, and the benchmark's one-GPU smoke (layer mode,
# shared-GPU ranks).
# Usage (repo root, shared data at ../shared/data): bash scripts/gpu/tokenweave_one_gpu.sh [seconds, default 540]
# DRY_RUN=1 prints the commands. Logs: $OUT/tokenweave_*.log; the bench's table under $OUT.
set -uo pipefail
. "$(dirname "$0")/device_preamble.sh"
. "$root/scripts/gpu/lib_budget.sh"; budget_start "${1:-540}"
out="${OUT:-/tmp}" step_prefix=tokenweave_ step_dry=${DRY_RUN:-} step_tail=30
step gpu_tests $(( $(left) * 55 / 100 )) "$PY" -m pytest -q -x test/gpu/test_tokenweave_gpu.py -p no:cacheprovider
if command -v compute-sanitizer >/dev/null || [ -n "$step_dry" ]; then
  step_show() { grep -E "RACECHECK SUMMARY|ERROR SUMMARY|hazard|racecheck case" "$1" | tail -8; }
  step racecheck $(( $(left) * 50 / 100 )) compute-sanitizer --tool racecheck --target-processes all \
    "$PY" test/gpu/tokenweave_racecheck_case.py
  unset -f step_show; step_show() { tail -n "${step_tail:-15}" "$1"; }
else
  summary+=("racecheck: not run (compute-sanitizer not found)")
fi
step bench_share_gpu $(( $(left) - 10 )) "$PY" benchmark/tokenweave/bench_layer.py --share-gpu --tp 2 \
  --model-path ../shared/data/configs/meta-llama--Llama-3.3-70B-Instruct --tokens 1024 2048 --iters 3 \
  --results-dir "$out"
echo; printf '%s\n' "${summary[@]}"
