#!/usr/bin/env bash
# TokenWeave on ONE GPU (issue 12): the GPU tests (two-stream executor vs unsplit on random shapes, the batch's KV
# slots NaN-poisoned before every run so a suffix split reading KV before the prefix split wrote it fails; tw-comm
# with 2 ranks on one GPU incl. CUDA-graph capture + replay of the fused call; TP ranks sharing the GPU through
# the engine and the HTTP server), compute-sanitizer racecheck on a small 2-rank case, and the benchmark's
# one-GPU smoke (layer mode, shared-GPU ranks). Re-run after the 2026-11-25 audit (graph replays, KV poisoning).
# Usage (repo root, shared data at ../shared/data): bash scripts/gpu/tokenweave_one_gpu.sh [seconds, default 540]
set -uo pipefail
. "$(dirname "$0")/device_preamble.sh"
. "$root/scripts/gpu/lib_budget.sh"; budget_start "${1:-540}"  # left: seconds of it left
out="${OUT:-/tmp}"
echo "== TokenWeave GPU tests"
timeout $(( $(left) * 55 / 100 )) python3 -m pytest -q -x test/gpu/test_tokenweave_gpu.py -p no:cacheprovider 2>&1 \
  | tee "$out/tokenweave_gpu_tests.log" | tail -30
echo "== compute-sanitizer racecheck (small 2-rank case)"
if command -v compute-sanitizer >/dev/null; then
  timeout $(( $(left) * 50 / 100 )) compute-sanitizer --tool racecheck --target-processes all \
    python3 test/gpu/tokenweave_racecheck_case.py > "$out/tokenweave_racecheck.log" 2>&1
  echo "racecheck exit $?"; grep -E "RACECHECK SUMMARY|ERROR SUMMARY|hazard|racecheck case" "$out/tokenweave_racecheck.log" | tail -8
else
  echo "compute-sanitizer not found: racecheck not run"
fi
echo "== bench_tokenweave one-GPU smoke (Llama-3.3-70B layer, 2 ranks sharing the GPU)"
timeout $(( $(left) - 10 )) python3 benchmark/tokenweave/bench_layer.py --share-gpu --tp 2 \
  --model-path ../shared/data/configs/meta-llama--Llama-3.3-70B-Instruct --tokens 1024 2048 --iters 3 \
  --results-dir "$out" 2>&1 | tail -14
