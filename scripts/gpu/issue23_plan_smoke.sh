#!/usr/bin/env bash
# Issue 23 (deployment plan) on the GPU machine: every launch path that now starts WorkerSpecs from the plan, on CUDA.
# 1. --dry-run tables on cuda for each technique (devices cuda:N from --base-gpu-id/--gpu-id-step, AFD transport
#    auto -> cuda_ipc on one node); 2. the servers whose workers are now built from specs, each vs its greedy baseline:
#    AFD (1 attention + 2 FFN on one GPU, executor from the registry, topology from the plan's wiring), TokenWeave TP2
#    on one shared GPU (tokenweave executor + tw-comm communicator from the specs), tdist TP2 (tdist_sp executor),
#    PD is covered on CPU; Ray on GPU (plan-driven actors) when the carried ray wheel imports.
# Usage (repo root, shared data at ../shared/data): bash scripts/gpu/issue23_plan_smoke.sh [seconds, default 450]
set -uo pipefail
. "$(dirname "$0")/device_preamble.sh"
. "$root/scripts/gpu/lib_budget.sh"; budget_start "${1:-450}"  # left: seconds of it left
out="${OUT:-/tmp}"
declare -A result
echo "== dry-run plans on cuda"
for flags in "--tp 2 --enable-tokenweave" "--tp 2 --enable-tdist-overlap" "--enable-afd --afd-ffn-workers 2" \
             "--tp 2 --base-gpu-id 1 --gpu-id-step 2" "--disaggregation-mode prefill --disaggregation-transfer-backend fake"; do
  # shellcheck disable=SC2086
  if timeout 120 python3 -m sglang.launch_server --dry-run --device cuda $flags >> "$out/issue23_dry_run.txt" 2>&1; then
    result["dry-run $flags"]=ok; else result["dry-run $flags"]=FAIL; fi
done
tail -40 "$out/issue23_dry_run.txt"
run() {  # name, share of the remaining budget (%), pytest args...
  local name=$1 share=$2; shift 2
  local t=$(( $(left) * share / 100 ))
  if [ "$t" -lt 30 ]; then result[$name]="skipped (no time left)"; return; fi
  echo "== $name (timeout ${t}s)"
  if timeout "$t" python3 -m pytest -q -x -p no:cacheprovider "$@" > "$out/issue23_$name.log" 2>&1; then
    result[$name]=ok; else result[$name]="FAIL (rc $?, see issue23_$name.log)"; fi
  tail -5 "$out/issue23_$name.log"
}
run afd_server 30 test/gpu/test_afd_gpu.py -k server
run tokenweave_server 40 test/gpu/test_tokenweave_gpu.py -k "server or share_one_gpu"
run tdist_server 50 test/gpu/test_tdist_gpu.py -k server
run tp_server 60 test/gpu/test_tp_gpu.py -k server
run ray_gpu 95 test/gpu/test_ray_gpu.py
echo "== summary"
for k in "${!result[@]}"; do echo "$k: ${result[$k]}"; done | sort
