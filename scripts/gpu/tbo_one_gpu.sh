#!/usr/bin/env bash
# Two-batch overlap on ONE GPU (1 x H100 or H200): the GPU tests (the two-stream schedule with slow communication
# stages gives the sequential tokens; decode CUDA graphs that capture the two-micro-batch schedule replay the eager
# forward; the 2-GPU test skips), then the benchmark's single-rank mode: the split's overhead at EP 1, TBO forced on
# vs off, Qwen3-30B-A3B and Mixtral-8x7B configs cut to 2 layers with dummy bf16 weights, MoE-layer and whole-model
# rows at 16 / 256 / 2048 / 8192 tokens (target tbo/seq <= 1.05, or auto-off: it is off at EP 1).
# Usage (repo root, shared data at ../shared/data): [OUT=dir] [DRY_RUN=1] bash scripts/gpu/tbo_one_gpu.sh [seconds]
set -uo pipefail
. "$(dirname "$0")/device_preamble.sh"
. "$root/scripts/gpu/lib_budget.sh"; budget_start "${1:-170}"
out="${OUT:-/tmp}"
step_dry=${DRY_RUN:-}
step tbo_gpu_tests 100 "$PY" -m pytest -q -x test/gpu/test_two_batch_overlap_gpu.py -p no:cacheprovider
step tbo_bench_1gpu 60 "$PY" benchmark/moe/bench_moe_overlap.py --nproc 1 --tokens 16 256 2048 8192 --warmup 2 --rounds 8 --out "$out"
echo; printf '%s\n' "${summary[@]}"
