#!/usr/bin/env bash
# Correctness smoke of the integrated tree on 2 GPUs (one rank per GPU where the test allows), in priority order,
# each step bounded: the paths changed together on 2026-11-26 (deployment plan + spec launchers, executor skeleton,
# Lamport auto-selection, tdist piece plan, cross-GPU M2N, extend-attention smem fallback).
#   bash scripts/gpu/integration_smoke_2gpu.sh [budget_s, default 270]
# Writes $OUT/integration_smoke.md (one line per step) and one log per step.
set -uo pipefail
. "$(dirname "$0")/device_preamble.sh"
budget="${1:-270}"; start=$SECONDS
out="${OUT:-/tmp/integration_smoke}"; mkdir -p "$out"
summary="$out/integration_smoke.md"
echo "# integration smoke ($(date -u +%FT%TZ), $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1) x $(nvidia-smi -L | wc -l))" > "$summary"
step() {  # step NAME SECONDS CMD...
  local name="$1" want="$2"; shift 2
  local left=$(( budget - (SECONDS - start) - 3 ))
  (( left < 10 )) && { echo "- $name: skipped (budget)" | tee -a "$summary"; return; }
  (( want > left )) && want=$left
  local t0=$SECONDS
  timeout -k 5 "$want" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  echo "- $name: rc=$rc in $(( SECONDS - t0 )) s; $(grep -E '[0-9]+ (passed|failed)' "$out/$name.log" | tail -1)" | tee -a "$summary"
}
pyt=("$PY" -m pytest -q -x -p no:cacheprovider -rA)
step dry_run 20 "$PY" -m sglang.launch_server --dry-run --enable-afd --model-path ../shared/data/models/stories260K-moe --device cuda
step graphs_qwen3_fp32 45 "${pyt[@]}" test/gpu/test_gpu_correctness.py -k "cuda_graph_replay_equals_eager"
step tokenweave_exec 40 "${pyt[@]}" "test/gpu/test_tokenweave_gpu.py::test_tokenweave_tp_ranks_share_one_gpu[llama_bias_untied-2]"
step tdist_one_rank_per_gpu 40 "${pyt[@]}" test/gpu/test_tdist_gpu.py -k "one_rank_per_gpu and decomp"
step m2n_cross_gpu 60 "${pyt[@]}" -s test/gpu/test_m2n_multi_gpu.py -k "2gpu"
step tp2_server 60 "${pyt[@]}" test/gpu/test_tp_gpu.py::test_tp2_server_fp32_greedy_equals_tp1
step afd_server 60 "${pyt[@]}" test/gpu/test_afd_gpu.py::test_afd_server_one_gpu_greedy_equals_colocated
echo "total $(( SECONDS - start )) s" | tee -a "$summary"
