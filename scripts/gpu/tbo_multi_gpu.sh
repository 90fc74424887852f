#!/usr/bin/env bash
# Two-batch overlap on N GPUs of one host (N = 2, 4 or 8; NVLink multicast off): the GPU tests (TP 2 / EP 2 over
# NCCL, the overlap forced on, gives the TP1 tokens), then the benchmark's multi-rank mode on all N GPUs (one process
# per GPU): TP without EP, the all-reduce EP and the all-to-all EP (--moe-a2a-backend nccl / tdist), each unsplit
# and with TBO, and their no-comm twins (a layout the checkout cannot run is listed as skipped, with the reason); it
# prints the candidate auto-off threshold per GPU and EP size for sglang/srt/two_batch_overlap/auto_off.py.
# Usage: [OUT=dir] [DRY_RUN=1] bash scripts/gpu/tbo_multi_gpu.sh N [seconds]
set -uo pipefail
. "$(dirname "$0")/device_preamble.sh"
n="${1:-2}"
. "$root/scripts/gpu/lib_budget.sh"; budget_start "${2:-540}"
out="${OUT:-/tmp}"
step_dry=${DRY_RUN:-}
step tbo_gpu_tests 150 "$PY" -m pytest -q -x test/gpu/test_two_batch_overlap_gpu.py -p no:cacheprovider
step "tbo_bench_${n}gpu" $(( $(left) - 10 )) "$PY" benchmark/moe/bench_moe_overlap.py --nproc "$n" --out "$out"
echo; printf '%s\n' "${summary[@]}"
